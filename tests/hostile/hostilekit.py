"""The hostile-input catalogue's harness (docs/reliability.md, "Hostile input"): each case runs a shardrun
command the way a user would (the CLI, in process) and checks what shardrun promises for its class of input:

- exit 2 (or 0 for valid-but-unusual input) and no traceback;
- the message names the key, the line or the path at fault;
- every file outside the expected outputs is byte-identical before and after (`snapshot`);
- where input could make a command wait for ever (a FIFO where a file should be), the command returns within
  BOUND_S seconds (`invoke_bounded`): a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from shardrun.cli import app


def snapshot(root: Path) -> dict[str, tuple[str, bytes | int | str]]:
    """Every entry under root: regular files by content, symlinks by target, other kinds by their type bits."""
    out: dict[str, tuple[str, bytes | int | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", p.read_bytes())
            elif not stat.S_ISDIR(st.st_mode):
                out[rel] = ("special", stat.S_IFMT(st.st_mode))
    return out


@dataclass
class Outcome:
    exit_code: int
    output: str
    exception: BaseException | None


def invoke(*args: str) -> Outcome:
    res = CliRunner().invoke(app, [str(a) for a in args])
    return Outcome(res.exit_code, res.output, res.exception)


def refused(outcome: Outcome, *names: str) -> None:
    """Exit 2, a message naming each of `names`, and no traceback (a SystemExit, not an escaped exception)."""
    assert outcome.exit_code == 2, outcome.output
    assert isinstance(outcome.exception, SystemExit), repr(outcome.exception)
    assert "Traceback" not in outcome.output
    for name in names:
        assert name in outcome.output, f"{name!r} not named in: {outcome.output}"


@contextmanager
def unchanged_tree(root: Path, *allowed: Path) -> Iterator[None]:
    """A context that asserts nothing under root but the `allowed` paths (and what is below them) changed."""
    before = snapshot(root)
    yield
    after = snapshot(root)
    skip = [Path(a).relative_to(root) for a in allowed]

    def expected(rel: str) -> bool:
        return any(Path(rel) == a or Path(rel).is_relative_to(a) for a in skip)

    changed = sorted(k for k in before.keys() | after.keys() if not expected(k) and before.get(k) != after.get(k))
    assert not changed, f"changed under {root}: {changed}"


BOUND_S = 120.0
"""What "at once" means for a hostile case: a hang is for ever, so the bound only has to tell "ended" from "never
ends"; it sits far above what any case takes even on a loaded 2-core machine (a report renders its figures in
seconds, or tens of seconds under a load of 15), so no case passes or fails by the machine's speed."""


def invoke_bounded(*args: str, bound_s: float = BOUND_S) -> Outcome:
    """invoke(*args) in a thread that must end within `bound_s` seconds: a command that hangs fails the case (the
    thread is left behind, a daemon) instead of blocking the suite."""
    box: list[Outcome] = []
    worker = threading.Thread(target=lambda: box.append(invoke(*args)), daemon=True)
    worker.start()
    worker.join(bound_s)
    assert not worker.is_alive() and box, f"shardrun {' '.join(map(str, args))} did not end within {bound_s:g} s"
    return box[0]


def stand_in_venv(root: Path, version: str = "0.4.0", configs: tuple[str, ...] = ()) -> Path:
    """A directory laid out like a Gym venv (what preflight reads: dist-info, bin/ng_run, site-packages), with the
    server configs `configs` in site-packages; it never starts Gym."""
    venv = root / "gym-venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "ng_run").write_text("")
    site = venv / "lib" / "python3.12" / "site-packages"
    meta = site / f"nemo_gym-{version}.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(f"Metadata-Version: 2.4\nName: nemo-gym\nVersion: {version}\n\n")
    for config in configs:
        (site / config).parent.mkdir(parents=True, exist_ok=True)
        (site / config).write_text(f"{Path(config).stem}: {{}}\n")
    return venv
