"""Launching shards through submitit (the only module that knows submitit).

The seam:
- `make_executor(cfg, run_dir)` builds the local submitit executor; Slurm executors are made per job array by
  `slurm_executor` (parameters from slurm.py, which is pure).
- `submit_shards(cfg, run_dir, indices)` submits shards and returns which job runs which shard; it appends one
  launch record to RUN_DIR/launches.jsonl (read by status / resume / cancel).
- The job functions `shard_job(run_dir, index)` and `shard_worker(run_dir, indices)` are small and importable;
  their arguments are a path and integers, so submitit's pickles hold no state and no secrets: everything a shard
  needs is in the run directory (plan.json, launch.json, the shard's files) and in the environment (API keys).

`submit` is `shardrun submit`: plan (refusing a different existing plan), save the launch settings, launch every
unsealed shard, and for the local executor wait for them by default.

Local executor: submitit's LocalExecutor starts every job at once, so the cap on concurrent shards
(cluster.array_parallelism) is kept by submitting at most that many worker jobs, each running its share of the
shards one after another (shards i, i+cap, i+2cap, ...).

Slurm executor: one job array per MaxArraySize shards (one sbatch each, throttled with %N so that together they
run at most array_parallelism shards), each task a `ShardJob` (submitit Checkpointable: on the checkpoint signal
the shard stops cleanly and submitit requeues it), then one CPU merge job after all arrays (afterany).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from submitit.helpers import Checkpointable

from shardrun.shard import processes
from shardrun.core import gym_version
from shardrun.rundir import env_manifest
from shardrun.rundir import seal
from shardrun.core import gym_adapter
from shardrun.launch import preflight, scheduler, slurm
from shardrun.launch import status
from shardrun.rundir import store
from shardrun.core.config import DEFAULT_MAX_ARRAY_SIZE, ClusterConfig, RunConfig
from shardrun.core.errors import BadInput, PlanMismatch, ShardFailed, ShardrunError
from shardrun.plan.planner import Plan

LOCAL_DEFAULT_TIMEOUT_MIN = 7 * 24 * 60
POLL_S = 1.0


# ---------------------------------------------------------------- job functions (run inside the job)


def current_job_id() -> str | None:
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except Exception:  # not inside a submitit job (run by hand)
        return None


def shard_job(run_dir: str, index: int) -> dict[str, Any]:
    """Run one shard (a Slurm array task runs exactly this)."""
    from shardrun.shard import runtime

    result = runtime.run_shard(Path(run_dir), int(index), job_id=current_job_id())
    return {"index": result.index, "state": result.state}


def shard_worker(run_dir: str, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Run several shards one after another (a local worker job); fails at the end if any shard failed."""
    from shardrun.shard.runtime import ShardInterrupted

    outcomes = []
    for i in indices:
        try:
            outcomes.append(shard_job(run_dir, i))
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


# ---------------------------------------------------------------- executor and submission


def make_executor(cfg: RunConfig, run_dir: Path):
    """The local submitit executor, with its folder in the run directory (Slurm: `slurm_executor`)."""
    import submitit

    cluster = cfg.cluster_or_default
    folder = store.jobs_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if cluster.executor == "local":
        executor = submitit.LocalExecutor(folder=folder)
        params: dict[str, Any] = {"timeout_min": local_timeout_min(cluster)}
        if cluster.gpus_per_node:
            params["gpus_per_node"] = cluster.gpus_per_node
        if cluster.setup:
            params["setup"] = list(cluster.setup)
        executor.update_parameters(**params)
        return executor
    raise BadInput(f"cluster.executor={cluster.executor!r}: make_executor builds the local executor only")


def local_timeout_min(cluster: ClusterConfig) -> int:
    if cluster.time_limit:
        from shardrun.launch.slurm import parse_time_limit

        return parse_time_limit(cluster.time_limit)
    return LOCAL_DEFAULT_TIMEOUT_MIN


