"""Read whole shards, each once, with orjson: the merge's unit of work, run over the shards by one process pool.

For one shard: its planned rows (materialized inputs), its rollouts, resolved to planned identities (identity),
and its failure sidecar. Nothing here keeps row text: a row is found again later by its (offset, length) in
the file it was read from, and a worker hands back compact arrays only, in shard order, with few shards in
flight, so memory stays bounded.

A sealed shard is read only up to the size its marker names and hashed while read (the hash is checked against
the marker the merge checked), so the bytes parsed are the bytes that were sealed. An unsealed shard (merged
with --allow-partial) may still be written to: its complete lines are copied to a private snapshot while they
are read, and its rows are later copied from that snapshot. A last line without its newline (a killed writer)
is never used (store.CompleteLines, the one torn-line reader).
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import orjson

from shardrun.core.errors import IncompleteRun, PlanMismatch
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.core.pool import available, ordered_map
from shardrun.merge import identity
from shardrun.merge.rowtable import RowTable
from shardrun.rundir import seal, store
from shardrun.rundir.records import Seal

INT64_MAX = 2**63 - 1
ROWS_PER_WORKER = 50_000


# ---------------------------------------------------------------- what a shard read gives


@dataclass
class Planned:
    """One shard's materialized rows: identity, agent code, and where each line sits in `path`."""

    path: Path
    task: np.ndarray
    rollout: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    agent: np.ndarray  # code into `agents`
    agents: list[str]


@dataclass
class Rollouts:
    """One shard's rollout rows (file order) with an identity; `source` is the file their bytes are in."""

    source: Path
    task: np.ndarray
    rollout: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    table: RowTable
    lines: int = 0
    torn_bytes: int = 0
    unreadable: int = 0
    no_identity: int = 0
    sha256: str = ""


@dataclass
class FailureRow:
    """A failure-sidecar row with a planned identity: its line (identity as planned) and the row itself."""

    task: int
    rollout: int
    line: bytes
    row: dict[str, Any]


@dataclass
class Failures:
    rows: list[FailureRow] = field(default_factory=list)
    rejected: int = 0
    torn_bytes: int = 0


@dataclass(frozen=True)
class ShardReadJob:
    run_dir: Path
    index: int
    planned_rows: int
    state: seal.SealState
    allow_partial: bool
    answer_field: str | None
    mask_field: str | None = None  # the Gym release's mask flag (GymAdapter.mask_field)


@dataclass
class ShardRead:
    index: int
    state: seal.SealState
    planned: Planned
    rollouts: Rollouts
    resolution: identity.Resolution
    failures: list[FailureRow]
    failures_rejected: int


# ---------------------------------------------------------------- the shards


