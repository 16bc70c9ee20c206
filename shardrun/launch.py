"""Launching shards through submitit (the only module that knows submitit).

The seam:
- `make_executor(cfg, run_dir)` builds the submitit executor from the cluster config (local now; slurm next).
- `submit_shards(cfg, run_dir, indices)` submits shards and returns which job runs which shard; it appends one
  launch record to RUN_DIR/launches.jsonl (read by status / resume).
- The job functions `shard_job(run_dir, index)` and `shard_worker(run_dir, indices)` are small and importable;
  their arguments are a path and integers, so submitit's pickles hold no state and no secrets: everything a shard
  needs is in the run directory (plan.json, launch.json, the shard's files) and in the environment (API keys).

`submit` is `shardrun submit`: plan (refusing a different existing plan), save the launch settings, launch every
unsealed shard, and for the local executor wait for them by default.

Local executor: submitit's LocalExecutor starts every job at once, so the cap on concurrent shards
(cluster.array_parallelism) is kept by submitting at most that many worker jobs, each running its share of the
shards one after another (shards i, i+cap, i+2cap, ...).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from shardrun import processes, seal, store
from shardrun.config import ClusterConfig, RunConfig
from shardrun.errors import BadInput, ShardFailed, ShardrunError
from shardrun.planner import Plan

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
    from shardrun import runtime

    result = runtime.run_shard(Path(run_dir), int(index), job_id=current_job_id())
    return {"index": result.index, "state": result.state}


def shard_worker(run_dir: str, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Run several shards one after another (a local worker job); fails at the end if any shard failed."""
    from shardrun.runtime import ShardInterrupted

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
        raise ShardFailed(f"{len(failed)} of {len(outcomes)} shard(s) failed: "
                          + "; ".join(f"shard {o['index']}: {o['error'].splitlines()[0]}" for o in failed))
    return outcomes


# ---------------------------------------------------------------- executor and submission

def make_executor(cfg: RunConfig, run_dir: Path):
    """The submitit executor for the run's cluster config, with its folder in the run directory."""
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
    raise BadInput(f"cluster.executor={cluster.executor!r}: only the local executor is available in this version")


def local_timeout_min(cluster: ClusterConfig) -> int:
    if cluster.time_limit:
        from shardrun.slurm import parse_time_limit

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


def submit_shards(cfg: RunConfig, run_dir: Path, indices: Sequence[int]) -> Launch:
    """Submit the shards `indices`; records the launch in RUN_DIR/launches.jsonl. Returns shard -> job id."""
    cluster = cfg.cluster_or_default
    executor = make_executor(cfg, run_dir)
    launch = Launch(jobs={})
    if cluster.executor == "local":
        for group in local_groups(list(indices), cluster.array_parallelism):
            job = executor.submit(shard_worker, str(run_dir), group)
            launch.handles.append(job)
            for i in group:
                launch.jobs[i] = str(job.job_id)
    with store.run_lock(run_dir):
        store.append_launch(run_dir, launch_record(cfg, run_dir, launch))
    return launch


def launch_record(cfg: RunConfig, run_dir: Path, launch: Launch) -> dict[str, Any]:
    cluster = cfg.cluster_or_default
    record: dict[str, Any] = {
        "executor": cluster.executor, "submitted_at": time.time(), "host": socket.gethostname(),
        "jobs": {str(i): j for i, j in sorted(launch.jobs.items())},
        "max_attempts": cluster.max_attempts, "gpus_per_shard": cluster.gpus_per_node,
        "done_at_submit": rollouts_done(run_dir),
    }
    if cluster.executor == "local":
        pids = sorted({int(j) for j in launch.jobs.values()})
        record["pid_start"] = {str(p): processes.start_ticks(p) for p in pids}
    return record


def rollouts_done(run_dir: Path) -> int:
    plan = store.load_plan(run_dir)
    done = 0
    for spec in plan.shards:
        st = seal.check(run_dir, plan, spec.index)
        done += spec.num_rollouts if st.sealed else (
            store.count_complete_lines(store.rollouts_path(run_dir, spec.index))
            + store.count_complete_lines(store.failures_path(run_dir, spec.index)))
    return done


def wait(launch: Launch, echo: Callable[[str], None] = print, poll_s: float = POLL_S) -> None:
    """Wait until every job of the launch has ended; Ctrl-C cancels them (their shards tear down) and re-raises."""
    pending = list(launch.handles)
    try:
        while pending:
            pending = [j for j in pending if not j.done()]
            if pending:
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

    @property
    def failed(self) -> list[ShardOutcome]:
        return [o for o in self.outcomes or [] if o.state != "sealed"]


def shard_outcomes(run_dir: Path, plan: Plan, indices: Sequence[int]) -> list[ShardOutcome]:
    out = []
    for i in indices:
        st = seal.check(run_dir, plan, i)
        if st.sealed:
            m = st.marker or {}
            out.append(ShardOutcome(i, "sealed", f"{m.get('num_rollouts')} rollouts, {m.get('num_failed')} failed"))
            continue
        failure = failure_record(run_dir, i)
        out.append(ShardOutcome(i, "failed", failure) if failure else ShardOutcome(i, "not_finished", st.reason))
    return out


def failure_record(run_dir: Path, index: int) -> str | None:
    import orjson

    try:
        data = orjson.loads(store.shard_failure_path(run_dir, index).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return str(data.get("error")) if isinstance(data, dict) else None


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


def launch_unsealed(cfg: RunConfig, run_dir: Path, plan: Plan, *, wait_for_jobs: bool,
                    echo: Callable[[str], None] = print) -> SubmitResult:
    """Save the launch settings and launch every unsealed shard (what submit and resume share)."""
    store.write_launch_settings(run_dir, cfg)
    todo, done, ignored = unsealed(run_dir, plan)
    result = SubmitResult(run_dir, plan, False, {}, done, ignored, None)
    if not todo:
        result.outcomes = []
        return result
    launch = submit_shards(cfg, run_dir, todo)
    result.jobs = launch.jobs
    echo(f"run directory: {run_dir}")
    echo("jobs: " + ", ".join(f"shard {i} -> {j}" for i, j in sorted(launch.jobs.items())))
    if wait_for_jobs and launch.handles:
        wait(launch, echo)
        result.outcomes = shard_outcomes(run_dir, plan, todo)
    return result


def submit(cfg: RunConfig, *, wait_for_jobs: bool | None = None, echo: Callable[[str], None] = print) -> SubmitResult:
    """`shardrun submit`: plan + launch every unsealed shard (+ wait, by default for the local executor)."""
    cfg.require("gym", "policy")
    plan, written = store.write_plan(cfg)
    if wait_for_jobs is None:
        wait_for_jobs = cfg.cluster_or_default.executor == "local"
    result = launch_unsealed(cfg, cfg.run_dir, plan, wait_for_jobs=wait_for_jobs, echo=echo)
    result.planned_now = written
    return result
