"""`shardrun merge-and-profile`: sealed shards -> the files one unsharded NeMo Gym run would have given.

    merged/rollouts.jsonl                        every kept rollout once, sorted by (task, rollout), raw bytes
    merged/rollouts_materialized_inputs.jsonl    every planned row, sorted by (task, rollout), raw bytes
    merged/rollouts_failures.jsonl               the shards' failure sidecars, sorted by identity
    merged/rollouts_reward_profiling.jsonl       ng_reward_profile's per-task rows
    merged/rollouts_agent_metrics.json           ng_reward_profile's per-agent rows
    merged/rollouts_aggregate_metrics.json       Gym's aggregate-metrics list (pass@k, majority@k per agent)
    merged/rollouts_repeat_level_metrics.json    Gym 0.7's per-agent, per-repeat rows (a 0.7 run only)
    merged/merge_summary.json                    what the merge saw and did (the only file with timings)
    merged/failures_by_class.json                the failed rollouts by class, per label; the unreliable labels

The merge stage (merge.shard_merge) reads the shards and writes the three row files; this module then profiles
the merged table (writers). Every output is written through a temp file, all renamed into place together at
the end, so a killed merge leaves the previous outputs untouched and a re-run gives the same bytes.

Under a Gym release with a mask flag (0.7's `mask_sample`: GymAdapter.mask_field) a masked rollout stays in
merged/rollouts.jsonl and counts as completed (it ran), but every statistic comes from the measured table
(MergedTable.measured), as the release's profiler and its aggregate metrics compute them, and the agents'
coverage says how many rollouts and tasks were masked.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import time
from pathlib import Path
from typing import IO, Any, Sequence

import numpy as np
import orjson

from shardrun.merge import shard_merge, shard_reader
from shardrun.merge.merged_table import MergedTable
from shardrun.merge.outcome import AgentResult, MergeSummary
from shardrun.merge.shard_merge import RowFiles
from shardrun.plan.planner import Plan
from shardrun.profile import blend_labels, denominator, repeat_metrics, writers
from shardrun.profile.writers import TaskInfo
from shardrun.core.gym_names import ROLLOUT_KEY, ROLLOUTS, TASK_KEY
from shardrun.rundir import store
from shardrun.rundir.records import LabelResult
from shardrun.rundir.seal import SealState
from shardrun.core import gym_adapter
from shardrun.core.errors import BadInput
from shardrun.core.terminal import shown


REPEAT_LEVEL_METRICS = ROLLOUTS.removesuffix(".jsonl") + "_repeat_level_metrics.json"


def merge_and_profile(
    run_dir: Path | str,
    allow_partial: bool = False,
    answer_field: str | None = None,
    workers: int | None = None,
    missing: str | None = None,
    raw_rewards_and_lengths: bool = False,
) -> MergeSummary:
    """Merge the run's shards and profile them. IncompleteRun if a shard is unsealed and not allow_partial.

    `answer_field` names the rollout field holding the extracted answer (enables majority@k); `workers` is how
    many processes read shards (default: the CPUs this process may use, at most 8; one for small runs);
    `missing` is what a planned rollout without a result counts as in the aggregate metrics, "omit" or "zero"
    (default: the run's Gym version's policy; profile/denominator.py); `raw_rewards_and_lengths` adds to each
    profile row its rollouts' rewards and token counts (Gym pull request 2771's field; off: Gym's own profile).
    """
    started = time.monotonic()
    run_dir = Path(run_dir)
    plan = store.load_plan(run_dir)
    states = shard_merge.check_seals(run_dir, plan, allow_partial)
    if answer_field is not None:
        check_answer_field(run_dir, plan, answer_field)
    release = gym_release(plan, states)
    policy = denominator.check_policy(missing or release.missing_policy)
    workers = workers or shard_reader.default_workers(plan.num_rollouts)
    with store.merge_lock(run_dir):
        store.remove_stale_temps(store.merged_dir(run_dir), store.MERGE_TMP_PREFIX)
        try:
            with contextlib.ExitStack() as stack:
                # the summary's writer is entered first, so it is renamed last: a merge_summary.json in place means
                # every output beside it comes from the same merge (one killed while renaming leaves the earlier one)
                outputs = output_paths(run_dir, release)
                out: dict[str, IO[bytes]] = {
                    k: stack.enter_context(store.atomic_writer(outputs[k], prefix=store.MERGE_TMP_PREFIX))
                    for k in sorted(outputs, key=lambda k: k != "summary")
                }
                files = RowFiles(out["rollouts"], out["materialized_inputs"], out["failures"])
                table, summary = shard_merge.merge_shards(
                    run_dir,
                    plan,
                    states,
                    files,
                    allow_partial=allow_partial,
                    answer_field=answer_field,
                    workers=workers,
                    mask_field=release.mask_field,
                )
                summary.outputs = {k: str(p) for k, p in outputs.items()}
                tick = time.monotonic()
                if plan.blend:  # each label's profile first, from the table before anything is released
                    _profile_labels(
                        run_dir, plan, table, states, summary, stack, release, policy, raw_rewards_and_lengths
                    )
                _profile_part(
                    run_dir, plan, table, states, summary, out, release, policy, raw_lengths=raw_rewards_and_lengths
                )
                summary.timings["profile_s"] = time.monotonic() - tick
                summary.timings["total_s"] = time.monotonic() - started
                if summary.tally is not None:
                    tally_out = stack.enter_context(
                        store.atomic_writer(store.failure_tally_path(run_dir), prefix=store.MERGE_TMP_PREFIX)
                    )
                    tally_out.write(summary.tally.to_bytes())
                out["summary"].write(orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        finally:
            store.remove_stale_temps(store.merged_dir(run_dir), store.MERGE_TMP_PREFIX)
    return summary


def _profile_part(
    run_dir: Path,
    plan: Plan,
    table: MergedTable,
    states: Sequence[SealState],
    summary: MergeSummary,
    out: dict[str, IO[bytes]],
    release: gym_adapter.GymAdapter,
    policy: str,
    scratch: str = "groups-",
    raw_lengths: bool = False,
) -> list[dict[str, Any]]:
    """Count and profile one merged table (the run's, or one label's): `summary` gets its counts, `out` its profile
    files; the table's locations and planned rows are released. Returns its aggregate-metrics entries."""
    tasks = TaskInfo(table)  # completion: every collected rollout, masked or not
    imputed = _without_result(table, tasks, _skipped(run_dir, table, states)) if policy == "zero" else None
    masked = _masked(table, tasks)
    _count_tasks(summary, table, tasks, plan, masked)
    table.release_locations()
    table = table.measured()  # the statistics: measured rollouts only (itself when none is masked)
    tasks = TaskInfo(table) if masked else tasks
    table.release_planned()
    return _profile(
        run_dir, plan, table, tasks, summary, out, release, imputed, stopped_tasks(states), masked, scratch, raw_lengths
    )


