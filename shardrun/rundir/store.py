"""The run directory: the only module that knows file names, atomic writes and the run lock.

Layout (an interface: later stages and outside tools rely on it):

    RUN_DIR/plan.json
    RUN_DIR/shards/<5-digit shard index>/rollouts_materialized_inputs.jsonl   planned rows (Gym format)
                                        /rollouts.jsonl, rollouts_failures.jsonl, .done, logs/
    RUN_DIR/merged/                                                          merge-and-profile results
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import re
import tempfile
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import orjson
from filelock import FileLock
from pydantic import ValidationError

from shardrun.plan import planner
from shardrun.rundir import safepaths
from shardrun.core import gym_adapter, gym_version
from shardrun.core.config import RunConfig
from shardrun.core.errors import BadInput, NotRegularFile, PlanMismatch, RunDirError
from shardrun.core.gym_names import FAILURES, MATERIALIZED, ROLLOUTS
from shardrun.plan.planner import Plan

PLAN_FILE = "plan.json"
SHARDS_DIR = "shards"
MERGED_DIR = "merged"
LOCK_FILE = ".shardrun.lock"
BLEND_INPUT = "input.jsonl"  # a blend's rows, written by write_plan (blend_input_path)
DONE = ".done"
DAMAGED_SEAL = ".done.damaged"  # a seal the merge found disagreeing with the shard's rows, set aside (rundir/seal.py)
LOGS = "logs"
TMP_PREFIX = ".tmp-"
MAX_OPEN_SHARD_FILES = 256


# ---------------------------------------------------------------- paths


def plan_path(run_dir: Path) -> Path:
    return Path(run_dir) / PLAN_FILE


def shard_dir(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / SHARDS_DIR / f"{index:05d}"


def materialized_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / MATERIALIZED


def rollouts_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / ROLLOUTS


def failures_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / FAILURES


def done_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / DONE


def damaged_seal_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / DAMAGED_SEAL


def logs_dir(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / LOGS


def merged_dir(run_dir: Path) -> Path:
    return Path(run_dir) / MERGED_DIR


# merged outputs (Gym's names: <rollouts stem>_reward_profiling.jsonl, ..._agent_metrics.json, ...) and the report

MERGED_ROLLOUTS_STEM = "rollouts"
REPORT_FILE = "report.html"


def merged_reward_profiling_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_reward_profiling.jsonl"


def merged_agent_metrics_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_agent_metrics.json"


def merged_aggregate_metrics_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_aggregate_metrics.json"


def merged_failures_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_failures.jsonl"


def merged_rollouts_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / ROLLOUTS


def merged_materialized_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / MATERIALIZED


def merged_summary_path(run_dir: Path) -> Path:
    """What the last merge-and-profile saw and did (counts, per shard, timings): merged/merge_summary.json."""
    return merged_dir(run_dir) / "merge_summary.json"


def merge_lock(run_dir: Path, timeout: float = -1) -> FileLock:
    """Held while merge-and-profile writes merged/ (one merge at a time; flock, never stale)."""
    merged_dir(run_dir).mkdir(parents=True, exist_ok=True)
    return FileLock(str(merged_dir(run_dir) / ".merge.lock"), timeout=timeout)


def merge_scratch(run_dir: Path, name: str) -> Path:
    """A scratch file of the running merge (snapshots, spills); removed as a stale temp if the merge is killed."""
    return merged_dir(run_dir) / f"{TMP_PREFIX}{name}"


def report_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / REPORT_FILE


def report_figure_path(run_dir: Path, name: str) -> Path:
    """A report figure, beside report.html: merged/report_<name>.png."""
    return merged_dir(run_dir) / f"report_{name}.png"


# the shard's self-hosted policy server (vLLM): its log and per-server scratch (IPC sockets, compile caches)

VLLM_LOG = "vllm.log"
VLLM_SCRATCH = "vllm"


def vllm_log_path(shard: Path) -> Path:
    """The vLLM server's log in the shard's logs/ (appended by every attempt)."""
    return Path(shard) / LOGS / VLLM_LOG


def vllm_scratch_dirs(shard: Path) -> tuple[Path, Path]:
    """(TMPDIR, VLLM_CACHE_ROOT) of the shard's vLLM server: SHARD/vllm/tmp and SHARD/vllm/cache."""
    base = Path(shard) / VLLM_SCRATCH
    return base / "tmp", base / "cache"


