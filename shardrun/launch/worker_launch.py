"""Launching warm workers (`cluster.workers`): jobs that start their servers once and claim shards (docs/workers.md).

- Local executor: `cluster.workers` submitit LocalExecutor jobs, each running `worker_job(run_dir)`.
- Slurm: ONE job array `--array=0-<workers-1>` with the per-shard resources, each task a `WorkerJob` (submitit
  Checkpointable: on USR2 the worker stops its shard cleanly, releases its claim, tears down and is requeued), then
  the *after job* (afterany on the array, the merge job's resources and name). The after job looks at the run:
  unsealed shards that did not fail `cluster.max_attempts` times get a new worker array and a new after job behind
  it, up to `cluster.auto_resume_rounds` rounds; then it runs `shardrun merge-and-profile`, which re-verifies every
  seal. Nobody has to watch the run.

The job functions take the run directory (and a worker number) only; all state is in the run directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from submitit.helpers import Checkpointable

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.launch import slurm, submission
from shardrun.plan.planner import Plan
from shardrun.rundir import seal, store

AFTER_MODULE = "shardrun.launch.worker_launch"


# ---------------------------------------------------------------- inside the job


def deadline(cluster: ClusterConfig, environ: dict[str, str] | None = None) -> float | None:
    """When the job's time limit ends (Unix time): Slurm's SLURM_JOB_END_TIME when it is set, else now plus the
    configured limit (Slurm: the shard time limit; local: cluster.time_limit, or none)."""
    env = os.environ if environ is None else environ
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit():
        return float(end)
    if cluster.executor == "slurm":
        return time.time() + slurm.shard_time_minutes(cluster) * 60
    if cluster.time_limit:
        return time.time() + slurm.parse_time_limit(cluster.time_limit) * 60
    return None


def job_cluster(run_dir: Path) -> ClusterConfig:
    cfg = store.read_launch_settings(run_dir)
    return cfg.cluster_or_default if cfg else ClusterConfig()


def worker_job(run_dir: str) -> dict[str, Any]:
    """One local worker job: claim and collect shards until none are left."""
    from shardrun.shard import worker

    job_id = submission.current_job_id()
    state = worker.run_worker(Path(run_dir), job_id=job_id, deadline=deadline(job_cluster(Path(run_dir))))
    return {"worker_id": state.worker_id, "sealed": state.sealed}


class WorkerJob(Checkpointable):
    """One warm worker as a Slurm array task. On the checkpoint signal (USR2: time limit near, or preemption) the
    worker stops its current shard (completed rollouts kept), releases its claim and tears its servers down; then
    submitit requeues the task, which starts again as the same worker id."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self, number: int) -> dict[str, Any]:
        from shardrun.shard import worker

        run_dir = Path(self.run_dir)
        job_id = submission.current_job_id()
        w = worker.Worker(run_dir, worker.worker_id_for(job_id), job_id=job_id, deadline=deadline(job_cluster(run_dir)))
        sig = submission.checkpoint_signal()
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


def submit_workers(
    cfg: RunConfig,
    run_dir: Path,
    indices: Sequence[int],
    launch: submission.Launch,
    *,
    merge_job: bool,
    round_no: int = 1,
) -> None:
    """Launch min(cluster.workers, shards) workers for the shards `indices` (Slurm: one array, and with
    `merge_job` the after job), filling `launch`. The caller holds the run lock and records the launch."""
    cluster = cfg.cluster_or_default
    n = min(int(cluster.workers or 1), len(indices))
    launch.worker_shards = list(indices)
    if n < 1:
        return
    if cluster.executor == "local":
        executor = submission.make_executor(cfg, run_dir)
        for k in range(n):
            job = executor.submit(worker_job, str(run_dir))
            launch.handles.append(job)
            launch.workers[k] = str(job.job_id)
        return
    missing = slurm.missing_pass_through(cluster.env_vars, submission.pass_through_env(cfg), os.environ)
    if missing:
        raise BadInput(
            f"{', '.join(missing)} not set in this shell: Slurm jobs get these from the environment "
            f"they are submitted from (sbatch --export=ALL); export them and submit again"
        )
    plan = store.load_plan(run_dir)
    sp = worker_slurm_plan(cfg, run_dir, plan, n)
    launch.tag, launch.merge_name = sp.tag, sp.merge_name
    jobs = submission.slurm_executor(run_dir, cluster, sp.shard_params).map_array(
        WorkerJob(str(run_dir)), list(range(n))
    )
    for k, j in enumerate(jobs):
        launch.workers[k] = str(j.job_id)
    array = str(jobs[0].job_id).split("_", 1)[0]
    launch.arrays.append(array)
    if merge_job:
        launch.merge_job_id = submission.queue_after_the_run(
            run_dir, cluster, {sp.tag, sp.merge_name}, [array], sp.merge_name, after_command(run_dir, round_no)
        )