def label_output_paths(run_dir: Path, release: gym_adapter.GymAdapter, label: str) -> dict[str, Path]:
    """A label's profile files in merged/by_label/<label>/, named as the run's are."""
    merged = store.merged_dir(run_dir)
    whole = output_paths(run_dir, release)
    names = ("reward_profiling", "agent_metrics", "aggregate_metrics", "repeat_level_metrics")
    return {k: store.by_label_dir(run_dir, label) / whole[k].relative_to(merged) for k in names if k in whole}


def _profile_labels(
    run_dir: Path,
    plan: Plan,
    table: MergedTable,
    states: Sequence[SealState],
    summary: MergeSummary,
    stack: contextlib.ExitStack,
    release: gym_adapter.GymAdapter,
    policy: str,
    raw_lengths: bool = False,
) -> None:
    """Each label's profile files (merged/by_label/<label>/) and merged/labels.json, written atomically with the
    run's other outputs (renamed when the stack closes); the labels' results go to `summary.labels`."""
    markers = [s.marker if s.sealed else None for s in states]
    whole = blend_labels.shard_share(table, len(plan.shards))
    failed = np.array([t for t, _ in summary.failed_ids], np.int64)
    skipped = table.task_of_key(_skipped(run_dir, table, states))
    results = []
    # each label's files are closed once written, and renamed when the stack closes (before the run's outputs): the
    # files open at once do not grow with the labels (a blend of 10,000 labels merges under `ulimit -n 1024`)
    at_end = stack.enter_context(store.renamed_at_end(store.MERGE_TMP_PREFIX))
    for entry, ranks in zip(plan.blend, blend_labels.task_ranks(plan, table)):
        paths = label_output_paths(run_dir, release, entry.label)
        for p in paths.values():
            p.parent.mkdir(parents=True, exist_ok=True)
            store.remove_stale_temps(p.parent, store.MERGE_TMP_PREFIX)
        sub = table.subset(ranks)
        mine = blend_labels.shard_share(sub, len(plan.shards))
        part = MergeSummary(summary.run_dir, summary.fingerprint, summary.allow_partial)
        with contextlib.ExitStack() as files:
            out = {k: files.enter_context(at_end.writer(p)) for k, p in paths.items()}
            entries = _profile_part(
                run_dir,
                blend_labels.label_plan(plan, entry),
                sub,
                states,
                part,
                out,
                release,
                policy,
                f"groups-{entry.label}-",
                raw_lengths,
            )
        metrics: dict[str, Any] = next(
            (e["agent_metrics"] for e in entries if e["agent_ref"]["name"] == entry.agent), {}
        )
        pass1 = _number(metrics.get("pass@1/accuracy"))
        in_label = np.isin(plan.label_codes(failed), [plan.labels.index(entry.label)])
        n_failed = int(in_label.sum())
        n_skipped = int((plan.label_codes(skipped) == plan.labels.index(entry.label)).sum())
        group = summary.tally.groups[plan.labels.index(entry.label)] if summary.tally is not None else None
        results.append(
            LabelResult(
                label=entry.label,
                agent=entry.agent,
                owner=entry.owner,
                tasks_planned=entry.num_tasks,
                rollouts_planned=entry.num_rollouts,
                collected=part.rollouts,
                masked=part.masked_rollouts,
                failed=n_failed,
                skipped=n_skipped,
                missing=entry.num_rollouts - part.rollouts - n_failed - n_skipped,
                tasks_complete=part.tasks_complete,
                tasks_partial=part.tasks_partial,
                tasks_missing=entry.num_tasks - part.tasks_complete - part.tasks_partial,
                mean_reward=_number(metrics.get("mean/reward")),
                pass_at_1=None if pass1 is None else pass1 / 100.0,
                rate=blend_labels.label_rate(mine, whole, markers),
                profile=str(paths["reward_profiling"].parent.relative_to(store.merged_dir(run_dir))),
                failures=group.by_class if group is not None else {},
                unreliable=group.unreliable if group is not None else False,
            )
        )
    summary.labels = results
    summary.failed_lanes = [r.label for r in results if r.failed_lane]
    document = blend_labels.labels_document(run_dir, plan, results)
    out_labels = stack.enter_context(store.atomic_writer(store.labels_path(run_dir), prefix=store.MERGE_TMP_PREFIX))
    out_labels.write(document.to_bytes())