# launches: what was submitted for which shard (written by launch, read by status / resume / cancel)

JOBS_DIR = "jobs"
LAUNCHES_FILE = "launches.jsonl"
SHARD_FAILURE = ".failed"


def jobs_dir(run_dir: Path) -> Path:
    """submitit's folder: job scripts, pickles and the job logs (RUN_DIR/jobs/)."""
    return Path(run_dir) / JOBS_DIR


def job_log_path(run_dir: Path, job_id: str) -> Path:
    """The log of one submitted job or array task, named as submitit names it: <job id>_<task 0>_log.out."""
    return jobs_dir(run_dir) / f"{job_id}_0_log.out"


def launches_path(run_dir: Path) -> Path:
    return Path(run_dir) / LAUNCHES_FILE


def shard_failure_path(run_dir: Path, index: int) -> Path:
    """The last attempt's error, written by the shard job when it raises (removed when a later attempt seals)."""
    return shard_dir(run_dir, index) / SHARD_FAILURE


def run_lock(run_dir: Path, timeout: float = -1) -> FileLock:
    """The run directory's lock (flock based: a killed holder releases it, so it is never stale)."""
    return FileLock(str(Path(run_dir) / LOCK_FILE), timeout=timeout)


# ---------------------------------------------------------------- atomic files


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, buffering: int = -1) -> Iterator[IO[bytes]]:
    """Write `path` atomically: temp file in the same directory, fsync, rename, fsync the directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_writer(path) as f:
        f.write(data)


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")


def remove_stale_temps(directory: Path) -> int:
    """Delete temp files a killed writer left behind; returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.glob(TMP_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
    return n


# ---------------------------------------------------------------- JSONL


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def open_regular(path: Path) -> IO[bytes]:
    """The one way shardrun opens a file in a run directory for reading: checked to be a regular file without
    blocking. FileNotFoundError when it is absent and IsADirectoryError for a directory (as open() raises them, for
    callers that expect either); NotRegularFile (a RunDirError naming the path) for a FIFO, a device or a socket, at
    once: such a file is never opened for reading (opening a device can act on it; reading a FIFO waits for a
    writer). O_NONBLOCK and an fstat of what was opened close the race with a file swapped in after the check."""
    return open(open_regular_fd(path), "rb")


def open_regular_fd(path: Path) -> int:
    """open_regular's descriptor (O_RDONLY), for os.pread and friends."""
    mode = os.stat(path).st_mode  # FileNotFoundError passes through
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path}: {file_kind(mode)}, not a regular file; refusing to read it (remove it)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path}: {file_kind(mode)}, not a regular file; refusing to read it (remove it)")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path) -> bytes:
    """A regular file's bytes (open_regular's checks and errors)."""
    with open_regular(path) as f:
        return f.read()