def local_groups(indices: Sequence[int], parallelism: int) -> list[list[int]]:
    """Deal shards to at most `parallelism` workers: worker w runs indices[w], indices[w + n], ..."""
    n = max(1, min(parallelism, len(indices)))
    return [list(indices[w::n]) for w in range(n)]


@dataclass
class Launch:
    jobs: dict[int, str]  # shard index -> job id
    handles: list[Any] = field(default_factory=list)  # submitit jobs (only to wait on them here)
    arrays: list[str] = field(default_factory=list)  # Slurm: the job array ids, in submission order
    tag: str | None = None  # Slurm: the job name of the shard jobs
    merge_name: str | None = None  # Slurm: the job name of the merge job
    merge_job_id: str | None = None
    workers: dict[int, str] = field(default_factory=dict)  # warm workers (cluster.workers): worker -> job id
    worker_shards: list[int] = field(default_factory=list)  # the shards the workers were launched for


def submit_shards(
    cfg: RunConfig, run_dir: Path, indices: Sequence[int], *, merge_job: bool = True, locked: bool = False
) -> Launch:
    """Submit the shards `indices` (Slurm: and, with `merge_job`, the merge job after them); records the launch in
    RUN_DIR/launches.jsonl, even when a later sbatch of the launch failed. Holds the run lock unless the caller
    does (`locked`). Returns shard -> job id."""
    cluster = cfg.cluster_or_default
    launch = Launch(jobs={})
    with contextlib.nullcontext() if locked else store.run_lock(run_dir):
        try:
            if cluster.workers is not None:
                from shardrun.launch import worker_launch

                worker_launch.submit_workers(cfg, run_dir, indices, launch, merge_job=merge_job)
            elif cluster.executor == "slurm":
                submit_slurm(cfg, run_dir, store.load_plan(run_dir), indices, launch, merge_job=merge_job)
            else:
                executor = make_executor(cfg, run_dir)
                for group in local_groups(list(indices), cluster.array_parallelism):
                    job = executor.submit(shard_worker, str(run_dir), group)
                    launch.handles.append(job)
                    for i in group:
                        launch.jobs[i] = str(job.job_id)
        finally:
            if launch.jobs or launch.workers:
                store.append_launch(run_dir, launch_record(cfg, run_dir, launch))
    return launch


def launch_record(cfg: RunConfig, run_dir: Path, launch: Launch) -> dict[str, Any]:
    cluster = cfg.cluster_or_default
    record: dict[str, Any] = {
        "executor": cluster.executor,
        "submitted_at": time.time(),
        "host": socket.gethostname(),
        "jobs": {str(i): j for i, j in sorted(launch.jobs.items())},
        "max_attempts": cluster.max_attempts,
        "gpus_per_shard": cluster.nodes * cluster.gpus_per_node,
        "done_at_submit": rollouts_done(run_dir),
    }
    if cluster.executor == "slurm":
        record.update(
            tag=launch.tag, merge_job_name=launch.merge_name, arrays=launch.arrays, merge_job_id=launch.merge_job_id
        )
    if launch.workers:
        record.update(
            workers={str(k): j for k, j in sorted(launch.workers.items())}, worker_shards=launch.worker_shards
        )
    if cluster.executor == "local":
        pids = sorted({int(j) for j in [*launch.jobs.values(), *launch.workers.values()]})
        record["pid_start"] = {str(p): processes.start_ticks(p) for p in pids}
    return record


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
        result = SubmitResult(run_dir, plan, False, {}, done, ignored, None, live=sorted(live & set(todo)))
        if st is not None and max_attempts is not None:
            result.gave_up = [
                s for s in st.shards if s.index in todo and s.index not in live and s.attempts >= max_attempts
            ]
        todo = [i for i in todo if i not in live and i not in {s.index for s in result.gave_up}]
        if dry_run:
            result.dry_run = (
                describe_submission(cfg, run_dir, todo, merge_job=merge_job) if todo else "nothing to submit"
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
) -> SubmitResult:
    """`shardrun submit`: plan + launch every unsealed shard (+ wait, by default for the local executor; on Slurm
    + the merge job unless `merge_job` is off). `dry_run` writes and submits nothing: it describes the launch."""
    if dry_run:
        return dry_run_submit(cfg, merge_job=merge_job)
    cfg.require("gym", "policy")
    plan = store.scan_input(cfg)
    preflight.check(cfg, cfg.run_dir, plan)  # everything a shard needs, before anything is written or launched
    plan, written = store.write_plan(cfg, plan)
    if wait_for_jobs is None:
        wait_for_jobs = cfg.cluster_or_default.executor == "local"
    result = launch_unsealed(cfg, cfg.run_dir, plan, wait_for_jobs=wait_for_jobs, echo=echo, merge_job=merge_job)
    result.planned_now = written
    return result


