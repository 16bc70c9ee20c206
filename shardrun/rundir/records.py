"""The run directory's records: one typed model each (pydantic), and the one place they are read and written.

| file | model | written by | read by |
|---|---|---|---|
| `shards/NNNNN/.done` | `Seal` | the shard runtime | status, resume, merge, report, select, workers |
| `launches.jsonl` | `LaunchRecord` (one per line) | submit / resume | status, resume, cancel, report, the runtime |
| `shards/NNNNN/.claim` | `ClaimRecord` | warm workers (`claims.py`) | workers, status |
| `workers/<id>/worker.json` | `WorkerState` | warm workers | status, report, workers |
| `fill.json` | `FillRequest` | `resume --fill` | the runtime, workers |
| `shards/NNNNN/.failed` | `ShardFailure` | the shard runtime | status, resume, workers |
| `merged/labels.json` | `BlendLabels` (a `LabelResult` per label) | merge-and-profile (a blend) | compare, the merge's summary |

plan.json's shape is the plan's own (planner.Plan, the one definition, read by store.load_plan). Every field has its
type; a record of another shape is shardrun's own file edited or damaged, and reading it raises
BadRecord (exit 2) naming the file, the line (JSONL) and the field, never a traceback. A `.done` seal that does not
validate is the exception: the shard counts as unsealed and the reason is reported (seal.check). A torn last line of
launches.jsonl (a killed writer) is skipped, as every JSONL reader does (fileio.complete_lines). Every file is opened
through fileio.open_regular: a FIFO, a device or a socket in its place is refused at once, naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from shardrun.core import slurm_values
from shardrun.core.errors import BadRecord
from shardrun.rundir import fileio, paths

Count = Annotated[int, Field(ge=0)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class Record(BaseModel):
    """A run-directory record: strict types (no "16" for 16, no true for 1), unknown fields kept as they are."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    def to_json(self) -> dict[str, Any]:
        """The record as written: the fields it was given (a launch record keeps its nulls, as it always had)."""
        return self.model_dump(mode="json", exclude_unset=True)


M = TypeVar("M", bound=Record)


def problem(e: ValidationError) -> str:
    """The first thing wrong in a record, in words, naming the field ('not an object' for the record itself)."""
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if not loc:
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
    servers_up_since: Finite | None = None


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
    started_at: Finite | None = None
    finished_at: Finite | None = None
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
    set_aside_at: Finite


def read_set_aside_seal(run_dir: Path, index: int) -> SetAsideSeal | None:
    return read_json(paths.damaged_seal_path(run_dir, index), SetAsideSeal, "a set-aside seal")


def write_set_aside_seal(run_dir: Path, index: int, record: SetAsideSeal) -> None:
    fileio.atomic_write_json(paths.damaged_seal_path(run_dir, index), record.model_dump(mode="json"))


# ---------------------------------------------------------------- launch records (launches.jsonl)


class LaunchRecord(Record):
    """One line of launches.jsonl: what one submit or resume launched. `jobs` maps a shard index to its job (Slurm
    job id, "123_4" for an array task; local: the pid), `pid_start` a local pid to its start time in clock ticks
    (None: unknown, so never taken for a live process), `workers` a warm worker's number to its job."""

    executor: str = "slurm"
    submitted_at: Finite | None = None
    host: str | None = None
    jobs: dict[str, str | int] = Field(default_factory=dict)
    max_attempts: Count | None = None
    gpus_per_shard: Count | None = None
    done_at_submit: Count | None = None
    tag: str | None = None
    merge_job_name: str | None = None
    merge_job_id: str | None = None
    arrays: list[str | int] | None = None
    workers: dict[str, str | int] = Field(default_factory=dict)
    worker_shards: list[Count] = Field(default_factory=list)
    pid_start: dict[str, int | None] = Field(default_factory=dict)

    @field_validator("jobs")
    @classmethod
    def _shard_keys(cls, jobs: dict[str, str | int]) -> dict[str, str | int]:
        for key in jobs:
            if not key.isdigit():
                raise ValueError(f"maps {key!r} to a job, not a shard index")
        return jobs

    @field_validator("tag", "merge_job_name")
    @classmethod
    def _job_name(cls, name: str | None) -> str | None:
        if name is not None and not slurm_values.NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a Slurm job name ({slurm_values.NAME_RULE})")
        return name

    @field_validator("pid_start")
    @classmethod
    def _pid_keys(cls, pids: dict[str, int | None]) -> dict[str, int | None]:
        for key in pids:
            if not key.isdigit() or int(key) <= 0:
                raise ValueError(f"{key!r} is not a process id")
        return pids

    @property
    def shard_jobs(self) -> dict[int, str]:
        return {int(k): str(v) for k, v in self.jobs.items()}

    @property
    def worker_jobs(self) -> list[str]:
        return [str(v) for v in self.workers.values()]


