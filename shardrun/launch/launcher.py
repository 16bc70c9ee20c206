"""The launcher interface: what every way of getting shards run implements (docs/architecture.md, "Launchers").

A backend is one module with one `Launcher` subclass, registered in backends.py (the only place that lists them):

- `submit(request, launch)`: launch the request's shards, filling `launch` as each job is accepted (the caller
  holds the run lock and appends the launch record, even when a later part of the submission failed);
- `describe(request, fingerprint)`: what `submit` would do, for `--dry-run` (nothing submitted or written);
- `live(launched, ask_slurm)`: which of the jobs this backend launched for the run are queued or running now;
- `cancel(live)`: stop those jobs.

`selects(cluster)` says whether the backend is the one a config asks for; `waits_by_default(cluster)` whether a
`submit` from the command line waits for its jobs (local jobs: yes; Slurm: no). The backends share the submitit
seam (executors.py) and know nothing of status, submission or each other's jobs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.launch import scheduler

# squeue for the run's job names (scheduler.query_live_jobs, or a test's stand-in)
AskSlurm = Callable[[Iterable[str]], Mapping[str, scheduler.LiveJob]]


@dataclass(frozen=True)
class Request:
    """What to launch: the shards `indices` of the run in `run_dir`, as `cfg` says."""

    cfg: RunConfig
    run_dir: Path
    indices: list[int]
    merge_job: bool = True  # Slurm: queue the merge job (workers: the after job) behind the shards
    run_job_names: frozenset[str] = frozenset()  # Slurm job names the run's earlier launches used
    round_no: int = 1  # warm workers on Slurm: the after job's auto-resume round

    @property
    def cluster(self) -> ClusterConfig:
        return self.cfg.cluster_or_default


@dataclass
class Launch:
    """What a submission launched (the launch record is written from it)."""

    jobs: dict[int, str]  # shard index -> job id
    handles: list[Any] = field(default_factory=list)  # submitit jobs (only to wait on them here)
    arrays: list[str] = field(default_factory=list)  # Slurm: the job array ids, in submission order
    tag: str | None = None  # Slurm: the job name of the shard jobs
    merge_name: str | None = None  # Slurm: the job name of the merge job
    merge_job_id: str | None = None
    workers: dict[int, str] = field(default_factory=dict)  # warm workers (cluster.workers): worker -> job id
    worker_shards: list[int] = field(default_factory=list)  # the shards the workers were launched for


class Launched(Protocol):
    """What the run's launch records say was launched (status.Launches folds them)."""

    @property
    def names(self) -> set[str]: ...  # Slurm job names of the run (shards and merge jobs)

    @property
    def local_pids(self) -> dict[str, int | None]: ...  # local jobs: pid -> its start time (clock ticks)

    @property
    def local_hosts(self) -> dict[str, str]: ...  # local jobs: pid -> the host it ran on

    @property
    def local_records(self) -> dict[str, int]: ...  # local jobs: pid -> its launch record (launches.jsonl line)

    @property
    def worker_jobs(self) -> dict[str, str]: ...  # warm workers: job id -> executor


@dataclass(frozen=True)
class Live:
    """One job that is queued or running now."""

    state: str  # RUNNING or PENDING
    reason: str
    started_at: float | None
    on_slurm: bool = False  # a Slurm job id (else a local pid)


@dataclass
class LiveJobs:
    """A backend's answer to `live`: its jobs queued or running now (job id or pid -> Live), and what it could not
    find out."""

    jobs: dict[str, Live] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)  # launch records whose live pid is not confirmed as ours

    def add(self, other: LiveJobs) -> LiveJobs:
        self.jobs.update(other.jobs)
        self.warnings += [w for w in other.warnings if w not in self.warnings]
        self.unconfirmed += [u for u in other.unconfirmed if u not in self.unconfirmed]
        return self


@dataclass
class Cancelled:
    slurm_jobs: list[str] = field(default_factory=list)
    local_pids: list[int] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)  # launch records not signalled: their pid is not ours


class Launcher(ABC):
    """One way of getting shards run. Implementations are stateless; backends.py holds one of each."""

    mode: ClassVar[str]  # the name a launch is known by (`shardrun submit --dry-run` prints it)

    @abstractmethod
    def selects(self, cluster: ClusterConfig) -> bool:
        """Is this the backend the cluster config asks for?"""

    @abstractmethod
    def waits_by_default(self, cluster: ClusterConfig) -> bool:
        """Does a `submit` from the command line wait for the jobs (and show their progress)?"""

    @abstractmethod
    def submit(self, request: Request, launch: Launch) -> None:
        """Launch the request's shards, filling `launch` as each job is accepted."""

    @abstractmethod
    def describe(self, request: Request, fingerprint: str) -> str:
        """What `submit` would launch, as text (`--dry-run`); submits and writes nothing."""

    @abstractmethod
    def live(self, launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
        """This backend's jobs of the run that are queued or running now."""

    @abstractmethod
    def cancel(self, live: LiveJobs) -> Cancelled:
        """Stop the jobs `live` found (each shard tears its servers down)."""
