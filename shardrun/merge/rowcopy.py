"""Copy rows, given as (file, offset, length), into one output in a chosen order, as raw bytes.

Rows are read with pread: nothing is mapped, so the process's resident size does not grow with the bytes
copied (the page cache keeps them), and a file that shrank under us is an error, not a crash. Runs of rows that
sit back to back in the same file are read with one call, in pieces of at most PIECE_BYTES.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import IO, Callable, Sequence

import numpy as np

from shardrun.merge import linescan
from shardrun.core.errors import RunDirError

WINDOW_BYTES = 64 << 20
SPAN_BYTES = 16 << 20
GAP_BYTES = 64 << 10
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
            fd = self._fds[i] = os.open(self.paths[i], os.O_RDONLY)
        else:
            self._fds.move_to_end(i)
        return fd

    def get(self, i: int, offset: int, length: int) -> bytes:
        data = os.pread(self.fd(i), length, offset)
        if len(data) != length:
            raise RunDirError(
                f"{self.paths[i]}: shorter than when it was read ({offset + len(data):,} bytes, "
                f"needed {offset + length:,}); it changed during the merge. Run the merge again"
            )
        return data

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

    The output is assembled a window (about WINDOW_BYTES) at a time. Within a window, rows are read in file
    order: runs of rows that are back to back in both orders are one unit, units close together in the same
    file are read with one pread (a span), and each unit is placed at its output position in the window's
    buffer, which is then written in one go. So the files are read mostly sequentially, whatever the output
    order, and memory is bounded by the window. Returns the number of bytes written.
    """
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
    buf = bytearray(min(WINDOW_BYTES, int(u_end[-1]) if len(u_end) else 0))  # reused: fresh pages cost faults
    for a, b in _windows(u_end, WINDOW_BYTES):
        base = int(u_end[a - 1]) if a else 0
        size = int(u_end[b - 1]) - base
        if b - a == 1 and a not in replaced and size > WINDOW_BYTES:  # one long run: stream it in pieces
            i, lo = int(u_source[a]), int(u_offset[a])
            for p in range(lo, lo + size, PIECE_BYTES):
                out.write(sources.get(i, p, min(lo + size, p + PIECE_BYTES) - p))
        else:
            if size > len(buf):
                buf = bytearray(size)
            _window(
                memoryview(buf)[:size],
                sources,
                u_source[a:b],
                u_offset[a:b],
                u_length[a:b],
                u_end[a:b] - u_size[a:b] - base,
                {u - a: d for u, d in replaced.items() if a <= u < b},
            )
            out.write(memoryview(buf)[:size])
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


def _windows(end: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive unit ranges whose bytes add up to about `limit` (at least one unit each)."""
    bounds = [0]
    while bounds[-1] < len(end):
        done = int(end[bounds[-1] - 1]) if bounds[-1] else 0
        bounds.append(max(bounds[-1] + 1, int(np.searchsorted(end, done + limit, side="right"))))
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
        data = sources.get(int(src[s0]), lo, hi - lo)
        units = order[s0:s1]
        units = units[~skip[units]]
        _place(view, data, off[s0:s1][~skip[order[s0:s1]]] - lo, length[units], dest[units])
    for u, data in replaced.items():
        view[int(dest[u]) : int(dest[u]) + len(data)] = data


def _place(view: memoryview, data: bytes, at: np.ndarray, length: np.ndarray, dest: np.ndarray) -> None:
    """view[dest[i]:dest[i] + length[i]] = data[at[i]:at[i] + length[i]] for every i (in C when built)."""
    if linescan.AVAILABLE:
        linescan.scatter(view, data, at, length, dest)
        return
    data = memoryview(data)
    for o, n, d in zip(at.tolist(), length.tolist(), dest.tolist()):
        view[d : d + n] = data[o : o + n]


def _span_too_long(off: np.ndarray, new_span: np.ndarray) -> np.ndarray:
    """Also start a span where the current one would exceed SPAN_BYTES (one pass, vectorised by span)."""
    out = np.zeros(len(off), bool)
    starts = np.flatnonzero(new_span)
    span_of = np.cumsum(new_span) - 1
    since = off - off[starts][span_of]
    out[1:] = (since[1:] // SPAN_BYTES) != (since[:-1] // SPAN_BYTES)
    return out & ~new_span
