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

TRIM_BYTES = 256 << 20
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

    def _map(self, i: int) -> mmap.mmap:
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
        return self._map(i)[offset:offset + length]

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
    bounds = runs(source, offset, length, breaks).tolist()
    src, off, ln = source.tolist(), offset.tolist(), length.tolist()
    parts: list[bytes] = []
    pending = written = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        start, end = off[a], off[b - 1] + ln[b - 1]
        if end - start <= PIECE_BYTES or (breaks is not None and breaks[a]):
            piece = sources.get(src[a], start, end - start)
            if rewrite is not None and breaks is not None and breaks[a]:
                piece = rewrite(a, piece)
            parts.append(piece)
            pending += len(piece)
        else:  # a long run of back-to-back rows: copy it in pieces (bounded memory)
            for p in range(start, end, PIECE_BYTES):
                parts.append(sources.get(src[a], p, min(end, p + PIECE_BYTES) - p))
                pending += len(parts[-1])
        if pending >= FLUSH_BYTES:
            out.write(b"".join(parts))
            written += pending
            parts.clear()
            pending = 0
    out.write(b"".join(parts))
    return written + pending
