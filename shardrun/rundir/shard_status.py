"""What `shardrun status` says of one shard: its state (sealed, running, pending, failed, damaged, never started)
and what it has done. The states are one vocabulary for every launch mode: a shard job's status and the warm
workers' view of their shards (workers/worker_view.py) both speak it."""

from __future__ import annotations

from dataclasses import dataclass

SEALED, RUNNING, PENDING, FAILED, NEVER_STARTED = "sealed", "running", "pending", "failed", "never_started"
DAMAGED = "damaged"  # a seal that disagrees with its rollouts file: not trusted, resume runs the shard again
STATES = (SEALED, RUNNING, PENDING, FAILED, DAMAGED, NEVER_STARTED)
LIVE_STATES = (RUNNING, PENDING)


@dataclass(frozen=True)
class ShardStatus:
    index: int
    state: str
    planned: int
    rollouts: int  # successful rollouts recorded
    failed_rollouts: int  # rollouts recorded as failed (after their retries)
    attempts: int  # times the shard was submitted
    job_id: str | None  # the latest job (Slurm job id, "123_4" for an array task; local: the pid)
    reason: str  # why it failed, why it waits, or why a marker was ignored; "" otherwise
    log: str | None  # the latest job's log
    gpu_hours: float
    gave_up: bool  # failed max_attempts times: resume will not resubmit it
    skipped_decided: int = 0  # rows its seal records as skipped because their task was decided (adaptive sampling)

    @property
    def done(self) -> int:
        return self.rollouts + self.failed_rollouts
