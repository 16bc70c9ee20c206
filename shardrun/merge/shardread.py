"""Read whole shards: the unit of work of the merge, run in a pool of worker processes.

For one shard: its planned rows (materialized inputs), its rollouts read as sealed (hash checked against the
`.done` marker the merge checked, while the file is read) or, when unsealed, from a snapshot of its complete
lines; its rows resolved to planned identities; its failure sidecar. Workers return compact arrays only (no row
text); results come back in shard order, with at most a few shards in flight, so memory stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import orjson

from shardrun.merge import identity
from shardrun.rundir import seal
from shardrun.rundir import store
from shardrun.core.errors import IncompleteRun, PlanMismatch
from shardrun.core.gym_names import ROLLOUT_KEY
from shardrun.merge.shardscan import FailureRow, Planned, Rollouts, scan_failures, scan_planned, scan_rollouts
from shardrun.core.pool import available, ordered_map

ROWS_PER_WORKER = 50_000


def default_workers(num_rollouts: int) -> int:
    """The CPUs this process may use (pool.available), and no pool for small runs (ROWS_PER_WORKER each)."""
    return max(1, min(available(), -(-num_rollouts // ROWS_PER_WORKER)))


@dataclass(frozen=True)
class ShardJob:
    run_dir: Path
    index: int
    planned_rows: int
    state: seal.SealState
    allow_partial: bool
    answer_field: str | None


@dataclass
class ShardScan:
    index: int
    state: seal.SealState
    planned: Planned
    rollouts: Rollouts
    resolution: identity.Resolution
    failures: list[FailureRow]
    failures_rejected: int


def unsealed_message(run_dir: Path, states: Sequence[tuple[int, str]], total: int) -> str:
    listed = "\n".join(f"  - shard {i:05d}: {why}" for i, why in states[:20])
    more = f"\n  ... and {len(states) - 20} more" if len(states) > 20 else ""
    return (
        f"{len(states)} of {total} shards are not sealed:\n{listed}{more}\n"
        f"Run `shardrun resume {run_dir}` to finish them, or merge what they hold with --allow-partial."
    )


def read_rollouts(job: ShardJob) -> tuple[Rollouts, seal.SealState]:
    """Read a sealed shard as sealed (hash checked against its marker while read), else from a snapshot."""
    path, state = store.rollouts_path(job.run_dir, job.index), job.state
    if state.sealed:
        marker = state.marker or {}
        rollouts = scan_rollouts(path, limit=marker.get("rollouts_bytes"), snapshot=None, answer_key=job.answer_field)
        if rollouts.sha256 == marker.get("rollouts_sha256"):
            return rollouts, state
        state = seal.SealState(False, f"{path}: content changed after sealing (sha256 differs); not sealed", marker)
        if not job.allow_partial:
            raise IncompleteRun(
                f"shard {job.index:05d} is not sealed: {state.reason}\nRun `shardrun resume "
                f"{job.run_dir}` to finish it, or merge what it holds with --allow-partial."
            )
    snapshot = store.merge_scratch(job.run_dir, f"snapshot-{job.index:05d}.jsonl")
    return scan_rollouts(path, limit=None, snapshot=snapshot, answer_key=job.answer_field), state


def scan_shard(job: ShardJob) -> ShardScan:
    planned = scan_planned(store.materialized_path(job.run_dir, job.index))
    if len(planned.task) != job.planned_rows:
        raise PlanMismatch(
            f"{planned.path}: {len(planned.task):,} planned rows, plan.json plans "
            f"{job.planned_rows:,} for shard {job.index:05d}; the run directory is damaged"
        )
    index = identity.plan_index(planned.task, planned.rollout, str(planned.path))
    rollouts, state = read_rollouts(job)
    resolution = identity.resolve(index, rollouts.task, rollouts.rollout)
    sidecar = scan_failures(store.failures_path(job.run_dir, job.index))
    kept = shard_failures(index, sidecar.rows, resolution.renumbered)
    return ShardScan(
        job.index, state, planned, rollouts, resolution, kept, sidecar.rejected + len(sidecar.rows) - len(kept)
    )


def shard_failures(index: identity.ShardPlanIndex, rows: list[FailureRow], renumbered: bool) -> list[FailureRow]:
    """The sidecar rows whose identity is planned for the shard, with their planned rollout index."""
    if not rows:
        return []
    t = np.array([r.task for r in rows], np.int64)
    r = np.array([r.rollout for r in rows], np.int64)
    ok, mapped = identity.map_identities(index, t, r, renumbered)
    out = []
    for row, good, planned in zip(rows, ok.tolist(), mapped.tolist()):
        if good:
            line = row.line if planned == row.rollout else with_rollout(row.line, planned)
            out.append(FailureRow(row.task, planned, line, row.reason))
    return out


def with_rollout(line: bytes, rollout: int) -> bytes:
    """The row with its _ng_rollout_index replaced (key order kept)."""
    row = orjson.loads(line)
    row[ROLLOUT_KEY] = rollout
    return orjson.dumps(row) + b"\n"


def scan_shards(jobs: Sequence[ShardJob], workers: int) -> Iterator[ShardScan]:
    """Scan every shard, in order, `workers` at a time."""
    return ordered_map(scan_shard, jobs, workers)
