"""The local Slurm of several nodes (scripts/local-slurm.sh --nodes 2 --gpus-per-node 2): each node a slurmd in its
own network namespace with its own hostname and address, fake GPUs as GRES. What a job spread over the nodes can
count on: a step over both nodes, the same port bound on each, one node reaching the other by hostname; and `stop`
removing exactly the namespaces, veths and bridge its cluster made."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_helpers import wait_for
from tests.slurm.conftest import SCRIPT, NodesCluster, cannot_install

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

PORT = 29500  # bound on 0.0.0.0 in every node's own network namespace, so no other test competes for it


def run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def sinfo(cluster: NodesCluster) -> dict[str, tuple[str, str]]:
    """node -> (state, gres) as sinfo shows them."""
    out = run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%G"], cluster.env).stdout
    return {n: (state, gres) for n, state, gres in (line.split("|") for line in out.split())}


def test_sinfo_shows_the_nodes_idle_with_gpus(slurm_nodes_cluster: NodesCluster):
    cluster = slurm_nodes_cluster
    assert list(cluster.nodes) == ["sr1", "sr2"]
    subnet = cluster.controller_addr.rsplit(".", 1)[0]
    assert cluster.controller_addr.endswith(".1") and list(cluster.nodes.values()) == [f"{subnet}.11", f"{subnet}.12"]

    # a job that just ended may leave its nodes "completing" for a moment
    def all_idle() -> dict[str, tuple[str, str]] | None:
        nodes = sinfo(cluster)
        return nodes if all(state == "idle" for state, _ in nodes.values()) else None

    nodes = wait_for(all_idle, 60, "idle nodes", 0.5)
    assert nodes == {"sr1": ("idle", "gpu:2"), "sr2": ("idle", "gpu:2")}
    # the single-node cluster's SLURM_CONF, if another test set it in os.environ, is not this cluster's
    assert cluster.env["SLURM_CONF"] == str(cluster.state / "etc" / "slurm.conf")


# One task per node. Each binds PORT on 0.0.0.0 (the same port on both: separate network namespaces); the task on
# node 1 answers one request with its hostname and the address the request came from; the task on node 0 connects
# to node 1 by hostname (the nodes' /etc/hosts), retrying while node 1 is not yet listening (bounded).
NODE_STEP = r"""
import json, os, socket, subprocess, sys, time
port = int(sys.argv[1])
me = socket.gethostname()
rec = {"host": me, "nodeid": int(os.environ["SLURM_NODEID"]), "addr": socket.gethostbyname(me),
       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
srv = socket.socket()
srv.bind(("0.0.0.0", port))
srv.listen()
rec["bound"] = port
nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                       capture_output=True, text=True, check=True).stdout.split()
if rec["nodeid"] == 1:
    srv.settimeout(120)
    conn, peer = srv.accept()
    with conn:
        request = conn.recv(100).decode()
        conn.sendall(f"{me} answers {request} from {peer[0]}".encode())
    rec["served"] = peer[0]
else:
    deadline = time.monotonic() + 120
    while True:
        try:
            conn = socket.create_connection((nodes[1], port), timeout=10)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with conn:
        rec["server"] = conn.getpeername()[0]
        conn.sendall(b"hello")
        conn.shutdown(socket.SHUT_WR)
        rec["answer"] = conn.recv(200).decode()
