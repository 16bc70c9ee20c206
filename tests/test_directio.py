"""DirectWriter: what it appends is exactly what was written, whether the file system takes O_DIRECT or not."""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path

import pytest

from shardrun.merge import directio
from shardrun.merge.directio import ALIGN, DirectWriter


def write_pieces(path: Path, pieces: list[bytes], buffer_bytes: int) -> bool:
    with open(path, "wb") as f:
        with DirectWriter(f.fileno(), buffer_bytes=buffer_bytes) as w:
            direct = w.direct
            for p in pieces:
                assert w.write(p) == len(p)
        f.flush()
        os.fsync(f.fileno())
    return direct


def takes_direct(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("refused", [False, True])
def test_bytes_written_in_any_pieces_land_whole_and_in_order(tmp_path: Path, monkeypatch, refused: bool) -> None:
    if refused:  # a file system that refuses O_DIRECT (EINVAL), as some network file systems do
        real_open = os.open

        def no_direct(path: str, flags: int, *a: int) -> int:
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real_open(path, flags, *a)

        monkeypatch.setattr(directio.os, "open", no_direct)
    path = tmp_path / "direct.bin"
    rng = random.Random(7)
    pieces = [rng.randbytes(rng.choice([0, 1, 17, ALIGN - 1, ALIGN, 3 * ALIGN + 5, 70_000])) for _ in range(200)]
    direct = write_pieces(path, pieces, buffer_bytes=4 * ALIGN)
    assert path.read_bytes() == b"".join(pieces)
    if refused:
        assert not direct  # the same writer, through the page cache
    else:
        assert direct == takes_direct(tmp_path)  # it did bypass the page cache where the file system allows


def test_the_callers_file_object_keeps_its_own_offset_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    with open(path, "wb") as f:
        flags = fcntl.fcntl(f.fileno(), fcntl.F_GETFL)
        with DirectWriter(f.fileno()) as w:
            w.write(b"x" * (ALIGN + 3))
        assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) == flags
        f.write(b"tail")  # appended after: the file object's own offset is still 0, so it overwrites the start
    assert path.read_bytes() == b"tail" + b"x" * (ALIGN - 1)


def test_a_direct_write_refused_after_the_open_goes_on_through_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    """Some file systems take O_DIRECT at open and refuse the writes (other alignment): nothing is lost."""
    real_write = os.write

    def picky(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(directio.os, "write", picky)
    pieces = [bytes([i]) * (ALIGN + i) for i in range(20)]
    path = tmp_path / "out.bin"
    write_pieces(path, pieces, buffer_bytes=2 * ALIGN)
    assert path.read_bytes() == b"".join(pieces)
