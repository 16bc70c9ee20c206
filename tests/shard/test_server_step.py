"""The policy's server step on one node (shard/server_step.py): the script server_layout renders, run for real by
bash, starts every replica, each is ready before the shard goes on, and any replica's exit, status 0 included,
ends the step, which the watchdog's check reports. The replicas are the stand-in policy server (a fake at the seam
shardrun does not own: the GPU model server) given vLLM's command line."""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shardrun.core.config import PolicyConfig
from shardrun.core.errors import ServerFailure
from shardrun.shard import policy, processes, vllm
from tests import ports
from tests.fakes import harness


def replicas_policy(port: int, n: int = 2, **vllm_extra) -> PolicyConfig:
    return PolicyConfig(
        vllm={
            "model": "stand-in",
            "command": [sys.executable, str(harness.FAKE)],
            "replicas": n,
            "port": port,
            "ready_timeout_s": 120,
            "device": "cpu",
            **vllm_extra,
        }
    )


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 free now (bounded scan)."""
    for _ in range(50):
        p = ports.free_port()
        if all(not vllm.port_answers("127.0.0.1", p + k) for k in range(n)):
            return p
    raise AssertionError("no run of free ports")


def chat(url: str) -> None:
    body = json.dumps({"model": "stand-in", "messages": [{"role": "user", "content": "What is 1 + 1?"}]}).encode()
    req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30).read()
    except OSError:
        pass  # the replica died answering it


def set_fault(url: str, faults: list[str], die_code: int) -> None:
    body = json.dumps({"faults": faults, "die_code": die_code}).encode()
    root = url.rsplit("/v1", 1)[0]
    urllib.request.urlopen(urllib.request.Request(root + "/_fault", body), timeout=30).read()


@pytest.mark.parametrize("die_code", [0, 5], ids=["exit-0", "exit-5"])
def test_two_replicas_start_serve_and_any_exit_ends_the_step(tmp_path: Path, die_code: int):
    port = free_run(2)
    endpoint = policy.open_policy(replicas_policy(port), tmp_path, env={"PATH": "/usr/bin:/bin"})
    try:
        assert endpoint.base_urls == [f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port + 1}/v1"]
        assert any("2 policy server(s) on 1 of 1 node(s)" in n for n in endpoint.notes), endpoint.notes
        for url in endpoint.base_urls:  # both answer, each as its own process
            got = processes.http_get(url + "/models", timeout=10)
            assert got is not None and got[0] == 200 and b"stand-in" in got[1]
        assert endpoint.problem() is None
        step = endpoint.server
        set_fault(endpoint.base_urls[1], ["die:after=0"], die_code)
        chat(endpoint.base_urls[1])
        assert step.proc.wait(timeout=120) == 1  # whatever the replica's status, the step fails
        problem = endpoint.problem()
        assert problem is not None and "the policy server step exited" in problem, problem
        log = (tmp_path / "logs" / "policy-servers.log").read_text()
        assert f"policy server r1 on {os.uname().nodename} (node 0) exited with status {die_code}; stopping" in log, log
        # the other replica was stopped with it: nothing answers at either address
        assert processes.http_get(endpoint.base_urls[0] + "/models", timeout=5) is None
        assert (tmp_path / "logs" / "vllm-r0.log").exists() and (tmp_path / "logs" / "vllm-r1.log").exists()
    finally:
        endpoint.stop()


def test_a_replica_that_never_comes_up_fails_the_start_and_leaves_nothing(tmp_path: Path):
    port = free_run(2)
    pcfg = replicas_policy(port, command=["/bin/sh", "-c", "echo cannot load; exit 0", "shim"])
    with pytest.raises(ServerFailure) as e:
        policy.open_policy(pcfg, tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert "before it was ready" in str(e.value)
    assert "cannot load" in (tmp_path / "logs" / "vllm-r0.log").read_text()


def test_the_api_key_reaches_the_servers_by_environment_only(tmp_path: Path):
    port = free_run(2)
    key = "sk-server-step-not-a-secret"
    pcfg = PolicyConfig(api_key_env="MY_KEY", vllm=replicas_policy(port).vllm.model_dump())
    endpoint = policy.open_policy(pcfg, tmp_path, env={"PATH": "/usr/bin:/bin", "MY_KEY": key})
    try:
        for url in endpoint.base_urls:
            assert processes.http_get(url + "/models", timeout=10)[0] == 401  # the stand-in wants the key
            assert processes.http_get(url + "/models", timeout=10, headers=policy.auth(key))[0] == 200
    finally:
        endpoint.stop()
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert key not in f.read_text(errors="replace"), f


class Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(type(self).status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


def test_liveness_waits_out_a_busy_server_but_not_a_dead_engine():
    now = [0.0]
    silent = f"http://127.0.0.1:{ports.free_port()}"  # nothing listens there
    live = vllm.Liveness([silent], timeout_s=300, clock=lambda: now[0])
    assert live.problem() is None
    now[0] = 299
    assert live.problem() is None
    now[0] = 300
    assert "has not answered GET /health for 300 s (policy.vllm.liveness_timeout_s = 300)" in live.problem()

    class Dead(Health):
        status = 503

    server = ThreadingHTTPServer(("127.0.0.1", 0), Dead)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dead = vllm.Liveness([f"http://127.0.0.1:{server.server_address[1]}"], timeout_s=300, clock=lambda: 0.0)
        assert "answered 503, the engine is dead" in dead.problem()
        Dead.status = 200
        assert dead.problem() is None
    finally:
        server.shutdown()
