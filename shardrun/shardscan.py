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

from shardrun.errors import PlanMismatch
from shardrun.planner import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.rowtable import RowTable

INT64_MAX = 2 ** 63 - 1
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

    def __init__(self, f: IO[bytes], limit: int | None = None, hasher: "hashlib._Hash | None" = None,
                 copy_to: IO[bytes] | None = None):
        self.f, self.limit, self.hasher, self.copy_to = f, limit, hasher, copy_to
        self.torn = 0

    def blocks(self) -> Iterator[tuple[int, list[bytes]]]:
        offset, carry, remaining = 0, b"", self.limit
        while remaining is None or remaining > 0:
            data = self.f.read(BLOCK if remaining is None else min(BLOCK, remaining))
            if not data:
                break
            if remaining is not None:
                remaining -= len(data)
            if self.hasher is not None:
                self.hasher.update(data)
            data = carry + data if carry else data
            lines = data.split(b"\n")
            carry = lines.pop()  # what follows the last newline (b"" when the block ends with one)
            if lines:
                cut = len(data) - len(carry)
                if self.copy_to is not None:
                    self.copy_to.write(memoryview(data)[:cut])
                yield offset, lines
                offset += cut
        self.torn = len(carry)


def _open_planned(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise PlanMismatch(f"{path}: missing; the run directory is damaged (re-plan into a new run_dir)") from None


def scan_planned(path: Path) -> Planned:
    """Parse a shard's materialized inputs (written by the planner: every line must be a planned row)."""
    task, rollout, offset, length, agent = array("q"), array("q"), array("q"), array("q"), array("i")
    codes: dict[str, int] = {}
    loads, n = orjson.loads, 0
    with _open_planned(path) as f:
        for off, lines in CompleteLines(f).blocks():
            for line in lines:
                n += 1
                size = len(line) + 1
                try:
                    row = loads(line)
                    t, r, name = row[TASK_KEY], row[ROLLOUT_KEY], row[AGENT_KEY]["name"]
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    if line.strip():
                        raise PlanMismatch(f"{path}:{n}: not a planned row (no identity or agent_ref); the run "
                                           f"directory is damaged") from None
                    off += size
                    continue
                if type(t) is not int or type(r) is not int or t < 0 or r < 0 or t > INT64_MAX or r > INT64_MAX:
                    raise PlanMismatch(f"{path}:{n}: identity ({t!r}, {r!r}) is not a pair of non-negative integers")
                task.append(t)
                rollout.append(r)
                offset.append(off)
                length.append(size)
                code = codes.get(name)
                agent.append(code if code is not None else codes.setdefault(name, len(codes)))
                off += size
    return Planned(path, _np(task, np.int64), _np(rollout, np.int64), _np(offset, np.int64),
                   _np(length, np.int64), _np(agent, np.int32), list(codes))


def scan_rollouts(path: Path, *, limit: int | None, snapshot: Path | None, answer_key: str | None,
                  exact_ints: bool = False) -> Rollouts:
    """Parse a shard's rollouts.jsonl. With `snapshot`, complete lines are copied there (offsets stay equal)."""
    offset, length = array("q"), array("q")
    table = RowTable(answer_key=answer_key, exact_ints=exact_ints)
    stats = Rollouts(snapshot or path, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                     np.zeros(0, np.int64), table)
    hasher = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        copy_to = stack.enter_context(open(snapshot, "wb")) if snapshot is not None else None
        try:
            f = stack.enter_context(open(path, "rb"))
        except FileNotFoundError:
            f = None
        if f is not None:
            reader = CompleteLines(f, limit, hasher, copy_to)
            _parse_rollouts(reader, table, offset, length, stats)
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


def _parse_rollouts(reader: CompleteLines, table: RowTable, offset: array, length: array, stats: Rollouts) -> None:
    """The hot loop: parse each line once; the table keeps identity and numbers, we keep where the line is."""
    add, loads, at, size_of = table.adder(), orjson.loads, offset.append, length.append
    lines = unreadable = no_identity = 0
    for off, block in reader.blocks():
        lines += len(block)
        for line in block:
            size = len(line) + 1
            try:
                row = loads(line)
            except orjson.JSONDecodeError:
                if line.strip():
                    unreadable += 1
                off += size
                continue
            if type(row) is dict and add(row):
                at(off)
                size_of(size)
            else:
                no_identity += 1
            off += size
    stats.lines, stats.unreadable, stats.no_identity = lines, unreadable, no_identity


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