def open_input(path: Path, hint: str = "") -> IO[bytes]:
    """An input file opened for reading: BadInput naming the path unless it is a regular file (a FIFO would hang,
    a device never end; shardrun reads its input more than once and hashes it). `hint` ends the not-found message."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise BadInput(f"input file not found: {path}{hint}") from None
    except (IsADirectoryError, NotRegularFile):
        kind = file_kind(os.stat(path).st_mode)
        raise BadInput(
            f"input path {path} is {kind}, not a regular JSONL file; shardrun reads its input twice "
            f"(plan, then write) and hashes it, so it must be a file"
        ) from None


def read_lines(path: Path, hasher: "hashlib._Hash | None" = None) -> Iterator[tuple[int, bytes]]:
    """Stream (1-based line number, line without newline) from a file, never loading it whole."""
    with open_input(path) as f:
        for line_no, raw in enumerate(f, 1):
            if hasher is not None:
                hasher.update(raw)
            yield line_no, raw.rstrip(b"\r\n")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


LINE_BLOCK = 8 << 20


class CompleteLines:
    """The one reader of JSONL files another process may still be appending to: the complete lines of an open
    file, read in blocks of LINE_BLOCK bytes. A last line without its newline (a killed or still running writer)
    is never handed out; afterwards `torn` is its length. Every byte read is hashed into `hasher`; the complete
    lines are copied to `copy_to` (a snapshot whose offsets equal the file's); bytes past `limit` are not read."""

    def __init__(
        self,
        f: IO[bytes],
        limit: int | None = None,
        hasher: "hashlib._Hash | None" = None,
        copy_to: IO[bytes] | None = None,
    ):
        self.f, self.limit, self.hasher, self.copy_to = f, limit, hasher, copy_to
        self.torn = 0

    def blocks(self) -> Iterator[tuple[int, list[bytes]]]:
        """(offset of the block's first line, the block's complete lines without their newline), block by block."""
        offset, carry, remaining = 0, b"", self.limit
        while remaining is None or remaining > 0:
            data = self.f.read(LINE_BLOCK if remaining is None else min(LINE_BLOCK, remaining))
            if not data:
                break
            if remaining is not None:
                remaining -= len(data)
            if self.hasher is not None:
                self.hasher.update(data)
            cut = data.rfind(b"\n") + 1
            if not cut:  # no line ends in this block: a line longer than a block goes on
                carry += data
                continue
            lines = carry + data[:cut] if carry else data[:cut]
            carry = data[cut:]
            if self.copy_to is not None:
                self.copy_to.write(lines)
            yield offset, lines[:-1].split(b"\n")
            offset += len(lines)
        self.torn = len(carry)


def complete_lines(path: Path) -> Iterator[bytes]:
    """Yield the complete (newline-terminated) non-blank lines of a JSONL file; a torn last line is skipped."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    with f:
        for _offset, lines in CompleteLines(f).blocks():
            yield from (line + b"\n" for line in lines if line.strip())


def repair_torn_tail(path: Path) -> int:
    """Cut a file back to its last newline (a killed writer's half line). Returns the bytes removed."""
    try:
        open_regular(path).close()  # never a FIFO or a device
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        pos = size
        chunk = 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep == size:
            return 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


# ---------------------------------------------------------------- plan


def load_plan(run_dir: Path) -> Plan:
    """Read plan.json (the one reader; its shape is records.PlanRecord) and check it was not edited since it was
    written (and that no link at the top of the run directory or in merged/ leads out of it; a shard's own links are
    refused by seal.check)."""
    from shardrun.rundir import records  # records reads and writes through this module

    path = plan_path(run_dir)
    if not Path(run_dir).is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    if not os.path.lexists(path):
        raise RunDirError(f"{path}: no plan here; run `shardrun plan CONFIG --write` or `shardrun submit`")
    refuse_links(run_dir)
    try:
        data = orjson.loads(read_regular(path))
        wrong = records.plan_problem(data)
        if wrong:
            raise ValueError(wrong)
        plan = Plan.from_json(data)
    except FileNotFoundError:
        raise RunDirError(f"{path}: no plan here; run `shardrun plan CONFIG --write` or `shardrun submit`") from None
    except IsADirectoryError:
        raise RunDirError(f"{path}: a directory, not a plan; the run directory is damaged") from None
    except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as e:
        raise PlanMismatch(
            f"{path}: unreadable plan ({e}); it was edited or damaged. Re-plan into a new run directory"
        ) from None
    if planner.fingerprint(plan) != plan.fingerprint:
        raise PlanMismatch(
            f"{path}: content does not match its fingerprint {plan.fingerprint[:12]}…; plan.json "
            f"was edited by hand. Restore it or plan into a new run directory"
        )
    return plan


def check_run_dir(run_dir: Path) -> None:
    """BadInput unless run_dir is absent, empty or a run directory (never /, the home directory, a file)."""
    own = (SHARDS_DIR, MERGED_DIR, JOBS_DIR, LAUNCHES_FILE, LAUNCH_SETTINGS, LOCK_FILE, BLEND_INPUT)
    safepaths.check_run_root(run_dir, PLAN_FILE, own, TMP_PREFIX)


def refuse_links(run_dir: Path, shards: Iterable[int] = ()) -> None:
    """RunDirError naming a symlink at the top of the run directory, in merged/, or (for `shards`) in shards/, a
    shard directory or its logs/: shardrun never reads or writes through a link out of a run directory (submitit
    keeps its own links inside jobs/)."""
    for directory in (run_dir, merged_dir(run_dir)):
        safepaths.refuse_links_in(directory, run_dir)
    for i in shards:
        safepaths.refuse_links((shard_dir(run_dir, i),), run_dir)
        safepaths.refuse_links_in(shard_dir(run_dir, i), run_dir)
        safepaths.refuse_links_in(logs_dir(run_dir, i), run_dir)


def prepare_run_dir(run_dir: Path) -> None:
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX + "probe.", dir=run_dir)  # own name: two submits may probe
        os.close(fd)
        os.unlink(probe)
    except PermissionError:
        raise RunDirError(f"run_dir: {run_dir} is not writable (permission denied)") from None
    except OSError as e:
        if e.errno == errno.EROFS:
            raise RunDirError(f"run_dir: {run_dir} is on a read-only file system") from None
        if e.errno == errno.ENOSPC:
            raise RunDirError(f"run_dir: no space left on the device holding {run_dir}") from None
        raise RunDirError(f"run_dir: cannot use {run_dir}: {e}") from None


def blend_input_path(run_dir: Path) -> Path:
    """A blend's input: its entries' chosen rows as one JSONL file (rundir/blend_input.py), the plan's input."""
    return Path(run_dir) / BLEND_INPUT


def scan_input(cfg: RunConfig) -> Plan:
    """Validation pass over the input (streamed) -> the plan. Writes nothing. A blend's input is its entries'
    rows (rundir/blend_input.py); its plan names RUN_DIR/input.jsonl, which write_plan writes."""
    hasher = hashlib.sha256()
    version = gym_version.of_settings(cfg.gym.venv if cfg.gym else None, os.environ)
    try:
        overrides = gym_adapter.for_version(version).agent_name_overrides if version else False
    except BadInput as e:  # the venv the config names (or the environment's) holds a release shardrun cannot run
        raise BadInput(f"gym.venv: {e}") from None
    if cfg.entries is not None:
        from shardrun.rundir import blend_input  # it reads files through this module

        layout = blend_input.layout(cfg)
        summary = planner.scan(blend_input.lines(layout, hasher), cfg, blend_input.BLEND_SOURCE, overrides, layout)
        info = planner.InputInfo(
            path=str(blend_input_path(cfg.run_dir)), sha256=hasher.hexdigest(), num_lines=summary.num_lines
        )
        return planner.make_plan(cfg, info, summary, version, overrides, layout)
    assert cfg.input_jsonl is not None  # the config holds one of input_jsonl and entries
    src = cfg.input_jsonl
    summary = planner.scan(read_lines(src, hasher), cfg, str(src), overrides)
    info = planner.InputInfo(path=str(src), sha256=hasher.hexdigest(), num_lines=summary.num_lines)
    return planner.make_plan(cfg, info, summary, gym_version=version, agent_name_overrides=overrides)


def existing_plan_matches(run_dir: Path, plan: Plan) -> bool:
    """True if RUN_DIR already holds a plan of the same rollouts (planner.same_rollouts); PlanMismatch if it holds
    another; False if none."""
    if not plan_path(run_dir).exists():
        return False
    old = load_plan(run_dir)
    if planner.same_rollouts(old, plan):
        return True
    raise plan_mismatch(
        old,
        plan,
        f"{run_dir} holds a plan made with other settings",
        "Use a new run_dir, or restore the original input and settings.",
    )


def plan_mismatch(old: Plan, new: Plan, headline: str, advice: str) -> PlanMismatch:
    """The one plan-mismatch error: what differs between the run's plan and the one planned now, and what to do."""
    diffs = planner.plan_differences(old, new)
    return PlanMismatch(
        f"{headline} (fingerprint {old.fingerprint[:12]}…, now {new.fingerprint[:12]}…):\n"
        + "\n".join(f"  - {d}" for d in diffs)
        + f"\n{advice}"
    )


def write_plan(cfg: RunConfig, plan: Plan | None = None) -> tuple[Plan, bool]:
    """Materialize the run directory for `cfg`. Returns (plan, written); an identical plan is a no-op."""
    plan = plan or scan_input(cfg)
    run_dir = cfg.run_dir
    check_run_dir(run_dir)
    refuse_links(run_dir, (s.index for s in plan.shards))
    prepare_run_dir(run_dir)
    with run_lock(run_dir):
        if existing_plan_matches(run_dir, plan):
            return load_plan(run_dir), False  # the plan as recorded (its input path, Gym release, config)
        _refuse_orphan_outputs(run_dir)
        with os_errors_as_domain_errors(f"writing the plan into {run_dir}"):
            _write_shards(plan, cfg)
            atomic_write_json(plan_path(run_dir), plan.to_json())
    return plan, True


@contextlib.contextmanager
def os_errors_as_domain_errors(doing: str) -> Iterator[None]:
    """Turn disk-full / permission / missing-directory errors into RunDirError with what to do next."""
    try:
        yield
    except OSError as e:
        raise os_error(e, doing) from None


def os_error(e: OSError, doing: str = "") -> RunDirError:
    """The RunDirError for an OSError met while `doing` something in a run directory (what happened, what to do)."""
    at = f" {doing}" if doing else ""
    where = f": {e.filename}" if e.filename else ""
    if isinstance(e, PermissionError) or e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return RunDirError(
            f"permission denied{at}{where or f': {e}'}; fix the permissions and rerun (nothing already written is lost)"
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunDirError(
            f"no space left on the device{at}{f' ({e.filename})' if e.filename else ''}; free "
            f"space and rerun (nothing already sealed is lost)"
        )
    if e.errno == errno.ENOENT:
        return RunDirError(f"a path vanished{at}{where}; was the run directory moved or deleted?")
    return RunDirError(f"I/O error{at}: {e}")


def _refuse_orphan_outputs(run_dir: Path) -> None:
    shards = Path(run_dir) / SHARDS_DIR
    if not shards.is_dir():
        return
    for p in shards.glob(f"*/{ROLLOUTS}"):
        if p.stat().st_size > 0:
            raise RunDirError(
                f"{run_dir} has shard outputs ({p}) but no plan.json; refusing to overwrite them. "
                f"Restore plan.json or use a new run_dir"
            )


def _write_shards(plan: Plan, cfg: RunConfig) -> None:
    layout = _write_blend_input(plan, cfg) if cfg.entries is not None else None
    indices = [s.index for s in plan.shards]
    for i in indices:
        shard_dir(cfg.run_dir, i).mkdir(parents=True, exist_ok=True)
        remove_stale_temps(shard_dir(cfg.run_dir, i))
    for g in range(0, len(indices), MAX_OPEN_SHARD_FILES):
        group = indices[g : g + MAX_OPEN_SHARD_FILES]
        _write_shard_group(plan, cfg, group, layout)


def _write_blend_input(plan: Plan, cfg: RunConfig) -> planner.BlendLayout:
    """Write a blend's rows into RUN_DIR/input.jsonl (atomically), checked against the plan's input hash."""
    from shardrun.rundir import blend_input

    layout = blend_input.layout(cfg)
    hasher = hashlib.sha256()
    path = blend_input_path(cfg.run_dir)
    with atomic_writer(path) as out:
        for _, row in blend_input.lines(layout, hasher):
            out.write(row + b"\n")
        if hasher.hexdigest() != plan.input.sha256:
            raise BadInput("the blend's entries changed while they were being planned; plan again")
    return layout


def _write_shard_group(plan: Plan, cfg: RunConfig, group: list[int], layout: planner.BlendLayout | None) -> None:
    with contextlib.ExitStack() as stack:
        buffering = max(1 << 14, (64 << 20) // len(group))  # at most ~64 MiB buffered over all open shards
        writers = {i: stack.enter_context(atomic_writer(materialized_path(cfg.run_dir, i), buffering)) for i in group}
        hasher = hashlib.sha256()
        source = Path(plan.input.path) if layout is not None else cfg.input_jsonl
        assert source is not None
        lines = read_lines(source, hasher)
        only = set(group) if len(group) < len(plan.shards) else None
        for shard_index, chunk in planner.materialize(plan, cfg, lines, str(source), only, layout):
            writers[shard_index].write(chunk)
        if hasher.hexdigest() != plan.input.sha256:
            raise BadInput(f"{source}: the input changed while it was being planned; plan again")


def iter_jsonl_objects(path: Path) -> Iterable[dict]:
    for raw in complete_lines(path):
        yield orjson.loads(raw)


# ---------------------------------------------------------------- launch records and counting


def append_launch(run_dir: Path, record: Any) -> None:
    """Append one launch record (a records.LaunchRecord, or its JSON: checked against its model): records.append_launch
    (the one writer). Callers hold run_lock."""
    from shardrun.rundir import records

    records.append_launch(run_dir, record)


def read_launches(run_dir: Path) -> list:
    """Every launch record as a records.LaunchRecord, oldest first (records.read_launches, the one reader)."""
    from shardrun.rundir import records

    return records.read_launches(run_dir)


_BLANK_LINE = re.compile(rb"(?<=\n)\n")


def count_complete_lines(path: Path) -> int:
    """Complete (newline-terminated) non-empty lines (a torn last line is not counted), in 1 MiB blocks."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return 0
    n = 0
    prev = b"\n"  # a file that starts with a newline has a blank first line
    with f:
        while block := f.read(1 << 20):
            blank = len(_BLANK_LINE.findall(block)) if b"\n\n" in block else 0
            n += block.count(b"\n") - blank - (prev == b"\n" and block[:1] == b"\n")
            prev = block[-1:]
    return n


# ---------------------------------------------------------------- shard runtime (one shard on one node)

GYM_DIR = "gym"
ENV_YAML = "env.yaml"
SERVER_VENVS = "venvs"
ROLLOUT_ATTEMPTS = "rollout_attempts.jsonl"
SHARD_LOG = "shard.log"
GYM_LOG = "ng_run.log"
COLLECTOR_LOG = "collector.log"
SHARD_LOCK = ".shard.lock"
LAUNCH_SETTINGS = "launch.json"


def gym_dir(run_dir: Path, index: int) -> Path:
    """ng_run's working directory for the shard (env.yaml while the stack runs, Gym's own caches)."""
    return shard_dir(run_dir, index) / GYM_DIR


def collect_dir(run_dir: Path, index: int) -> Path:
    """The collector's view of a shard that skips decided tasks (adaptive sampling): its own materialized file
    (the planned rows less the skipped ones) beside links to the shard's rollouts.jsonl and failures sidecar, so
    Gym, which finds the materialized file beside its output, dispatches only the rows still to collect."""
    return shard_dir(run_dir, index) / COLLECT_DIR


COLLECT_DIR = "collect"
FILL_FILE = "fill.json"


def fill_path(run_dir: Path) -> Path:
    """The tasks `shardrun resume --fill` asked to collect in full (adaptive sampling): never skipped again."""
    return Path(run_dir) / FILL_FILE


def env_yaml_path(run_dir: Path, index: int) -> Path:
    """Gym's env.yaml (policy URL, key, model), 0600, present only while the shard's Gym stack runs."""
    return gym_dir(run_dir, index) / ENV_YAML


def server_venvs_dir(run_dir: Path, index: int) -> Path:
    """Gym's uv_venv_dir for the shared-venv route: <type>/<impl>/.venv symlinks to the Gym venv."""
    return gym_dir(run_dir, index) / SERVER_VENVS


def rollout_attempts_path(run_dir: Path, index: int) -> Path:
    """One line per failed attempt of one identity (identity, reason, time): shardrun's retry ledger."""
    return shard_dir(run_dir, index) / ROLLOUT_ATTEMPTS


def shard_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / SHARD_LOG


def gym_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / GYM_LOG


def collector_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / COLLECTOR_LOG


def shard_lock(run_dir: Path, index: int, timeout: float = 0) -> FileLock:
    """Held while a shard runs, so two attempts of one shard never run at once (flock: never stale)."""
    return FileLock(str(shard_dir(run_dir, index) / SHARD_LOCK), timeout=timeout)


# warm workers: claims on shards and each worker's own directory (docs/workers.md)

CLAIM = ".claim"
WORKERS_DIR = "workers"
WORKER_STATE = "worker.json"
WORKER_LOG = "worker.log"


def claim_path(run_dir: Path, index: int) -> Path:
    """The shard's claim (JSON: worker id, job id, host, pid, claimed at), held by the worker collecting it."""
    return shard_dir(run_dir, index) / CLAIM


def workers_dir(run_dir: Path) -> Path:
    return Path(run_dir) / WORKERS_DIR


def worker_dir(run_dir: Path, worker_id: str) -> Path:
    """One worker's home: its servers' working dirs and logs (gym/, logs/) and its state (worker.json)."""
    return workers_dir(run_dir) / worker_id


def worker_state_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / WORKER_STATE


def worker_log_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / LOGS / WORKER_LOG


def worker_gym_dir(run_dir: Path, worker_id: str) -> Path:
    """ng_run's working directory for a worker's Gym stack (env.yaml while it runs): WORKER/gym."""
    return worker_dir(run_dir, worker_id) / GYM_DIR


def worker_gym_log_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / LOGS / GYM_LOG


def launch_settings_path(run_dir: Path) -> Path:
    """The validated config of the latest launch (env-var names only, never secrets): resume needs no config."""
    return Path(run_dir) / LAUNCH_SETTINGS


def append_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """Append JSON lines durably (fsync) after cutting a torn tail; for files only this process appends to."""
    repair_torn_tail(path)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    if not data:
        return
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_launch_settings(run_dir: Path, cfg: RunConfig) -> None:
    """Save the validated config of a launch (config files name env vars only; no secret values exist in it)."""
    atomic_write_json(launch_settings_path(run_dir), {"config": planner.public_config(cfg)})


def read_launch_settings(run_dir: Path) -> RunConfig | None:
    """The config the latest launch saved, or None when nothing was launched yet."""
    try:
        data = orjson.loads(read_regular(launch_settings_path(run_dir)))
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as e:
        raise RunDirError(f"{launch_settings_path(run_dir)}: unreadable ({e}); submit again with the config") from None
    try:
        return RunConfig.model_validate(data["config"])
    except ValidationError as e:
        detail = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        raise RunDirError(
            f"{launch_settings_path(run_dir)}: invalid launch settings ({detail}); resume with --config CONFIG"
        ) from None
    except (KeyError, TypeError):
        raise RunDirError(
            f"{launch_settings_path(run_dir)}: no launch settings in it; resume with --config CONFIG"
        ) from None
