"""`shardrun submit`, and what submit and resume share: launch every unsealed shard through the backend the config
selects (backends.py), record the launch, and wait for local jobs with the progress view.

- `submit_shards(cfg, run_dir, indices)` submits shards and returns which job runs which shard; it appends one
  launch record to RUN_DIR/launches.jsonl (read by status / resume / cancel).
- `launch_unsealed` holds the run lock from the check of what is sealed or live to the launch record.
- `submit` is `shardrun submit`: plan (refusing a different existing plan), save the launch settings, launch every
  unsealed shard, and for local jobs wait for them by default.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from shardrun.core import gym_version
from shardrun.rundir import env_manifest
from shardrun.rundir import seal
from shardrun.core import gym_adapter
from shardrun.launch import backends, preflight, slurm
from shardrun.launch import status
from shardrun.launch.launcher import Launch, Launcher, Request
from shardrun.rundir import store
from shardrun.core.config import RunConfig
from shardrun.rundir.records import LaunchRecord
from shardrun.core.errors import PlanMismatch, ServerFailure
from shardrun.rundir import records
from shardrun.plan.planner import Plan

POLL_S = 1.0


def run_job_names(run_dir: Path) -> frozenset[str]:
    """The Slurm job names the run's launches used (the merge job queued next replaces their waiting merge jobs)."""
    return frozenset(status.fold_launches(store.read_launches(run_dir)).slurm_names)


def submit_shards(
    cfg: RunConfig, run_dir: Path, indices: Sequence[int], *, merge_job: bool = True, locked: bool = False
) -> Launch:
    """Submit the shards `indices` through the config's backend (Slurm: and, with `merge_job`, the merge job after
    them); records the launch in RUN_DIR/launches.jsonl, even when a later sbatch of the launch failed. Holds the
    run lock unless the caller does (`locked`). Returns shard -> job id."""
    backend = backends.for_config(cfg)
    launch = Launch(jobs={})
    with contextlib.nullcontext() if locked else store.run_lock(run_dir):
        request = Request(cfg, run_dir, list(indices), merge_job=merge_job, run_job_names=run_job_names(run_dir))
        try:
            backend.submit(request, launch)
        finally:
            if launch.anything:
                store.append_launch(run_dir, launch_record(backend, request, launch))
    return launch


def launch_record(backend: Launcher, request: Request, launch: Launch) -> LaunchRecord:
    """The backend's launch record of `launch`, with what every launch record holds: when and where it was
    submitted, the attempt cap, GPUs per shard and the rollouts done at submit (status's throughput)."""
    cluster = request.cluster
    common: dict[str, Any] = {
        "submitted_at": time.time(),
        "host": socket.gethostname(),
        "max_attempts": cluster.max_attempts,
        "gpus_per_shard": cluster.nodes * cluster.gpus_per_node,
        "done_at_submit": rollouts_done(request.run_dir),
    }
    return backend.record(request, launch, common)


def rollouts_done(run_dir: Path) -> int:
    plan = store.load_plan(run_dir)
    done = 0
    for spec in plan.shards:
        st = seal.check(run_dir, plan, spec.index)
        done += (
            spec.num_rollouts
            if st.sealed
            else (
                store.count_complete_lines(store.rollouts_path(run_dir, spec.index))
                + store.count_complete_lines(store.failures_path(run_dir, spec.index))
            )
        )
    return done


def wait(
    launch: Launch,
    echo: Callable[[str], None] = print,
    poll_s: float = POLL_S,
    tick: Callable[[], object] | None = None,
) -> None:
    """Wait until every job of the launch has ended (calling `tick`, the progress view, as it polls); Ctrl-C
    cancels them (their shards tear down) and re-raises."""
    pending = list(launch.handles)
    try:
        while pending:
            pending = [j for j in pending if not j.done()]
            if pending:
                if tick is not None:
                    tick()
                time.sleep(poll_s)
    except KeyboardInterrupt:
        echo("interrupted: cancelling the shard jobs")
        for j in pending:
            j.cancel(check=False)
        raise


# ---------------------------------------------------------------- outcomes and `shardrun submit`


@dataclass(frozen=True)
class ShardOutcome:
    index: int
    state: str  # sealed | failed | not_finished
    detail: str