def append_launch(run_dir: Path, record: LaunchRecord | dict[str, Any]) -> None:
    """Append one launch record (checked against its model; one JSON line, fsynced). Callers hold run_lock."""
    rec = record if isinstance(record, LaunchRecord) else parse(LaunchRecord, record, "a new launch record", "launch")
    fileio.append_jsonl(paths.launches_path(run_dir), [rec.to_json()])


def read_launches(run_dir: Path) -> list[LaunchRecord]:
    """Every launch record, oldest first; BadRecord naming the line and the field for one that is not a launch
    record (its job ids and names would reach Slurm commands and kill())."""
    return read_jsonl(paths.launches_path(run_dir), LaunchRecord, "a launch record")


# ---------------------------------------------------------------- claims (.claim)


class ClaimRecord(Record):
    """`shards/NNNNN/.claim`: which warm worker collects the shard (workers/claims.py has the protocol)."""

    worker_id: str
    job_id: str | None = None
    host: str
    pid: Annotated[int, Field(gt=0)]
    claimed_at: Finite
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
    at: Finite


class HelpGrant(Record):
    """`help/TOKEN.grant.json`: the holder's answer, the identities lent (none: no help wanted)."""

    holder: str
    rows: list[Annotated[list[int], Field(min_length=2, max_length=2)]]
    at: Finite


class HelpBeat(Record):
    """`help/TOKEN.beat.json`: the helper is at it."""

    at: Finite


class HelpDone(Record):
    """`help/TOKEN.done.json`: the helper has stopped; its round's exit code."""

    rc: int
    at: Finite


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
    starts and times, and the process groups of its running servers ([pgid, leader start ticks])."""

    model_config = ConfigDict(strict=True, extra="allow", validate_assignment=True)

    worker_id: str
    job_id: str | None
    host: str
    pid: Annotated[int, Field(gt=0)]
    pid_start: int | None
    started_at: Finite
    gpus: Count
    state: str = STARTING
    current_shard: Count | None = None
    servers_up_since: Finite | None = None
    server_starts: Count = 0
    startup_s: Finite = 0.0  # seconds spent starting servers, every start
    sealed: list[Count] = Field(default_factory=list)
    collecting_s: dict[str, Finite] = Field(default_factory=dict)  # shard -> seconds from claim to release
    current_shards: list[Count] = Field(default_factory=list)  # every shard held now (collector.pipeline_shards)
    holding_s: Finite = 0.0  # seconds with at least one shard held (shards held at once overlap)
    slots: Count | None = None  # gym.num_samples_in_parallel: the policy requests its slot gate admits at once
    request_s: Finite = 0.0  # policy request-seconds through its slot gate, summed over requests
    failed_attempts: Count = 0
    ended_at: Finite | None = None
    exit_reason: str = ""
    updated_at: Finite = 0.0
    server_groups: list[list[int]] = Field(default_factory=list)

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
    at: Finite | None = None
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


def read_labels(run_dir: Path) -> BlendLabels | None:
    """A blend's labels.json (None when the run has none: not a blend, or not merged yet); BadRecord naming the
    file and the field for one of another shape."""
    return read_json(paths.labels_path(run_dir), BlendLabels, "a blend's labels")
