"""`shardrun merge-and-profile`: sealed shards -> the files one unsharded NeMo Gym run would have given.

    merged/rollouts.jsonl                        every kept rollout once, sorted by (task, rollout), raw bytes
    merged/rollouts_materialized_inputs.jsonl    every planned row, sorted by (task, rollout), raw bytes
    merged/rollouts_failures.jsonl               the shards' failure sidecars, sorted by identity
    merged/rollouts_reward_profiling.jsonl       ng_reward_profile's per-task rows
    merged/rollouts_agent_metrics.json           ng_reward_profile's per-agent rows
    merged/rollouts_aggregate_metrics.json       Gym's aggregate-metrics list (pass@k, majority@k per agent)
    merged/merge_summary.json                    what the merge saw and did (the only file with timings)

Steps: check every shard's `.done` (refuse unsealed shards unless allow_partial); read each shard once
(shardscan), resolve its rows to planned identities (identity), add it to the sorted table (merged_table);
then write every output through a temp file, all renamed into place together at the end, so a killed merge
leaves the previous outputs untouched and a re-run gives the same bytes.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from shardrun import aggregate, identity, profile, seal, store
from shardrun.errors import IncompleteRun, PlanMismatch
from shardrun.merge_summary import (MAX_LISTED_FAILED, AgentResult, FailedRollout, MergeSummary,
                                    ShardResult)
from shardrun.merged_table import MergedTable, TableBuilder
from shardrun.planner import Plan, ROLLOUT_KEY
from shardrun.rowcopy import ByteSources, copy_rows
from shardrun.shardscan import FailureRow, Rollouts, scan_failures, scan_planned, scan_rollouts

CHUNK_ROWS = 1 << 18
GROUPS_PLACEHOLDER = "@@shardrun-group-level-metrics-{}@@"
GROUP_INDENT = b"      "


def merge_and_profile(run_dir: Path | str, allow_partial: bool = False,
                      answer_field: str | None = None) -> MergeSummary:
    """Merge the run's shards and profile them. IncompleteRun if a shard is unsealed and not allow_partial."""
    started = time.monotonic()
    run_dir = Path(run_dir)
    plan = store.load_plan(run_dir)
    states = [seal.check(run_dir, plan, s.index) for s in plan.shards]
    refuse_unsealed(run_dir, states, allow_partial)
    with store.merge_lock(run_dir):
        store.remove_stale_temps(store.merged_dir(run_dir))
        try:
            summary = _merge(run_dir, plan, states, allow_partial, answer_field, started)
        finally:
            store.remove_stale_temps(store.merged_dir(run_dir))
    return summary


def refuse_unsealed(run_dir: Path, states: list[seal.SealState], allow_partial: bool) -> None:
    unsealed = [(i, s.reason) for i, s in enumerate(states) if not s.sealed]
    if unsealed and not allow_partial:
        listed = "\n".join(f"  - shard {i:05d}: {why}" for i, why in unsealed[:20])
        more = f"\n  ... and {len(unsealed) - 20} more" if len(unsealed) > 20 else ""
        raise IncompleteRun(f"{len(unsealed)} of {len(states)} shards are not sealed:\n{listed}{more}\n"
                            f"Run `shardrun resume {run_dir}` to finish them, or merge what they hold with "
                            f"--allow-partial.")


# ---------------------------------------------------------------- reading the shards

def _read_rollouts(run_dir: Path, i: int, state: seal.SealState, allow_partial: bool,
                   answer_field: str | None) -> tuple[Rollouts, seal.SealState]:
    """Read a sealed shard as sealed (hash checked against its marker while read), else from a snapshot."""
    path = store.rollouts_path(run_dir, i)
    if state.sealed:
        marker = state.marker or {}
        rollouts = scan_rollouts(path, limit=marker.get("rollouts_bytes"), snapshot=None, answer_key=answer_field)
        if rollouts.sha256 == marker.get("rollouts_sha256"):
            return rollouts, state
        state = seal.SealState(False, f"{path}: content changed after sealing (sha256 differs); not sealed",
                               marker)
        refuse_unsealed(run_dir, [state], allow_partial)
    snapshot = store.merge_scratch(run_dir, f"snapshot-{i:05d}.jsonl")
    return scan_rollouts(path, limit=None, snapshot=snapshot, answer_key=answer_field), state