@dataclass
class SubmitResult:
    run_dir: Path
    plan: Plan
    planned_now: bool
    jobs: dict[int, str]
    already_sealed: list[int]
    ignored_markers: list[str]
    outcomes: list[ShardOutcome] | None  # None with --no-wait
    live: list[int] = field(default_factory=list)  # unsealed but still queued or running: not submitted again
    gave_up: list[status.ShardStatus] = field(default_factory=list)  # launched max_attempts times: not again
    merge_job_id: str | None = None
    dry_run: str | None = None  # --dry-run: what would be submitted
    workers: dict[int, str] = field(default_factory=dict)  # warm workers launched: worker -> job id

    @property
    def failed(self) -> list[ShardOutcome]:
        return [o for o in self.outcomes or [] if o.state != "sealed"]


@dataclass(frozen=True)
class Failure:
    """Why shards of a waited-for launch did not seal: a warm worker that failed, or a shard's last attempt."""

    what: str  # "worker <id>" or "shard NNNNN"
    cause: str  # its error, as recorded (a server's: with the last lines of the server's log)
    log: Path | None  # the log to read next: one that exists, or None

    @property
    def server(self) -> bool:
        """A policy, judge or Gym server that did not start or died (ServerFailure: exit code 3)."""
        return self.cause.startswith(ServerFailure.__name__)


MAX_FAILURES_SHOWN = 5


def failures(run_dir: Path, result: SubmitResult) -> list[Failure]:
    """The causes of the shards that did not seal: the failed warm workers of this launch first (with their
    worker.log), then each shard's recorded failure (with its shard.log where it exists) whose cause no worker
    already gave."""
    out: list[Failure] = []
    jobs = set(result.workers.values())
    for w in records.read_worker_states(run_dir):
        if w.state == records.FAILED and w.exit_reason and (not jobs or w.job_id in jobs):
            log = store.worker_log_path(run_dir, w.worker_id)
            out.append(Failure(f"worker {w.worker_id}", w.exit_reason, log if log.is_file() else None))
    for o in result.failed:
        if o.state == "failed" and o.detail and not any(o.detail == f.cause for f in out):
            log = store.shard_log_path(run_dir, o.index)
            out.append(Failure(f"shard {o.index:05d}", o.detail, log if log.is_file() else None))
    return out


def failure_exit_code(found: Sequence[Failure]) -> int:
    """3 when a server did not start or died (ServerFailure), else 4 (shards did not seal; docs/troubleshooting.md)."""
    return ServerFailure.exit_code if any(f.server for f in found) else 4


def failure_text(run_dir: Path, result: SubmitResult, found: Sequence[Failure]) -> str:
    """What `submit` says when shards did not seal: how many, each cause (the first MAX_FAILURES_SHOWN) with the log
    to read; where no cause was recorded, where to look."""
    lines = [f"error: {len(result.failed)} shard(s) did not seal"]
    for f in found[:MAX_FAILURES_SHOWN]:
        lines.append(f"{f.what} failed: {f.cause}")
        if f.log is not None:
            lines.append(f"  log: {f.log}")
    if len(found) > MAX_FAILURES_SHOWN:
        lines.append(f"... {len(found) - MAX_FAILURES_SHOWN} more cause(s): shardrun status {run_dir}")
    if not found:
        logs = [store.shard_log_path(run_dir, o.index) for o in result.failed]
        there = [p for p in logs if p.is_file()]
        lines.append(
            f"no cause was recorded; logs: {', '.join(map(str, there[:3]))}"
            if there
            else f"no cause was recorded and no shard wrote a log; see shardrun status {run_dir} and {run_dir}/jobs/"
        )
    return "\n".join(lines)


def describe_jobs(jobs: dict[int, str], listed: int = 12) -> str:
    """'shard 0 -> 7_0, ...' for a few shards; per job array ('array 7: shards 0-1000') for many."""
    if len(jobs) <= listed:
        return ", ".join(f"shard {i} -> {j}" for i, j in sorted(jobs.items()))
    groups: dict[str, list[int]] = {}
    for i, j in jobs.items():
        groups.setdefault(j.split("_", 1)[0], []).append(i)
    return ", ".join(
        f"{'array ' if len(g) > 1 else 'job '}{a}: shard{'s' if len(g) > 1 else ''} {slurm.format_ranges(g)}"
        for a, g in groups.items()
    )


def shard_outcomes(run_dir: Path, plan: Plan, indices: Sequence[int]) -> list[ShardOutcome]:
    out = []
    for i in indices:
        st = seal.check(run_dir, plan, i)
        if st.sealed and st.marker is not None:
            m = st.marker
            out.append(ShardOutcome(i, "sealed", f"{m.num_rollouts} rollouts, {m.num_failed} failed"))
            continue
        failure = failure_record(run_dir, i)
        out.append(ShardOutcome(i, "failed", failure) if failure else ShardOutcome(i, "not_finished", st.reason))
    return out


