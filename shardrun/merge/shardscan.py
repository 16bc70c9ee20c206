"""Read one shard's files once, line by line, into compact arrays (identity, byte offset, length) and a RowTable.

Nothing here keeps row text: a row is found again later by its (offset, length) in the file it was read from.
A sealed shard is read only up to the size its marker names and hashed while read, so the caller can tell
that the bytes it parsed are the bytes that were sealed. An unsealed shard (merged with --allow-partial) may
still be written to, so its complete lines are copied to a private snapshot while they are read, and rows are
later copied from that snapshot. A last line without its newline (a killed writer) is never used.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

import numpy as np
import orjson

from shardrun.merge import linescan
from shardrun.core.errors import PlanMismatch
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.merge.rowtable import NO_ANSWER, RowTable, ScannedShapes, answer_code

INT64_MAX = 2**63 - 1
BLOCK = 8 << 20


@dataclass
class Planned:
    """One shard's materialized rows: identity, agent code, and where each line sits in `path`."""

    path: Path
    task: np.ndarray
    rollout: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    agent: np.ndarray  # code into `agents`
    agents: list[str]


@dataclass
class Rollouts:
    """One shard's rollout rows (file order) with an identity; `source` is the file their bytes are in."""

    source: Path
    task: np.ndarray
    rollout: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    table: RowTable
    lines: int = 0
    torn_bytes: int = 0
    unreadable: int = 0
    no_identity: int = 0
    sha256: str = ""


@dataclass
class FailureRow:
    task: int
    rollout: int
    line: bytes
    reason: str


@dataclass
class Failures:
    rows: list[FailureRow] = field(default_factory=list)
    rejected: int = 0
    torn_bytes: int = 0


def _is_index(v: object) -> bool:
    return type(v) is int and 0 <= v <= INT64_MAX


class CompleteLines:
    """The complete lines of an open file, read in large blocks: `blocks()` yields (offset of the first line,
    lines without their newline). Every byte read is hashed into `hasher`; complete lines are copied to
    `copy_to`; bytes past `limit` are not read. Afterwards `torn` is the length of an incomplete last line."""

    def __init__(
        self,
        f: IO[bytes],
        limit: int | None = None,
        hasher: "hashlib._Hash | None" = None,
        copy_to: IO[bytes] | None = None,
    ):
        self.f, self.limit, self.hasher, self.copy_to = f, limit, hasher, copy_to
        self.torn = 0

    def chunks(self) -> Iterator[tuple[int, bytearray, int]]:
        """(offset of the block, block, end of its last complete line): the lines are block[:end]. The block is
        one buffer, reused: use it before asking for the next (what follows the last newline moves to its front,
        so no block is copied whole)."""
        buf = bytearray(BLOCK)
        offset, carry, remaining = 0, 0, self.limit
        while remaining is None or remaining > 0:
            want = BLOCK if remaining is None else min(BLOCK, remaining)
            if carry + want > len(buf):  # a line longer than a block: a buffer twice as big
                buf = buf[:carry] + bytearray(max(want, carry))
            with memoryview(buf) as view:
                got = self.f.readinto(view[carry : carry + want])
                if not got:
                    break
                if remaining is not None:
                    remaining -= got
                if self.hasher is not None:
                    self.hasher.update(view[carry : carry + got])
            end = carry + got
            cut = buf.rfind(b"\n", 0, end) + 1
            if cut:
                if self.copy_to is not None:
                    with memoryview(buf) as view:
                        self.copy_to.write(view[:cut])
                yield offset, buf, cut
                offset += cut
            carry = end - cut  # the start of an incomplete line, moved to the front
            if cut:
                buf[:carry] = buf[cut:end]
        self.torn = carry

    def blocks(self) -> Iterator[tuple[int, list[bytes]]]:
        """(offset of the first line, lines without their newline), block by block."""
        for offset, data, cut in self.chunks():
            yield offset, bytes(data[: cut - 1]).split(b"\n")


