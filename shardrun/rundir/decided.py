"""Which of a shard's tasks the rollouts already in the run directory decide (adaptive sampling, docs/adaptive-sampling.md).

Read when a shard starts (its own job, or a warm worker claiming it): the shard's planned rows say which tasks it
holds and how many rollouts each task has in all (its agent's repeats); every shard's rollouts.jsonl (complete
lines, the first row of each identity, as the merge counts them) and failures sidecar (identities failed for good
by the ledger's gate) say what is known of those tasks. A task is decided when `core.stopping.decide` says so
under the plan's `sampling` settings; its rows in this shard that are neither done nor failed are skipped.

Failed rollouts follow the per-task profile's rule, the one `select` reads: a failed rollout is left out of the
task's statistics (the `omit` policy; the `zero` policy of profile/denominator.py changes only the aggregate
metrics). A completed rollout whose metric is missing, not a number or outside `sampling.metric_range` is an error
of that rollout: its task is never decided (all its rollouts are collected) and the error is reported.

Everything here only reads; the decision is monotone (more rollouts only narrow what a task can end as), so
reading while other shards write can cost extra rollouts, never a different result.

Reading every shard's files costs time in proportion to the rollouts already in the run. A shard job reads them
once; a warm worker keeps one `RunRollouts` for its life, so each later shard start reads only the complete lines
appended since the one before (a file replaced, cut below what was read, or rewritten in place, as the last bytes
read show, starts the reading over).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

import orjson

from shardrun.core import stopping
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.core.stopping import Partial
from shardrun.plan.planner import Plan
from shardrun.rundir import ledger, records, seal, store

Key = tuple[int, int]


@dataclass(frozen=True)
class RangeError:
    """A completed rollout whose metric the decision cannot use."""

    task: int
    rollout: int
    value: Any


@dataclass
class ShardDecisions:
    """What the run directory decides for one shard's tasks."""

    verdicts: dict[int, bool] = field(default_factory=dict)  # decided tasks: keep (True) or drop (False)
    skip: set[Key] = field(default_factory=set)  # this shard's rows of decided tasks, neither done nor failed
    errors: list[RangeError] = field(default_factory=list)
    tasks: int = 0  # tasks the shard holds

    @property
    def skipped_tasks(self) -> list[int]:
        return sorted({t for t, _ in self.skip})


TAIL = 256  # bytes kept from the end of what was read, compared before reading on (a file rewritten in place)


class RunRollouts:
    """What every shard's files say so far: the metric of the first row of each identity in rollouts.jsonl, and
    the rows of the failures sidecars. `refresh` reads the complete lines appended since the last refresh."""

    def __init__(self, run_dir: Path, plan: Plan, metric: str):
        self.run_dir, self.plan, self.metric = Path(run_dir), plan, metric
        self.lock = threading.RLock()  # a warm worker starts shards from several threads (collector.pipeline_shards)
        self.reset()

    def reset(self) -> None:
        self.values: dict[int, dict[int, Any]] = defaultdict(dict)  # task -> rollout -> metric (first row)
        self.failures: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        self.read: dict[Path, tuple[int, int, bytes]] = {}  # file -> (inode, bytes read, the last of them)
        self.bytes_read = 0

    def refresh(self) -> None:
        for _ in range(2):  # a second pass starts from nothing, so it cannot find anything to start over for
            if self._read_new():
                return
            self.reset()
        raise AssertionError("unreachable: a pass from nothing never starts over")  # pragma: no cover

    def _read_new(self) -> bool:
        """Read what was appended; False when a file was replaced or cut below what was read (start over)."""
        for s in range(len(self.plan.shards)):
            for path, failures in (
                (store.rollouts_path(self.run_dir, s), False),
                (store.failures_path(self.run_dir, s), True),
            ):
                try:
                    f = store.open_regular(path)
                except FileNotFoundError:
                    if path in self.read:
                        return False
                    continue
                with f:
                    st = os.fstat(f.fileno())
                    inode, offset, tail = self.read.get(path, (st.st_ino, 0, b""))
                    if inode != st.st_ino or st.st_size < offset:
                        return False
                    f.seek(offset - len(tail))
                    if f.read(len(tail)) != tail:  # rewritten in place: what was read is gone
                        return False
                    lines = store.CompleteLines(f)
                    for _, block in lines.blocks():
                        for raw in block:
                            if raw.strip():
                                self._add(orjson.loads(raw), failures)
                    end = f.tell() - lines.torn
                    if end > offset:
                        f.seek(max(0, end - TAIL))
                        tail = f.read(end - max(0, end - TAIL))
                    self.bytes_read += end - offset
                    self.read[path] = (st.st_ino, end, tail)
        return True

    def _add(self, row: dict[str, Any], failures: bool) -> None:
        task, rollout = row.get(TASK_KEY), row.get(ROLLOUT_KEY)
        if not isinstance(task, int) or not isinstance(rollout, int):
            return
        if failures:
            self.failures[task][rollout].append(row)
        elif rollout not in self.values[task]:
            self.values[task][rollout] = row.get(self.metric)