def failure_record(run_dir: Path, index: int) -> str | None:
    from shardrun.rundir import records

    failure = records.read_failure(run_dir, index)
    return failure.error if failure is not None else None


def unsealed(run_dir: Path, plan: Plan) -> tuple[list[int], list[int], list[str]]:
    """(unsealed shard indices, sealed ones, reasons of markers that were ignored)."""
    todo, done, ignored = [], [], []
    for spec in plan.shards:
        st = seal.check(run_dir, plan, spec.index, deep=True)
        if st.sealed:
            done.append(spec.index)
        else:
            todo.append(spec.index)
            if st.reason != "no marker":
                ignored.append(st.reason)
    return todo, done, ignored


def check_gym_version(cfg: RunConfig, plan: Plan) -> None:
    """Refuse a Gym venv holding an unsupported nemo-gym, or another version than the run was planned with (a run
    never mixes Gym versions). A venv that is not there is left to the shard to report."""
    venv = gym_version.configured_venv(cfg.gym.venv, os.environ) if cfg.gym else None
    found = gym_version.installed_version(venv) if venv else None
    if found is None:
        return
    gym_adapter.for_version(found)
    if plan.gym_version and found != plan.gym_version:
        raise PlanMismatch(
            f"{cfg.run_dir}: gym venv {venv} holds nemo-gym {found}, but this run was planned with nemo-gym "
            f"{plan.gym_version}; a run never mixes Gym versions. Point gym.venv at a {plan.gym_version} venv "
            f"(scripts/setup.sh builds one: SHARDRUN_GYM_VERSION={plan.gym_version} ./scripts/setup.sh gym), or plan "
            f"into a new run directory"
        )


def launch_unsealed(
    cfg: RunConfig,
    run_dir: Path,
    plan: Plan,
    *,
    wait_for_jobs: bool,
    echo: Callable[[str], None] = print,
    merge_job: bool = True,
    max_attempts: int | None = None,
    dry_run: bool = False,
    lock_timeout: float = -1,
    allow_config_change: bool = False,
) -> SubmitResult:
    """Save the launch settings and launch every unsealed shard that is not queued or running already (what submit
    and resume share); with `max_attempts`, not the shards launched that many times (they are listed in gave_up).
    Holds the run lock from the check to the launch record, so two submits or resumes launch once."""
    with store.run_lock(run_dir, timeout=lock_timeout):
        check_gym_version(cfg, plan)
        for change in env_manifest.check_and_record(run_dir, cfg, allow_change=allow_config_change, dry_run=dry_run):
            echo(f"configuration change accepted ({env_manifest.ALLOW_FLAG}, recorded): {change}")
        todo, done, ignored = unsealed(run_dir, plan)
        st = status.collect(run_dir, plan=plan) if todo else None
        live = set(st.indices(*status.LIVE_STATES)) if st else set()
        if st is not None:
            # seals again, after the liveness check: a shard whose job sealed it and ended between the first look
            # and the liveness check is sealed now, not to be launched twice (a job seals before it exits)
            todo, done, ignored = unsealed(run_dir, plan)
        result = SubmitResult(run_dir, plan, False, {}, done, ignored, None, live=sorted(live & set(todo)))
        if st is not None and max_attempts is not None:
            result.gave_up = [
                s for s in st.shards if s.index in todo and s.index not in live and s.attempts >= max_attempts
            ]
        todo = [i for i in todo if i not in live and i not in {s.index for s in result.gave_up}]
        if dry_run:
            result.dry_run = (
                describe_submission(cfg, run_dir, todo, merge_job=merge_job, fingerprint=plan.fingerprint)
                if todo
                else "nothing to submit"
            )
            return result
        store.write_launch_settings(run_dir, cfg)
        if not todo:
            result.outcomes = [] if not result.live else None
            return result
        launch = submit_shards(cfg, run_dir, todo, merge_job=merge_job and not result.gave_up, locked=True)
    result.jobs, result.workers = launch.jobs, launch.workers
    result.merge_job_id = launch.merge_job_id
    echo(f"run directory: {run_dir}")
    if launch.workers:
        echo(
            f"warm workers: {len(launch.workers)} job(s) ({', '.join(launch.workers.values())}) for "
            f"{len(todo)} shard(s)"
        )
    else:
        echo("jobs: " + describe_jobs(launch.jobs))
    if wait_for_jobs and launch.handles:
        from shardrun.launch import progress

        ticker = progress.Ticker(run_dir, plan, echo, tty=sys.stdout.isatty())
        try:
            wait(launch, echo, tick=ticker.safe_tick)
        finally:
            ticker.close()
        result.outcomes = shard_outcomes(run_dir, plan, todo)
    return result