def dry_run_submit(cfg: RunConfig, *, merge_job: bool) -> SubmitResult:
    """What `submit` would launch: the shards not sealed yet (all of them for a run not planned yet)."""
    run_dir = cfg.run_dir
    plan = store.scan_input(cfg)
    store.check_run_dir(run_dir)
    existing = store.existing_plan_matches(run_dir, plan)  # PlanMismatch if the run directory holds another plan
    todo, done, ignored = unsealed(run_dir, plan) if existing else ([s.index for s in plan.shards], [], [])
    result = SubmitResult(run_dir, plan, False, {}, done, ignored, None)
    text = (
        describe_submission(cfg, run_dir, todo, merge_job=merge_job, fingerprint=plan.fingerprint)
        if todo
        else "every shard is sealed; nothing would be submitted"
    )
    missing = [name for name in ("gym", "policy") if getattr(cfg, name) is None]
    if missing:
        text += f"\nnote: the config has no {' or '.join(missing)} section; submit needs them"
    result.dry_run = text
    return result


# ---------------------------------------------------------------- Slurm: job arrays, the merge job, checkpoints


class CheckpointRequested(BaseException):
    """Raised inside a Slurm shard job by the checkpoint signal (USR2: the time limit is near, or a preemption).

    A BaseException, so the runtime's `except Exception` neither records it as the shard's failure nor as failed
    rollouts: it unwinds the shard, whose teardown stops the collector (watchdog) and the servers in order; every
    completed rollout stays in rollouts.jsonl and rollouts in flight are simply run again by the requeued job."""

    def __init__(self, signum: int):
        super().__init__(f"checkpoint signal {signal.Signals(signum).name}")
        self.signum = signum


def checkpoint_signal() -> int:
    """submitit's checkpoint signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise)."""
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))


class ShardJob(Checkpointable):
    """One shard as a Slurm array task. On the checkpoint signal it stops the shard cleanly, then hands over to
    submitit, which calls `checkpoint` (the same shard again: it resumes from its files), requeues the job and
    exits. Pickled by submitit: it holds the run directory only."""

    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self, index: int) -> dict[str, Any]:
        sig = checkpoint_signal()
        submitit_handler = signal.getsignal(sig)  # submitit's checkpoint_and_try_requeue inside a job

        def on_signal(signum: int, _frame: Any) -> None:
            signal.signal(signum, signal.SIG_IGN)  # one stop is enough; Slurm may signal again
            raise CheckpointRequested(signum)

        signal.signal(sig, on_signal)
        try:
            return shard_job(self.run_dir, index)
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


def slurm_executor(run_dir: Path, cluster: ClusterConfig, params: dict[str, Any]):
    import submitit

    folder = store.jobs_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=cluster.max_requeues)
    except RuntimeError as e:  # no srun on PATH
        raise scheduler.SlurmError(f"cannot submit to Slurm from here: {e}") from None
    executor.update_parameters(**params)
    return executor