def _read_shards(run_dir: Path, plan: Plan, states: list[seal.SealState], allow_partial: bool,
                 answer_field: str | None) -> tuple[MergedTable, list[ShardResult], list[tuple[int, FailureRow]],
                                                   list[Path]]:
    builder = TableBuilder(plan.num_rollouts, answers=answer_field is not None)
    agent_codes: dict[str, int] = {}
    results, failures, sources = [], [], []
    for spec, state in zip(plan.shards, states):
        i = spec.index
        planned = scan_planned(store.materialized_path(run_dir, i), agent_codes)
        if len(planned.task) != spec.num_rollouts:
            raise PlanMismatch(f"{planned.path}: {len(planned.task):,} planned rows, plan.json plans "
                               f"{spec.num_rollouts:,} for shard {i:05d}; the run directory is damaged")
        index = identity.plan_index(planned.task, planned.rollout, str(planned.path))
        rollouts, state = _read_rollouts(run_dir, i, state, allow_partial, answer_field)
        res = identity.resolve(index, rollouts.task, rollouts.rollout)
        builder.add(i, planned, rollouts, res)
        sidecar = scan_failures(store.failures_path(run_dir, i))
        kept_failures = _shard_failures(index, sidecar.rows, res.renumbered)
        failures += [(i, f) for f in kept_failures]
        results.append(ShardResult(
            i, state.sealed, state.reason, rollouts.lines, len(res.keep), res.duplicates, res.foreign,
            rollouts.no_identity, rollouts.unreadable, rollouts.torn_bytes, res.renumbered, len(kept_failures),
            state.marker if state.sealed else None))
        sources.append(rollouts.source)
    agents = sorted(agent_codes, key=agent_codes.get)  # type: ignore[arg-type]
    return builder.finish(agents), results, failures, sources


def _shard_failures(index: identity.ShardPlanIndex, rows: list[FailureRow], renumbered: bool) -> list[FailureRow]:
    """The sidecar rows whose identity is planned for the shard, with their planned rollout index."""
    if not rows:
        return []
    t = np.array([r.task for r in rows], np.int64)
    r = np.array([r.rollout for r in rows], np.int64)
    ok, mapped = identity.map_identities(index, t, r, renumbered)
    out = []
    for row, good, planned in zip(rows, ok.tolist(), mapped.tolist()):
        if good:
            line = row.line if planned == row.rollout else _with_rollout(row.line, planned)
            out.append(FailureRow(row.task, planned, line, row.reason))
    return out


def _with_rollout(line: bytes, rollout: int) -> bytes:
    row = orjson.loads(line)
    row[ROLLOUT_KEY] = rollout
    return orjson.dumps(row) + b"\n"


# ---------------------------------------------------------------- the merge

