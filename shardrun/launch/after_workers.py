"""The job after the warm workers on Slurm (`python -m shardrun.launch.after_workers RUN_DIR --round N`).

It looks at the run: unsealed shards that did not fail `cluster.max_attempts` times get a new worker array and a
new after job behind it (warm_workers.py), up to `cluster.auto_resume_rounds` rounds; then it runs
`shardrun merge-and-profile`, which re-verifies every seal.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import socket
from pathlib import Path

from shardrun.core.errors import BadInput
from shardrun.launch import backends, slurm, submission
from shardrun.launch.launcher import Launch, Request
from shardrun.launch.warm_workers import AFTER_MODULE, WarmWorkers
from shardrun.plan.planner import Plan
from shardrun.rundir import seal, store


def unfinished(run_dir: Path, plan: Plan, max_attempts: int) -> tuple[list[int], list[int]]:
    """(unsealed shards still to try, unsealed shards that failed max_attempts times)."""
    from shardrun.workers import worker

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
        from shardrun.workers import worker

        reaped = worker.reap_gone_workers(run_dir, socket.gethostname())
        if reaped:
            print(f"[shardrun] killed {reaped} server process(es) that workers gone from this host left", flush=True)
        todo, gave_up = unfinished(run_dir, plan, cluster.max_attempts)
        print(
            f"[shardrun] after the workers (round {round_no}): {len(plan.shards) - len(todo) - len(gave_up)} sealed, "
            f"{len(todo)} to resubmit, {len(gave_up)} failed {cluster.max_attempts} times",
            flush=True,
        )
        if todo and round_no <= cluster.auto_resume_rounds:
            request = Request(
                cfg,
                run_dir,
                todo,
                merge_job=True,
                run_job_names=submission.run_job_names(run_dir),
                round_no=round_no + 1,
            )
            launch = Launch(jobs={})
            backend = backends.REGISTRY[WarmWorkers.mode]
            try:
                backend.submit(request, launch)
            finally:
                if launch.anything:
                    store.append_launch(run_dir, submission.launch_record(backend, request, launch))
            print(
                f"[shardrun] resubmitted {len(launch.workers)} worker(s) ({', '.join(launch.workers.values())}) "
                f"for shards {slurm.format_ranges(todo)}; next: job {launch.merge_job_id}",
                flush=True,
            )
            return 0
    return subprocess.run(slurm.merge_command(run_dir), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {AFTER_MODULE}", description=after_workers.__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--round", type=int, default=1)
    args = ap.parse_args(argv)
    return after_workers(Path(args.run_dir), args.round)


if __name__ == "__main__":
    sys.exit(main())
