"""What `shardrun status` shows of warm workers: a row per worker, and each shard's state from its claim.

Shards run by warm workers are not tied to a job: running = held by a live claim, pending = waiting for a live
worker, failed = its last attempt failed (attempts from `.failed`) or its workers ended without sealing it. A claim
not renewed within the lease is listed as stale (the next worker to look takes it over).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection

from shardrun.core.config import ClusterConfig
from shardrun.core.errors import ShardrunError
from shardrun.rundir import records, store
from shardrun.rundir.shard_status import FAILED, PENDING, RUNNING, SEALED, ShardStatus
from shardrun.shard import processes
from shardrun.workers import claims

GONE = "gone"  # a worker whose record says it runs, but whose job or process is no longer there


@dataclass(frozen=True)
class WorkerRow:
    """One worker as `status` shows it (from its worker.json and whether its job or process still runs)."""

    worker_id: str
    job_id: str | None
    host: str
    state: str  # its record's state while it lives; stopped, failed or gone once it does not
    current_shard: int | None  # the first shard it holds now (None: none, or not alive)
    current_shards: list[int]  # every shard it holds now
    sealed: int  # shards it sealed
    servers_up_since: float | None
    server_starts: int
    exit_reason: str | None

    @property
    def live(self) -> bool:
        return self.state not in (records.STOPPED, records.FAILED, GONE)

    @property
    def holding(self) -> str:
        """The shards it holds, for a table cell ("-": none)."""
        return ",".join(map(str, self.current_shards)) or "-"


@dataclass(frozen=True)
class StaleClaim:
    """A claim not renewed within the lease: its shard, its worker, and how long since its last heartbeat."""

    shard: int
    worker_id: str
    job_id: str | None
    host: str
    pid: int
    claimed_at: float
    renewed_at: float
    age_s: float


def worker_rows(run_dir: Path, live_jobs: Collection[str], local_jobs: Collection[str]) -> list[WorkerRow]:
    """Every worker of the run: alive when its job is live, or (a local worker, or one with no job) when its process
    is still the one recorded on this host."""
    host = socket.gethostname()
    rows = []
    for w in records.read_worker_states(run_dir):
        if w.job_id in live_jobs or w.job_id is None or w.job_id in local_jobs:
            alive = w.job_id in live_jobs or (
                w.host == host and w.pid_start is not None and processes.start_ticks(w.pid) == w.pid_start
            )
        else:
            alive = False
        alive = alive and w.state not in (records.STOPPED, records.FAILED)
        held = (w.current_shards or ([] if w.current_shard is None else [w.current_shard])) if alive else []
        rows.append(
            WorkerRow(
                worker_id=w.worker_id,
                job_id=w.job_id,
                host=w.host,
                state=w.state if alive or w.state in (records.STOPPED, records.FAILED) else GONE,
                current_shard=w.current_shard if alive else None,
                current_shards=list(held),
                sealed=len(w.sealed),
                servers_up_since=w.servers_up_since if alive else None,
                server_starts=w.server_starts,
                exit_reason=w.exit_reason,
            )
        )
    return rows


def claim_lease_s(run_dir: Path) -> float:
    try:
        settings = store.read_launch_settings(run_dir)
    except ShardrunError:
        settings = None
    return (settings.cluster_or_default if settings else ClusterConfig()).claim_lease_s


def by_claims(
    run_dir: Path,
    shards: list[ShardStatus],
    launched: Collection[int],
    *,
    any_live: bool,
    now: float,
    max_attempts: int,
) -> tuple[list[ShardStatus], list[StaleClaim]]:
    """Each shard launched for the workers (`launched`) as its claim says; the stale claims."""
    lease = claim_lease_s(run_dir)
    stale: list[StaleClaim] = []
    out = []
    for s in shards:
        if s.state == SEALED or (s.index not in launched and s.job_id is not None):
            out.append(s)
            continue
        info = claims.read(run_dir, s.index)
        failure = records.read_failure(run_dir, s.index)
        attempts = failure.attempt if failure is not None else 0
        log = str(store.shard_log_path(run_dir, s.index))
        if info is not None and info.stale(now, lease):
            stale.append(StaleClaim(shard=s.index, **info.to_json(), age_s=round(info.age(now), 1)))
        if info is not None and not info.stale(now, lease):
            reason = f"worker {info.worker_id} on {info.host}"
            out.append(replace(s, state=RUNNING, job_id=info.job_id, attempts=attempts, reason=reason, log=log))
        elif any_live and attempts < max_attempts:
            why = (
                f"stale claim of worker {info.worker_id} (no heartbeat for {info.age(now):.0f} s): taken over next"
                if info is not None
                else "waiting for a warm worker"
            )
            out.append(replace(s, state=PENDING, attempts=attempts, reason=why, job_id=None))
        elif failure is not None or s.index in launched:
            out.append(
                replace(
                    s,
                    state=FAILED,
                    attempts=attempts,
                    reason=(failure.error if failure is not None else "") or "its workers ended without sealing it",
                    job_id=failure.job_id if failure is not None else None,
                    log=log,
                    gave_up=attempts >= max_attempts,
                )
            )
        else:
            out.append(s)
    return out, stale


def view(
    run_dir: Path,
    shards: list[ShardStatus],
    *,
    live_jobs: Collection[str],
    local_jobs: Collection[str],
    launched: Collection[int],
    now: float,
    max_attempts: int,
    worker_jobs: Collection[str] = (),
) -> tuple[list[ShardStatus], list[WorkerRow], list[StaleClaim]]:
    """The shards as the workers' claims say, the workers' rows and the stale claims. A worker job that is live
    but has written no record yet (`worker_jobs`: the launches' worker jobs) is a worker starting: its shards are
    pending, not failed."""
    rows = worker_rows(run_dir, live_jobs, local_jobs)
    starting = (set(worker_jobs) & set(live_jobs)) - {r.job_id for r in rows}
    shards, stale = by_claims(
        run_dir,
        shards,
        launched,
        any_live=any(r.live for r in rows) or bool(starting),
        now=now,
        max_attempts=max_attempts,
    )
    return [with_worker_cause(run_dir, s, rows) for s in shards], rows, stale


def with_worker_cause(run_dir: Path, shard: ShardStatus, rows: list[WorkerRow]) -> ShardStatus:
    """A failed shard that left no log of its own (its workers never collected it): the failed worker's cause and
    its worker.log, which exists, instead of the shard's log, which does not."""
    if shard.state != FAILED or (shard.log and Path(shard.log).is_file()):
        return shard
    failed = [r for r in rows if r.state == records.FAILED and r.exit_reason]
    if not failed:
        return shard
    w = next((r for r in failed if r.job_id is not None and r.job_id == shard.job_id), failed[0])
    log = store.worker_log_path(run_dir, w.worker_id)
    reason = shard.reason
    if w.exit_reason and w.exit_reason not in reason:
        reason = f"{reason}: worker {w.worker_id} failed: {w.exit_reason.splitlines()[0]}"
    return replace(shard, reason=reason, log=str(log) if log.is_file() else shard.log)