def decide_shard(
    run_dir: Path,
    plan: Plan,
    index: int,
    max_attempts: int | None = None,
    known: RunRollouts | None = None,
) -> ShardDecisions:
    """The decisions for shard `index` from the run directory alone (nothing when the plan does not stop early).
    `known`: what an earlier call read (a warm worker's); brought up to date here."""
    sampling = plan.sampling
    if sampling is None or sampling.stop_when_decided is None:
        return ShardDecisions()
    rules = sampling.stop_when_decided
    fill_all, filled = fill_requested(run_dir)
    if fill_all:
        return ShardDecisions()
    attempts = ledger.launched_max_attempts(run_dir) if max_attempts is None else max_attempts
    planned: dict[Key, str] = {}
    agents: dict[int, str] = {}
    for row in store.iter_jsonl_objects(store.materialized_path(run_dir, index)):
        key = (row[TASK_KEY], row[ROLLOUT_KEY])
        ref = row.get(AGENT_KEY)
        agent = ref.get("name") if isinstance(ref, dict) else None
        agents[key[0]] = agent if isinstance(agent, str) else str(agent)
        planned[key] = agents[key[0]]
    out = ShardDecisions(tasks=len(agents))
    if not agents:
        return out
    if known is None or known.metric != rules.metric:
        known = RunRollouts(run_dir, plan, rules.metric)
    values: dict[Key, Any] = {}
    by_task: dict[int, list[Any]] = {}
    failed: set[Key] = set()
    failed_per_task: dict[int, int] = defaultdict(int)
    with known.lock:
        known.refresh()
        for t in agents:
            seen = dict(known.values.get(t, {}))
            by_task[t] = sorted(seen.items())
            values.update(((t, r), v) for r, v in seen.items())
            for r, rows in known.failures.get(t, {}).items():
                if r not in seen and ledger.failed_for_good(rows, attempts):
                    failed.add((t, r))
                    failed_per_task[t] += 1
    for task, agent in agents.items():
        if task in filled:
            continue
        k = plan.repeats_of(task, agent)
        got = by_task.get(task, [])
        bad = [(r, v) for r, v in got if stopping.out_of_range([v], sampling.metric_range)]
        if bad:
            out.errors.extend(RangeError(task, r, v) for r, v in bad)
            continue
        numbers = [float(v) for _, v in got]
        still_open = max(0, k - len(numbers) - failed_per_task[task])
        partial = Partial.of(numbers, failed_per_task[task], still_open, sampling.metric_range)
        verdict = stopping.decide(rules, agent, partial, sampling.metric_range, "omit", sampling.min_repeats)
        if verdict is not None:
            out.verdicts[task] = verdict
    out.skip = {key for key in planned if key[0] in out.verdicts and key not in values and key not in failed}
    return out


# ---------------------------------------------------------------- filling (`shardrun resume --fill`)


def fill_requested(run_dir: Path) -> tuple[bool, set[int]]:
    """(every task, the tasks) a fill asked for: never skipped again (records.FillRequest)."""
    request = records.read_fill(run_dir)
    return request.all, set(request.tasks)


def request_fill(run_dir: Path, plan: Plan, tasks: Collection[int] | None, dry_run: bool = False) -> list[int]:
    """Ask for the skipped rollouts of `tasks` (None: of every task) to be collected: record the tasks in fill.json
    (they are never skipped again) and unseal each sealed shard that skipped rows of them, so that `resume` runs it;
    it resumes from its rollouts and collects only the skipped rows. Returns the shards unsealed (`dry_run`: the
    shards it would unseal; nothing is written)."""
    with store.run_lock(run_dir):
        before_all, before = fill_requested(run_dir)
        if tasks is None or before_all:
            record = records.FillRequest(all=True)
            wanted: set[int] | None = None
        else:
            wanted = set(before) | {int(t) for t in tasks}
            record = records.FillRequest(tasks=sorted(wanted))
        reopen = []
        for spec in plan.shards:
            state = seal.check(run_dir, plan, spec.index)
            skipped = set(state.marker.skipped_decided_tasks) if state.sealed and state.marker else set()
            if skipped and (wanted is None or skipped & wanted):
                reopen.append(spec.index)
        if dry_run:
            return reopen
        records.write_fill(run_dir, record)
        for index in reopen:
            store.done_path(run_dir, index).unlink()
        return reopen
