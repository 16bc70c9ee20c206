"""Read one shard's files once, line by line, into compact arrays (identity, byte offset, length) and a RowTable.

Nothing here keeps row text: a row is found again later by its (offset, length) in the file it was read from.
A sealed shard is read only up to the size its marker names and hashed while read, so the caller can tell
that the bytes it parsed are the bytes that were sealed. An unsealed shard (merged with --allow-partial) may
still be written to, so its complete lines are copied to a private snapshot while they are read, and rows are
later copied from that snapshot. A last line without its newline (a killed writer) is never used.
"""

from __future__ import annotations

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


@dataclass
class Planned:
    """One shard's materialized rows: identity, agent code, and where each line sits in `path`."""

    path: Path
    task: np.ndarray
    rollout: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    agent: np.ndarray


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
    bytes_read: int = 0


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
    """(offset, line with its newline) for every complete line of an open file, in order.

    Each complete line is hashed into `hasher` and copied to `copy_to` as it is read; bytes past `limit` are not
    read. After iteration `torn` holds the length of the incomplete last line (0 if none).
    """

    def __init__(self, f: IO[bytes], limit: int | None = None, hasher: "hashlib._Hash | None" = None,
                 copy_to: IO[bytes] | None = None):
        self.f, self.limit, self.hasher, self.copy_to = f, limit, hasher, copy_to
        self.torn = 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        offset, limit = 0, self.limit
        for line in self.f:
            if limit is not None and offset + len(line) > limit:
                line = line[:limit - offset]
            if self.hasher is not None:
                self.hasher.update(line)
            if not line.endswith(b"\n"):
                self.torn = len(line)
                return
            if self.copy_to is not None:
                self.copy_to.write(line)
            yield offset, line
            offset += len(line)
            if limit is not None and offset >= limit:
                return


def scan_planned(path: Path, agent_codes: dict[str, int]) -> Planned:
    """Parse a shard's materialized inputs (written by the planner: every line must be a planned row)."""
    task, rollout, offset, length, agent = array("q"), array("q"), array("q"), array("q"), array("i")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise PlanMismatch(f"{path}: missing; the run directory is damaged (re-plan into a new run_dir)") from None
    with f:
        for n, (off, line) in enumerate(CompleteLines(f), 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                t, r, name = row[TASK_KEY], row[ROLLOUT_KEY], row[AGENT_KEY]["name"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise PlanMismatch(f"{path}:{n}: not a planned row (no identity or agent_ref); the run directory "
                                   f"is damaged") from None
            if not (_is_index(t) and _is_index(r)):
                raise PlanMismatch(f"{path}:{n}: identity ({t!r}, {r!r}) is not a pair of non-negative integers")
            task.append(t)
            rollout.append(r)
            offset.append(off)
            length.append(len(line))
            agent.append(agent_codes.setdefault(name, len(agent_codes)))
    return Planned(path, _np(task, np.int64), _np(rollout, np.int64), _np(offset, np.int64),
                   _np(length, np.int64), _np(agent, np.int32))


def scan_rollouts(path: Path, *, limit: int | None, snapshot: Path | None,
                  answer_key: str | None) -> Rollouts:
    """Parse a shard's rollouts.jsonl. With `snapshot`, complete lines are copied there (offsets stay equal)."""
    task, rollout, offset, length = array("q"), array("q"), array("q"), array("q")
    table = RowTable(answer_key=answer_key)
    stats = Rollouts(snapshot or path, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                     np.zeros(0, np.int64), table)
    hasher = hashlib.sha256()
    copy_to = open(snapshot, "wb") if snapshot is not None else None
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        f = None
    try:
        if f is not None:
            with f:
                lines = CompleteLines(f, limit, hasher, copy_to)
                for off, line in lines:
                    stats.lines += 1
                    stats.bytes_read = off + len(line)
                    try:
                        row = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        if line.strip():
                            stats.unreadable += 1
                        continue
                    t = row.get(TASK_KEY) if type(row) is dict else None
                    r = row.get(ROLLOUT_KEY) if t is not None else None
                    if not (_is_index(t) and _is_index(r)):
                        stats.no_identity += 1
                        continue
                    task.append(t)
                    rollout.append(r)
                    offset.append(off)
                    length.append(len(line))
                    table.add(row)
                stats.torn_bytes = lines.torn
    finally:
        if copy_to is not None:
            copy_to.close()
    table.finish()
    stats.sha256 = hasher.hexdigest()
    stats.task, stats.rollout = _np(task, np.int64), _np(rollout, np.int64)
    stats.offset, stats.length = _np(offset, np.int64), _np(length, np.int64)
    return stats


def scan_failures(path: Path) -> Failures:
    """The failure sidecar's complete rows with an identity (kept whole: sidecars are small)."""
    out = Failures()
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return out
    with f:
        lines = CompleteLines(f)
        for _off, line in lines:
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
            out.rows.append(FailureRow(t, r, line, failure_reason(row)))
        out.torn_bytes = lines.torn
    return out


def failure_reason(row: dict) -> str:
    for key in ("_ng_failure_class", "reason", "error", "failure"):
        if row.get(key) not in (None, ""):
            value = row[key]
            return value if isinstance(value, str) else orjson.dumps(value).decode()
    return "unknown"


def _np(a: array, dtype: type) -> np.ndarray:
    return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)
