"""The run directory's records: one typed model each (pydantic), and the one place they are read and written.

| file | model | written by | read by |
|---|---|---|---|
| `shards/NNNNN/.done` | `Seal` | the shard runtime | status, resume, merge, report, select, workers |
| `launches.jsonl` | `LaunchRecord`: one model per `mode` (one per line) | submit / resume | status, resume, cancel, report, the runtime |
| `shards/NNNNN/.claim` | `ClaimRecord` | warm workers (`claims.py`) | workers, status |
| `workers/<id>/worker.json` | `WorkerState` | warm workers | status, report, workers |
| `fill.json` | `FillRequest` | `resume --fill` | the runtime, workers |
| `shards/NNNNN/.failed` | `ShardFailure` | the shard runtime | status, resume, workers |
| `merged/labels.json` | `BlendLabels` (a `LabelResult` per label) | merge-and-profile (a blend) | compare, the merge's summary |
| `merged/failures_by_class.json` | `FailureTally` (a `GroupFailures` per label, or one for the run) | merge-and-profile | report |

plan.json's shape is the plan's own (planner.Plan, the one definition, read by store.load_plan). Every field has its
type; a record of another shape is shardrun's own file edited or damaged, and reading it raises
BadRecord (exit 2) naming the file, the line (JSONL) and the field, never a traceback. A `.done` seal that does not
validate is the exception: the shard counts as unsealed and the reason is reported (seal.check). A torn last line of
launches.jsonl (a killed writer) is skipped, as every JSONL reader does (fileio.complete_lines). Every file is opened
through fileio.open_regular: a FIFO, a device or a socket in its place is refused at once, naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shardrun.core import failure_classes, slurm_values
from shardrun.core.errors import BadRecord
from shardrun.rundir import fileio, paths

Count = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
MAX_TIME = 32503680000.0
"""The latest time a record may hold: 3000-01-01 (Unix seconds); a later one (the year 10000) is damage, and no
clock or date rendering has to cope with it."""
Time = Annotated[float, Field(allow_inf_nan=False, ge=0, le=MAX_TIME)]
"""A moment, in Unix seconds: finite, from 1970 to 3000."""


class Record(BaseModel):
    """A run-directory record: strict types (no "16" for 16, no true for 1), unknown fields kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    def to_json(self) -> dict[str, Any]:
        """The record as written: the fields it was given (a launch record keeps its nulls, as it always had)."""
        return self.model_dump(mode="json", exclude_unset=True)


M = TypeVar("M", bound=Record)


def problem(e: ValidationError, skip: int = 0) -> str:
    """The first thing wrong in a record, in words, naming the field ('not an object' for the record itself; a rule
    over several fields says which). `skip`: leading parts of the location that name no field (a union's tag)."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"][skip:])
    if not loc:
        if err["type"] == "value_error":
            return str(err["msg"]).removeprefix("Value error, ")
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
            return f"'mode' is {shown((err.get('input') or {}).get('mode'))}: not one of {', '.join(MODEL_OF)}"
        return "not an object"
    if err["type"] == "missing":
        return f"no {loc!r}"
    return f"{loc!r} is {shown(err.get('input'))}: {err['msg']}"


def shown(value: Any) -> str:
    """A value as the record has it (strings and numbers, cut short), or its kind (lists, objects)."""
    if isinstance(value, bool) or value is None:
        return orjson.dumps(value).decode()
    if isinstance(value, (str, int, float)):
        text = orjson.dumps(value).decode() if isinstance(value, str) else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return "a list" if isinstance(value, list) else "an object"


def parse(model: type[M], data: Any, where: str, what: str) -> M:
    """`data` as a `model`; BadRecord naming `where` (path or path:line), the record and the field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRecord(f"{where}: invalid {what}: {problem(e)}; the file was edited or damaged") from None


def read_json(path: Path, model: type[M], what: str) -> M | None:
    """A JSON record file as `model`, or None when there is none."""
    try:
        raw = fileio.read_regular(path)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise BadRecord(f"{path}: a directory, not {what}; remove it") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRecord(f"{path}: not {what} ({e}); the file was edited or damaged") from None
    return parse(model, data, str(path), what)