def default_workers(num_rollouts: int) -> int:
    """The CPUs this process may use (pool.available), and no pool for small runs (ROWS_PER_WORKER each)."""
    return max(1, min(available(), -(-num_rollouts // ROWS_PER_WORKER)))


def read_shards(jobs: Sequence[ShardReadJob], workers: int) -> Iterator[ShardRead]:
    """Read every shard, in order, `workers` at a time (one process pool)."""
    return ordered_map(read_shard, jobs, workers)


def read_shard(job: ShardReadJob) -> ShardRead:
    planned = scan_planned(store.materialized_path(job.run_dir, job.index))
    if len(planned.task) != job.planned_rows:
        raise PlanMismatch(
            f"{planned.path}: {len(planned.task):,} planned rows, plan.json plans "
            f"{job.planned_rows:,} for shard {job.index:05d}; the run directory is damaged"
        )
    index = identity.plan_index(planned.task, planned.rollout, str(planned.path))
    rollouts, state = read_rollouts(job)
    resolution = identity.resolve(index, rollouts.task, rollouts.rollout)
    state = counted(job, state, resolution)
    sidecar = scan_failures(store.failures_path(job.run_dir, job.index))
    kept = shard_failures(index, sidecar.rows, resolution.renumbered)
    return ShardRead(
        job.index, state, planned, rollouts, resolution, kept, sidecar.rejected + len(sidecar.rows) - len(kept)
    )


def counted(job: ShardReadJob, state: seal.SealState, resolution: identity.Resolution) -> seal.SealState:
    """A sealed shard whose rollouts file holds another number of rollouts than its seal counts (the planned
    identities found, and at most as many more as rows not planned for the shard) is damaged: not sealed."""
    marker = state.marker
    if not state.sealed or marker is None:
        return state
    kept = len(resolution.keep)
    if kept <= marker.num_rollouts <= kept + resolution.foreign:
        return state
    path = store.done_path(job.run_dir, job.index)
    return damaged(
        job,
        marker,
        f"damaged seal {path}: it counts {marker.num_rollouts:,} rollouts, {kept:,} planned identities were found "
        f"in {store.ROLLOUTS}; not trusted",
    )


def damaged(job: ShardReadJob, marker: Seal, reason: str) -> seal.SealState:
    """A seal that disagrees with its file: not sealed (with the reason), set aside (`.done.damaged`: status and
    resume, which do not read every row, then see it too), and an IncompleteRun unless the merge takes what unsealed
    shards hold (--allow-partial)."""
    if seal.set_aside(job.run_dir, job.index, marker, reason) is not None:
        reason += f"; set aside as {store.damaged_seal_path(job.run_dir, job.index).name}"
    state = seal.SealState(False, reason, marker, damaged=True)
    if not job.allow_partial:
        raise IncompleteRun(
            f"shard {job.index:05d} is not sealed: {state.reason}\nRun `shardrun resume "
            f"{job.run_dir}` to finish it, or merge what it holds with --allow-partial."
        )
    return state


def unsealed_message(run_dir: Path, states: Sequence[tuple[int, str]], total: int) -> str:
    listed = "\n".join(f"  - shard {i:05d}: {why}" for i, why in states[:20])
    more = f"\n  ... and {len(states) - 20} more" if len(states) > 20 else ""
    return (
        f"{len(states)} of {total} shards are not sealed:\n{listed}{more}\n"
        f"Run `shardrun resume {run_dir}` to finish them, or merge what they hold with --allow-partial."
    )


def read_rollouts(job: ShardReadJob) -> tuple[Rollouts, seal.SealState]:
    """Read a sealed shard as sealed (hash checked against its marker while read), else from a snapshot."""
    path, state = store.rollouts_path(job.run_dir, job.index), job.state
    if state.sealed and state.marker is not None:
        marker = state.marker
        rollouts = scan_rollouts(
            path,
            limit=marker.rollouts_bytes,
            snapshot=None,
            answer_key=job.answer_field,
            mask_key=job.mask_field,
        )
        if rollouts.sha256 == marker.rollouts_sha256:
            return rollouts, state
        state = damaged(
            job, marker, f"damaged seal: {path}: content changed after sealing (sha256 differs); not sealed"
        )
    snapshot = store.merge_scratch(job.run_dir, f"snapshot-{job.index:05d}.jsonl")
    return scan_rollouts(
        path, limit=None, snapshot=snapshot, answer_key=job.answer_field, mask_key=job.mask_field
    ), state


# ---------------------------------------------------------------- one file each


def scan_planned(path: Path) -> Planned:
    """Parse a shard's materialized inputs (written by the planner: every line must be a planned row)."""
    task, rollout, offset, length = array("q"), array("q"), array("q"), array("q")
    agent = array("i")
    codes: dict[str, int] = {}
    n = 0
    try:
        f = store.open_regular(path)
    except FileNotFoundError:
        raise PlanMismatch(f"{path}: missing; the run directory is damaged (re-plan into a new run_dir)") from None
    with f:
        for off, lines in store.CompleteLines(f).blocks():
            for line in lines:
                n += 1
                try:
                    row = orjson.loads(line)
                    t, r, name = row[TASK_KEY], row[ROLLOUT_KEY], row[AGENT_KEY]["name"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    if line.strip():
                        raise PlanMismatch(
                            f"{path}:{n}: not a planned row (no identity or agent_ref); the run directory is damaged"
                        ) from None
                    off += len(line) + 1
                    continue
                if type(t) is not int or type(r) is not int or not (0 <= t <= INT64_MAX and 0 <= r <= INT64_MAX):
                    raise PlanMismatch(f"{path}:{n}: identity ({t!r}, {r!r}) is not a pair of non-negative integers")
                task.append(t)
                rollout.append(r)
                offset.append(off)
                length.append(len(line) + 1)
                agent.append(codes.setdefault(name, len(codes)))
                off += len(line) + 1
    return Planned(
        path,
        _np(task, np.int64),
        _np(rollout, np.int64),
        _np(offset, np.int64),
        _np(length, np.int64),
        _np(agent, np.int32),
        list(codes),
    )


def scan_rollouts(
    path: Path,
    *,
    limit: int | None,
    snapshot: Path | None,
    answer_key: str | None,
    exact_ints: bool = False,
    mask_key: str | None = None,
) -> Rollouts:
    """Parse a shard's rollouts.jsonl. With `snapshot`, complete lines are copied there (offsets stay equal)."""
    offset, length = array("q"), array("q")
    table = RowTable(answer_key=answer_key, exact_ints=exact_ints, mask_key=mask_key)
    add = table.adder()
    empty = np.zeros(0, np.int64)
    out = Rollouts(snapshot or path, empty, empty, empty, empty, table)
    hasher = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        copy_to = stack.enter_context(open(snapshot, "wb")) if snapshot is not None else None
        try:
            f = stack.enter_context(store.open_regular(path))
        except FileNotFoundError:
            f = None
        if f is not None:
            reader = store.CompleteLines(f, limit, hasher, copy_to)
            for off, lines in reader.blocks():
                out.lines += len(lines)
                for line in lines:
                    try:
                        row = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        if line.strip():
                            out.unreadable += 1
                        off += len(line) + 1
                        continue
                    if type(row) is dict and add(row):
                        offset.append(off)
                        length.append(len(line) + 1)
                    else:
                        out.no_identity += 1
                    off += len(line) + 1
            out.torn_bytes = reader.torn
    if table.needs_exact_ints():  # rare: integers beyond 2**53; read again (from the snapshot if any)
        again = scan_rollouts(
            snapshot or path, limit=limit, snapshot=None, answer_key=answer_key, exact_ints=True, mask_key=mask_key
        )
        again.torn_bytes = out.torn_bytes
        return again
    table.finish()
    out.sha256 = hasher.hexdigest()
    out.task, out.rollout = table.task_array(), table.rollout_array()
    out.offset, out.length = _np(offset, np.int64), _np(length, np.int64)
    return out


def scan_failures(path: Path) -> Failures:
    """The failure sidecar's complete rows with an identity (kept whole: sidecars are small)."""
    out = Failures()
    try:
        f = store.open_regular(path)
    except FileNotFoundError:
        return out
    with f:
        reader = store.CompleteLines(f)
        for line in (x for _off, lines in reader.blocks() for x in lines):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                out.rejected += 1
                continue
            t = row.get(TASK_KEY) if type(row) is dict else None
            r = row.get(ROLLOUT_KEY) if t is not None else None
            if type(t) is not int or type(r) is not int or not (0 <= t <= INT64_MAX and 0 <= r <= INT64_MAX):
                out.rejected += 1
                continue
            out.rows.append(FailureRow(t, r, line + b"\n", row))
        out.torn_bytes = reader.torn
    return out


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
            out.append(FailureRow(row.task, planned, line, row.row))
    return out


def with_rollout(line: bytes, rollout: int) -> bytes:
    """The row with its _ng_rollout_index replaced (key order kept)."""
    row = orjson.loads(line)
    row[ROLLOUT_KEY] = rollout
    return orjson.dumps(row) + b"\n"


def _np(a: array, dtype: type) -> np.ndarray:
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)
