"""The real local Slurm for tests marked `slurm`: started once per test session by the shared script
(<repo>/../shared/slurm/start-local-slurm.sh: slurmctld, slurmd, slurmdbd for sacct) and stopped at the end if this
session started it.

Skipped, with the reason, only where Slurm cannot be installed (no script, not root, no apt-get and no Slurm).
A cluster that can be installed but does not start fails the tests. Environment knobs:
SHARDRUN_TEST_SLURM_STATE (default /tmp/shardrun-slurm), SHARDRUN_TEST_SLURM_PORT (default 23817),
SHARDRUN_TEST_SLURM_KEEP=1 leaves a cluster this session started running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_SLURM = REPO.parent / "shared" / "slurm"
STATE = Path(os.environ.get("SHARDRUN_TEST_SLURM_STATE", "/tmp/shardrun-slurm"))
PORT = os.environ.get("SHARDRUN_TEST_SLURM_PORT", "23817")
CPUS = "8"


def _cannot_install() -> str | None:
    start = SHARED_SLURM / "start-local-slurm.sh"
    if not start.is_file():
        return f"the local Slurm script is not there ({start})"
    have = all(
        shutil.which(c, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        for c in ("slurmctld", "slurmd", "sbatch", "munged", "slurmdbd")
    )
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root; this test session is not root"
    if not have and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


def _ctld_running() -> bool:
    pid_file = STATE / "run" / "slurmctld.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return False
    return Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="session")
def slurm_cluster():
    """Start (or reuse) the local cluster; export SLURM_CONF for this process, submitit and the jobs."""
    reason = _cannot_install()
    if reason:
        pytest.skip(f"Slurm cannot be installed here: {reason}")
    was_running = _ctld_running()
    t0 = time.time()
    res = subprocess.run(
        ["bash", str(SHARED_SLURM / "start-local-slurm.sh"), str(STATE), "--cpus", CPUS, "--port-base", PORT],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        pytest.fail(f"start-local-slurm.sh failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    env = {}
    for line in res.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip().strip("'\"")
    assert "SLURM_CONF" in env, res.stdout
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    info = dict(env, started_in_s=f"{time.time() - t0:.1f}", state=str(STATE))
    try:
        yield info
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not was_running and os.environ.get("SHARDRUN_TEST_SLURM_KEEP") != "1":
            subprocess.run(
                ["bash", str(SHARED_SLURM / "stop-local-slurm.sh"), str(STATE)], capture_output=True, timeout=300
            )


def squeue_names(*names: str) -> list[str]:
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--name={','.join(names)}", "--format=%i|%T|%r"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def scancel_names(*names: str) -> None:
    for name in names:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)