def read_jsonl(path: Path, model: type[M], what: str) -> list[M]:
    """Every complete line of a JSONL record file as `model` (a torn last line is skipped; blank lines too)."""
    out = []
    for line_no, raw in enumerate(fileio.complete_lines(path), 1):
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRecord(f"{path}:{line_no}: not {what} ({e}); the file was edited or damaged") from None
        out.append(parse(model, data, f"{path}:{line_no}", what))
    return out


# ---------------------------------------------------------------- the seal (.done)

MARKER_VERSION = 1


class SealWorker(Record):
    """The warm worker that sealed a shard (the seal's `worker`): its id and job, whether its servers had already
    collected a shard (warm) and since when they were up."""

    id: str
    job_id: str | None = None
    servers_warm: bool = False
    servers_up_since: Time | None = None


class Seal(Record):
    """`shards/NNNNN/.done`: the shard's rollouts are complete. Valid only for its plan and shard, with its planned
    rollouts accounted for, and for the exact rollouts file it names (bytes, sha256, and at least its rows: num_rollouts
    plus num_duplicate_lines). Times are Unix seconds; `host` and `job_id` may be null."""

    marker_version: Count = MARKER_VERSION
    plan_fingerprint: str
    shard_index: Count
    planned_rollouts: Count | None = None
    num_rollouts: Count
    num_failed: Count
    num_duplicate_lines: Count = 0  # rollout lines of an identity already done (merge dedupes them)
    rollouts_sha256: str
    rollouts_bytes: Count
    started_at: Time | None = None
    finished_at: Time | None = None
    host: str | None = None
    job_id: str | None = None
    attempt: Count | None = None
    server_wait_s: Finite | None = None
    collect_s: Finite | None = None
    gpus: Count | None = None
    gpu_hours: Finite | None = None
    gym_version: str | None = None  # the nemo-gym release the shard ran with
    worker: SealWorker | None = None  # the warm worker that sealed it
    extra: dict[str, Any] | None = None  # optional accounting such as tokens
    num_skipped_decided: Count = 0  # adaptive sampling: rows never run because their task was decided
    skipped_decided_tasks: list[Count] = Field(default_factory=list)
    label_rollouts: list[Count] | None = None  # a blend: its num_rollouts per label, in the plan's entry order

    @field_validator("label_rollouts")
    @classmethod
    def _labels_add_up(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        total = info.data.get("num_rollouts")
        if value is not None and total is not None and sum(value) != total:
            raise ValueError(f"adds up to {sum(value)}, not num_rollouts ({total})")
        return value

    @property
    def rows(self) -> int:
        """The lines its rollouts file must have."""
        return self.num_rollouts + self.num_duplicate_lines

    @property
    def accounted(self) -> int:
        return self.num_rollouts + self.num_failed + self.num_skipped_decided

    @property
    def worker_id(self) -> str | None:
        return self.worker.id if self.worker is not None else None

    def to_json(self) -> dict[str, Any]:
        out = self.model_dump(mode="json", exclude_none=True)
        if not self.num_skipped_decided:
            out.pop("num_skipped_decided")
            out.pop("skipped_decided_tasks")
        if not self.num_duplicate_lines:
            out.pop("num_duplicate_lines")
        for name in ("host", "job_id"):
            out.setdefault(name, None)
        return out


def seal_problem(data: Any) -> tuple[Seal | None, str]:
    """(the seal, "") or (None, what is wrong with it)."""
    try:
        return Seal.model_validate(data), ""
    except ValidationError as e:
        return None, problem(e)


def write_seal(run_dir: Path, seal: Seal) -> None:
    fileio.atomic_write_json(paths.done_path(run_dir, seal.shard_index), seal.to_json())


class SetAsideSeal(Record):
    """`shards/NNNNN/.done.damaged`: a seal that merge-and-profile, reading every row, found disagreeing with them,
    set aside with why (rundir/seal.set_aside). Its presence marks the shard damaged until the shard seals again."""

    seal: dict[str, Any]  # the seal as it was
    reason: str
    set_aside_at: Time


def read_set_aside_seal(run_dir: Path, index: int) -> SetAsideSeal | None:
    return read_json(paths.damaged_seal_path(run_dir, index), SetAsideSeal, "a set-aside seal")


def write_set_aside_seal(run_dir: Path, index: int, record: SetAsideSeal) -> None:
    fileio.atomic_write_json(paths.damaged_seal_path(run_dir, index), record.model_dump(mode="json"))


# ---------------------------------------------------------------- launch records (launches.jsonl)

LOCAL_JOBS: Literal["local_jobs"] = "local_jobs"
SLURM_ARRAYS: Literal["slurm_arrays"] = "slurm_arrays"
WARM_WORKERS: Literal["warm_workers"] = "warm_workers"


class LaunchBase(Record):
    """What every line of launches.jsonl holds, whichever backend launched: when and where, the attempt cap, GPUs
    per shard and the rollouts done at submit (status's throughput). `mode` names the backend (launch/backends.py
    maps a record to it); each mode's model holds its own fields only, and another mode's field is refused."""

    mode: str
    submitted_at: Time | None = None
    host: str | None = None
    max_attempts: Count | None = None
    gpus_per_shard: Count | None = None
    done_at_submit: Count | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_other_modes_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data:
                owners = [m for m in LAUNCH_MODELS if name in m.model_fields and name not in cls.model_fields]
                if owners:
                    raise ValueError(
                        f"{name!r} is a field of {' and '.join(m.what for m in owners)} launch records, not of "
                        f"{cls.what} ones"
                    )
        return data

    what: ClassVar[str] = "launch"

    def to_json(self) -> dict[str, Any]:
        """The record as written: its mode and the fields it was given."""
        return {"mode": self.mode} | self.model_dump(mode="json", exclude_unset=True)

    @property
    def shard_jobs(self) -> dict[int, str]:
        """Shard index -> the job launched for it (none: the launch's jobs are not tied to shards)."""
        return {}

    @property
    def slurm_names(self) -> set[str]:
        """The Slurm job names its jobs run under (squeue finds them by these)."""
        return set()

    @property
    def local_pids(self) -> dict[str, int | None]:
        """Its jobs that are processes on `host`: pid -> start time in clock ticks (None: never taken as live)."""
        return {}

    @property
    def merge_job(self) -> str | None:
        """The job it queued after the run (merge, or the job after the workers), if any."""
        return None

    @property
    def worker_jobs(self) -> list[str]:
        """Its warm workers' jobs (none: it launched no warm workers)."""
        return []

    @property
    def local_worker_jobs(self) -> list[str]:
        """Those of its warm workers' jobs that are processes on `host`."""
        return []

    @property
    def shards_for_workers(self) -> list[int]:
        """The shards its warm workers were launched for (they claim them: no job is tied to a shard)."""
        return []


def _job_name(name: str | None) -> str | None:
    if name is not None and not slurm_values.NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a Slurm job name ({slurm_values.NAME_RULE})")
    return name


def _pid_keys(pids: dict[str, int | None]) -> dict[str, int | None]:
    for key in pids:
        if not (key.isascii() and key.isdigit()) or int(key) <= 0:
            raise ValueError(f"{key!r} is not a process id")
    return pids


def _shard_keys(jobs: dict[str, str | int]) -> dict[str, str | int]:
    for key in jobs:
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"maps {key!r} to a job, not a shard index")
    return jobs


