"""Append large outputs with O_DIRECT: the bytes go from an aligned buffer to the disk, not through the page cache.

The merge writes as many bytes as it reads (the merged rows, then the profile). Through the page cache every
byte is copied into freshly allocated cache pages, which on some machines (virtual ones especially) costs more
CPU than parsing it did; with O_DIRECT the kernel hands the aligned buffer to the disk and the CPU stays free.
Where the file system refuses O_DIRECT (tmpfs, some network file systems), the same writer writes normally.
The writer opens its own description of the file (via /proc/self/fd), so the caller's file object, offset and
flags are left as they were; fsync stays the caller's (it covers the file, whichever descriptor wrote it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os

ALIGN = 4096
BUFFER_BYTES = 8 << 20


class DirectWriter:
    """A write-only file object appending to the (empty) file open as `fd`, O_DIRECT where possible."""

    def __init__(self, fd: int, buffer_bytes: int = BUFFER_BYTES):
        self.fd, self.direct = _reopen(fd)
        self._buf = mmap.mmap(-1, buffer_bytes)  # page aligned, as O_DIRECT needs
        self._view = memoryview(self._buf)
        self._used = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        pos, n, cap = 0, len(view), len(self._buf)
        while pos < n:
            take = min(n - pos, cap - self._used)
            self._view[self._used : self._used + take] = view[pos : pos + take]
            self._used += take
            pos += take
            if self._used == cap:
                self._drain(cap)
        return n

    def flush(self) -> None:
        """Write what is buffered (all of it: the file is then written normally from here on)."""
        self._drain(self._used - self._used % ALIGN)
        if self._used:
            self._plain()
            self._drain(self._used)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            self._view.release()
            self._buf.close()
            os.close(self.fd)

    def __enter__(self) -> "DirectWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drain(self, size: int) -> None:
        """Write the first `size` buffered bytes (a multiple of ALIGN while direct) and keep the rest."""
        done = 0
        while done < size:
            try:
                wrote = os.write(self.fd, self._view[done:size])
            except OSError as e:  # O_DIRECT taken at open but not for this write (alignment): write normally
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._plain()
                continue
            done += wrote
            if self.direct and done % ALIGN:  # a short, unaligned write: go on without O_DIRECT
                self._plain()
        rest = self._used - size
        if rest:
            self._view[:rest] = self._view[size : self._used]
        self._used = rest

    def _plain(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False


def _reopen(fd: int) -> tuple[int, bool]:
    """A new description of the file open as fd, appending, with O_DIRECT if the file system takes it."""
    path = f"/proc/self/fd/{fd}"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
    with contextlib.suppress(OSError, AttributeError):
        return os.open(path, flags | os.O_DIRECT), True
    return os.open(path, flags), False
