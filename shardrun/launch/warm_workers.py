"""Backend: warm workers (`cluster.workers`), jobs that start their servers once and claim shards (docs/workers.md),
on this machine or on Slurm.

- Local executor: `cluster.workers` submitit LocalExecutor jobs, each running `worker_job(run_dir)`.
- Slurm: ONE job array `--array=0-<workers-1>` with the per-shard resources, each task a `WorkerJob` (submitit
  Checkpointable: on USR2 the worker stops its shard cleanly, releases its claim, tears down and is requeued), then
  the *after job* (after_workers.py: afterany on the array, the merge job's resources and name), which resubmits
  workers for what is unsealed, up to `cluster.auto_resume_rounds` rounds, then merges. Nobody has to watch the run.

The job functions take the run directory (and a worker number) only; all state is in the run directory.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.launch import executors, slurm
from shardrun.launch.launcher import AskSlurm, Cancelled, Launch, Launched, Launcher, LiveJobs, Request, SlurmJobs
from shardrun.plan.planner import Plan
from shardrun.rundir import store
from shardrun.rundir.records import WarmWorkersLaunch
from shardrun.shard import processes

AFTER_MODULE = "shardrun.launch.after_workers"


# ---------------------------------------------------------------- inside the job


def deadline(cluster: ClusterConfig, environ: dict[str, str] | None = None) -> float | None:
    """When the job's time limit ends (Unix time): Slurm's SLURM_JOB_END_TIME when it is set, else now plus the
    configured limit (Slurm: the shard time limit; local: cluster.time_limit, or none)."""
    env = os.environ if environ is None else environ
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isascii() and end.isdigit():
        return float(end)
    if cluster.uses_slurm:
        return time.time() + slurm.shard_time_minutes(cluster) * 60
    if cluster.time_limit:
        return time.time() + slurm.parse_time_limit(cluster.time_limit) * 60
    return None


def job_cluster(run_dir: Path) -> ClusterConfig:
    cfg = store.read_launch_settings(run_dir)
    return cfg.cluster_or_default if cfg else ClusterConfig()


def worker_job(run_dir: str) -> dict[str, Any]:
    """One local worker job: claim and collect shards until none are left."""
    from shardrun.workers import worker

    job_id = executors.current_job_id()
    state = worker.run_worker(Path(run_dir), job_id=job_id, deadline=deadline(job_cluster(Path(run_dir))))
    return {"worker_id": state.worker_id, "sealed": state.sealed}


class WorkerJob(Checkpointable):
    """One warm worker as a Slurm array task. On the checkpoint signal (USR2: time limit near, or preemption) the
    worker stops its current shard (completed rollouts kept), releases its claim and tears its servers down; then
    submitit requeues the task, which starts again as the same worker id."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self, number: int) -> dict[str, Any]:
        from shardrun.workers import worker

        run_dir = Path(self.run_dir)
        job_id = executors.current_job_id()
        w = worker.Worker(run_dir, worker.worker_id_for(job_id), job_id=job_id, deadline=deadline(job_cluster(run_dir)))
        sig = executors.checkpoint_signal()
        submitit_handler = signal.getsignal(sig)
        requested: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            signal.signal(signum, signal.SIG_IGN)  # one stop is enough; Slurm may signal again
            requested.append(signum)
            w.save(state=worker.DRAINING)
            raise worker.ShardReleased(f"checkpoint signal {signal.Signals(signum).name}: stopping to be requeued")

        signal.signal(sig, on_signal)
        try:
            state = w.run()
        finally:
            signal.signal(sig, submitit_handler)
        if requested:
            print(
                f"[shardrun] worker {w.worker_id}: claim released, servers stopped, completed rollouts kept; "
                f"handing over to submitit to requeue",
                flush=True,
            )
            if callable(submitit_handler):
                submitit_handler(requested[0], None)  # checkpoint -> scontrol requeue -> exit
        return {"worker_id": state.worker_id, "number": number, "sealed": state.sealed}


# ---------------------------------------------------------------- submitting


def worker_count(cluster: ClusterConfig, shards: int) -> int:
    return min(int(cluster.workers or 1), shards)


def worker_slurm_plan(cfg: RunConfig, run_dir: Path, plan: Plan, n: int) -> slurm.SlurmPlan:
    """The workers' array: one chunk of n tasks (0..n-1), all at once, with the per-shard resources."""
    sp = slurm.slurm_plan(cfg, run_dir, plan.fingerprint, list(range(n)), max_array_size=n + 1, merge_job=False)
    return dataclasses.replace(sp, shard_params={**sp.shard_params, "array_parallelism": n})