def submit(
    cfg: RunConfig,
    *,
    wait_for_jobs: bool | None = None,
    echo: Callable[[str], None] = print,
    merge_job: bool = True,
    dry_run: bool = False,
    warn: Callable[[str], None] | None = None,
) -> SubmitResult:
    """`shardrun submit`: plan + launch every unsealed shard (+ wait, by default for the local executor; on Slurm
    + the merge job unless `merge_job` is off). `dry_run` writes and submits nothing: it rehearses the submission
    (dry_run_submit), saying the plan's warnings through `warn`."""
    if dry_run:
        return dry_run_submit(cfg, merge_job=merge_job, warn=warn)
    cfg.require("gym", "policy")
    plan = store.scan_input(cfg)
    preflight.check(cfg, cfg.run_dir, plan)  # everything a shard needs, before anything is written or launched
    plan, written = store.write_plan(cfg, plan)
    if wait_for_jobs is None:
        wait_for_jobs = waits_by_default(cfg)
    result = launch_unsealed(cfg, cfg.run_dir, plan, wait_for_jobs=wait_for_jobs, echo=echo, merge_job=merge_job)
    result.planned_now = written
    return result


def dry_run_submit(cfg: RunConfig, *, merge_job: bool, warn: Callable[[str], None] | None = None) -> SubmitResult:
    """A rehearsal of `submit`: the plan's warnings (through `warn`, as `plan` prints them), the same checks
    (preflight, the Gym version, the recorded configuration), refusing with the same error where `submit` would,
    then what `submit` would launch: the shards not sealed yet (all of them for a run not planned yet). Nothing is
    written or submitted."""
    run_dir = cfg.run_dir
    plan = store.scan_input(cfg)
    for w in plan.warnings:
        if warn is not None:
            warn(w)
    store.check_run_dir(run_dir)
    preflight.check(cfg, run_dir, plan)  # what submit refuses (PlanMismatch for another plan in the run directory)
    existing = store.existing_plan_matches(run_dir, plan)
    if existing:
        plan = store.load_plan(run_dir)  # the plan as recorded: its fingerprint is what the seals name
        check_gym_version(cfg, plan)
        env_manifest.check_and_record(run_dir, cfg, dry_run=True)  # submit refuses a changed Gym or policy config
    todo, done, ignored = unsealed(run_dir, plan) if existing else ([s.index for s in plan.shards], [], [])
    result = SubmitResult(run_dir, plan, False, {}, done, ignored, None)
    text = (
        describe_submission(cfg, run_dir, todo, merge_job=merge_job, fingerprint=plan.fingerprint)
        if todo
        else "every shard is sealed; nothing would be submitted"
    )
    result.dry_run = text
    return result


def waits_by_default(cfg: RunConfig) -> bool:
    """Does submit (or resume) wait for the jobs unless told otherwise? The backend's say (local jobs: yes)."""
    return backends.for_config(cfg).waits_by_default(cfg.cluster_or_default)


def describe_submission(
    cfg: RunConfig, run_dir: Path, indices: Sequence[int], *, merge_job: bool = True, fingerprint: str | None = None
) -> str:
    """`--dry-run`: what the config's backend would launch (Slurm: the array layout and every sbatch script; local:
    the worker jobs). Nothing is submitted or written."""
    backend = backends.for_config(cfg)
    request = Request(cfg, run_dir, list(indices), merge_job=merge_job)
    text = backend.describe(request, fingerprint or store.load_plan(run_dir).fingerprint)
    box = cfg.sandbox
    if box is not None:  # started by each job beside its Gym servers (shard/sandbox.py)
        how = f"image {box.image}" + (f" ({box.runtime})" if box.runtime else "") if box.image else box.command
        text += (
            f"\nsandbox per job: {how}, port {box.port or 'free'}, GET {box.health_path}; the Gym servers get "
            f"NEMO_SKILLS_SANDBOX_HOST/NEMO_SKILLS_SANDBOX_PORT"
        )
    from shardrun.shard import judges

    on_slurm = backend.runs_on_slurm(cfg.cluster_or_default)
    shown = "\n".join(judges.preview(cfg.judges, cluster=cfg.cluster_or_default if on_slurm else None))
    return f"launch mode: {backend.mode}\n{text}" + (f"\n{shown}" if shown else "")