JobName = Annotated[str | None, AfterValidator(_job_name)]
PidStarts = Annotated[dict[str, int | None], AfterValidator(_pid_keys)]
ShardJobs = Annotated[dict[str, str | int], AfterValidator(_shard_keys)]


class LocalJobsLaunch(LaunchBase):
    """Local jobs (launch/local_jobs.py): `jobs` maps a shard index to the pid of the job that runs it (one job runs
    several shards in turn), `pid_start` each pid to its start time in clock ticks."""

    what: ClassVar[str] = "local jobs"
    mode: Literal["local_jobs"] = LOCAL_JOBS
    jobs: ShardJobs = Field(default_factory=dict)
    pid_start: PidStarts = Field(default_factory=dict)

    @property
    def shard_jobs(self) -> dict[int, str]:
        return {int(k): str(v) for k, v in self.jobs.items()}

    @property
    def local_pids(self) -> dict[str, int | None]:
        return dict(self.pid_start)


class SlurmLaunch(LaunchBase):
    """What a launch onto Slurm records: the job name of its jobs (`tag`), the job arrays, and the job queued after
    them (name and id)."""

    tag: JobName = None
    arrays: list[str | int] | None = None
    merge_job_name: JobName = None
    merge_job_id: str | None = None

    @property
    def slurm_names(self) -> set[str]:
        return {n for n in (self.tag, self.merge_job_name) if n}

    @property
    def merge_job(self) -> str | None:
        return self.merge_job_id


