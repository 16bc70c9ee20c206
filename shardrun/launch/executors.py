"""The submitit seam the backends share: its executors (local and Slurm), what runs inside a job, the job queued
after a run's arrays, and how a backend finds which of its jobs are live (a local pid that is still the same
process, or a Slurm job squeue lists).

The job functions take a path and integers, so submitit's pickles hold no state and no secrets: everything a shard
needs is in the run directory (plan.json, launch.json, the shard's files) and in the environment (API keys).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
from datetime import datetime
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.launch import scheduler, slurm
from shardrun.launch.launcher import AskSlurm, Live, LiveJobs
from shardrun.rundir.records import LaunchBase
from shardrun.rundir import store
from shardrun.shard import processes

LOCAL_DEFAULT_TIMEOUT_MIN = 7 * 24 * 60


# ---------------------------------------------------------------- inside the job


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


def checkpoint_signal() -> int:
    """submitit's checkpoint signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise)."""
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))


# ---------------------------------------------------------------- executors


def local_executor(cfg: RunConfig, run_dir: Path):
    """submitit's LocalExecutor, with its folder in the run directory."""
    import submitit

    cluster = cfg.cluster_or_default
    folder = store.jobs_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=folder)
    params: dict[str, Any] = {"timeout_min": local_timeout_min(cluster)}
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.setup:
        params["setup"] = list(cluster.setup)
    executor.update_parameters(**params)
    return executor


def local_timeout_min(cluster: ClusterConfig) -> int:
    return slurm.parse_time_limit(cluster.time_limit) if cluster.time_limit else LOCAL_DEFAULT_TIMEOUT_MIN


def slurm_executor(run_dir: Path, cluster: ClusterConfig, params: dict[str, Any]):
    import submitit

    folder = store.jobs_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        python = slurm.job_python(cluster)  # in a container image: the image's interpreter, not this one
        executor = submitit.SlurmExecutor(
            folder=folder, max_num_timeout=cluster.max_requeues, python=shlex.quote(python) if python else None
        )
    except RuntimeError as e:  # no srun on PATH
        raise scheduler.SlurmError(f"cannot submit to Slurm from here: {e}") from None
    executor.update_parameters(**params)
    return executor


def require_pass_through(cfg: RunConfig) -> None:
    """Refuse a Slurm submission from a shell that lacks what its jobs take from it (bare env_vars, the key)."""
    missing = slurm.missing_pass_through(cfg.cluster_or_default.env_vars, slurm.pass_through_env(cfg), os.environ)
    if missing:
        raise BadInput(
            f"{', '.join(missing)} not set in this shell: Slurm jobs get these from the environment "
            f"they are submitted from (sbatch --export=ALL); export them and submit again"
        )


def queue_after_the_run(
    run_dir: Path, cluster: ClusterConfig, names: set[str], arrays: Sequence[str], job_name: str, command: list[str]
) -> str:
    """Queue the job that runs `command` after the run (merge-and-profile, or the job after the workers) and return
    its id. `names` are the run's Slurm job names. The run's merge jobs still waiting would run before the new
    `arrays` end: they are replaced by this one, which waits (afterany) for every array of the run still queued or
    running and for `arrays`. The job this runs in, when the job after the workers resubmits them, is neither
    cancelled nor waited for."""
    from submitit.helpers import CommandFunction

    me = os.environ.get("SLURM_JOB_ID")
    live = scheduler.query_live_jobs(names)
    live = {k: j for k, j in live.items() if me is None or me not in (j.job_id, j.array_id)}
    merges = {j.job_id for j in live.values() if j.name.endswith(slurm.MERGE_SUFFIX)}
    scheduler.cancel(merges)
    after = sorted(
        {j.array_id for j in live.values() if j.job_id not in merges} | set(arrays), key=lambda s: (len(s), s)
    )
    params = slurm.merge_parameters(cluster, job_name=job_name, comment=f"shardrun {run_dir}", after=after)
    return str(slurm_executor(run_dir, cluster, params).submit(CommandFunction(command, verbose=True)).job_id)


# ---------------------------------------------------------------- live jobs


@dataclass(frozen=True)
class RecordedPid:
    """A local job as its launch record has it: the pid's start time (clock ticks; None: unknown), the host it ran
    on, and the record's line in launches.jsonl."""

    start: int | None
    host: str
    line: int


def recorded_pids(found: Iterable[tuple[int, LaunchBase]]) -> dict[str, RecordedPid]:
    """The local jobs (pid -> RecordedPid) of launch records with their line numbers (a later record wins)."""
    return {
        pid: RecordedPid(start, rec.host or "", line) for line, rec in found for pid, start in rec.local_pids.items()
    }


def live_pids(pids: Mapping[str, RecordedPid]) -> LiveJobs:
    """Local jobs among `pids` whose recorded pid is still the same process: a live process with that pid whose
    start time is the one its launch record holds (pid reuse ruled out). A record with no start time, or whose pid
    is now another process, names no job of this run: it is never live, so never signalled, and `unconfirmed` (a
    warning too) says which record could not be confirmed. Jobs that ran on another host are named in a warning."""
    out = LiveJobs()
    host = socket.gethostname()
    foreign = sorted({p.host for p in pids.values() if p.host and p.host != host})
    if foreign:
        out.warnings.append(f"local jobs ran on {', '.join(foreign)}; run status there to see if they still run")
    for pid, recorded in pids.items():
        if recorded.host != host:
            continue  # elsewhere, or a record without its host: never taken for a process here
        start = recorded.start
        ticks = processes.start_ticks(int(pid))
        if ticks is None:
            continue  # ended
        if start is not None and ticks == start:
            out.jobs[pid] = Live("RUNNING", "", None)
            continue
        said = "no start time recorded" if start is None else f"recorded start {start}, the live process's {ticks}"
        out.unconfirmed.append(
            f"{store.LAUNCHES_FILE}:{recorded.line}: local job pid {pid} could not be confirmed as this run's "
            f"({said}); taken for another process, never signalled"
        )
    out.warnings += out.unconfirmed
    return out


def queued(names: set[str], ask_slurm: AskSlurm, keep: Any = None) -> LiveJobs:
    """The run's Slurm jobs squeue lists (by the run's job names `names`), those `keep(job_id)` accepts."""
    out = LiveJobs()
    if not names:
        return out
    try:
        jobs = ask_slurm(names)
    except scheduler.SlurmError as e:
        out.warnings.append(
            f"cannot ask Slurm which jobs are live ({e}); launched shards that are not sealed show as failed"
        )
        return out
    for job_id, j in jobs.items():
        if keep is None or keep(job_id):
            out.jobs[job_id] = Live(
                "RUNNING" if j.running else "PENDING", j.reason, parse_start(j.start) if j.running else None, True
            )
    return out


def parse_start(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def cancel_live(live: LiveJobs) -> tuple[list[str], list[int]]:
    """scancel the Slurm jobs (whole arrays) or SIGINT the local jobs (submitit's own cancel: the shard tears down
    its servers) that `live` found; returns what was cancelled."""
    arrays = {job_id.split("_", 1)[0] for job_id, job in live.jobs.items() if job.on_slurm}
    cancelled = scheduler.cancel(arrays) if arrays else []
    pids = []
    for pid in (p for p, job in live.jobs.items() if not job.on_slurm):
        try:
            os.kill(int(pid), signal.SIGINT)
            pids.append(int(pid))
        except ProcessLookupError:
            pass
    return cancelled, pids
