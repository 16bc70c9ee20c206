"""The `.done` marker that seals a shard (records.Seal), and the rules that decide whether a marker is valid.

A marker is valid only for the plan it was written under (same fingerprint), for its own shard, with the
planned number of identities accounted for, and for the exact rollouts file it describes: its size and at least
as many rows as it counts (num_rollouts plus num_duplicate_lines complete lines) always, its sha256 when `deep`
(the merge, which reads every row, also checks that the file holds exactly the rollouts it counts:
merge/shard_reader.counted). Anything else is reported
and ignored: the shard counts as unsealed, and one whose file disagrees with its seal is *damaged*. A FIFO, a device
or a socket in place of the marker is refused (store.open_regular), never read.

What only a check that reads every row can see (the sha256, the identities the seal counts) the merge acts on: it
sets the seal aside as `.done.damaged` with its reason (set_aside), so that `status` shows the shard damaged and
`resume` collects it again, instead of both trusting a seal the merge refuses. A new seal of the shard removes it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shardrun.core.errors import ShardrunError
from shardrun.rundir import ledger, records, store
from shardrun.plan.planner import Plan
from shardrun.rundir.records import MARKER_VERSION, Seal

__all__ = ["MARKER_VERSION", "Seal", "SealState", "check", "make_marker", "set_aside", "write_marker"]


def make_marker(
    plan: Plan,
    shard_index: int,
    *,
    num_rollouts: int,
    num_failed: int,
    rollouts_sha256: str,
    rollouts_bytes: int,
    started_at: float,
    finished_at: float,
    host: str,
    job_id: str | None,
    attempt: int,
    server_wait_s: float,
    collect_s: float,
    gpus: int,
    extra: dict[str, Any] | None = None,
    gym_version: str | None = None,
    worker: records.SealWorker | None = None,
    skipped_decided_tasks: list[int] | None = None,
    num_skipped_decided: int = 0,
    num_duplicate_lines: int = 0,
    label_rollouts: list[int] | None = None,
) -> Seal:
    """The marker's content (pure). Times are Unix seconds; `extra` holds optional accounting such as tokens."""
    return Seal(
        marker_version=MARKER_VERSION,
        plan_fingerprint=plan.fingerprint,
        shard_index=shard_index,
        planned_rollouts=plan.shards[shard_index].num_rollouts,
        num_rollouts=num_rollouts,
        num_failed=num_failed,
        num_duplicate_lines=num_duplicate_lines,
        rollouts_sha256=rollouts_sha256,
        rollouts_bytes=rollouts_bytes,
        started_at=started_at,
        finished_at=finished_at,
        host=host,
        job_id=job_id,
        attempt=attempt,
        server_wait_s=server_wait_s,
        collect_s=collect_s,
        gpus=gpus,
        gpu_hours=gpus * (finished_at - started_at) / 3600.0,
        gym_version=gym_version,
        num_skipped_decided=num_skipped_decided,
        skipped_decided_tasks=sorted(skipped_decided_tasks or ()) if num_skipped_decided else [],
        worker=worker,
        extra=extra or None,
        label_rollouts=label_rollouts,
    )


def counted_marker(plan: Plan, shard_index: int, book: "ledger.Ledger", rollouts: Path, **fields: Any) -> Seal:
    """The marker of a shard whose identities the ledger `book` counted in its `rollouts` file: the counts, the
    file's size and sha256, the tokens and a blend's rollouts per label from it; `fields` the rest of make_marker's."""
    return make_marker(
        plan,
        shard_index,
        num_rollouts=len(book.done),
        num_failed=book.num_failed,
        rollouts_sha256=store.sha256_file(rollouts),
        rollouts_bytes=rollouts.stat().st_size,
        extra=dict(book.usage) or None,
        num_duplicate_lines=book.duplicates,
        label_rollouts=plan.label_counts([task for task, _ in book.done]) if plan.blend else None,
        **fields,
    )


def write_marker(run_dir: Path, shard_index: int, marker: Seal) -> None:
    if marker.shard_index != shard_index:
        raise ValueError(f"a seal of shard {marker.shard_index} written for shard {shard_index}")
    records.write_seal(run_dir, marker)
    store.damaged_seal_path(run_dir, shard_index).unlink(missing_ok=True)  # that one is settled now