class SlurmArraysLaunch(SlurmLaunch):
    """Slurm job arrays (launch/slurm_arrays.py): `jobs` maps a shard index to its array task ("123_4")."""

    what: ClassVar[str] = "Slurm job arrays"
    mode: Literal["slurm_arrays"] = SLURM_ARRAYS
    jobs: ShardJobs = Field(default_factory=dict)

    @property
    def shard_jobs(self) -> dict[int, str]:
        return {int(k): str(v) for k, v in self.jobs.items()}


class WarmWorkersLaunch(SlurmLaunch):
    """Warm workers (launch/warm_workers.py), on this machine (`executor: local`: `workers` are pids, `pid_start`
    their start times) or as one Slurm array (`executor: slurm`: `workers` are array tasks, with the Slurm fields).
    `workers` maps a worker's number to its job, `worker_shards` lists the shards they were launched for (they claim
    them: no job is tied to a shard)."""

    what: ClassVar[str] = "warm workers"
    mode: Literal["warm_workers"] = WARM_WORKERS
    executor: Literal["local", "slurm"]
    workers: dict[str, str | int] = Field(default_factory=dict)
    worker_shards: list[Count] = Field(default_factory=list)
    pid_start: PidStarts = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fields_of_its_executor(self) -> "WarmWorkersLaunch":
        for name in NOT_ON[self.executor]:
            if getattr(self, name):
                raise ValueError(f"{name!r} is not a field of warm workers run with executor {self.executor!r}")
        return self

    @property
    def worker_jobs(self) -> list[str]:
        return [str(v) for v in self.workers.values()]

    @property
    def local_pids(self) -> dict[str, int | None]:
        return dict(self.pid_start)

    @property
    def local_worker_jobs(self) -> list[str]:
        """Its workers' jobs that are processes on `host` (none on Slurm)."""
        return self.worker_jobs if RUNS_LOCALLY[self.executor] else []

    @property
    def shards_for_workers(self) -> list[int]:
        return list(self.worker_shards)

    @property
    def slurm_worker_jobs(self) -> list[str]:
        """Its workers' jobs that are Slurm array tasks (none on this machine)."""
        return [] if RUNS_LOCALLY[self.executor] else self.worker_jobs


# warm workers: the fields a record of each executor must leave empty, and whether its workers are local processes
NOT_ON: dict[str, tuple[str, ...]] = {
    "local": ("tag", "arrays", "merge_job_name", "merge_job_id"),
    "slurm": ("pid_start",),
}
RUNS_LOCALLY: dict[str, bool] = {"local": True, "slurm": False}

LAUNCH_MODELS: tuple[type[LaunchBase], ...] = (LocalJobsLaunch, SlurmArraysLaunch, WarmWorkersLaunch)

# one line of launches.jsonl: the model its `mode` names
LaunchRecord = Annotated[Union[LocalJobsLaunch, SlurmArraysLaunch, WarmWorkersLaunch], Field(discriminator="mode")]
LAUNCH_RECORD: TypeAdapter[LaunchRecord] = TypeAdapter(LaunchRecord)