def _merge(run_dir: Path, plan: Plan, states: list[seal.SealState], allow_partial: bool,
           answer_field: str | None, started: float) -> MergeSummary:
    timings: dict[str, float] = {}
    tick = time.monotonic()
    table, shards, failures, rollout_sources = _read_shards(run_dir, plan, states, allow_partial, answer_field)
    timings["read_s"] = time.monotonic() - tick
    summary = MergeSummary(str(run_dir), plan.fingerprint, allow_partial, shards=shards, timings=timings)
    outputs = {
        "rollouts": store.merged_rollouts_path(run_dir),
        "materialized_inputs": store.merged_materialized_path(run_dir),
        "failures": store.merged_failures_path(run_dir),
        "reward_profiling": store.merged_reward_profiling_path(run_dir),
        "agent_metrics": store.merged_agent_metrics_path(run_dir),
        "aggregate_metrics": store.merged_aggregate_metrics_path(run_dir),
        "summary": store.merged_summary_path(run_dir),
    }
    summary.outputs = {k: str(p) for k, p in outputs.items()}
    materialized_sources = [store.materialized_path(run_dir, s.index) for s in plan.shards]
    with contextlib.ExitStack() as stack:
        out = {k: stack.enter_context(store.atomic_writer(p)) for k, p in outputs.items()}
        tick = time.monotonic()
        tasks = _write_materialized(out["materialized_inputs"], table, materialized_sources)
        _write_rollouts(out["rollouts"], table, rollout_sources)
        _write_failures(out["failures"], table, failures, summary)
        timings["copy_s"] = time.monotonic() - tick
        tick = time.monotonic()
        _count_tasks(summary, table, tasks, plan)
        profiled = _write_profile(run_dir, out["reward_profiling"], table, tasks, materialized_sources)
        agent_stats = _agent_stats(table, tasks)
        out["agent_metrics"].write(orjson.dumps(_agent_metric_rows(table, agent_stats)))
        _write_aggregate(out["aggregate_metrics"], run_dir, table, tasks, agent_stats, profiled, summary, plan)
        timings["profile_s"] = time.monotonic() - tick
        timings["total_s"] = time.monotonic() - started
        out["summary"].write(orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return summary


# ---------------------------------------------------------------- row files

class TaskInfo:
    """Per-task facts the profile needs, kept after the planned rows are released."""

    def __init__(self, table: MergedTable):
        self.expected = table.planned_per_task()
        self.done = table.done_per_task()
        self.agent = table.agent_of_task()
        self.starts, self.sizes = profile.segments(table.r_key // table.stride)
        first_keys = table.r_key[self.starts]
        self.sample_shard, self.sample_offset, self.sample_length = table.planned_rows_of(first_keys)


def _write_materialized(out: IO[bytes], table: MergedTable, sources: list[Path]) -> TaskInfo:
    with ByteSources(sources) as src:
        copy_rows(out, src, table.p_shard, table.p_offset, table.p_length)
    tasks = TaskInfo(table)
    table.release_planned()
    return tasks


def _write_rollouts(out: IO[bytes], table: MergedTable, sources: list[Path]) -> None:
    def renumber(position: int, line: bytes) -> bytes:
        return _with_rollout(line, int(table.rollout_of_key(table.r_key[position])))

    with ByteSources(sources) as src:
        copy_rows(out, src, table.r_shard, table.r_offset, table.r_length, renumber, table.r_renumbered)


def _write_failures(out: IO[bytes], table: MergedTable, failures: list[tuple[int, FailureRow]],
                    summary: MergeSummary) -> None:
    """Sidecar rows sorted by identity (attempts keep their order); identities never completed are 'failed'."""
    failures.sort(key=lambda sf: (sf[1].task, sf[1].rollout, sf[0]))
    for _, f in failures:
        out.write(f.line)
    summary.failure_rows = len(failures)
    by_identity: dict[tuple[int, int], list[tuple[int, FailureRow]]] = {}
    for shard, f in failures:
        by_identity.setdefault((f.task, f.rollout), []).append((shard, f))
    if not by_identity:
        return
    ids = list(by_identity)
    keys = np.searchsorted(table.tasks, [t for t, _ in ids]) * table.stride + np.array([r for _, r in ids])
    done = table.has_rollout(keys)
    failed = [ident for ident, d in zip(ids, done.tolist()) if not d]
    summary.failed_total = len(failed)
    summary.failed = [FailedRollout(t, r, by_identity[(t, r)][-1][0], by_identity[(t, r)][-1][1].reason,
                                    len(by_identity[(t, r)])) for t, r in failed[:MAX_LISTED_FAILED]]


# ---------------------------------------------------------------- the reward profile

def _write_profile(run_dir: Path, out: IO[bytes], table: MergedTable, tasks: TaskInfo,
                   materialized: list[Path]) -> dict[int, Path]:
    """Write the per-task profile rows; also spill each agent's Gym aggregate group rows to a scratch file.

    Returns agent code -> spill file.
    """
    layout = table.layout()
    agent_rows = _agent_row_positions(table, tasks)
    agent_layouts = {a: table.layout(rows) for a, rows in agent_rows.items()}
    spills = {a: store.merge_scratch(run_dir, f"groups-{a}.json") for a in agent_rows}
    with contextlib.ExitStack() as stack, ByteSources(materialized) as src:
        spill_files = {a: stack.enter_context(open(p, "wb")) for a, p in spills.items()}
        spilled = {a: 0 for a in spills}
        same = {a: agent_layouts[a] == layout for a in agent_layouts}
        for g0, g1 in _chunks(tasks.sizes):
            a, b = int(tasks.starts[g0]), int(tasks.starts[g1 - 1] + tasks.sizes[g1 - 1])
            starts, sizes = tasks.starts[g0:g1] - a, tasks.sizes[g0:g1]
            stats = profile.group_stats(table.gather(a, b), starts, sizes)
            infos = table.infos(a, b)
            codes = (table.r_key[tasks.starts[g0:g1]] // table.stride).tolist()
            samples = zip(tasks.sample_shard[g0:g1].tolist(), tasks.sample_offset[g0:g1].tolist(),
                          tasks.sample_length[g0:g1].tolist())
            lines, group_lines = [], {x: [] for x in spills}
            for j, (code, start, n, where) in enumerate(zip(codes, starts.tolist(), sizes.tolist(), samples)):
                task_index = int(table.tasks[code])
                mine = infos[start:start + n]
                sample = profile.sample_of(orjson.loads(src.get(*where)))
                items = profile.stat_items(layout, stats, j)
                expected = int(tasks.expected[code])
                lines.append(orjson.dumps(profile.task_profile_row(task_index, items, sample, n, expected, mine)))
                agent = int(tasks.agent[code])
                group_items = items if same[agent] else profile.stat_items(agent_layouts[agent], stats, j)
                group = profile.task_profile_row(task_index, group_items, {"agent_ref": {"name": "agent"}}, n, n,
                                                 mine)
                group_lines[agent].append(_indented(group))
            out.write(b"\n".join(lines) + b"\n")
            for agent, rows in group_lines.items():
                if rows:
                    spill_files[agent].write((b",\n" if spilled[agent] else b"") + b",\n".join(rows))
                    spilled[agent] += len(rows)
    return {a: p for a, p in spills.items() if spilled[a]}


def _indented(row: dict[str, Any]) -> bytes:
    """A group row as orjson would indent it three levels deep inside the aggregate-metrics list."""
    return GROUP_INDENT + orjson.dumps(row, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n" + GROUP_INDENT)


def _chunks(sizes: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive task ranges of about CHUNK_ROWS rollouts each (at least one task each)."""
    ends = np.cumsum(sizes)
    bounds = [0]
    while bounds[-1] < len(sizes):
        done = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
        bounds.append(max(bounds[-1] + 1, int(np.searchsorted(ends, done + CHUNK_ROWS, side="right"))))
    return list(zip(bounds[:-1], bounds[1:]))


def _agent_row_positions(table: MergedTable, tasks: TaskInfo) -> dict[int, np.ndarray]:
    """Agent code -> positions of its kept rollout rows (ascending)."""
    row_agent = tasks.agent[table.r_key // table.stride]
    order = np.argsort(row_agent, kind="stable")
    starts, sizes = profile.segments(row_agent[order])
    return {int(row_agent[order[s]]): order[s:s + n] for s, n in zip(starts.tolist(), sizes.tolist())}


class AgentStats:
    def __init__(self, table: MergedTable, tasks: TaskInfo):
        self.rows = _agent_row_positions(table, tasks)
        self.codes = sorted(self.rows, key=lambda a: table.agents[a])  # Gym's groupby order: by name
        order = np.concatenate([self.rows[a] for a in self.codes]) if self.codes else np.zeros(0, np.int64)
        sizes = np.array([len(self.rows[a]) for a in self.codes], np.int64)
        starts = np.cumsum(np.r_[0, sizes[:-1]]) if len(sizes) else sizes
        columns = (table.gather(0, len(table.r_key), [c])[0][order] for c in range(len(table.columns)))
        self.stats = profile.group_stats(columns, starts, sizes)


def _agent_stats(table: MergedTable, tasks: TaskInfo) -> AgentStats:
    return AgentStats(table, tasks)


def _agent_metric_rows(table: MergedTable, stats: AgentStats) -> list[dict[str, Any]]:
    layout = table.layout()
    return [profile.stat_items(layout, stats.stats, j) | {"agent_ref": {"name": table.agents[a]}}
            for j, a in enumerate(stats.codes)]


# ---------------------------------------------------------------- aggregate metrics and counts

def _write_aggregate(out: IO[bytes], run_dir: Path, table: MergedTable, tasks: TaskInfo, stats: AgentStats,
                     spills: dict[int, Path], summary: MergeSummary, plan: Plan) -> None:
    reward = table.column("reward")
    row_task = table.r_key // table.stride
    entries = []
    for j, a in enumerate(stats.codes):
        rows = stats.rows[a]
        name = table.agents[a]
        answers = table.r_answers[rows] if table.r_answers is not None else None
        scores = aggregate.score_table(row_task[rows], reward[rows], answers)
        repeats = plan.agents.get(name, {}).get("repeats", 1)
        metrics = profile.stat_items(table.layout(rows), stats.stats, j)
        metrics.update(aggregate.agent_pass_metrics(scores, repeats))
        entries.append({"agent_ref": {"name": name}, "agent_metrics": metrics,
                        "key_metrics": aggregate.key_metrics(metrics),
                        "group_level_metrics": GROUPS_PLACEHOLDER.format(a)})
        for result in summary.agents:
            if result.name == name:
                result.mean_reward = metrics.get("mean/reward")
                result.metrics = {k: v for k, v in metrics.items() if "@" in k}
    _write_with_groups(out, orjson.dumps(entries, option=orjson.OPT_INDENT_2), spills)


def _write_with_groups(out: IO[bytes], skeleton: bytes, spills: dict[int, Path]) -> None:
    """Write the aggregate list, putting each agent's spilled group rows where its placeholder is."""
    rest = skeleton
    while True:
        at = rest.find(b'"@@shardrun-group-level-metrics-')
        if at < 0:
            out.write(rest)
            return
        end = rest.index(b'@@"', at + 2) + 3
        agent = int(rest[at + len(b'"@@shardrun-group-level-metrics-'):end - 3])
        out.write(rest[:at])
        spill = spills.get(agent)
        if spill is None:
            out.write(b"[]")
        else:
            out.write(b"[\n")
            with open(spill, "rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
            out.write(b"\n    ]")
        rest = rest[end:]


def _count_tasks(summary: MergeSummary, table: MergedTable, tasks: TaskInfo, plan: Plan) -> None:
    done, expected = tasks.done, tasks.expected
    complete, partial = done == expected, (done > 0) & (done < expected)
    missing = done == 0
    summary.tasks = len(expected)
    summary.tasks_complete, summary.tasks_partial = int(complete.sum()), int(partial.sum())
    summary.tasks_missing = int(missing.sum())
    summary.rollouts, summary.expected_rollouts = int(done.sum()), int(expected.sum())
    for code, name in enumerate(table.agents):
        mine = tasks.agent == code
        summary.agents.append(AgentResult(
            name, plan.agents.get(name, {}).get("repeats", 0), int(mine.sum()), int((complete & mine).sum()),
            int((partial & mine).sum()), int((missing & mine).sum()), int(done[mine].sum()),
            int(expected[mine].sum())))
    summary.agents.sort(key=lambda a: a.name)