print("RESULT " + json.dumps(rec), flush=True)
"""


def test_a_job_over_both_nodes(slurm_nodes_cluster: NodesCluster, tmp_path: Path):
    cluster = slurm_nodes_cluster
    (tmp_path / "node_step.py").write_text(NODE_STEP)
    (tmp_path / "job.sh").write_text(
        "#!/bin/bash\n"
        "set -euo pipefail\n"
        'echo "BATCH $(hostname) $SLURM_JOB_NODELIST $SLURM_GPUS_ON_NODE"\n'
        "srun --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1 "
        "bash -c 'echo \"STEP $(hostname) $SLURM_NODEID $(hostname -i)\"'\n"
        "srun --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1 "
        f"{sys.executable} {tmp_path}/node_step.py {PORT}\n"
    )
    out = tmp_path / "job.out"
    sbatch = ["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2", "--time=5"]
    run([*sbatch, f"--output={out}", str(tmp_path / "job.sh")], cluster.env, timeout=300)
    lines = out.read_text().splitlines()
    log = "\n".join(lines)
    assert [line.split()[1:] for line in lines if line.startswith("BATCH ")] == [["sr1", "sr[1-2]", "2"]], log
    steps = sorted(line.split()[1:] for line in lines if line.startswith("STEP "))
    assert steps == [["sr1", "0", cluster.nodes["sr1"]], ["sr2", "1", cluster.nodes["sr2"]]], log
    results = [json.loads(line[len("RESULT ") :]) for line in lines if line.startswith("RESULT ")]
    recs = sorted(results, key=lambda r: r["nodeid"])
    expected = [(k, name, addr) for k, (name, addr) in enumerate(cluster.nodes.items())]
    assert [(r["nodeid"], r["host"], r["addr"]) for r in recs] == expected, log
    assert [r["bound"] for r in recs] == [PORT, PORT]  # the same port on 0.0.0.0 of both nodes
    assert [r["cuda_visible_devices"] for r in recs] == ["0,1", "0,1"]  # the fake GPUs, two per node
    client, server = recs
    assert client["server"] == cluster.nodes["sr2"]  # "sr2" resolved to node 2's address on node 1
    assert server["served"] == cluster.nodes["sr1"]  # the request came from node 1's address
    assert client["answer"] == f"sr2 answers hello from {cluster.nodes['sr1']}"


def free_port_base() -> int:
    """A port base P of 26000-26996 whose ports P..P+3 are free and whose namespaces and bridge do not exist."""
    for k in range(250):
        base = 26000 + 4 * ((os.getpid() + k) % 250)
        if Path("/sys/class/net", f"sr{base}br").exists() or any(Path("/run/netns").glob(f"shardrun-{base}-*")):
            continue
        try:
            for port in range(base, base + 4):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port base in 26000-26999")


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def links() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir()}


def test_stop_removes_what_start_made_and_only_that(slurm_nodes_cluster: NodesCluster, tmp_path: Path):
    """A throwaway two-node cluster next to the session's: started twice (the second start changes nothing),
    stopped (its namespaces, veths and bridge are gone, the session's cluster is untouched), started again."""
    if cannot_install():
        pytest.skip(f"Slurm cannot be installed here: {cannot_install()}")
    state, base = tmp_path / "state", free_port_base()
    names = {f"shardrun-{base}-sr1", f"shardrun-{base}-sr2"}
    ifaces = {f"sr{base}br", f"sr{base}v1", f"sr{base}v2"}
    # the session's cluster: its namespaces and bridge, as its record names them
    record = [line.split() for line in (slurm_nodes_cluster.state / "run" / "nodes").read_text().splitlines()]
    session_names, session_bridge = {r[3] for r in record if r[0] == "node"}, record[0][1]
    assert session_names <= netns_names() and session_bridge in links()

    def script(*args: str) -> subprocess.CompletedProcess:
        cmd = ["bash", str(SCRIPT), *args, "--state", str(state), "--port-base", str(base), "--nodes", "2"]
        return run(cmd, {**os.environ, "PATH": os.environ["PATH"] + ":/usr/sbin:/sbin"}, timeout=600)

    try:
        first = script("start")
        assert f"SHARDRUN_SLURM_NODE_ADDRS=sr1=10.{base // 256}.{base % 256}.11," in first.stdout
        assert names <= netns_names() and ifaces <= links()
        again = script("start")
        assert "stopping" not in again.stderr and again.stdout == first.stdout  # same settings: left alone
        status = script("status").stdout
        assert "node sr2: slurmd running" in status and f"bridge sr{base}br up" in status
        script("stop")
        assert not names & netns_names() and not ifaces & links()
        assert session_names <= netns_names() and session_bridge in links()  # only its own
        assert set(slurm_nodes_cluster.nodes) == set(sinfo(slurm_nodes_cluster))  # the session's cluster runs
        assert script("start").stdout == first.stdout  # a clean stop: starting again works
        assert names <= netns_names()
    finally:
        subprocess.run(
            ["bash", str(SCRIPT), "stop", "--purge", "--state", str(state)], capture_output=True, timeout=600
        )
    assert not names & netns_names() and not ifaces & links() and not state.exists()
