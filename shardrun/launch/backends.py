"""The launch backends, registered here and nowhere else: a new way of getting shards run is one module with a
`launcher.Launcher` subclass, and one entry below (tests/launch/test_launchers.py checks that every Launcher subclass in
launch/ is registered here, and that nothing else in shardrun picks a backend by the config's fields).

| mode              | module           | selected by                                  | its launch records  |
|-------------------|------------------|----------------------------------------------|---------------------|
| local jobs        | local_jobs.py    | cluster.executor=local, cluster.workers=null | `LocalJobsLaunch`   |
| Slurm job arrays  | slurm_arrays.py  | cluster.executor=slurm, cluster.workers=null | `SlurmArraysLaunch` |
| warm workers      | warm_workers.py  | cluster.workers=N (local or Slurm)           | `WarmWorkersLaunch` |

A launch record is mapped to the backend that wrote it by its model (`for_record`): what a record means (are its jobs
Slurm jobs, do they run their shards in turn) is asked of that backend, never of the record's mode or executor.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.launch import scheduler
from shardrun.launch.launcher import AskSlurm, Cancelled, Launched, Launcher, LiveJobs
from shardrun.launch.local_jobs import LocalJobs
from shardrun.launch.slurm_arrays import SlurmArrays
from shardrun.launch.warm_workers import WarmWorkers
from shardrun.rundir.records import LaunchBase

REGISTRY: dict[str, Launcher] = {b.mode: b for b in (LocalJobs(), SlurmArrays(), WarmWorkers())}
BY_RECORD: dict[type[LaunchBase], Launcher] = {b.record_type: b for b in REGISTRY.values()}


def mode(cluster: ClusterConfig) -> str:
    """The config's launch mode: the one registered backend that selects it."""
    found = [name for name, backend in REGISTRY.items() if backend.selects(cluster)]
    if len(found) != 1:
        raise BadInput(
            f"cluster (executor={cluster.executor!r}, workers={cluster.workers!r}) selects "
            f"{'no' if not found else ' and '.join(found)} launch backend; one of {', '.join(REGISTRY)} is needed"
        )
    return found[0]


def for_config(cfg: RunConfig) -> Launcher:
    return for_cluster(cfg.cluster_or_default)


def for_cluster(cluster: ClusterConfig) -> Launcher:
    return REGISTRY[mode(cluster)]


def for_record(record: LaunchBase) -> Launcher:
    """The backend that wrote a launch record (and the one that reads it)."""
    return BY_RECORD[type(record)]


def asked_once(ask_slurm: AskSlurm) -> AskSlurm:
    """`ask_slurm` that runs squeue once for the backends that ask it the same question (its error too)."""
    answers: dict[frozenset[str], Mapping[str, scheduler.LiveJob] | scheduler.SlurmError] = {}

    def ask(names: Iterable[str]) -> Mapping[str, scheduler.LiveJob]:
        key = frozenset(names)
        if key not in answers:
            try:
                answers[key] = ask_slurm(key)
            except scheduler.SlurmError as e:
                answers[key] = e
        answer = answers[key]
        if isinstance(answer, scheduler.SlurmError):
            raise answer
        return answer

    return ask


def live(launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
    """Every backend's live jobs of the run (a run may have been launched in several modes over time)."""
    out = LiveJobs()
    ask = asked_once(ask_slurm)
    for backend in REGISTRY.values():
        out.add(backend.live(launched, ask))
    return out


def cancel(launched: Launched, ask_slurm: AskSlurm) -> Cancelled:
    """Cancel every backend's live jobs of the run. A squeue that fails is an error here (SlurmError), not a
    warning: nothing is cancelled on a guess."""
    out = Cancelled()
    ask_slurm = asked_once(ask_slurm)
    if launched.slurm_names:
        ask_slurm(launched.slurm_names)
    for backend in REGISTRY.values():
        live = backend.live(launched, ask_slurm)
        done = backend.cancel(live)
        out.slurm_jobs += [j for j in done.slurm_jobs if j not in out.slurm_jobs]
        out.local_pids += [p for p in done.local_pids if p not in out.local_pids]
        out.unconfirmed += [u for u in live.unconfirmed if u not in out.unconfirmed]
    return out
