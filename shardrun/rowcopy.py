"""Copy rows, given as (file, offset, length), into one output in a chosen order, as raw bytes.

Files are memory-mapped read-only; pages the copy has touched are dropped from this process every
`TRIM_BYTES` (they stay in the page cache), so the resident size stays bounded however much is copied.
Runs of rows that sit back to back in the same file are copied with one slice.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import IO, Callable, Sequence

import numpy as np

TRIM_BYTES = 32 << 20
FLUSH_BYTES = 4 << 20
PIECE_BYTES = 8 << 20


class ByteSources:
    """Read-only maps of the files rows come from, opened on first use."""

    def __init__(self, paths: Sequence[Path]):
        self.paths = list(paths)
        self._maps: dict[int, mmap.mmap] = {}
        self._since_trim = 0

    def __enter__(self) -> "ByteSources":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def map(self, i: int) -> mmap.mmap:
        """The map of file i (callers that slice it themselves call trim() now and then)."""
        m = self._maps.get(i)
        if m is None:
            fd = os.open(self.paths[i], os.O_RDONLY)
            try:
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._maps[i] = m
        return m

    def get(self, i: int, offset: int, length: int) -> bytes:
        self._since_trim += length
        if self._since_trim >= TRIM_BYTES:
            self.trim()
        return self.map(i)[offset:offset + length]

    def trim(self) -> None:
        """Drop the mapped pages touched so far from this process's resident set."""
        for m in self._maps.values():
            m.madvise(mmap.MADV_DONTNEED)
        self._since_trim = 0

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def runs(source: np.ndarray, offset: np.ndarray, length: np.ndarray, breaks: np.ndarray | None = None) -> np.ndarray:
    """Start positions of maximal runs of rows that follow each other in the same file (plus a final end)."""
    n = len(source)
    if n == 0:
        return np.zeros(1, np.int64)
    joined = (source[1:] == source[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    if breaks is not None:
        joined &= ~breaks[1:] & ~breaks[:-1]
    return np.r_[0, np.flatnonzero(~joined) + 1, n]


def copy_rows(out: IO[bytes], sources: ByteSources, source: np.ndarray, offset: np.ndarray, length: np.ndarray,
              rewrite: Callable[[int, bytes], bytes] | None = None, breaks: np.ndarray | None = None) -> int:
    """Write the rows in the given order; rows flagged in `breaks` pass through `rewrite(position, bytes)`.

    Returns the number of bytes written.
    """
    bounds = runs(source, offset, length, breaks)
    first, last = bounds[:-1], bounds[1:] - 1
    if not len(first):
        return 0
    run_source = source[first].tolist()
    run_start = offset[first].tolist()
    run_end = (offset[last] + length[last]).tolist()
    flagged = set(np.flatnonzero(breaks[first]).tolist()) if breaks is not None and rewrite is not None else set()
    maps = {i: sources.map(i) for i in set(run_source)}
    parts: list[bytes] = []
    pending = written = since_trim = 0
    for n, (i, a, b) in enumerate(zip(run_source, run_start, run_end)):
        if b - a > PIECE_BYTES and n not in flagged:  # a long run of back-to-back rows: copy it in pieces
            for p in range(a, b, PIECE_BYTES):
                out.write(b"".join(parts) + maps[i][p:min(b, p + PIECE_BYTES)])
                parts.clear()
            written, since_trim, pending = written + pending + b - a, since_trim + b - a, 0
        else:
            piece = maps[i][a:b]
            parts.append(rewrite(int(first[n]), piece) if n in flagged else piece)  # type: ignore[misc]
            pending += b - a
            if pending >= FLUSH_BYTES:
                out.write(b"".join(parts))
                parts.clear()
                written, since_trim, pending = written + pending, since_trim + pending, 0
        if since_trim >= TRIM_BYTES:
            sources.trim()
            since_trim = 0
    out.write(b"".join(parts))
    return written + pending