def render_sbatch(params: dict[str, Any], folder: Path, *, map_count: int | None, python: str | None = None) -> str:
    """The sbatch script submitit writes for these parameters (pure: submitit's own renderer, nothing submitted).
    A job array when `map_count` is given (submitit submits a single shard as a plain job)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = Path(folder).absolute()
    command = " ".join([shlex.quote(python or sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, map_count=map_count, **params)


@dataclass(frozen=True)
class SlurmPlan:
    """What a Slurm submission consists of (pure): the job name, the arrays and the parameters."""

    tag: str
    merge_name: str
    layout: list[slurm.ArrayChunk]
    shard_params: dict[str, Any]
    merge_params: dict[str, Any] | None

    def array_params(self, chunk: slurm.ArrayChunk) -> dict[str, Any]:
        return {**self.shard_params, "array_parallelism": chunk.parallelism}


def slurm_plan(
    cfg: RunConfig,
    run_dir: Path,
    fingerprint: str,
    indices: Sequence[int],
    *,
    max_array_size: int,
    merge_job: bool,
    after: Sequence[str] = (),
) -> SlurmPlan:
    cluster = cfg.cluster_or_default
    tag = slurm.job_tag(cluster.job_name_prefix, run_dir, fingerprint)
    comment = f"shardrun {run_dir}"
    shard_params = slurm.shard_parameters(
        cluster, job_name=tag, comment=comment, pass_through_env=pass_through_env(cfg)
    )
    merge_name = slurm.merge_job_name(tag)
    merge_params = (
        slurm.merge_parameters(cluster, job_name=merge_name, comment=comment, after=after) if merge_job else None
    )
    return SlurmPlan(
        tag,
        merge_name,
        slurm.array_layout(list(indices), max_array_size, cluster.array_parallelism),
        shard_params,
        merge_params,
    )


def pass_through_env(cfg: RunConfig) -> list[str]:
    """Environment variables a shard job needs from the submitting shell besides cluster.env_vars: the API key."""
    return [cfg.policy.api_key_env] if cfg.policy and cfg.policy.api_key_env else []


def merge_command(run_dir: Path) -> list[str]:
    """What the merge job runs: `shardrun merge-and-profile RUN_DIR` (it re-verifies every shard's seal itself,
    since Slurm counts a dependency on a purged job id as met; missing shards: non-zero exit, 'shardrun resume')."""
    return [sys.executable, "-m", "shardrun.cli", "merge-and-profile", str(run_dir)]


def slurm_scripts(sp: SlurmPlan, run_dir: Path, *, python: str | None = None) -> list[tuple[str, str]]:
    """(title, sbatch script) for every sbatch call of the submission, in order (pure)."""
    folder = store.jobs_dir(run_dir)
    out = []
    for k, chunk in enumerate(sp.layout):
        out.append(
            (
                f"array {k}: shards {slurm.format_ranges(chunk.shards)}",
                render_sbatch(
                    sp.array_params(chunk), folder, map_count=chunk.size if chunk.size > 1 else None, python=python
                ),
            )
        )
    if sp.merge_params is not None:
        out.append(
            (
                f"merge job: shardrun merge-and-profile {shlex.quote(str(run_dir))}",
                render_sbatch(sp.merge_params, folder, map_count=None, python=python),
            )
        )
    return out


def max_array_size_for_dry_run(cluster: ClusterConfig) -> tuple[int, str]:
    if cluster.max_array_size:
        return cluster.max_array_size, "cluster.max_array_size"
    try:
        return scheduler.query_max_array_size(), "scontrol show config"
    except scheduler.SlurmError:
        return DEFAULT_MAX_ARRAY_SIZE, "Slurm's default; scontrol is not available here"


def describe_submission(
    cfg: RunConfig, run_dir: Path, indices: Sequence[int], *, merge_job: bool = True, fingerprint: str | None = None
) -> str:
    """`--dry-run`: the array layout and every sbatch script that would be submitted (Slurm), or the worker
    groups (local). Nothing is submitted or written."""
    cluster = cfg.cluster_or_default
    if cluster.workers is not None:
        from shardrun.launch import worker_launch

        return worker_launch.describe(cfg, run_dir, indices, merge_job)
    if cluster.executor == "local":
        groups = local_groups(list(indices), cluster.array_parallelism)
        return "\n".join(
            [f"local executor: {len(indices)} shard(s) in {len(groups)} worker job(s) at once"]
            + [f"  worker {w}: shards {slurm.format_ranges(g)}" for w, g in enumerate(groups)]
        )
    fingerprint = fingerprint or store.load_plan(run_dir).fingerprint
    size, source = max_array_size_for_dry_run(cluster)
    sp = slurm_plan(
        cfg,
        run_dir,
        fingerprint,
        indices,
        max_array_size=size,
        merge_job=merge_job,
        after=[f"<array {k} job id>" for k in range(-(-len(indices) // size))],
    )
    lines = [
        f"job name: {sp.tag} (status, resume and cancel find the run's jobs by it)",
        f"MaxArraySize: {size} ({source})",
        slurm.describe_layout(sp.layout),
    ]
    if merge_job:
        lines.append(f"merge job: {sp.merge_name}, after every array ends (afterany, --kill-on-invalid-dep=yes)")
    for title, script in slurm_scripts(sp, run_dir):
        lines += ["", f"# ---- sbatch script for {title}", script.rstrip("\n")]
    return "\n".join(lines)


def submit_slurm(
    cfg: RunConfig, run_dir: Path, plan: Plan, indices: Sequence[int], launch: Launch, *, merge_job: bool
) -> None:
    """Submit the shards as job arrays (one sbatch per array) and the merge job after them (one more sbatch),
    filling `launch` as each sbatch succeeds."""

    cluster = cfg.cluster_or_default
    missing = slurm.missing_pass_through(cluster.env_vars, pass_through_env(cfg), os.environ)
    if missing:
        raise BadInput(
            f"{', '.join(missing)} not set in this shell: Slurm jobs get these from the environment "
            f"they are submitted from (sbatch --export=ALL); export them and submit again"
        )
    sp = slurm_plan(
        cfg, run_dir, plan.fingerprint, indices, max_array_size=scheduler.max_array_size(cluster), merge_job=False
    )
    launch.tag, launch.merge_name = sp.tag, sp.merge_name
    job = ShardJob(str(run_dir))
    for chunk in sp.layout:
        jobs = slurm_executor(run_dir, cluster, sp.array_params(chunk)).map_array(job, list(chunk.shards))
        for i, j in zip(chunk.shards, jobs):
            launch.jobs[i] = str(j.job_id)
        launch.arrays.append(str(jobs[0].job_id).split("_", 1)[0])
    if merge_job:
        launch.merge_job_id = queue_after_the_run(
            run_dir, cluster, {sp.tag, sp.merge_name}, launch.arrays, sp.merge_name, merge_command(run_dir)
        )


def queue_after_the_run(
    run_dir: Path, cluster: ClusterConfig, names: set[str], arrays: Sequence[str], job_name: str, command: list[str]
) -> str:
    """Queue the job that runs `command` after the run (merge-and-profile, or the job after the workers) and return
    its id. The run's merge jobs still waiting would run before the new `arrays` end: they are replaced by this one,
    which waits (afterany) for every array of the run still queued or running and for `arrays`. The job this runs
    in, when the job after the workers resubmits them, is neither cancelled nor waited for."""
    from submitit.helpers import CommandFunction

    me = os.environ.get("SLURM_JOB_ID")
    live = scheduler.query_live_jobs(status.fold_launches(store.read_launches(run_dir)).names | names)
    live = {k: j for k, j in live.items() if me is None or me not in (j.job_id, j.array_id)}
    merges = {j.job_id for j in live.values() if j.name.endswith(slurm.MERGE_SUFFIX)}
    scheduler.cancel(merges)
    after = sorted(
        {j.array_id for j in live.values() if j.job_id not in merges} | set(arrays), key=lambda s: (len(s), s)
    )
    params = slurm.merge_parameters(cluster, job_name=job_name, comment=f"shardrun {run_dir}", after=after)
    return str(slurm_executor(run_dir, cluster, params).submit(CommandFunction(command, verbose=True)).job_id)