def _number(value: Any) -> float | None:
    """A metric as labels.json holds it: a float, or None for none (or a NaN: no mean over no rollout)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


MAX_FIELDS_LISTED = 40


def check_answer_field(run_dir: Path, plan: Plan, field: str) -> None:
    """BadInput, listing the fields the rows have, when no rollout row has `field` (a typo in --answer-field would
    leave every rollout without an answer and majority@k at zero). The shards' rows are read only until one has
    the field: at once for a field every row has, all of them only to refuse. Nothing is written before."""
    seen: set[str] = set()
    for spec in plan.shards:
        path = store.rollouts_path(run_dir, spec.index)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue  # not a regular file: the merge itself says what is wrong with it
        except FileNotFoundError:
            continue
        for raw in store.complete_lines(path):
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # the merge counts the rows it rejects
            if isinstance(row, dict):
                if field in row:
                    return
                seen.update(row)
    if not seen:
        return  # no rows at all: the merge says what is missing
    names = sorted(seen)
    listed = ", ".join(shown(n) for n in names[:MAX_FIELDS_LISTED]) + (
        f" and {len(names) - MAX_FIELDS_LISTED} more" if len(names) > MAX_FIELDS_LISTED else ""
    )
    raise BadInput(f"--answer-field {shown(field)}: no rollout row has this field; the rows have: {listed}")


def stopped_tasks(states: Sequence[SealState]) -> frozenset[int]:
    """Tasks whose rollouts a sealed shard skipped because they were decided (adaptive sampling)."""
    return frozenset(t for s in states if s.sealed and s.marker for t in s.marker.skipped_decided_tasks)


def gym_release(plan: Plan, states: Sequence[SealState]) -> gym_adapter.GymAdapter:
    """The adapter of the run's Gym release: the plan's version, else the one its sealed shards ran with, else
    0.4.0 (what shardrun profiled before it recorded versions)."""
    marked = (s.marker.gym_version for s in states if s.marker and s.marker.gym_version)
    return gym_adapter.for_version(plan.gym_version or next(marked, None) or "0.4.0")


def _skipped(run_dir: Path, table: MergedTable, states: Sequence[SealState]) -> np.ndarray:
    """The planned keys skipped because their task was decided (adaptive sampling): in a shard whose seal lists
    their task, without a rollout and without a failure row. They were never run, so no policy counts them."""
    skipped = {
        s.marker.shard_index: set(s.marker.skipped_decided_tasks)
        for s in states
        if s.sealed and s.marker and s.marker.skipped_decided_tasks
    }
    if not skipped:
        return np.zeros(0, np.int64)
    keys = table.p_key[~table.has_rollout(table.p_key)]
    shards = table.planned_rows_of(keys)[0].tolist()
    failed = {
        (r.get(TASK_KEY), r.get(ROLLOUT_KEY))
        for i in skipped
        for r in store.iter_jsonl_objects(store.failures_path(run_dir, i))
    }
    task, rollout = table.task_of_key(keys).tolist(), table.rollout_of_key(keys).tolist()
    mask = [t in skipped.get(s, ()) and (t, r) not in failed for s, t, r in zip(shards, task, rollout)]
    return keys[np.array(mask, dtype=bool)]


def _without_result(table: MergedTable, tasks: TaskInfo, skipped: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """Per agent code, the planned keys that have no kept rollout (missing or failed), before the planned rows
    are released; `skipped` keys (adaptive sampling: never run) are not among them."""
    keys = table.p_key[~table.has_rollout(table.p_key)]
    if skipped is not None and len(skipped):
        keys = keys[~np.isin(keys, skipped)]
    agent = tasks.agent[keys // table.stride]
    return {int(a): keys[agent == a] for a in np.unique(agent).tolist()}


def _masked(table: MergedTable, tasks: TaskInfo) -> dict[int, np.ndarray]:
    """Per agent code, the keys of its masked rollouts (none without a mask field)."""
    keys = table.r_key[table.r_masked]
    agent = tasks.agent[keys // table.stride]
    return {int(a): keys[agent == a] for a in np.unique(agent).tolist()}


def output_paths(run_dir: Path, release: gym_adapter.GymAdapter) -> dict[str, Path]:
    """The merged files, the profile's as the release's own profiler names them."""
    repeats = {"repeat_level_metrics": store.merged_dir(run_dir) / REPEAT_LEVEL_METRICS}
    return {
        "rollouts": store.merged_rollouts_path(run_dir),
        "materialized_inputs": store.merged_materialized_path(run_dir),
        "failures": store.merged_failures_path(run_dir),
        "reward_profiling": store.merged_reward_profiling_path(run_dir),
        "agent_metrics": store.merged_agent_metrics_path(run_dir),
        "aggregate_metrics": store.merged_aggregate_metrics_path(run_dir),
        "summary": store.merged_summary_path(run_dir),
    } | (repeats if release.repeat_level_metrics else {})


def _profile(
    run_dir: Path,
    plan: Plan,
    table: MergedTable,
    tasks: TaskInfo,
    summary: MergeSummary,
    out: dict[str, IO[bytes]],
    release: gym_adapter.GymAdapter,
    imputed: dict[int, np.ndarray] | None = None,
    stopped: frozenset[int] = frozenset(),
    masked: dict[int, np.ndarray] | None = None,
    scratch: str = "groups-",
    raw_lengths: bool = False,
) -> list[dict[str, Any]]:
    """The profile files from the measured table and its tasks; `masked`: per agent code, its masked keys. Returns
    the aggregate-metrics entries (without their group rows)."""
    masked = masked or {}
    agents = writers.AgentStats(table, tasks)
    agent_rows = writers.agent_metric_rows(table, agents)
    if release.repeat_level_metrics:  # Gym 0.7: per-repeat rows, and their spread appended to each agent's row
        repeats = repeat_metrics.repeat_level_metrics(repeat_metrics.table_frame(table, tasks.agent))
        across = repeat_metrics.across_repeats(repeats)
        agent_rows = [row | across.get(row["agent_ref"]["name"], {}) for row in agent_rows]
        out["repeat_level_metrics"].write(orjson.dumps(repeats))
    if masked:
        agent_rows = writers.masked_agent_rows(agent_rows, table, agents, masked)
    out["agent_metrics"].write(orjson.dumps(agent_rows))
    entries = writers.aggregate_entries(table, agents, plan, imputed, masked)
    _summarize_agents(summary, entries)
    groups = writers.AggregateWriter(
        out["aggregate_metrics"],
        entries,
        writers.entry_codes(table, agents, masked),
        lambda a: store.merge_scratch(run_dir, f"{scratch}{a}.json"),
    )
    materialized = [store.materialized_path(run_dir, s.index) for s in plan.shards]
    writers.write_profile(out["reward_profiling"], groups, table, tasks, agents, materialized, stopped, raw_lengths)
    groups.close()
    return entries


def _summarize_agents(summary: MergeSummary, entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        for result in summary.agents:
            if result.name == entry["agent_ref"]["name"]:
                metrics = entry["agent_metrics"]
                result.mean_reward = metrics.get("mean/reward")
                result.metrics = {k: v for k, v in metrics.items() if "@" in k}


def _count_tasks(
    summary: MergeSummary, table: MergedTable, tasks: TaskInfo, plan: Plan, masked: dict[int, np.ndarray]
) -> None:
    """Completion (of the whole table: a masked rollout is completed) and the masked rollouts, per agent."""
    done, expected = tasks.done, tasks.expected
    complete, partial = done == expected, (done > 0) & (done < expected)
    missing = done == 0
    summary.tasks = len(expected)
    summary.tasks_complete, summary.tasks_partial = int(complete.sum()), int(partial.sum())
    summary.tasks_missing = int(missing.sum())
    summary.rollouts, summary.expected_rollouts = int(done.sum()), int(expected.sum())
    for code, name in enumerate(table.agents):
        mine = tasks.agent == code
        summary.agents.append(
            AgentResult(
                name,
                plan.agents.get(name, {}).get("repeats", 0),
                int(mine.sum()),
                int((complete & mine).sum()),
                int((partial & mine).sum()),
                int((missing & mine).sum()),
                int(done[mine].sum()),
                int(expected[mine].sum()),
                masked=len(masked.get(code, ())),
            )
        )
    summary.masked_rollouts = sum(len(keys) for keys in masked.values())
    summary.agents.sort(key=lambda a: a.name)
