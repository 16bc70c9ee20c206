"""The launcher interface: what every way of getting shards run implements (docs/architecture.md, "Launchers").

A backend is one module with one `Launcher` subclass, registered in backends.py (the only place that lists them):

- `submit(request, launch)`: launch the request's shards, filling `launch` as each job is accepted (the caller
  holds the run lock and appends the launch record, even when a later part of the submission failed);
- `record(request, launch, common)`: the backend's own launch record (`record_type`, one model per backend in
  rundir/records.py) of what `submit` launched; the records a backend wrote are read back by it only;
- `describe(request, fingerprint)`: what `submit` would do, for `--dry-run` (nothing submitted or written);
- `live(launched, ask_slurm)`: which of the jobs this backend launched for the run are queued or running now;
- `cancel(live)`: stop those jobs.

`selects(cluster)` says whether the backend is the one a config asks for; `waits_by_default(cluster)` whether a
`submit` from the command line waits for its jobs (local jobs: yes; Slurm: no); `runs_on_slurm(cluster)` whether its
jobs are Slurm jobs (the run directory must then suit a job script; a container image hides the venvs). Of its
records: `accounted_by_slurm` (its shard jobs are Slurm jobs: sacct says how they ended, and their GPU-hours) and
`runs_shards_in_turn` (one job runs several shards one after another). Status, submission, resume, preflight and
report ask these, never the executor. The backends share the submitit seam (executors.py) and know nothing of
status, submission or each other's jobs (but Slurm arrays, which answer for every job under the run's names that no
warm worker's record claims: the merge jobs whichever launch queued them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol, TypeVar

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.launch import scheduler
from shardrun.rundir.records import LaunchBase, LaunchRecord

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
class SlurmJobs:
    """What a launch onto Slurm submitted besides its jobs: their job name, the arrays, the job after them's name."""

    tag: str
    merge_name: str
    arrays: list[str] = field(default_factory=list)  # the job array ids, in submission order


@dataclass
class Launch:
    """What a submission launched, as the backend fills it (its launch record is built from it: Launcher.record)."""

    jobs: dict[int, str]  # shard index -> job id (warm workers: none, they claim shards)
    handles: list[Any] = field(default_factory=list)  # submitit jobs (only to wait on them here)
    workers: dict[int, str] = field(default_factory=dict)  # warm workers: worker -> job id
    slurm: SlurmJobs | None = None  # a launch onto Slurm
    merge_job_id: str | None = None  # Slurm: the job queued after the run

    @property
    def anything(self) -> bool:
        """Was any job launched (then it is recorded, even when a later part of the launch failed)?"""
        return bool(self.jobs or self.workers)


R = TypeVar("R", bound=LaunchBase)


class Launched(Protocol):
    """What the run's launch records say was launched (status.Launches folds them): each backend reads its own."""

    def of(self, kind: type[R]) -> list[tuple[int, R]]: ...  # the records of one model, with their line numbers

    @property
    def slurm_names(self) -> set[str]: ...  # the Slurm job names of the run, every launch's (shards, merge jobs)


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
    record_type: ClassVar[type[LaunchBase]]  # the model of its launch records (rundir/records.py)
    accounted_by_slurm: ClassVar[bool] = False  # its shard jobs are Slurm jobs: sacct says how they ended
    runs_shards_in_turn: ClassVar[bool] = False  # one job runs several shards, one after another

    @abstractmethod
    def selects(self, cluster: ClusterConfig) -> bool:
        """Is this the backend the cluster config asks for?"""

    @abstractmethod
    def waits_by_default(self, cluster: ClusterConfig) -> bool:
        """Does a `submit` from the command line wait for the jobs (and show their progress)?"""

    @abstractmethod
    def runs_on_slurm(self, cluster: ClusterConfig) -> bool:
        """Are its jobs Slurm jobs under this config (its run directory then reaches a job script)?"""

    @abstractmethod
    def submit(self, request: Request, launch: Launch) -> None:
        """Launch the request's shards, filling `launch` as each job is accepted."""

    @abstractmethod
    def record(self, request: Request, launch: Launch, common: dict[str, Any]) -> LaunchRecord:
        """Its launch record of `launch` (`common`: the fields every launch record holds, LaunchBase's)."""

    @abstractmethod
    def describe(self, request: Request, fingerprint: str) -> str:
        """What `submit` would launch, as text (`--dry-run`); submits and writes nothing."""

    @abstractmethod
    def live(self, launched: Launched, ask_slurm: AskSlurm) -> LiveJobs:
        """This backend's jobs of the run that are queued or running now."""

    @abstractmethod
    def cancel(self, live: LiveJobs) -> Cancelled:
        """Stop the jobs `live` found (each shard tears its servers down)."""