def set_aside(run_dir: Path, shard_index: int, marker: Seal, reason: str) -> Path | None:
    """Set the shard's seal aside as `.done.damaged`, with `reason`, if it is still `marker` (a seal written since, by
    a job sealing the shard again, stays). For the merge, which found it disagreeing with the rows. Returns where it
    went, or None."""
    path = store.done_path(run_dir, shard_index)
    try:
        raw = store.read_regular(path)
        current, _ = records.seal_problem(orjson.loads(raw))
    except (FileNotFoundError, IsADirectoryError, orjson.JSONDecodeError):
        return None
    if current != marker:
        return None
    record = records.SetAsideSeal(seal=orjson.loads(raw), reason=reason, set_aside_at=time.time())
    records.write_set_aside_seal(run_dir, shard_index, record)
    path.unlink(missing_ok=True)
    return store.damaged_seal_path(run_dir, shard_index)


def set_aside_state(run_dir: Path, shard_index: int) -> SealState | None:
    """The shard as damaged, with the merge's reason, when its seal was set aside (and no seal written since)."""
    aside = store.damaged_seal_path(run_dir, shard_index)
    if not os.path.lexists(aside):
        return None
    try:
        record = records.read_set_aside_seal(run_dir, shard_index)
        why = record.reason if record is not None else "gone"
    except ShardrunError as e:
        why = str(e)
    return SealState(
        False,
        f"{why} (set aside as {aside.name} by merge-and-profile, which reads every row; `shardrun resume` collects "
        "the shard again)",
        damaged=True,
    )


@dataclass(frozen=True)
class SealState:
    sealed: bool
    reason: str  # "" when sealed; why not otherwise ("no marker" for a shard never sealed)
    marker: Seal | None = None
    damaged: bool = False  # a seal of this plan and shard whose rollouts file disagrees with it: never trusted


def check(run_dir: Path, plan: Plan, shard_index: int, deep: bool = False) -> SealState:
    """Is shard `shard_index` sealed under `plan`? `deep` also re-hashes the rollouts file. RunDirError when the
    shard directory or a file in it is a symlink (nothing is read through it), or the marker or the rollouts file
    is a FIFO, a device or a socket."""
    store.refuse_links(run_dir, (shard_index,))
    path = store.done_path(run_dir, shard_index)
    try:
        raw = store.read_regular(path)
    except FileNotFoundError:
        return set_aside_state(run_dir, shard_index) or SealState(False, "no marker")
    except IsADirectoryError:
        return SealState(False, f"{path}: a directory, not a marker (ignored)")
    try:
        data: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return SealState(False, f"{path}: unreadable marker (ignored)")
    if not isinstance(data, dict):
        return SealState(False, f"{path}: marker is not an object (ignored)")
    if data.get("plan_fingerprint") != plan.fingerprint:
        return SealState(
            False,
            f"{path}: marker belongs to another plan (fingerprint "
            f"{str(data.get('plan_fingerprint'))[:12]}…, this plan {plan.fingerprint[:12]}…); "
            f"ignored",
        )
    if data.get("shard_index") != shard_index:
        return SealState(False, f"{path}: marker is for shard {data.get('shard_index')}, copied here? ignored")
    marker, wrong = records.seal_problem(data)
    if marker is None:
        return SealState(False, f"{path}: invalid marker, {wrong}; ignored")
    planned = plan.shards[shard_index].num_rollouts
    if marker.accounted != planned:
        return SealState(
            False, f"{path}: marker accounts for {marker.accounted} of {planned} planned rollouts; ignored", marker
        )
    return against_file(run_dir, shard_index, marker, deep)


def against_file(run_dir: Path, shard_index: int, marker: Seal, deep: bool) -> SealState:
    """The seal checked against the rollouts file it names: its bytes, its rows, and (`deep`) its sha256."""
    path = store.done_path(run_dir, shard_index)
    rollouts = store.rollouts_path(run_dir, shard_index)

    def damaged(why: str) -> SealState:
        return SealState(False, f"damaged seal {path}: {why}; not trusted", marker, damaged=True)

    try:
        size = rollouts.stat().st_size
        rows = store.count_complete_lines(rollouts)
    except FileNotFoundError:
        return damaged(f"sealed but {rollouts.name} is missing")
    if size != marker.rollouts_bytes:
        return damaged(f"{rollouts.name} changed after sealing ({size} bytes, sealed {marker.rollouts_bytes})")
    if rows < marker.rows:  # fewer rows than rollouts: the merge would miss some (it checks the count exactly)
        return damaged(
            f"it counts {marker.num_rollouts} rollouts"
            + (f" and {marker.num_duplicate_lines} duplicate lines" if marker.num_duplicate_lines else "")
            + f", {rollouts.name} has {rows} rows"
        )
    if deep and store.sha256_file(rollouts) != marker.rollouts_sha256:
        return damaged(f"{rollouts.name} content changed after sealing (sha256 differs)")
    return SealState(True, "", marker)