def after_command(run_dir: Path, round_no: int, python: str | None = None) -> list[str]:
    """What the job after the workers runs, with `python` (slurm.job_python: a container image's), else this one."""
    return [python or sys.executable, "-m", AFTER_MODULE, str(run_dir), "--round", str(round_no)]


class WarmWorkers(Launcher):
    mode = "warm workers"
    record_type = WarmWorkersLaunch

    def selects(self, cluster: ClusterConfig) -> bool:
        return cluster.workers is not None

    def waits_by_default(self, cluster: ClusterConfig) -> bool:
        return not cluster.uses_slurm

    def runs_on_slurm(self, cluster: ClusterConfig) -> bool:
        return cluster.uses_slurm

    def submit(self, request: Request, launch: Launch) -> None:
        """min(cluster.workers, shards) workers for the request's shards (Slurm: one array, and with `merge_job`
        the after job)."""
        cfg, run_dir, cluster = request.cfg, request.run_dir, request.cluster
        n = worker_count(cluster, len(request.indices))
        if n < 1:
            return
        if not cluster.uses_slurm:
            executor = executors.local_executor(cfg, run_dir)
            for k in range(n):
                job = executor.submit(worker_job, str(run_dir))
                launch.handles.append(job)
                launch.workers[k] = str(job.job_id)
            return
        executors.require_pass_through(cfg)
        sp = worker_slurm_plan(cfg, run_dir, store.load_plan(run_dir), n)
        launch.slurm = SlurmJobs(sp.tag, sp.merge_name)
        jobs = executors.slurm_executor(run_dir, cluster, sp.shard_params).map_array(
            WorkerJob(str(run_dir)), list(range(n))
        )
        for k, j in enumerate(jobs):
            launch.workers[k] = str(j.job_id)
        array = str(jobs[0].job_id).split("_", 1)[0]
        launch.slurm.arrays.append(array)
        if request.merge_job:
            launch.merge_job_id = executors.queue_after_the_run(
                run_dir,
                cluster,
                set(request.run_job_names) | {sp.tag, sp.merge_name},
                [array],
                sp.merge_name,
                after_command(run_dir, request.round_no, sp.python),
            )

    def record(self, request: Request, launch: Launch, common: dict[str, Any]) -> WarmWorkersLaunch:
        """The workers' jobs, the shards they were launched for, where they run; on this machine each worker pid's
        start time, on Slurm the array, its job name and the after job's (name and id)."""
        cluster = request.cluster
        workers: dict[str, str | int] = {str(k): j for k, j in sorted(launch.workers.items())}
        if not cluster.uses_slurm:
            pids = sorted({int(j) for j in launch.workers.values()})
            return WarmWorkersLaunch(
                **common,
                executor=cluster.executor,
                workers=workers,
                worker_shards=list(request.indices),
                pid_start={str(p): processes.start_ticks(p) for p in pids},
            )
        submitted = launch.slurm
        return WarmWorkersLaunch(
            **common,
            executor=cluster.executor,
            workers=workers,
            worker_shards=list(request.indices),
            tag=submitted.tag if submitted else None,
            merge_job_name=submitted.merge_name if submitted else None,
            arrays=list(submitted.arrays) if submitted else [],
            merge_job_id=launch.merge_job_id,
        )

    def describe(self, request: Request, fingerprint: str) -> str:
        cluster, indices = request.cluster, request.indices
        n = worker_count(cluster, len(indices))
        lines = [
            f"warm workers: {n} job(s) for {len(indices)} shard(s) ({slurm.format_ranges(indices)}); each starts its "
            f"servers once and claims shards until none are left"
        ]
        if cluster.uses_slurm:
            lines.append(f"one job array --array=0-{n - 1} with the per-shard resources")
            if request.merge_job:
                lines.append(
                    f"after job: afterany on the array; resubmits workers for unsealed shards up to "
                    f"{cluster.auto_resume_rounds} round(s), then merge-and-profile"
                )
            lines += slurm.server_step_preview(request.cfg, request.run_dir, f"{request.run_dir}/workers/WORKER")
        return "\n".join(lines)

    def live(self, launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
        """The workers' jobs: local ones by pid, Slurm ones (their array tasks) from squeue."""
        records = launched.of(WarmWorkersLaunch)
        local = {job for _, rec in records for job in rec.local_worker_jobs}
        pids = executors.recorded_pids(records)
        out = executors.live_pids({pid: pids[pid] for pid in pids if pid in local})
        on_slurm = {job for _, rec in records for job in rec.slurm_worker_jobs}
        if on_slurm:
            out.add(executors.queued(launched.slurm_names, ask_slurm, keep=lambda job_id: job_id in on_slurm))
        return out

    def cancel(self, live: LiveJobs) -> Cancelled:
        return Cancelled(*executors.cancel_live(live))
