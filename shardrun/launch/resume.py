"""`shardrun resume` and `shardrun cancel`.

Resume: the run's saved launch settings (or a config given again) must still plan to the same fingerprint from the
input as it is now; then, holding the run directory's lock (so two resumes submit once), it asks `status` which
shards are sealed or still queued/running, and resubmits the rest. Each resubmitted shard resumes inside the job
from its last complete rollout (runtime.py). A shard submitted `cluster.max_attempts` times is not submitted again;
it is reported with its last error.

Cancel: cancels the run's live jobs (Slurm: the jobs squeue lists under the run's job names; local: the recorded
pids that are still the same processes, confirmed by the start time the launch record holds). A launch record whose
pid is alive but whose start time is unknown or another process's is never signalled: cancel says which record it
could not confirm.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import orjson
from filelock import Timeout

from shardrun.core import config as config_mod
from shardrun.core import slurm_values
from shardrun.plan import planner
from shardrun.launch import backends, preflight, scheduler, slurm
from shardrun.launch import status
from shardrun.rundir import records, store
from shardrun.core.config import RunConfig
from shardrun.core.errors import BadInput, RunDirError, ShardrunError
from shardrun.plan.planner import Plan

LOCK_TIMEOUT_S = 600.0


class RunBusy(ShardrunError):
    """Another shardrun command holds the run directory's lock for too long."""

    exit_code = 7


def resume_config(run_dir: Path, config_file: Path | None, overrides: Sequence[str]) -> RunConfig:
    """The config to resume with: CONFIG [overrides] when given, else the launch settings saved in the run directory
    (overrides apply to those). The run directory is always RUN_DIR."""
    if config_file is None:
        saved = store.read_launch_settings(run_dir)
        if saved is None:
            raise RunDirError(
                f"{run_dir}: nothing was launched from here (no launch settings); use "
                f"`shardrun submit CONFIG` or `shardrun resume {run_dir} --config CONFIG`"
            )
        if not overrides:
            return saved.model_copy(update={"run_dir": Path(run_dir)})
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "launch_settings.yaml"
            path.write_bytes(orjson.dumps(saved.model_dump(mode="json")))  # JSON is YAML
            cfg = config_mod.load(path, list(overrides))
    else:
        cfg = config_mod.load(config_file, list(overrides))
    return cfg.model_copy(update={"run_dir": Path(run_dir)})


def check_plan(cfg: RunConfig, plan: Plan) -> None:
    """Refuse when the input or the planning settings no longer give the plan in the run directory."""
    fresh = store.scan_input(cfg)
    if planner.same_rollouts(fresh, plan):
        return
    raise store.plan_mismatch(
        plan,
        fresh,
        f"{cfg.run_dir}: the input or the config no longer match the plan of this run",
        "Restore the original input and settings, or plan into a new run directory.",
    )


def resume(
    run_dir: Path,
    config_file: Path | None = None,
    overrides: Sequence[str] = (),
    *,
    merge_job: bool = True,
    dry_run: bool = False,
    wait_for_jobs: bool | None = None,
    lock_timeout: float = LOCK_TIMEOUT_S,
    echo: Callable[[str], None] = print,
    allow_config_change: bool = False,
):
    """Check the plan, then submission.launch_unsealed with the attempt cap. Returns submission.SubmitResult."""
    from shardrun.launch import submission

    run_dir = Path(run_dir).absolute()
    plan = store.load_plan(run_dir)
    cfg = resume_config(run_dir, config_file, overrides)
    try:  # RUN_DIR from the command line reaches the job scripts as the config's run_dir does
        slurm_values.run_dir(str(run_dir), slurm=backends.for_config(cfg).runs_on_slurm(cfg.cluster_or_default))
    except ValueError as e:
        raise BadInput(f"run_dir: {e}") from None
    cfg.require("gym", "policy")
    check_plan(cfg, plan)
    if not dry_run:
        preflight.check(cfg, run_dir, plan)  # everything a shard needs, before anything is launched
    if wait_for_jobs is None:
        wait_for_jobs = submission.waits_by_default(cfg)
    try:
        return submission.launch_unsealed(
            cfg,
            run_dir,
            plan,
            wait_for_jobs=wait_for_jobs,
            echo=echo,
            merge_job=merge_job,
            max_attempts=cfg.cluster_or_default.max_attempts,
            dry_run=dry_run,
            lock_timeout=lock_timeout,
            allow_config_change=allow_config_change,
        )
    except Timeout:
        raise RunBusy(
            f"{run_dir} is locked by another shardrun command (submit, resume or cancel) for over "
            f"{lock_timeout:.0f} s; try again when it is done"
        ) from None


