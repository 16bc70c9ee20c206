"""The real local Slurm for tests marked `slurm`: the project's scripts/local-slurm.sh installs it where it is
missing and starts it (munged, slurmctld, slurmd, and slurmdbd with MariaDB for sacct) once per test session.

Several test sessions may share the cluster: each holds a lease (a file named after its pid) while it runs, and the
last one to leave stops the cluster if a test session started it; a cluster started by hand is left running.
Skipped (failed when CI=true, see tests/conftest.py) only where Slurm cannot be installed: not root, or Slurm
missing and no apt-get. A cluster that can be installed but does not start fails the tests.

Two clusters, each its own state directory, ports, daemons and leases; both may run at once:
- `slurm_cluster`: one node on 127.0.0.1; exports SLURM_CONF in os.environ for the session (submitit, the CLI).
- `slurm_nodes_cluster`: NODES_COUNT nodes in network namespaces with GPUS_PER_NODE fake GPUs each (`--nodes`,
  `--gpus-per-node`); touches no os.environ: pass its `env` to the subprocesses (sbatch, srun, the CLI).

Knobs: SHARDRUN_SLURM_STATE (default /tmp/shardrun-slurm) and the script's other variables
(SHARDRUN_SLURM_PORT_BASE, SHARDRUN_SLURM_CPUS, ...: `scripts/local-slurm.sh --help`); for the nodes cluster
SHARDRUN_SLURM_NODES_STATE (default /tmp/shardrun-slurm-nodes) and SHARDRUN_SLURM_NODES_PORT_BASE (default 25817);
SHARDRUN_TEST_SLURM_KEEP=1 leaves running a cluster this session started.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "local-slurm.sh"
STATE = Path(os.environ.get("SHARDRUN_SLURM_STATE", "/tmp/shardrun-slurm"))
NODES_STATE = Path(os.environ.get("SHARDRUN_SLURM_NODES_STATE", "/tmp/shardrun-slurm-nodes"))
# outside the tests' port ranges (tests/ports.py); its subnet is 10.100.217.0/24 (docs/slurm.md)
NODES_PORT_BASE = int(os.environ.get("SHARDRUN_SLURM_NODES_PORT_BASE", "25817"))
NODES_COUNT = 2
GPUS_PER_NODE = 2
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


def local_slurm(action: str, state: Path = STATE, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), action, "--state", str(state), *options], capture_output=True, text=True, timeout=900
    )


@contextmanager
def leases(state: Path = STATE) -> Iterator[Path]:
    """The directory of the test sessions' leases, locked while a session joins or leaves."""
    folder = state / "test-sessions"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def live_leases(folder: Path) -> list[Path]:
    return [p for p in folder.glob("[0-9]*") if Path(f"/proc/{p.name}").exists()]


@contextmanager
def leased_cluster(state: Path, *options: str) -> Iterator[dict[str, str]]:
    """Start (or join) the cluster of `state` with the script's `options`; yield the `export` lines of `start`
    as a dict. On leaving, the last session out stops the cluster if a test session started it."""
    reason = cannot_install()
    if reason:
        pytest.skip(f"Slurm cannot be installed here: {reason}")
    with leases(state) as folder:
        if not live_leases(folder) and local_slurm("status", state).returncode != 0:
            (folder / "started-by-tests").touch()
        (folder / str(os.getpid())).touch()
        res = local_slurm("start", state, *options)
    try:
        if res.returncode != 0:
            pytest.fail(f"scripts/local-slurm.sh start failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        exports = dict(
            line[len("export ") :].split("=", 1) for line in res.stdout.splitlines() if line.startswith("export ")
        )
        assert "SLURM_CONF" in exports, res.stdout
        yield exports
    finally:
        with leases(state) as folder:
            (folder / str(os.getpid())).unlink(missing_ok=True)
            ours = folder / "started-by-tests"
            if ours.exists() and not live_leases(folder) and os.environ.get("SHARDRUN_TEST_SLURM_KEEP") != "1":
                local_slurm("stop", state)
                ours.unlink()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start (or join) the local cluster; export SLURM_CONF for this process, submitit and the jobs."""
    with leased_cluster(STATE, "--nodes", "1") as env:
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


@dataclass(frozen=True)
class NodesCluster:
    """The local Slurm of several nodes (scripts/local-slurm.sh --nodes): each node a slurmd in its own network,
    UTS and mount namespace, with its own hostname and address on a bridge; partition `debug`."""

    exports: Mapping[str, str]  # what `start` printed: SLURM_CONF, SHARDRUN_SLURM_STATE, SHARDRUN_SLURM_NODE_ADDRS
    nodes: Mapping[str, str]  # node name -> its address, in node order: {"sr1": "10.100.217.11", "sr2": ...}
    gpus_per_node: int  # fake GPUs (GRES gpu) on each node: --gpus-per-node schedules, CUDA_VISIBLE_DEVICES is set
    controller_addr: str  # slurmctld's address on the bridge, the root namespace as the nodes reach it
    state: Path  # the state directory: etc/slurm.conf, log/ (slurmd-<node>.log per node), run/nodes

    @property
    def conf(self) -> str:
        return self.exports["SLURM_CONF"]

    @property
    def env(self) -> dict[str, str]:
        """os.environ as it is now, with this cluster's SLURM_CONF (and the other exports) and /usr/sbin on PATH:
        the environment for subprocess.run(..., env=cluster.env) of sbatch, srun, squeue or shardrun's CLI."""
        return {**os.environ, **self.exports, "PATH": os.environ.get("PATH", "") + SBIN}


@pytest.fixture(scope="session")
def slurm_nodes_cluster() -> Iterator[NodesCluster]:
    """Start (or join) the local cluster of NODES_COUNT nodes with GPUS_PER_NODE fake GPUs each, at NODES_STATE and
    NODES_PORT_BASE. It leaves os.environ alone (slurm_cluster's SLURM_CONF may be there): run Slurm's commands
    with env=cluster.env."""
    options = ("--port-base", str(NODES_PORT_BASE), "--nodes", str(NODES_COUNT), "--gpus-per-node", str(GPUS_PER_NODE))
    with leased_cluster(NODES_STATE, *options) as exports:
        nodes = dict(item.split("=", 1) for item in exports["SHARDRUN_SLURM_NODE_ADDRS"].split(","))
        controller = next(iter(nodes.values())).rsplit(".", 1)[0] + ".1"
        yield NodesCluster(exports, nodes, GPUS_PER_NODE, controller, NODES_STATE)