def with_mode(data: Any) -> Any:
    """A line written before launch records had a mode, with the mode its fields imply: `workers` set -> warm
    workers (its `executor` says where); otherwise `executor` (Slurm when absent, as it always defaulted) -> local
    jobs or Slurm arrays, whose `executor` is implied by the mode. A field such a line left empty (null, {} or [])
    that its mode does not have is dropped; one with a value is kept, so the record is refused naming it."""
    if not isinstance(data, dict) or "mode" in data:
        return data
    executor = data.get("executor", "slurm")
    mode = WARM_WORKERS if data.get("workers") else OLD_MODES.get(executor) if isinstance(executor, str) else None
    if mode is None:
        return data  # an executor of no mode: refused, naming it
    model = MODEL_OF[mode]
    out = {"mode": mode}
    for name, value in data.items():
        if name in model.model_fields or value not in (None, {}, []):
            out[name] = value
    if "executor" not in model.model_fields:
        out.pop("executor", None)  # implied by the mode
    return out


OLD_MODES: dict[str, str] = {"local": LOCAL_JOBS, "slurm": SLURM_ARRAYS}
MODEL_OF: dict[str, type[LaunchBase]] = {m.model_fields["mode"].default: m for m in LAUNCH_MODELS}


def parse_launch(data: Any, where: str) -> LaunchRecord:
    """One launch record (an old line without a mode too: with_mode); BadRecord naming `where` and the field."""
    data = with_mode(data)
    if isinstance(data, dict) and "mode" not in data:
        raise BadRecord(
            f"{where}: invalid launch record: 'executor' is {shown(data.get('executor'))}: not one of "
            f"{', '.join(OLD_MODES)}; the file was edited or damaged"
        )
    try:
        return LAUNCH_RECORD.validate_python(data)
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        tag = 1 if loc and str(loc[0]) in MODEL_OF else 0  # the union's tag names no field
        raise BadRecord(
            f"{where}: invalid launch record: {problem(e, skip=tag)}; the file was edited or damaged"
        ) from None


def append_launch(run_dir: Path, record: LaunchBase | dict[str, Any]) -> None:
    """Append one launch record (checked against its model; one JSON line, fsynced). Callers hold run_lock."""
    rec = record if isinstance(record, LaunchBase) else parse_launch(record, "a new launch record")
    fileio.append_jsonl(paths.launches_path(run_dir), [rec.to_json()])


def read_launches(run_dir: Path) -> list[LaunchRecord]:
    """Every launch record, oldest first; BadRecord naming the line and the field for one that is not a launch
    record (its job ids and names would reach Slurm commands and kill()). A torn last line is skipped."""
    path = paths.launches_path(run_dir)
    out = []
    for line_no, raw in enumerate(fileio.complete_lines(path), 1):
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BadRecord(f"{path}:{line_no}: not a launch record ({e}); the file was edited or damaged") from None
        out.append(parse_launch(data, f"{path}:{line_no}"))
    return out


# ---------------------------------------------------------------- claims (.claim)


class ClaimRecord(Record):
    """`shards/NNNNN/.claim`: which warm worker collects the shard (workers/claims.py has the protocol)."""

    worker_id: str
    job_id: str | None = None
    host: str
    pid: Annotated[int, Field(gt=0)]
    claimed_at: Time
    token: Annotated[str, Field(pattern=r"^[0-9a-f]{1,64}$")]


def parse_claim(path: Path, raw: bytes) -> ClaimRecord:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRecord(f"{path}: not a claim ({e}); the file was edited or damaged") from None
    return parse(ClaimRecord, data, str(path), "claim")


# ---------------------------------------------------------------- help with the end of a run (shards/NNNNN/help/)


class HelpAsk(Record):
    """`help/TOKEN.ask.json`: an idle worker asks the shard's holder for a share (workers/tail_help.py)."""

    worker: str
    at: Time


class HelpGrant(Record):
    """`help/TOKEN.grant.json`: the holder's answer, the identities lent (none: no help wanted)."""

    holder: str
    rows: list[Annotated[list[int], Field(min_length=2, max_length=2)]]
    at: Time


class HelpBeat(Record):
    """`help/TOKEN.beat.json`: the helper is at it."""

    at: Time


