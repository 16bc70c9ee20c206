"""`shardrun merge-and-profile`: sealed shards -> the files one unsharded NeMo Gym run would have given.

    merged/rollouts.jsonl                        every kept rollout once, sorted by (task, rollout), raw bytes
    merged/rollouts_materialized_inputs.jsonl    every planned row, sorted by (task, rollout), raw bytes
    merged/rollouts_failures.jsonl               the shards' failure sidecars, sorted by identity
    merged/rollouts_reward_profiling.jsonl       ng_reward_profile's per-task rows
    merged/rollouts_agent_metrics.json           ng_reward_profile's per-agent rows
    merged/rollouts_aggregate_metrics.json       Gym's aggregate-metrics list (pass@k, majority@k per agent)
    merged/merge_summary.json                    what the merge saw and did (the only file with timings)

Steps: check every shard's `.done` (refuse unsealed shards unless allow_partial); read each shard once
(shardscan, through the C line scanner where it is built), resolve its rows to planned identities (identity),
add it to the sorted table (merged_table); a forked copy process writes the merged row files shard by shard
while the shards are read and profiled (shardcopy; shards out of identity order are copied from the sorted
table afterwards, rowcopy), and the profile is computed. Every output is written through a temp file, all
renamed into place together at the end, so a killed merge leaves the previous outputs untouched and a re-run
gives the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from shardrun.profile import writers
from shardrun.rundir import seal
from shardrun.merge import shardread
from shardrun.rundir import store
from shardrun.merge.directio import DirectWriter
from shardrun.core.errors import IncompleteRun
from shardrun.merge.outcome import MAX_LISTED_FAILED, AgentResult, FailedRollout, MergeSummary, ShardResult
from shardrun.merge.merged_table import MergedTable, TableBuilder
from shardrun.profile.writers import TaskInfo
from shardrun.plan.planner import Plan
from shardrun.merge.rowcopy import ByteSources, copy_rows
from shardrun.merge.shardcopy import ShardStreamer
from shardrun.merge.shardscan import FailureRow


RENDER_POOL_MIN = 3  # with fewer CPUs the copy thread (when the rows are copied after reading) gets one
# the row copies overlap the profile (in a thread) up to this many rollouts: the rows' locations are then held
# while the profile runs, beside its own memory (about 30 bytes a row, plus the copy's 64 MiB window)
OVERLAP_MAX_ROWS = 2_000_000


def merge_and_profile(
    run_dir: Path | str, allow_partial: bool = False, answer_field: str | None = None, workers: int | None = None
) -> MergeSummary:
    """Merge the run's shards and profile them. IncompleteRun if a shard is unsealed and not allow_partial.

    `answer_field` names the rollout field holding the extracted answer (enables majority@k); `workers` is how
    many processes read shards (default: the CPUs this process may use, at most 8; one for small runs).
    """
    started = time.monotonic()
    run_dir = Path(run_dir)
    plan = store.load_plan(run_dir)
    states = [seal.check(run_dir, plan, s.index) for s in plan.shards]
    refuse_unsealed(run_dir, states, allow_partial)
    with store.merge_lock(run_dir):
        store.remove_stale_temps(store.merged_dir(run_dir))
        try:
            summary = _merge(
                run_dir,
                plan,
                states,
                allow_partial,
                answer_field,
                workers or shardread.default_workers(plan.num_rollouts),
                started,
            )
        finally:
            store.remove_stale_temps(store.merged_dir(run_dir))
    return summary


def refuse_unsealed(run_dir: Path, states: list[seal.SealState], allow_partial: bool) -> None:
    unsealed = [(i, s.reason) for i, s in enumerate(states) if not s.sealed]
    if unsealed and not allow_partial:
        raise IncompleteRun(shardread.unsealed_message(run_dir, unsealed, len(states)))


def _read_shards(
    run_dir: Path,
    plan: Plan,
    states: list[seal.SealState],
    allow_partial: bool,
    answer_field: str | None,
    workers: int,
    streamer: ShardStreamer,
) -> tuple[MergedTable, list[ShardResult], list[tuple[int, FailureRow]], list[Path]]:
    jobs = [
        shardread.ShardJob(run_dir, spec.index, spec.num_rollouts, state, allow_partial, answer_field)
        for spec, state in zip(plan.shards, states)
    ]
    builder = TableBuilder(plan.num_rollouts, answers=answer_field is not None)
    results, failures, sources = [], [], []
    for scan in shardread.scan_shards(jobs, workers):
        builder.add(scan.index, scan.planned, scan.rollouts, scan.resolution)
        streamer.add(scan)
        failures += [(scan.index, f) for f in scan.failures]
        r, res, state = scan.rollouts, scan.resolution, scan.state
        results.append(
            ShardResult(
                scan.index,
                state.sealed,
                state.reason,
                r.lines,
                len(res.keep),
                res.duplicates,
                res.foreign,
                r.no_identity,
                r.unreadable,
                r.torn_bytes,
                res.renumbered,
                len(scan.failures),
                state.marker if state.sealed else None,
                scan.failures_rejected,
            )
        )
        sources.append(r.source)
    return builder.finish(), results, failures, sources


def shard_warnings(shards: list[ShardResult]) -> list[str]:
    """What the summary should point out about the shards (markers that disagree with their files)."""
    out = []
    for s in shards:
        claimed = (s.marker or {}).get("num_rollouts")
        if s.sealed and isinstance(claimed, int) and claimed != s.kept:
            out.append(
                f"shard {s.index:05d}: its marker counts {claimed:,} rollouts, {s.kept:,} planned "
                f"identities were found in its rollouts.jsonl"
            )
        if s.failure_rows_rejected:
            out.append(
                f"shard {s.index:05d}: {s.failure_rows_rejected:,} failure-sidecar rows without a planned "
                f"identity were left out"
            )
    return out


# ---------------------------------------------------------------- the merge


def _merge(
    run_dir: Path,
    plan: Plan,
    states: list[seal.SealState],
    allow_partial: bool,
    answer_field: str | None,
    workers: int,
    started: float,
) -> MergeSummary:
    timings: dict[str, float] = {}
    outputs = _output_paths(run_dir)
    materialized_sources = [store.materialized_path(run_dir, s.index) for s in plan.shards]
    with contextlib.ExitStack() as stack:
        # the summary's writer is entered first, so it is renamed last: a merge_summary.json in place means every
        # output beside it comes from the same merge (one killed while renaming leaves the earlier summary)
        out: dict[str, Any] = {
            k: stack.enter_context(store.atomic_writer(outputs[k]))
            for k in sorted(outputs, key=lambda k: k != "summary")
        }
        for k in ("reward_profiling", "aggregate_metrics"):  # large: written past the page cache (directio)
            out[k] = stack.enter_context(DirectWriter(out[k].fileno()))
        tick = time.monotonic()
        # forked now, before any thread or pool: copies the shards' rows while they are read and profiled
        streamer = stack.enter_context(
            ShardStreamer(out["materialized_inputs"], out["rollouts"], lambda name: store.merge_scratch(run_dir, name))
        )
        table, shards, failures, rollout_sources = _read_shards(
            run_dir, plan, states, allow_partial, answer_field, workers, streamer
        )
        streamed = streamer.end_of_shards()
        timings["read_s"] = time.monotonic() - tick
        trim_heap()
        summary = MergeSummary(
            str(run_dir),
            plan.fingerprint,
            allow_partial,
            shards=shards,
            timings=timings,
            warnings=shard_warnings(shards),
        )
        summary.outputs = {k: str(p) for k, p in outputs.items()}
        tasks = TaskInfo(table)
        copier = None if streamed else _start_copier(out, table, materialized_sources, rollout_sources, workers)
        table.release_planned()
        table.release_locations()
        try:
            _write_failures(out["failures"], table, failures, summary)
            tick = time.monotonic()
            # chunks are rendered by a pool of forked workers, unless the copy thread runs (no fork beside it)
            _profile(
                run_dir,
                plan,
                table,
                tasks,
                summary,
                out,
                materialized_sources,
                1 if copier is not None and copier.is_alive() else workers,
            )
            timings["profile_s"] = time.monotonic() - tick
        finally:
            if copier is not None and copier.is_alive():
                copier.join()
        if copier is not None:
            copier.raise_error()
        streamer.wait()
        timings["copy_s"] = streamer.seconds + (copier.seconds if copier is not None else 0.0)
        timings["total_s"] = time.monotonic() - started
        out["summary"].write(orjson.dumps(summary.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return summary


def _output_paths(run_dir: Path) -> dict[str, Path]:
    return {
        "rollouts": store.merged_rollouts_path(run_dir),
        "materialized_inputs": store.merged_materialized_path(run_dir),
        "failures": store.merged_failures_path(run_dir),
        "reward_profiling": store.merged_reward_profiling_path(run_dir),
        "agent_metrics": store.merged_agent_metrics_path(run_dir),
        "aggregate_metrics": store.merged_aggregate_metrics_path(run_dir),
        "summary": store.merged_summary_path(run_dir),
    }


def _start_copier(
    out: dict[str, Any], table: MergedTable, materialized_sources: list[Path], rollout_sources: list[Path], workers: int
) -> "_Copier":
    """Shards out of identity order: the row copies are made from the sorted table, on the locations taken here
    (the caller then lets the table drop its own references). Mostly kernel time (pread, write, fsync), so they run in a thread
    beside the profile (up to OVERLAP_MAX_ROWS, and only where the profile renders without a pool, which forks);
    otherwise they are made now."""
    copier = _Copier(out["materialized_inputs"], out["rollouts"], table, materialized_sources, rollout_sources)
    if workers < RENDER_POOL_MIN and len(table.r_key) <= OVERLAP_MAX_ROWS:
        copier.start()
    else:
        copier.run()
    return copier


def _profile(
    run_dir: Path,
    plan: Plan,
    table: MergedTable,
    tasks: TaskInfo,
    summary: MergeSummary,
    out: dict[str, IO[bytes]],
    materialized_sources: list[Path],
    workers: int,
) -> None:
    _count_tasks(summary, table, tasks, plan)
    agents = writers.AgentStats(table, tasks)
    trim_heap()
    out["agent_metrics"].write(orjson.dumps(writers.agent_metric_rows(table, agents)))
    entries = writers.aggregate_entries(table, agents, plan)
    trim_heap()
    _summarize_agents(summary, entries)
    groups = writers.AggregateWriter(
        out["aggregate_metrics"], entries, agents.codes, lambda a: store.merge_scratch(run_dir, f"groups-{a}.json")
    )
    writers.write_profile(out["reward_profiling"], groups, table, tasks, agents, materialized_sources, workers)
    groups.close()


class _Copier(threading.Thread):
    """Writes merged/rollouts_materialized_inputs.jsonl and merged/rollouts.jsonl (flushed and fsynced), raw
    bytes in (task, rollout) order; an error is kept for raise_error."""

    def __init__(
        self,
        materialized: IO[bytes],
        rollouts: IO[bytes],
        table: MergedTable,
        materialized_sources: list[Path],
        rollout_sources: list[Path],
    ):
        super().__init__(name="merge-copy", daemon=True)
        self.materialized, self.rollouts = materialized, rollouts
        self.sources = materialized_sources, rollout_sources
        self.planned = table.p_shard, table.p_offset, table.p_length
        self.located = table.r_shard, table.r_offset, table.r_length, table.r_renumbered
        self.r_key, self.rollout_of_key = table.r_key, table.rollout_of_key
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        tick = time.monotonic()
        try:
            with ByteSources(self.sources[0]) as src:
                copy_rows(self.materialized, src, *self.planned)
            self.planned = None  # type: ignore[assignment]
            _sync(self.materialized)
            r_key, rollout_of_key = self.r_key, self.rollout_of_key

            def renumber(position: int, line: bytes) -> bytes:
                return shardread.with_rollout(line, int(rollout_of_key(r_key[position])))

            shard, offset, length, renumbered = self.located
            with ByteSources(self.sources[1]) as src:
                copy_rows(self.rollouts, src, shard, offset, length, renumber, renumbered)
            self.located = None  # type: ignore[assignment]
            _sync(self.rollouts)
        except BaseException as e:
            self.error = e
        self.seconds = time.monotonic() - tick

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def _sync(f: IO[bytes]) -> None:
    """Flush and fsync now, in the copy thread (the writer's own fsync at the end then finds nothing to do)."""
    f.flush()
    os.fsync(f.fileno())


def trim_heap() -> None:
    """Give the heap memory freed by a finished step back to the OS (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


# ---------------------------------------------------------------- row files


def _write_failures(
    out: IO[bytes], table: MergedTable, failures: list[tuple[int, FailureRow]], summary: MergeSummary
) -> None:
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
    summary.failed = [
        FailedRollout(t, r, by_identity[(t, r)][-1][0], by_identity[(t, r)][-1][1].reason, len(by_identity[(t, r)]))
        for t, r in failed[:MAX_LISTED_FAILED]
    ]


# ---------------------------------------------------------------- counts


def _summarize_agents(summary: MergeSummary, entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        for result in summary.agents:
            if result.name == entry["agent_ref"]["name"]:
                metrics = entry["agent_metrics"]
                result.mean_reward = metrics.get("mean/reward")
                result.metrics = {k: v for k, v in metrics.items() if "@" in k}


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
            )
        )
    summary.agents.sort(key=lambda a: a.name)
