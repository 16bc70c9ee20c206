"""Where shardrun may write and what it may follow: user-named outputs, the run directory's root, and links.

- `output_target`: the one check every user-named output passes before it is written (today `select -o`): never a
  path inside the run directory, never an input, never a device, FIFO, socket or directory, never a path under the
  kernel's file systems (/dev, /proc, /sys), and never a symlink to any of these. A symlink to a regular file
  elsewhere is followed: the link stays and its target is replaced atomically.
- `output_folder`: the same for an output that is a folder (`export --to hf DIR`): never the run directory, inside
  it or holding it, never a path under the kernel's file systems, and an existing folder only when it is empty or
  the command's own earlier output (which is then replaced whole).
- `check_run_root`: `run_dir` is absent, empty or a shardrun run directory; never `/`, the home directory or a
  folder that holds other files.
- `refuse_links`: nothing inside a run directory is a symlink shardrun would follow out of it (`merged/`,
  `shards/`, a shard directory, a run file); the run directory itself may be a link.

Pure checks over the file system: they read (lstat, listdir) and never write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Iterable, Sequence

from shardrun.core.errors import BadInput, RunDirError

KERNEL_FILE_SYSTEMS = (Path("/dev"), Path("/proc"), Path("/sys"))
"""Where device nodes and kernel files live. Whatever a path there is on this machine (a sandbox may give a regular
file for /dev/null), it is never the place for a data file, and a root user could replace a device node there."""

_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def kind_of(mode: int) -> str:
    """What a file of this mode is, in words ('a regular file' for a regular file)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a regular file")


def _real(path: Path | str) -> Path:
    return Path(os.path.realpath(path))


def output_target(output: Path, option: str, run_dir: Path | None = None, inputs: Sequence[Path] = ()) -> Path:
    """The regular file a user-named output (`option`, e.g. '--output') may (re)place: the real path behind
    `output`. BadInput, naming the option and the path, for a path inside `run_dir`, one of `inputs`, anything
    but a regular file (or nothing yet), a path under /dev, /proc or /sys, or a symlink to any of these."""
    target, said, mode = _resolved(Path(output), option, "a regular file")
    if mode is not None and not stat.S_ISREG(mode):
        raise BadInput(f"{said} is {kind_of(mode)}, not a regular file; name a regular file. Nothing was written")
    if run_dir is not None and target.is_relative_to(_real(run_dir)):
        raise BadInput(
            f"{said} is inside the run directory {run_dir}, whose files shardrun owns; write it somewhere else. "
            f"Nothing was written"
        )
    for source in inputs:
        if target == _real(source) or (mode is not None and _same_file(target, source)):
            raise BadInput(f"{said} is the input file itself ({source}); write it somewhere else. Nothing was written")
    return target


def output_folder(output: Path, option: str, run_dir: Path, ours: Callable[[Path], bool]) -> Path:
    """The real path of the folder a user-named folder output (`option`) is written to. BadInput, naming the option
    and the path, for an empty path, a path under the kernel's file systems, something there that is not a
    folder, the run directory itself, a folder inside it or one that holds it, and a folder that is neither empty
    nor `ours` (the command's own earlier output, which the caller replaces whole)."""
    target, said, mode = _resolved(Path(output), option, "a folder")
    run = _real(run_dir)
    if target.is_relative_to(run) or run.is_relative_to(target):
        where = "is the run directory" if target == run else "is inside" if target.is_relative_to(run) else "holds"
        raise BadInput(
            f"{said} {where}{'' if target == run else ' the run directory'} {run_dir}, whose files shardrun owns; "
            f"write it somewhere else. Nothing was written"
        )
    if mode is not None and not stat.S_ISDIR(mode):
        raise BadInput(f"{said} is {kind_of(mode)}, not a folder; name a folder. Nothing was written")
    if mode is not None and os.listdir(target) and not ours(target):
        raise BadInput(
            f"{said} holds other files and is no earlier output of this command; name a new or empty folder. "
            f"Nothing was written"
        )
    return target


def _resolved(output: Path, option: str, kind: str) -> tuple[Path, str, int | None]:
    """(the real path behind a user-named output, how messages name it, its mode or None when nothing is there);
    BadInput for an empty path or one under the kernel's file systems, where `kind` (a data file) never belongs."""
    if not str(output).strip():
        raise BadInput(f"{option}: an empty path; name {kind}. Nothing was written")
    target = _real(output)
    via = f" (a symlink to {target})" if target != Path(os.path.abspath(output)) else ""
    said = f"{option} {output}{via}"
    for system in KERNEL_FILE_SYSTEMS:
        if target == system or target.is_relative_to(system):
            raise BadInput(
                f"{said} is under {system}, where devices and kernel files live, not a data file; name "
                f"{kind} elsewhere. Nothing was written"
            )
    try:
        mode: int | None = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    return target, said, mode


def _same_file(a: Path, b: Path) -> bool:
    """A hard link is the same file under another name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ---------------------------------------------------------------- the run directory's root


def check_run_root(run_dir: Path | str, plan_name: str, own_names: Iterable[str], tmp_prefix: str) -> None:
    """BadInput unless `run_dir` may become (or already is) a run directory: not an empty path, not `/`, the home
    directory or a kernel file system, not a file, and absent, empty, holding a plan (`plan_name`), or holding
    only what shardrun creates there (`own_names`, temps starting with `tmp_prefix`): a run whose first write
    was interrupted."""
    if not str(run_dir).strip():
        raise BadInput("run_dir: an empty path (it would be the current directory); name the run directory")
    real = _real(run_dir)
    if real == Path(real.anchor):
        raise BadInput(f"run_dir: {run_dir} is the root of the file system; name a directory of its own")
    if real == _real(Path.home()):
        raise BadInput(f"run_dir: {run_dir} is the home directory; name a directory of its own (e.g. ~/runs/NAME)")
    if any(real == s or real.is_relative_to(s) for s in KERNEL_FILE_SYSTEMS):
        raise BadInput(f"run_dir: {run_dir} is under a kernel file system (/dev, /proc, /sys); name a directory")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise BadInput(f"run_dir: {run_dir} exists and is {kind_of(mode)}, not a directory")
    names = os.listdir(real)
    own = set(own_names)
    foreign = sorted(n for n in names if n not in own and not n.startswith(tmp_prefix))
    if plan_name in names or not foreign:
        return
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    raise BadInput(
        f"run_dir: {run_dir} is a directory that is not empty and holds no shardrun run ({shown}); shardrun "
        f"writes only into an absent or empty directory or a run directory of its own. Name a new directory"
    )


# ---------------------------------------------------------------- links inside a run directory


def refuse_links(paths: Iterable[Path], run_dir: Path) -> None:
    """RunDirError naming the first of `paths` (entries of the run directory) that is a symlink: shardrun would
    read or write through it, out of the run directory. Missing paths are fine."""
    for path in paths:
        if os.path.islink(path):
            what = "directory" if os.path.isdir(path) else "file"
            raise RunDirError(
                f"{path} is a symlink (to {os.readlink(path)}); shardrun never follows a link inside the run "
                f"directory {run_dir}, where it could read or write outside it. Put the real {what} there"
            )


def refuse_links_in(directory: Path, run_dir: Path) -> None:
    """`refuse_links` over every entry of `directory` (one listing; nothing when it does not exist)."""
    try:
        with os.scandir(directory) as entries:
            links = sorted(Path(e.path) for e in entries if e.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return
    refuse_links(links, run_dir)