class HelpDone(Record):
    """`help/TOKEN.done.json`: the helper has stopped; its round's exit code."""

    rc: int
    at: Time


# ---------------------------------------------------------------- warm workers (workers/<id>/worker.json)

STARTING, IDLE, COLLECTING, DRAINING, STOPPED, FAILED = (
    "starting",
    "idle",
    "collecting",
    "draining",
    "stopped",
    "failed",
)


class WorkerState(BaseModel):
    """`workers/<id>/worker.json`: a warm worker's job, host, process, state, current shard, shards sealed, server
    starts and times, and its running servers: their process groups ([pgid, leader start ticks]) and every process
    of theirs it has seen ([pid, start ticks]: the leaders and their descendants, refreshed as it runs), so that
    whoever reaps them after it signals only what it can show the worker started."""

    model_config = ConfigDict(strict=True, extra="allow", validate_assignment=True)

    worker_id: str
    job_id: str | None
    host: str
    pid: Annotated[int, Field(gt=0)]
    pid_start: int | None
    started_at: Time
    gpus: Count
    state: str = STARTING
    current_shard: Count | None = None
    servers_up_since: Time | None = None
    server_starts: Count = 0
    startup_s: Finite = 0.0  # seconds spent starting servers, every start
    sealed: list[Count] = Field(default_factory=list)
    collecting_s: dict[str, Finite] = Field(default_factory=dict)  # shard -> seconds from claim to release
    current_shards: list[Count] = Field(default_factory=list)  # every shard held now (collector.pipeline_shards)
    holding_s: Finite = 0.0  # seconds with at least one shard held (shards held at once overlap)
    slots: Count | None = None  # gym.num_samples_in_parallel: the policy requests its slot gate admits at once
    request_s: Finite = 0.0  # policy request-seconds through its slot gate, summed over requests
    failed_attempts: Count = 0
    ended_at: Time | None = None
    exit_reason: str = ""
    updated_at: Time = 0.0
    server_groups: list[list[int]] = Field(default_factory=list)
    server_processes: list[list[int]] = Field(default_factory=list)  # [pid, start ticks] of its servers and theirs

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def write_worker_state(run_dir: Path, state: WorkerState) -> None:
    fileio.atomic_write_json(paths.worker_state_path(run_dir, state.worker_id), state.to_json())


def read_worker_state(path: Path) -> WorkerState | None:
    """A worker's state, or None when it has none yet."""
    return read_json(path, WorkerState, "a worker state")  # type: ignore[type-var]


def read_worker_states(run_dir: Path) -> list[WorkerState]:
    """Every worker that ran in this run directory, oldest first."""
    root = paths.workers_dir(run_dir)
    if not root.is_dir():
        return []
    found = [read_worker_state(paths.worker_state_path(run_dir, p.name)) for p in sorted(root.iterdir()) if p.is_dir()]
    return sorted((s for s in found if s is not None), key=lambda s: s.started_at)


# ---------------------------------------------------------------- the fill request (fill.json)


class FillRequest(Record):
    """`fill.json`: the tasks `resume --fill` asked to collect in full (`all`: every task); never skipped again."""

    all: bool = False
    tasks: list[Count] = Field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_defaults=True)  # {"all": true} or {"tasks": [...]}


def read_fill(run_dir: Path) -> FillRequest:
    return read_json(paths.fill_path(run_dir), FillRequest, "a fill request") or FillRequest()


def write_fill(run_dir: Path, request: FillRequest) -> None:
    fileio.atomic_write_json(paths.fill_path(run_dir), request.to_json())


# ---------------------------------------------------------------- a shard's last error (.failed)


class ShardFailure(Record):
    """`shards/NNNNN/.failed`: the last attempt's error, written by the shard job when it raises (removed when a
    later attempt seals)."""

    job_id: str | None = None
    error: str = ""
    attempt: Count = 0
    at: Time | None = None
    host: str | None = None


def read_failure(run_dir: Path, index: int) -> ShardFailure | None:
    return read_json(paths.shard_failure_path(run_dir, index), ShardFailure, "a shard failure record")


