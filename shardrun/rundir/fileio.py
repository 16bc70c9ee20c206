"""Files read and written safely, wherever they lie: only regular files are opened for reading (a FIFO or a device
is refused at once), JSONL files another process may be appending to are read by complete lines, and files other
processes read are written atomically (a temp file, fsync, rename) or appended durably. Nothing here knows the run
directory's layout (rundir/paths.py) or its records (rundir/records.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

import orjson

from shardrun.core.errors import BadInput, NotRegularFile

TMP_PREFIX = ".tmp-"  # a file being written atomically; a killed writer's is removed by remove_stale_temps
MERGE_TMP_PREFIX = TMP_PREFIX + "merge-"  # the merge's own temp and scratch files: the only ones it removes

__all__ = [
    "TMP_PREFIX",
    "MERGE_TMP_PREFIX",
    "RenamesAtEnd",
    "renamed_at_end",
    "LINE_BLOCK",
    "fsync_dir",
    "atomic_writer",
    "atomic_write_bytes",
    "atomic_write_json",
    "remove_stale_temps",
    "file_kind",
    "open_regular",
    "open_regular_fd",
    "read_regular",
    "open_input",
    "read_lines",
    "sha256_file",
    "CompleteLines",
    "complete_lines",
    "repair_torn_tail",
    "cut_back",
    "iter_jsonl_objects",
    "count_complete_lines",
    "append_jsonl",
]


# ---------------------------------------------------------------- atomic files


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: Path, buffering: int = -1, prefix: str = TMP_PREFIX) -> Iterator[IO[bytes]]:
    """Write `path` atomically: temp file in the same directory, fsync, rename, fsync the directory. `prefix` names
    the temp file (MERGE_TMP_PREFIX: the merge's own, which only the merge removes as stale)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix + path.name + ".", dir=path.parent)
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


class RenamesAtEnd:
    """Files written now, each closed when written, and renamed into place together at the end (`renamed_at_end`):
    many outputs of one atomic step with only the one being written open. None is renamed if the step fails."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.pending: list[tuple[str, Path]] = []

    @contextlib.contextmanager
    def writer(self, path: Path) -> Iterator[IO[bytes]]:
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=self.prefix + path.name + ".", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.pending.append((tmp, path))

    def rename(self) -> None:
        for tmp, path in self.pending:
            os.replace(tmp, path)
        for parent in {path.parent for _, path in self.pending}:
            fsync_dir(parent)
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.pending = []


@contextlib.contextmanager
def renamed_at_end(prefix: str = TMP_PREFIX) -> Iterator[RenamesAtEnd]:
    """A RenamesAtEnd whose files are renamed into place when the block ends, or removed if it raises."""
    files = RenamesAtEnd(prefix)
    try:
        yield files
    except BaseException:
        files.discard()
        raise
    try:
        files.rename()
    finally:
        files.discard()


def remove_stale_temps(directory: Path, prefix: str = TMP_PREFIX) -> int:
    """Delete temp files a killed writer left behind (those of `prefix`: a writer removes only its own kind, never
    another command's temp file being written now); returns how many."""
    n = 0
    if directory.is_dir():
        for p in directory.glob(prefix + "*"):
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


def repair_torn_tail(path: Path, announce: Callable[[int], None] | None = None) -> int:
    """Cut a file back to its last newline (a killed writer's half line). Returns the bytes removed. `announce`
    is told the size before the cut, so a log says so even when this process is killed right after cutting."""
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
        if announce is not None:
            announce(size - keep)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


def cut_back(path: Path, size: int) -> int:
    """Cut an appended file back to `size` bytes (what it held before a writer that has exited added to it).
    Returns the bytes removed; nothing when it is not longer."""
    try:
        now = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    if now <= size:
        return 0
    open_regular(path).close()  # never a FIFO or a device
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
    return now - size


def iter_jsonl_objects(path: Path) -> Iterable[dict]:
    for raw in complete_lines(path):
        yield orjson.loads(raw)


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
