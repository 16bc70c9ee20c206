"""Backend: per-shard jobs on this machine (cluster.executor=local, no warm workers), through submitit's
LocalExecutor.

LocalExecutor starts every job at once, so the cap on concurrent shards (cluster.array_parallelism) is kept by
submitting at most that many jobs, each running its share of the shards one after another (shards i, i+cap,
i+2cap, ...). A job's id is its pid; what is live is a recorded pid that is still the same process.
"""

from __future__ import annotations

from typing import Any, Sequence

from shardrun.core.config import ClusterConfig
from shardrun.core.errors import ShardFailed, ShardrunError
from shardrun.launch import executors, slurm
from shardrun.launch.launcher import AskSlurm, Cancelled, Launch, Launched, Launcher, LiveJobs, Request
from shardrun.rundir.records import LocalJobsLaunch
from shardrun.shard import processes


def shard_worker(run_dir: str, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Run several shards one after another (a local job); fails at the end if any shard failed."""
    from shardrun.shard.runtime import ShardInterrupted

    outcomes = []
    for i in indices:
        try:
            outcomes.append(executors.shard_job(run_dir, i))
        except ShardInterrupted:
            raise
        except ShardrunError as e:
            outcomes.append({"index": int(i), "state": "failed", "error": f"{type(e).__name__}: {e}"})
    failed = [o for o in outcomes if o["state"] == "failed"]
    if failed:
        raise ShardFailed(
            f"{len(failed)} of {len(outcomes)} shard(s) failed: "
            + "; ".join(f"shard {o['index']}: {o['error'].splitlines()[0]}" for o in failed)
        )
    return outcomes


def local_groups(indices: Sequence[int], parallelism: int) -> list[list[int]]:
    """Deal shards to at most `parallelism` jobs: job w runs indices[w], indices[w + n], ..."""
    n = max(1, min(parallelism, len(indices)))
    return [list(indices[w::n]) for w in range(n)]


class LocalJobs(Launcher):
    mode = "local jobs"
    record_type = LocalJobsLaunch
    runs_shards_in_turn = True  # a job runs its share of the shards one after another

    def selects(self, cluster: ClusterConfig) -> bool:
        return not cluster.uses_slurm and cluster.workers is None

    def waits_by_default(self, cluster: ClusterConfig) -> bool:
        return True

    def runs_on_slurm(self, cluster: ClusterConfig) -> bool:
        return False

    def submit(self, request: Request, launch: Launch) -> None:
        executor = executors.local_executor(request.cfg, request.run_dir)
        for group in local_groups(request.indices, request.cluster.array_parallelism):
            job = executor.submit(shard_worker, str(request.run_dir), group)
            launch.handles.append(job)
            for i in group:
                launch.jobs[i] = str(job.job_id)

    def record(self, request: Request, launch: Launch, common: dict[str, Any]) -> LocalJobsLaunch:
        """The jobs (pids) and each pid's start time, so that status and cancel never take another process for it."""
        pids = sorted({int(j) for j in launch.jobs.values()})
        return LocalJobsLaunch(
            **common,
            jobs={str(i): j for i, j in sorted(launch.jobs.items())},
            pid_start={str(p): processes.start_ticks(p) for p in pids},
        )

    def describe(self, request: Request, fingerprint: str) -> str:
        groups = local_groups(request.indices, request.cluster.array_parallelism)
        return "\n".join(
            [f"local executor: {len(request.indices)} shard(s) in {len(groups)} worker job(s) at once"]
            + [f"  worker {w}: shards {slurm.format_ranges(g)}" for w, g in enumerate(groups)]
        )

    def live(self, launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
        return executors.live_pids(executors.recorded_pids(launched.of(LocalJobsLaunch)))

    def cancel(self, live: LiveJobs) -> Cancelled:
        return Cancelled(*executors.cancel_live(live))