def write_failure(run_dir: Path, index: int, failure: ShardFailure) -> None:
    """Written by the shard runtime as it fails (callers suppress OSError: a full disk must not hide the error)."""
    fileio.atomic_write_json(paths.shard_failure_path(run_dir, index), failure.to_json())


# ---------------------------------------------------------------- a blend's labels after the merge (merged/labels.json)


class LabelRate(Record):
    """A label's share of the sealed shards' time and GPU-hours and its rates over them (profile/blend_labels.py);
    a rate is None when its hours are 0, `basis` None when no sealed shard held the label."""

    rollouts: Count
    hours: Finite
    gpu_hours: Finite
    rollouts_per_hour: Finite | None
    rollouts_per_gpu_hour: Finite | None
    output_tokens: Count
    output_tokens_per_s: Finite | None
    basis: str | None


class LabelResult(Record):
    """One label's line of labels.json: planned, collected, failed, skipped and missing rollouts, its tasks,
    mean reward, pass@1 (a fraction), rate, and its profile folder (relative to merged/)."""

    label: str
    agent: str
    owner: str | None
    tasks_planned: Count
    rollouts_planned: Count
    collected: Count
    masked: Count
    failed: Count
    skipped: Count
    missing: int
    tasks_complete: Count
    tasks_partial: Count
    tasks_missing: int
    mean_reward: Finite | None
    pass_at_1: Finite | None
    rate: LabelRate
    profile: str
    failures: "ClassCounts" = Field(default_factory=dict)  # failed rollouts by failure class (none before classes)
    unreliable: bool = False  # failed share above report.unreliable_failure_rate

    @property
    def failed_lane(self) -> bool:
        return self.collected == 0


class BlendLabels(Record):
    """`merged/labels.json`: a blend's labels in config order after the merge, the lanes that collected nothing,
    and how the rates were shared out."""

    run_dir: str
    fingerprint: str
    labels: list[LabelResult]
    failed_lanes: list[str]
    rate_basis: str

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n"


def _known_classes(counts: dict[str, int]) -> dict[str, int]:
    for name in counts:
        failure_classes.check_class(name)
    return counts


ClassCounts = Annotated[dict[str, Count], AfterValidator(_known_classes)]
"""Failed rollouts by failure class (core/failure_classes.py): each key one of its CLASSES."""
LabelResult.model_rebuild()


class GroupFailures(Record):
    """One label's (a blend) or the run's failed rollouts: planned rollouts, failed ones by class, their share of the
    planned, and whether that share is above the threshold (unreliable)."""

    name: str
    planned: Count
    failed: Count
    by_class: ClassCounts
    rate: Finite | None  # failed / planned (None when nothing was planned)
    unreliable: bool

    @model_validator(mode="after")
    def _classes_add_up(self) -> "GroupFailures":
        if sum(self.by_class.values()) != self.failed:
            raise ValueError(f"'by_class' adds up to {sum(self.by_class.values())}, not 'failed' ({self.failed})")
        return self


class FailureTally(Record):
    """`merged/failures_by_class.json`: the run's failed rollouts by class, per label (a blend: `group` "label") or
    for the whole run (`group` "run", one group), and the threshold above which a group's failures make it unreliable."""

    fingerprint: str
    group: Literal["label", "run"]
    unreliable_failure_rate: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    by_class: ClassCounts
    groups: list[GroupFailures]

    @property
    def unreliable(self) -> list[GroupFailures]:
        return [g for g in self.groups if g.unreliable]

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n"


def read_failure_tally(run_dir: Path) -> FailureTally | None:
    """merged/failures_by_class.json (None for a run merged before failures had classes, or not merged yet);
    BadRecord naming the file and the field for one of another shape."""
    return read_json(paths.failure_tally_path(run_dir), FailureTally, "a failure tally")


def read_labels(run_dir: Path) -> BlendLabels | None:
    """A blend's labels.json (None when the run has none: not a blend, or not merged yet); BadRecord naming the
    file and the field for one of another shape."""
    return read_json(paths.labels_path(run_dir), BlendLabels, "a blend's labels")
