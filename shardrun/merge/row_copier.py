"""Copy rows, given as (file, offset, length), into one output in a chosen order, as raw bytes.

Runs of rows that sit back to back in the same file, in both orders, are one unit. A unit of at least
RANGE_BYTES (a whole shard's planned rows, usually) is copied file to file by the kernel
(`os.copy_file_range`, or plain reads where the file systems refuse it). Shorter units (rollout rows, which
shards write in completion order) are gathered a window of about WINDOW_BYTES at a time: within a window they
are read in file order with one `os.pread` per span of nearby rows, and each is placed at its output position
in the window's buffer, which is then written in one go. So the files are read mostly sequentially, whatever
the output order, and memory is bounded by the window. Nothing is mapped: a file that shrank under us is an
error, not a crash.
"""

from __future__ import annotations

import errno
import io
import os
from collections import OrderedDict
from pathlib import Path
from typing import IO, Callable, Sequence

import numpy as np

from shardrun.core.errors import RunDirError
from shardrun.rundir import store

WINDOW_BYTES = 64 << 20
SPAN_BYTES = 16 << 20
GAP_BYTES = 64 << 10
RANGE_BYTES = 1 << 20
PIECE_BYTES = 8 << 20
MAX_OPEN = 256


class ByteSources:
    """The files rows come from, opened on first use (at most MAX_OPEN at a time)."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        self._fds: OrderedDict[int, int] = OrderedDict()

    def __enter__(self) -> "ByteSources":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            if len(self._fds) >= MAX_OPEN:
                os.close(self._fds.popitem(last=False)[1])
            fd = self._fds[i] = store.open_regular_fd(self.paths[i])
        else:
            self._fds.move_to_end(i)
        return fd

    def get(self, i: int, offset: int, length: int) -> bytes:
        data = os.pread(self.fd(i), length, offset)
        if len(data) != length:
            raise self._shrunk(i, offset + len(data), offset + length)
        return data

    def copy_range(self, out: IO[bytes], i: int, offset: int, length: int) -> None:
        """bytes offset..offset+length of file i appended to `out`, by the kernel where it can."""
        done = 0
        try:
            out.flush()
            fd_out = out.fileno()
        except (AttributeError, io.UnsupportedOperation):  # not a file (tests): plain reads
            fd_out = -1
        while fd_out >= 0 and done < length:
            try:
                n = os.copy_file_range(self.fd(i), fd_out, length - done, offset + done)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                break  # not between these file systems: plain reads
            if n == 0:
                raise self._shrunk(i, offset + done, offset + length)
            done += n
        for p in range(offset + done, offset + length, PIECE_BYTES):
            out.write(self.get(i, p, min(offset + length, p + PIECE_BYTES) - p))

    def _shrunk(self, i: int, size: int, needed: int) -> RunDirError:
        return RunDirError(
            f"{self.paths[i]}: shorter than when it was read ({size:,} bytes, needed {needed:,}); it changed "
            f"during the merge. Run the merge again"
        )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def runs(source: np.ndarray, offset: np.ndarray, length: np.ndarray, breaks: np.ndarray | None = None) -> np.ndarray:
    """Start positions of maximal runs of rows that follow each other in the same file (plus a final end)."""
    n = len(source)
    if n == 0:
        return np.zeros(1, np.int64)
    joined = (source[1:] == source[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    if breaks is not None:
        joined &= ~breaks[1:] & ~breaks[:-1]
    return np.r_[0, np.flatnonzero(~joined) + 1, n]


def copy_rows(
    out: IO[bytes],
    sources: ByteSources,
    source: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    rewrite: Callable[[int, bytes], bytes] | None = None,
    breaks: np.ndarray | None = None,
) -> int:
    """Write the rows in the given order; rows flagged in `breaks` pass through `rewrite(position, bytes)`.
    Returns the number of bytes written."""
    bounds = runs(source, offset, length, breaks)
    first, last = bounds[:-1], bounds[1:] - 1
    u_source, u_offset = source[first], offset[first]
    u_length = offset[last] + length[last] - u_offset
    replaced = _rewritten(sources, source, offset, length, first, rewrite, breaks)
    u_size = u_length.copy()
    for unit, data in replaced.items():
        u_size[unit] = len(data)
    u_end = np.cumsum(u_size)
    written = 0
    buf = bytearray()  # one window's buffer, reused
    for a, b in _windows(u_end, u_size, WINDOW_BYTES, RANGE_BYTES):
        base = int(u_end[a - 1]) if a else 0
        size = int(u_end[b - 1]) - base
        if b - a == 1 and a not in replaced and size >= RANGE_BYTES:
            sources.copy_range(out, int(u_source[a]), int(u_offset[a]), size)
        else:
            if size > len(buf):
                buf = bytearray(size)
            with memoryview(buf) as view:
                _window(
                    view[:size],
                    sources,
                    u_source[a:b],
                    u_offset[a:b],
                    u_length[a:b],
                    u_end[a:b] - u_size[a:b] - base,
                    {u - a: d for u, d in replaced.items() if a <= u < b},
                )
                out.write(view[:size])
        written += size
    return written


def _rewritten(
    sources: ByteSources,
    source: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    first: np.ndarray,
    rewrite: Callable[[int, bytes], bytes] | None,
    breaks: np.ndarray | None,
) -> dict[int, bytes]:
    """unit number -> new bytes, for the flagged rows (each its own unit; rare)."""
    if rewrite is None or breaks is None:
        return {}
    units = np.flatnonzero(breaks[first])
    return {
        int(u): rewrite(int(first[u]), sources.get(int(source[first[u]]), int(offset[first[u]]), int(length[first[u]])))
        for u in units
    }


def _windows(end: np.ndarray, size: np.ndarray, limit: int, alone: int) -> list[tuple[int, int]]:
    """Consecutive unit ranges whose bytes add up to about `limit` (at least one unit each); a unit of at least
    `alone` bytes is a range of its own (copied file to file)."""
    bounds = [0]
    big = np.flatnonzero(size >= alone)
    while bounds[-1] < len(end):
        a = bounds[-1]
        done = int(end[a - 1]) if a else 0
        stop = max(a + 1, int(np.searchsorted(end, done + limit, side="right")))
        nxt = int(big[np.searchsorted(big, a)]) if np.searchsorted(big, a) < len(big) else len(end)
        bounds.append(a + 1 if nxt == a else min(stop, nxt))
    return list(zip(bounds[:-1], bounds[1:]))


def _window(
    view: memoryview,
    sources: ByteSources,
    source: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    dest: np.ndarray,
    replaced: dict[int, bytes],
) -> None:
    """Fill one window: units read in file order, in spans, and placed at their `dest` in `view`."""
    order = np.lexsort((offset, source))
    src, off, end = source[order], offset[order], offset[order] + length[order]
    new_span = np.r_[True, (src[1:] != src[:-1]) | (off[1:] > end[:-1] + GAP_BYTES)]
    new_span |= _span_too_long(off, new_span)
    starts = np.flatnonzero(new_span)
    stops = np.r_[starts[1:], len(order)]
    highs = np.maximum.reduceat(end, starts) if len(starts) else end
    skip = np.zeros(len(source), bool)
    skip[list(replaced)] = True
    for s0, s1, hi in zip(starts.tolist(), stops.tolist(), highs.tolist()):
        lo = int(off[s0])
        with memoryview(sources.get(int(src[s0]), lo, hi - lo)) as data:
            units = order[s0:s1]
            units = units[~skip[units]]
            for o, n, d in zip((offset[units] - lo).tolist(), length[units].tolist(), dest[units].tolist()):
                view[d : d + n] = data[o : o + n]
    for u, new in replaced.items():
        view[int(dest[u]) : int(dest[u]) + len(new)] = new


def _span_too_long(off: np.ndarray, new_span: np.ndarray) -> np.ndarray:
    """Also start a span where the current one would exceed SPAN_BYTES (one pass, vectorised by span)."""
    out = np.zeros(len(off), bool)
    starts = np.flatnonzero(new_span)
    span_of = np.cumsum(new_span) - 1
    since = off - off[starts][span_of]
    out[1:] = (since[1:] // SPAN_BYTES) != (since[:-1] // SPAN_BYTES)
    return out & ~new_span