def worker_slurm_plan(cfg: RunConfig, run_dir: Path, plan: Plan, n: int) -> submission.SlurmPlan:
    """The workers' array: one chunk of n tasks (0..n-1), all at once, with the per-shard resources."""
    sp = submission.slurm_plan(cfg, run_dir, plan.fingerprint, list(range(n)), max_array_size=n + 1, merge_job=False)
    return submission.SlurmPlan(
        sp.tag, sp.merge_name, sp.layout, {**sp.shard_params, "array_parallelism": n}, sp.merge_params
    )


def after_command(run_dir: Path, round_no: int) -> list[str]:
    return [sys.executable, "-m", AFTER_MODULE, str(run_dir), "--round", str(round_no)]


def describe(cfg: RunConfig, run_dir: Path, indices: Sequence[int], merge_job: bool) -> str:
    """`--dry-run` with workers."""
    cluster = cfg.cluster_or_default
    n = min(int(cluster.workers or 1), len(indices))
    lines = [
        f"warm workers: {n} job(s) for {len(indices)} shard(s) ({slurm.format_ranges(indices)}); each starts its "
        f"servers once and claims shards until none are left"
    ]
    if cluster.executor == "slurm":
        lines.append(f"one job array --array=0-{n - 1} with the per-shard resources")
        if merge_job:
            lines.append(
                f"after job: afterany on the array; resubmits workers for unsealed shards up to "
                f"{cluster.auto_resume_rounds} round(s), then merge-and-profile"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- the after job (Slurm)


def unfinished(run_dir: Path, plan: Plan, max_attempts: int) -> tuple[list[int], list[int]]:
    """(unsealed shards still to try, unsealed shards that failed max_attempts times)."""
    from shardrun.shard import worker

    todo: list[int] = []
    gave_up: list[int] = []
    for spec in plan.shards:
        if seal.check(run_dir, plan, spec.index, deep=True).sealed:
            continue
        (gave_up if worker.failed_attempts(run_dir, spec.index) >= max_attempts else todo).append(spec.index)
    return todo, gave_up


def after_workers(run_dir: Path, round_no: int) -> int:
    """Resubmit workers for the unsealed shards (within max_attempts) and queue this job again behind them, up to
    cluster.auto_resume_rounds rounds; then merge. Returns the exit code."""
    run_dir = Path(run_dir).absolute()
    plan = store.load_plan(run_dir)
    cfg = store.read_launch_settings(run_dir)
    if cfg is None:
        raise BadInput(f"{run_dir}: no launch settings; nothing was launched from here")
    cfg = cfg.model_copy(update={"run_dir": run_dir})
    cluster = cfg.cluster_or_default
    with store.run_lock(run_dir):
        todo, gave_up = unfinished(run_dir, plan, cluster.max_attempts)
        print(
            f"[shardrun] after the workers (round {round_no}): {len(plan.shards) - len(todo) - len(gave_up)} sealed, "
            f"{len(todo)} to resubmit, {len(gave_up)} failed {cluster.max_attempts} times",
            flush=True,
        )
        if todo and round_no <= cluster.auto_resume_rounds:
            launch = submission.Launch(jobs={})
            try:
                submit_workers(cfg, run_dir, todo, launch, merge_job=True, round_no=round_no + 1)
            finally:
                if launch.workers:
                    store.append_launch(run_dir, submission.launch_record(cfg, run_dir, launch))
            print(
                f"[shardrun] resubmitted {len(launch.workers)} worker(s) ({', '.join(launch.workers.values())}) "
                f"for shards {slurm.format_ranges(todo)}; next: job {launch.merge_job_id}",
                flush=True,
            )
            return 0
    return subprocess.run(submission.merge_command(run_dir), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {AFTER_MODULE}", description=after_workers.__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--round", type=int, default=1)
    args = ap.parse_args(argv)
    return after_workers(Path(args.run_dir), args.round)


if __name__ == "__main__":
    sys.exit(main())