def _open_planned(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise PlanMismatch(f"{path}: missing; the run directory is damaged (re-plan into a new run_dir)") from None


def scan_planned(path: Path) -> Planned:
    """Parse a shard's materialized inputs (written by the planner: every line must be a planned row)."""
    rows = _PlannedRows(path)
    with _open_planned(path) as f:
        reader = CompleteLines(f)
        if linescan.AVAILABLE:
            rows.read_scanned(reader)
        else:
            for off, lines in reader.blocks():
                for line in lines:
                    rows.add_line(line, off)
                    off += len(line) + 1
    return rows.planned()


class _PlannedRows:
    """A shard's planned rows as they are read: identity, where each line is, and its agent (coded)."""

    def __init__(self, path: Path):
        self.path = path
        self.task, self.rollout, self.offset, self.length = array("q"), array("q"), array("q"), array("q")
        self.agent = array("i")
        self.codes: dict[str, int] = {}
        self.n = 0  # lines read

    def add_line(self, line: bytes, off: int) -> None:
        """One line (without its newline) at byte `off`: a planned row, or blank; anything else is an error."""
        self.n += 1
        try:
            row = orjson.loads(line)
            t, r, name = row[TASK_KEY], row[ROLLOUT_KEY], row[AGENT_KEY]["name"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            if line.strip():
                raise PlanMismatch(
                    f"{self.path}:{self.n}: not a planned row (no identity or agent_ref); the run directory is damaged"
                ) from None
            return
        if type(t) is not int or type(r) is not int or t < 0 or r < 0 or t > INT64_MAX or r > INT64_MAX:
            raise PlanMismatch(f"{self.path}:{self.n}: identity ({t!r}, {r!r}) is not a pair of non-negative integers")
        self.task.append(t)
        self.rollout.append(r)
        self.offset.append(off)
        self.length.append(len(line) + 1)
        self.agent.append(self.code(name))

    def code(self, name: str) -> int:
        return self.codes.setdefault(name, len(self.codes))

    def read_scanned(self, reader: CompleteLines) -> None:
        """Every line through the C scanner; lines it leaves (or without an agent name) go through add_line."""
        identity: list[tuple[int, int]] = []
        scanner = linescan.Scanner(
            lambda row: _planned_shape(row, identity), AGENT_KEY.encode(), self._agent_code, missing=-1
        )
        for off, data, end in reader.chunks():
            block = scanner.scan(data, end)
            cols = np.array(identity, np.int64).reshape(-1, 2)
            known = block.shape != linescan.SLOW
            task = np.full(block.lines, -1.0)
            rollout = np.full(block.lines, -1.0)
            vstart, shape = block.vstart[known], block.shape[known]
            task[known] = block.values[vstart + cols[shape, 0]]
            rollout[known] = block.values[vstart + cols[shape, 1]]
            good = known & (block.key_code >= 0) & (task >= 0) & (rollout >= 0)
            for a, b in _runs_between(np.flatnonzero(~good), block.lines):
                mine = np.arange(a, b)
                self.task.frombytes(task[mine].astype(np.int64).tobytes())
                self.rollout.frombytes(rollout[mine].astype(np.int64).tobytes())
                self.offset.frombytes((off + block.starts[mine]).tobytes())
                self.length.frombytes(block.lengths[mine].tobytes())
                self.agent.frombytes(block.key_code[mine].astype(np.int32).tobytes())
                self.n += b - a
                if b < block.lines:  # the line after the run: parse it here
                    line, start = block.line(data, b)
                    self.add_line(line, off + start)

    def _agent_code(self, raw: bytes) -> int:
        """The code of the agent named in an agent_ref's raw JSON; -1 when it names none."""
        ref = orjson.loads(raw)
        name = ref.get("name") if type(ref) is dict else None
        return self.code(name) if isinstance(name, str) else -1

    def planned(self) -> Planned:
        return Planned(
            self.path,
            _np(self.task, np.int64),
            _np(self.rollout, np.int64),
            _np(self.offset, np.int64),
            _np(self.length, np.int64),
            _np(self.agent, np.int32),
            list(self.codes),
        )


def _planned_shape(row: dict, identity: list[tuple[int, int]]) -> int:
    """linescan's `learn` for planned rows: where the identity is among the scanner's numbers."""
    t, r = row.get(TASK_KEY), row.get(ROLLOUT_KEY)
    if type(t) is not int or type(r) is not int:
        return linescan.SLOW
    numbers = [k for k, v in row.items() if type(v) in (int, float, bool)]
    identity.append((numbers.index(TASK_KEY), numbers.index(ROLLOUT_KEY)))
    return len(identity) - 1


def _runs_between(breaks: np.ndarray, lines: int) -> list[tuple[int, int]]:
    """The runs of lines between the break lines: (start, stop) pairs; a run's stop is the next break (or
    `lines` for the last run), so every break line follows exactly one run (possibly empty)."""
    stops = [*breaks.tolist(), lines]
    starts = [0, *(b + 1 for b in breaks.tolist())]
    return list(zip(starts, stops))


def scan_rollouts(
    path: Path, *, limit: int | None, snapshot: Path | None, answer_key: str | None, exact_ints: bool = False
) -> Rollouts:
    """Parse a shard's rollouts.jsonl. With `snapshot`, complete lines are copied there (offsets stay equal)."""
    offset, length = array("q"), array("q")
    table = RowTable(answer_key=answer_key, exact_ints=exact_ints)
    stats = Rollouts(
        snapshot or path,
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
        np.zeros(0, np.int64),
        table,
    )
    hasher = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        copy_to = stack.enter_context(open(snapshot, "wb")) if snapshot is not None else None
        try:
            f = stack.enter_context(open(path, "rb"))
        except FileNotFoundError:
            f = None
        if f is not None:
            reader = CompleteLines(f, limit, hasher, copy_to)
            sink = _RolloutRows(table, offset, length)
            if linescan.AVAILABLE and (answer_key is None or linescan.plain_key(answer_key) is not None):
                sink.read_scanned(reader)
            else:
                sink.read(reader)
            stats.lines, stats.unreadable, stats.no_identity = sink.lines, sink.unreadable, sink.no_identity
            stats.torn_bytes = reader.torn
    if table.needs_exact_ints():  # rare: integers beyond 2**53; read again (from the snapshot if any)
        again = scan_rollouts(snapshot or path, limit=limit, snapshot=None, answer_key=answer_key, exact_ints=True)
        again.torn_bytes = stats.torn_bytes
        return again
    table.finish()
    stats.sha256 = hasher.hexdigest()
    stats.task, stats.rollout = table.task_array(), table.rollout_array()
    stats.offset, stats.length = _np(offset, np.int64), _np(length, np.int64)
    return stats


class _RolloutRows:
    """Rollout lines into the table (identity and numbers) and the offsets (where each line is), with counts."""

    def __init__(self, table: RowTable, offset: array, length: array):
        self.table, self.offset, self.length = table, offset, length
        self.add = table.adder()
        self.lines = self.unreadable = self.no_identity = 0

    def line(self, line: bytes, off: int) -> None:
        """One line without its newline, at byte `off` (lines are counted by the caller)."""
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            if line.strip():
                self.unreadable += 1
            return
        if type(row) is dict and self.add(row):
            self.offset.append(off)
            self.length.append(len(line) + 1)
        else:
            self.no_identity += 1

    def read(self, reader: CompleteLines) -> None:
        """The pure-Python path: every line parsed by orjson."""
        for off, block in reader.blocks():
            self.lines += len(block)
            for line in block:
                self.line(line, off)
                off += len(line) + 1

    def read_scanned(self, reader: CompleteLines) -> None:
        """The C scanner's path: runs of lines of learned shapes are added as arrays, other lines one by one
        (in file order, so the table is the same as `read` gives)."""
        table, key = self.table, self.table.answer_key
        shapes = ScannedShapes(table)
        scanner = linescan.Scanner(
            shapes.learn,
            linescan.plain_key(key) if key else None,
            lambda raw: answer_code(orjson.loads(raw)),
            NO_ANSWER,
        )
        for off, data, end in reader.chunks():
            block = scanner.scan(data, end)
            self.lines += block.lines
            slow = np.flatnonzero(block.shape == linescan.SLOW)
            if len(slow) * 8 > block.lines:  # mostly odd lines: not worth the arrays
                for i in range(block.lines):
                    line, start = block.line(data, i)
                    self.line(line, off + start)
                continue
            for a, b in _runs_between(slow, block.lines):
                if b > a:
                    added = table.add_scanned(shapes, block, np.arange(a, b))
                    self.no_identity += b - a - len(added)
                    self.offset.frombytes((off + block.starts[added]).tobytes())
                    self.length.frombytes(block.lengths[added].tobytes())
                if b < block.lines:
                    line, start = block.line(data, b)
                    self.line(line, off + start)


def scan_failures(path: Path) -> Failures:
    """The failure sidecar's complete rows with an identity (kept whole: sidecars are small)."""
    out = Failures()
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return out
    with f:
        reader = CompleteLines(f)
        for line in (x for _off, block in reader.blocks() for x in block):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                out.rejected += 1
                continue
            t = row.get(TASK_KEY) if type(row) is dict else None
            r = row.get(ROLLOUT_KEY) if t is not None else None
            if not (_is_index(t) and _is_index(r)):
                out.rejected += 1
                continue
            out.rows.append(FailureRow(t, r, line + b"\n", failure_reason(row)))
        out.torn_bytes = reader.torn
    return out


def failure_reason(row: dict) -> str:
    for key in ("_ng_failure_class", "reason", "error", "failure"):
        if row.get(key) not in (None, ""):
            value = row[key]
            return value if isinstance(value, str) else orjson.dumps(value).decode()
    return "unknown"


def _np(a: array, dtype: type) -> np.ndarray:
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)