def render(result) -> str:
    """What `shardrun resume` prints (result: submission.SubmitResult)."""
    from shardrun.launch import submission

    lines = []
    if result.dry_run is not None:
        lines.append(result.dry_run)
    if result.jobs:
        lines.append(
            f"resubmitted {len(result.jobs)} shard(s): {slurm.format_ranges(result.jobs)} "
            f"({submission.describe_jobs(result.jobs)})"
        )
    if result.workers:
        lines.append(
            f"launched {len(result.workers)} warm worker(s) ({', '.join(result.workers.values())}); they claim the "
            f"unsealed shards until none are left"
        )
    if result.merge_job_id:
        lines.append(f"merge job {result.merge_job_id} runs when they have ended")
    if result.live:
        lines.append(f"left alone, still queued or running: {slurm.format_ranges(result.live)}")
    lines.append(f"sealed: {len(result.already_sealed)} of {len(result.plan.shards)}")
    for reason in result.ignored_markers:
        lines.append(f"warning: {reason}")
    for s in result.gave_up:
        lines.append(f"gave up on shard {s.index} after {s.attempts} attempt(s): {s.reason} (log {s.log})")
    if result.gave_up:
        lines.append("raise cluster.max_attempts (shardrun resume RUN_DIR cluster.max_attempts=N) to try them again")
    for o in result.outcomes or []:
        lines.append(f"shard {o.index:05d}: {o.state}" + (f" ({o.detail})" if o.detail else ""))
    if len(result.already_sealed) == len(result.plan.shards):
        lines.append("every shard is sealed; nothing to resume (merge with `shardrun merge-and-profile RUN_DIR`)")
    return "\n".join(lines)


# ---------------------------------------------------------------- cancel


@dataclass
class CancelResult:
    slurm_jobs: list[str]
    local_pids: list[int]
    unconfirmed: list[str] = field(default_factory=list)  # launch records whose live pid is not confirmed as ours
    reaped_servers: int = 0  # server processes that workers gone from this host left, killed by their records


def cancel(run_dir: Path, lock_timeout: float = LOCK_TIMEOUT_S) -> CancelResult:
    """Cancel every live job of the run (shards and merge jobs): each backend stops the jobs it launched."""
    run_dir = Path(run_dir)
    store.load_plan(run_dir)
    try:
        with store.run_lock(run_dir, timeout=lock_timeout):
            launches = status.fold_launches(records.read_launches(run_dir))
            done = backends.cancel(launches, scheduler.query_live_jobs)
            from shardrun.workers import worker

            reaped = worker.reap_gone_workers(run_dir, socket.gethostname())
    except Timeout:
        raise RunBusy(f"{run_dir} is locked by another shardrun command for over {lock_timeout:.0f} s") from None
    return CancelResult(done.slurm_jobs, done.local_pids, done.unconfirmed, reaped)


def render_cancel(result: CancelResult) -> str:
    notes = [f"not signalled: {u}" for u in result.unconfirmed]
    if result.reaped_servers:
        notes.append(f"killed {result.reaped_servers} server process(es) that workers gone from this host left")
    if not (result.slurm_jobs or result.local_pids):
        return "\n".join(["no live jobs for this run", *notes])
    parts = []
    if result.slurm_jobs:
        parts.append(f"cancelled Slurm job(s) {', '.join(result.slurm_jobs)}")
    if result.local_pids:
        parts.append(f"interrupted local job(s) {', '.join(map(str, result.local_pids))}")
    return "\n".join(["; ".join(parts), *notes])
