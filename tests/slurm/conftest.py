"""The real local Slurm for tests marked `slurm`: the project's scripts/local-slurm.sh installs it where it is
missing and starts it (munged, slurmctld, slurmd, and slurmdbd with MariaDB for sacct) once per test session.

Several test sessions may share the cluster: each holds a lease (a file named after its pid) while it runs, and the
last one to leave stops the cluster if a test session started it; a cluster started by hand is left running.
Skipped (failed when CI=true, see tests/conftest.py) only where Slurm cannot be installed: not root, or Slurm
missing and no apt-get. A cluster that can be installed but does not start fails the tests.

Knobs: SHARDRUN_SLURM_STATE (default /tmp/shardrun-slurm) and the script's other variables
(SHARDRUN_SLURM_PORT_BASE, SHARDRUN_SLURM_CPUS, ...: `scripts/local-slurm.sh --help`);
SHARDRUN_TEST_SLURM_KEEP=1 leaves running a cluster this session started.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-slurm.sh"
STATE = Path(os.environ.get("SHARDRUN_SLURM_STATE", "/tmp/shardrun-slurm"))
SBIN = ":/usr/local/sbin:/usr/sbin:/sbin"


def cannot_install() -> str | None:
    """Why the local Slurm cannot be installed and started here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root; this test session is not root"
    path = os.environ.get("PATH", "") + SBIN
    if not all(shutil.which(c, path=path) for c in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd")):
        if shutil.which("apt-get") is None:
            return "Slurm is not installed and there is no apt-get to install it"
    return None


def local_slurm(action: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), action, "--state", str(STATE)], capture_output=True, text=True, timeout=900
    )


@contextmanager
def leases() -> Iterator[Path]:
    """The directory of the test sessions' leases, locked while a session joins or leaves."""
    folder = STATE / "test-sessions"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def live_leases(folder: Path) -> list[Path]:
    return [p for p in folder.glob("[0-9]*") if Path(f"/proc/{p.name}").exists()]


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start (or join) the local cluster; export SLURM_CONF for this process, submitit and the jobs."""
    reason = cannot_install()
    if reason:
        pytest.skip(f"Slurm cannot be installed here: {reason}")
    with leases() as folder:
        if not live_leases(folder) and local_slurm("status").returncode != 0:
            (folder / "started-by-tests").touch()
        (folder / str(os.getpid())).touch()
        res = local_slurm("start")
    if res.returncode != 0:
        pytest.fail(f"scripts/local-slurm.sh start failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    env = dict(line[len("export ") :].split("=", 1) for line in res.stdout.splitlines() if line.startswith("export "))
    assert "SLURM_CONF" in env, res.stdout
    saved = {k: os.environ.get(k) for k in [*env, "PATH"]}
    os.environ.update(env)
    os.environ["PATH"] = os.environ.get("PATH", "") + SBIN
    try:
        yield dict(env, state=str(STATE))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with leases() as folder:
            (folder / str(os.getpid())).unlink(missing_ok=True)
            ours = folder / "started-by-tests"
            if ours.exists() and not live_leases(folder) and os.environ.get("SHARDRUN_TEST_SLURM_KEEP") != "1":
                local_slurm("stop")
                ours.unlink()
