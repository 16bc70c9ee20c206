"""Write Gym's profile files from the merged table: `_reward_profiling.jsonl`, `_agent_metrics.json` and
`_aggregate_metrics.json` (the maths is in reward_profile.py and aggregate.py; this module only arranges and writes).

Tasks are processed in chunks of about CHUNK_ROWS rollouts, in task order, so memory does not grow with the
run. The aggregate-metrics file is Gym's list, one entry per agent, each ending with that agent's
`group_level_metrics` (one row per task, as Gym's `compute_aggregate_metrics` builds them: the task's stats, a
stub `sample` and completion counted over the rollouts it has). The first agent's rows go straight into the file
as the chunks are written; other agents' rows wait in scratch files until their entry comes.

Under a Gym release with a mask flag (0.7's `mask_sample`) the table given here is the measured one
(MergedTable.measured), and `masked` holds, per agent code, the keys of its masked rollouts: they add the agents'
coverage (denominator.masked_coverage), and an agent with nothing measured keeps a coverage-only entry.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np
import orjson

from shardrun.merge.merged_table import MergedTable, segments
from shardrun.merge.row_copier import ByteSources
from shardrun.plan.planner import Plan
from shardrun.merge.rowtable import NO_ANSWER
from shardrun.profile import aggregate, denominator, reward_profile
from shardrun.profile.reward_profile import Layout

CHUNK_ROWS = 1 << 15  # rollouts per chunk of tasks
PLACEHOLDER = b'"@@shardrun-group-level-metrics@@"'
ROW_INDENT = b"\n      "
LIST_END = b"\n    ]"
STUB_SAMPLE = b'{"agent_ref":{"name":"agent"}}'  # Gym's stub `sample` of group rows, as JSON
STOPPED_DECIDED = b',"stopped_decided":true'  # adaptive sampling: the task's other rollouts were skipped, decided


def frame_layout(table: MergedTable, rows: np.ndarray | None = None) -> Layout:
    """Column order and integer rule of the frame Gym would build from these rows (all kept rows if None)."""
    order, all_int = table.column_order(rows)
    return Layout(tuple(table.columns), order, all_int)


class TaskInfo:
    """Per-task facts the profile needs, taken from the planned rows before they are released."""

    def __init__(self, table: MergedTable):
        self.expected = table.planned_per_task()
        self.done = table.done_per_task()
        self.agent = table.agent_of_task()
        self.starts, self.sizes = segments(table.r_key // table.stride)
        first_keys = table.r_key[self.starts]
        self.sample_shard, self.sample_offset, self.sample_length = table.planned_rows_of(first_keys)


class AgentStats:
    """Stats of every agent over all its rollouts (Gym's agent level), agents in name order."""

    def __init__(self, table: MergedTable, tasks: TaskInfo):
        row_agent = tasks.agent[table.r_key // table.stride]
        order = np.argsort(row_agent, kind="stable")
        starts, sizes = segments(row_agent[order])
        self.rows = {int(row_agent[order[s]]): order[s : s + n] for s, n in zip(starts.tolist(), sizes.tolist())}
        self.codes = sorted(self.rows, key=lambda a: table.agents[a])
        self.layouts = {a: frame_layout(table, self.rows[a]) for a in self.codes}
        by_name = np.concatenate([self.rows[a] for a in self.codes]) if self.codes else np.zeros(0, np.int64)
        sizes = np.array([len(self.rows[a]) for a in self.codes], np.int64)
        starts = np.cumsum(np.r_[0, sizes[:-1]]).astype(np.int64) if len(sizes) else sizes
        columns = (table.gather(0, len(table.r_key), [c])[0][by_name] for c in range(len(table.columns)))
        self.stats = reward_profile.group_stats(columns, starts, sizes)


def agent_metric_rows(table: MergedTable, stats: AgentStats) -> list[dict[str, Any]]:
    """`_agent_metrics.json`: one row per agent, columns as in the whole frame."""
    layout = frame_layout(table)
    return [
        reward_profile.stat_items(layout, stats.stats, j) | {"agent_ref": {"name": table.agents[a]}}
        for j, a in enumerate(stats.codes)
    ]


def masked_agent_rows(
    rows: list[dict[str, Any]], table: MergedTable, stats: AgentStats, masked: dict[int, np.ndarray]
) -> list[dict[str, Any]]:
    """`_agent_metrics.json` rows (one per agent of `stats.codes`, in that order) as Gym 0.7 completes them when
    rollouts were masked: each agent with a masked rollout gets its coverage at the end of its row, and each agent
    none of whose rollouts was measured a row `{"agent_ref", coverage}` after the others, in the order of its
    first rollout."""
    out = list(rows)
    for j, a in enumerate(stats.codes):
        if len(masked.get(a, ())):
            out[j] = out[j] | _masked_coverage(table, table.r_key[stats.rows[a]], masked[a])
    only = sorted((a for a, keys in masked.items() if len(keys) and a not in stats.rows), key=lambda a: masked[a][0])
    empty = np.zeros(0, np.int64)
    return out + [{"agent_ref": {"name": table.agents[a]}} | _masked_coverage(table, empty, masked[a]) for a in only]


def _masked_coverage(table: MergedTable, measured_keys: np.ndarray, masked_keys: np.ndarray) -> dict[str, int]:
    return denominator.masked_coverage(measured_keys // table.stride, masked_keys // table.stride)


def entry_codes(table: MergedTable, stats: AgentStats, masked: dict[int, np.ndarray] | None = None) -> list[int]:
    """The agents of the aggregate-metrics list, by name: those with measured rollouts and those with masked ones."""
    codes = set(stats.codes) | {a for a, keys in (masked or {}).items() if len(keys)}
    return sorted(codes, key=lambda a: table.agents[a])


def aggregate_entries(
    table: MergedTable,
    stats: AgentStats,
    plan: Plan,
    imputed: dict[int, np.ndarray] | None = None,
    masked: dict[int, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """Gym's aggregate-metrics entries without their group rows, one per agent of entry_codes: agent_metrics (stats
    over the agent's own frame and pass@k / majority@k, then its coverage) and key_metrics. `imputed` (the zero
    policy, profile/denominator.py): per agent code, the planned keys without a result, counted as reward 0 in the
    reward stats and pass@k. `masked` (Gym 0.7): per agent code, the keys of its masked rollouts, which are left
    out of every statistic (`table` is the measured one) and reported as Gym 0.7's compute_aggregate_metrics
    reports them: its masked coverage after the stats and in key_metrics; an agent with nothing measured (and
    nothing imputed) gets its coverage only."""
    reward = table.column("reward")
    answers = table.r_answers
    column = {a: j for j, a in enumerate(stats.codes)}
    entries = []
    for a in entry_codes(table, stats, masked):
        rows, name = stats.rows.get(a, np.zeros(0, np.int64)), table.agents[a]
        keys, rew, ans = table.r_key[rows], reward[rows], answers[rows] if answers is not None else None
        zeros = imputed.get(a, np.zeros(0, np.int64)) if imputed is not None else None
        if zeros is not None:
            keys, rew, ans = denominator.with_zeros(keys, rew, ans, zeros, NO_ANSWER)
        masked_keys = (masked or {}).get(a, np.zeros(0, np.int64))
        masked_coverage = _masked_coverage(table, keys, masked_keys)
        planned = int(plan.agents.get(name, {}).get("rollouts", len(rows) + len(masked_keys)))
        coverage = denominator.coverage(planned, len(rows) + len(masked_keys), None if zeros is None else len(zeros))
        if not len(keys):  # every rollout masked: no quality metric, only what happened
            entries.append(
                {
                    "agent_ref": {"name": name},
                    "agent_metrics": masked_coverage | coverage,
                    "key_metrics": masked_coverage,
                }
            )
            continue
        scores = aggregate.score_table(keys // table.stride, rew, ans)
        metrics = reward_profile.stat_items(stats.layouts[a], stats.stats, column[a]) if a in column else {}
        if zeros is not None:
            metrics.update(denominator.reward_stats(rew))
        metrics.update(masked_coverage)
        metrics.update(aggregate.agent_pass_metrics(scores, plan.agents.get(name, {}).get("repeats", 1)))
        metrics.update(coverage)
        entries.append(
            {
                "agent_ref": {"name": name},
                "agent_metrics": metrics,
                "key_metrics": aggregate.key_metrics(metrics) | masked_coverage,
            }
        )
    return entries


class AggregateWriter:
    """Streams the aggregate-metrics list: entries' heads first, each agent's group rows where they belong."""

    def __init__(self, out: IO[bytes], entries: list[dict[str, Any]], codes: list[int], scratch: Callable[[int], Path]):
        self.out, self.codes = out, codes
        parts = orjson.dumps(
            [e | {"group_level_metrics": "@@shardrun-group-level-metrics@@"} for e in entries],
            option=orjson.OPT_INDENT_2,
        ).split(PLACEHOLDER)
        self.parts = parts
        self.count = {a: 0 for a in codes}
        self.spills: dict[int, tuple[Path, IO[bytes]]] = {}
        self._stack = contextlib.ExitStack()
        for a in codes[1:]:
            path = scratch(a)
            self.spills[a] = (path, self._stack.enter_context(open(path, "wb")))
        out.write(parts[0])
        if codes:
            out.write(b"[")

    def add(self, agent: int, rows: list[bytes]) -> None:
        if not rows:
            return
        sink = self.out if agent == self.codes[0] else self.spills[agent][1]
        sink.write((b"," if self.count[agent] else b"") + ROW_INDENT + (b"," + ROW_INDENT).join(rows))
        self.count[agent] += len(rows)

    def close(self) -> None:
        self._stack.close()
        for i, a in enumerate(self.codes):
            if i:
                self.out.write(b"[")
                path = self.spills[a][0]
                with open(path, "rb") as f:
                    while block := f.read(1 << 20):
                        self.out.write(block)
                path.unlink()
            self.out.write(LIST_END if self.count[a] else b"]")
            self.out.write(self.parts[i + 1])


def write_profile(
    out: IO[bytes],
    aggregate_out: AggregateWriter,
    table: MergedTable,
    tasks: TaskInfo,
    stats: AgentStats,
    materialized: list[Path],
    stopped: frozenset[int] = frozenset(),
    raw_lengths: bool = False,
) -> None:
    """The per-task profile rows (and each task's aggregate group row), chunk by chunk in task order. A task in
    `stopped` (adaptive sampling: rollouts skipped because it was decided) says so in its row: `stopped_decided`.
    `raw_lengths`: each profile row also carries its rollouts' `raw_rewards_and_lengths` after `rollout_infos`
    (opt-in: Gym's own profile has no such field; the aggregate group rows never have it)."""
    layout = frame_layout(table)  # once: it looks at every row (per chunk, the profile's time would grow as n²)
    with ByteSources(materialized) as samples:
        for bounds in chunks(tasks.sizes):
            text, by_agent = render_chunk(table, tasks, stats, layout, samples, bounds, stopped, raw_lengths)
            out.write(text)
            for agent, rows in by_agent.items():
                aggregate_out.add(agent, rows)


def render_chunk(
    table: MergedTable,
    tasks: TaskInfo,
    stats: AgentStats,
    layout: Layout,
    samples: ByteSources,
    bounds: tuple[int, int],
    stopped: frozenset[int] = frozenset(),
    raw_lengths: bool = False,
) -> tuple[bytes, dict[int, list[bytes]]]:
    """Profile lines of tasks g0..g1 (task order), and their aggregate group rows by agent; `layout` is the whole
    frame's (frame_layout)."""
    same = {x: stats.layouts[x] == layout for x in stats.codes}
    g0, g1 = bounds
    a, b = int(tasks.starts[g0]), int(tasks.starts[g1 - 1] + tasks.sizes[g1 - 1])
    starts, sizes = tasks.starts[g0:g1] - a, tasks.sizes[g0:g1]
    group = reward_profile.group_stats(table.gather(a, b), starts, sizes)
    infos = table.infos(a, b)
    codes = (table.r_key[tasks.starts[g0:g1]] // table.stride).tolist()
    sample_rows = zip(
        tasks.sample_shard[g0:g1].tolist(), tasks.sample_offset[g0:g1].tolist(), tasks.sample_length[g0:g1].tolist()
    )
    lines: list[bytes] = []
    by_agent: dict[int, list[bytes]] = {x: [] for x in stats.codes}
    all_items = reward_profile.stat_rows(layout, group)
    for j, (code, start, n, where) in enumerate(zip(codes, starts.tolist(), sizes.tolist(), sample_rows)):
        task_index, agent = int(table.tasks[code]), int(tasks.agent[code])
        infos_json = b"[" + b",".join(infos[start : start + n]) + b"]"
        items_json = orjson.dumps(all_items[j])
        sample = orjson.dumps(reward_profile.sample_of(orjson.loads(samples.get(*where))))
        row = reward_profile.task_profile_row_json(
            task_index, items_json, sample, n, int(tasks.expected[code]), infos_json
        )
        extra = b""
        if raw_lengths:
            raw = reward_profile.raw_rewards_and_lengths(infos[start : start + n])
            extra += b',"' + reward_profile.RAW_REWARDS_AND_LENGTHS.encode() + b'":' + raw
        if task_index in stopped:
            extra += STOPPED_DECIDED
        lines.append(row[:-1] + extra + b"}" if extra else row)
        if not same[agent]:
            items_json = orjson.dumps(reward_profile.stat_items(stats.layouts[agent], group, j))
        by_agent[agent].append(
            reward_profile.task_profile_row_json(task_index, items_json, STUB_SAMPLE, n, n, infos_json)
        )
    return b"\n".join(lines) + b"\n", by_agent


def chunks(sizes: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive task ranges of about CHUNK_ROWS rollouts each (at least one task each)."""
    ends = np.cumsum(sizes)
    bounds = [0]
    while bounds[-1] < len(sizes):
        done = int(ends[bounds[-1] - 1]) if bounds[-1] else 0
        bounds.append(max(bounds[-1] + 1, int(np.searchsorted(ends, done + CHUNK_ROWS, side="right"))))
    return list(zip(bounds[:-1], bounds[1:]))
