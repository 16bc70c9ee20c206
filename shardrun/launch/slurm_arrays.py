"""Backend: per-shard Slurm job arrays (cluster.executor=slurm, no warm workers), through submitit's SlurmExecutor.

One job array per MaxArraySize shards (one sbatch each, throttled with %N so that together they run at most
array_parallelism shards), each task a `ShardJob` (submitit Checkpointable: on the checkpoint signal the shard
stops cleanly and submitit requeues it), then one CPU merge job after all arrays (afterany). What is live is what
squeue lists under the run's job names.
"""

from __future__ import annotations

import signal
from typing import Any

from submitit.helpers import Checkpointable

from shardrun.core.config import DEFAULT_MAX_ARRAY_SIZE, ClusterConfig
from shardrun.launch import executors, scheduler, slurm
from shardrun.launch.launcher import AskSlurm, Cancelled, Launch, Launched, Launcher, LiveJobs, Request, SlurmJobs
from shardrun.rundir import store
from shardrun.rundir.records import SlurmArraysLaunch, WarmWorkersLaunch


class CheckpointRequested(BaseException):
    """Raised inside a Slurm shard job by the checkpoint signal (USR2: the time limit is near, or a preemption).

    A BaseException, so the runtime's `except Exception` neither records it as the shard's failure nor as failed
    rollouts: it unwinds the shard, whose teardown stops the collector (watchdog) and the servers in order; every
    completed rollout stays in rollouts.jsonl and rollouts in flight are simply run again by the requeued job."""

    def __init__(self, signum: int):
        super().__init__(f"checkpoint signal {signal.Signals(signum).name}")
        self.signum = signum


class ShardJob(Checkpointable):
    """One shard as a Slurm array task. On the checkpoint signal it stops the shard cleanly, then hands over to
    submitit, which calls `checkpoint` (the same shard again: it resumes from its files), requeues the job and
    exits. Pickled by submitit: it holds the run directory only."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self, index: int) -> dict[str, Any]:
        sig = executors.checkpoint_signal()
        submitit_handler = signal.getsignal(sig)  # submitit's checkpoint_and_try_requeue inside a job

        def on_signal(signum: int, _frame: Any) -> None:
            signal.signal(signum, signal.SIG_IGN)  # one stop is enough; Slurm may signal again
            raise CheckpointRequested(signum)

        signal.signal(sig, on_signal)
        try:
            return executors.shard_job(self.run_dir, index)
        except CheckpointRequested as e:
            print(
                f"[shardrun] shard {index}: {e}: collector and servers stopped, completed rollouts kept; "
                f"handing over to submitit to requeue",
                flush=True,
            )
            signal.signal(sig, submitit_handler)
            if callable(submitit_handler):
                submitit_handler(e.signum, None)  # checkpoint -> scontrol requeue -> exit
            raise
        finally:
            signal.signal(sig, submitit_handler)


def max_array_size_for_dry_run(cluster: ClusterConfig) -> tuple[int, str]:
    if cluster.max_array_size:
        return cluster.max_array_size, "cluster.max_array_size"
    try:
        return scheduler.query_max_array_size(), "scontrol show config"
    except scheduler.SlurmError:
        return DEFAULT_MAX_ARRAY_SIZE, "Slurm's default; scontrol is not available here"


class SlurmArrays(Launcher):
    mode = "Slurm job arrays"
    record_type = SlurmArraysLaunch
    accounted_by_slurm = True  # each shard's job is an array task: sacct says how it ended

    def selects(self, cluster: ClusterConfig) -> bool:
        return cluster.uses_slurm and cluster.workers is None

    def waits_by_default(self, cluster: ClusterConfig) -> bool:
        return False

    def runs_on_slurm(self, cluster: ClusterConfig) -> bool:
        return True

    def submit(self, request: Request, launch: Launch) -> None:
        """The shards as job arrays (one sbatch per array) and the merge job after them (one more sbatch)."""
        cfg, run_dir, cluster = request.cfg, request.run_dir, request.cluster
        executors.require_pass_through(cfg)
        sp = slurm.slurm_plan(
            cfg,
            run_dir,
            store.load_plan(run_dir).fingerprint,
            request.indices,
            max_array_size=scheduler.max_array_size(cluster),
            merge_job=False,
        )
        launch.slurm = submitted = SlurmJobs(sp.tag, sp.merge_name)
        job = ShardJob(str(run_dir))
        for chunk in sp.layout:
            jobs = executors.slurm_executor(run_dir, cluster, sp.array_params(chunk)).map_array(job, list(chunk.shards))
            for i, j in zip(chunk.shards, jobs):
                launch.jobs[i] = str(j.job_id)
            submitted.arrays.append(str(jobs[0].job_id).split("_", 1)[0])
        if request.merge_job:
            launch.merge_job_id = executors.queue_after_the_run(
                run_dir,
                cluster,
                set(request.run_job_names) | {sp.tag, sp.merge_name},
                submitted.arrays,
                sp.merge_name,
                slurm.merge_command(run_dir, sp.python),
            )

    def record(self, request: Request, launch: Launch, common: dict[str, Any]) -> SlurmArraysLaunch:
        """The array task of each shard, the arrays, their job name and the merge job's (name and id)."""
        submitted = launch.slurm
        return SlurmArraysLaunch(
            **common,
            jobs={str(i): j for i, j in sorted(launch.jobs.items())},
            tag=submitted.tag if submitted else None,
            merge_job_name=submitted.merge_name if submitted else None,
            arrays=list(submitted.arrays) if submitted else [],
            merge_job_id=launch.merge_job_id,
        )

    def describe(self, request: Request, fingerprint: str) -> str:
        """The array layout and every sbatch script that would be submitted."""
        size, source = max_array_size_for_dry_run(request.cluster)
        sp = slurm.slurm_plan(
            request.cfg,
            request.run_dir,
            fingerprint,
            request.indices,
            max_array_size=size,
            merge_job=request.merge_job,
            after=[f"<array {k} job id>" for k in range(-(-len(request.indices) // size))],
        )
        lines = [
            f"job name: {sp.tag} (status, resume and cancel find the run's jobs by it)",
            f"MaxArraySize: {size} ({source})",
            slurm.describe_layout(sp.layout),
        ]
        if request.merge_job:
            lines.append(f"merge job: {sp.merge_name}, after every array ends (afterany, --kill-on-invalid-dep=yes)")
        for title, script in slurm.slurm_scripts(sp, request.run_dir):
            lines += ["", f"# ---- sbatch script for {title}", script.rstrip("\n")]
        lines += slurm.server_step_preview(request.cfg, request.run_dir, str(store.shard_dir(request.run_dir, 0)))
        return "\n".join(lines)

    def live(self, launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
        """What squeue lists under the run's names, but the warm workers' array tasks (warm_workers.py answers for
        those, as their records list them); the merge jobs are answered for here, whichever launch queued them."""
        workers = {job for _, rec in launched.of(WarmWorkersLaunch) for job in rec.worker_jobs}
        return executors.queued(launched.slurm_names, ask_slurm, keep=lambda job_id: job_id not in workers)

    def cancel(self, live: LiveJobs) -> Cancelled:
        return Cancelled(*executors.cancel_live(live))
