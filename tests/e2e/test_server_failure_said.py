"""A server outside shardrun that does not come up is said at once, where the user looks (issue 34, item 2): a
pre-hosted policy endpoint that is down (a loopback port bound by no listener) fails the warm worker at its first
start, within policy.ready_timeout_s and without restarts; `submit` prints the cause and a log that exists and
exits 3 (a server did not start, docs/troubleshooting.md); `status` says the same.

The Gym venv is needed only for submit's preflight (the Gym configs are looked up there): the dead policy fails
before the Gym stack would start.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardrun.rundir import records, store
from shardrun.shard import gym_stack
from tests.fakes import harness
from tests.faults import gymkit

pytestmark = [pytest.mark.gym, pytest.mark.timeout(600)]
READY_TIMEOUT_S = 2


def test_a_dead_policy_endpoint_fails_the_submit_at_once_with_its_cause(
    tmp_path: Path, gym_venv: Path, monkeypatch
) -> None:
    monkeypatch.setenv(harness.TAG_ENV, uuid.uuid4().hex)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    with socket.socket() as held:  # bound, never listening: a connection to it is refused while the test runs
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/v1"
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl", tasks=4),
            run_dir,
            url,
            shards=4,
            api_key_env=harness.API_KEY_ENV,
            cluster={"workers": 1, "max_server_restarts": 2},
        )
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg), f"policy.ready_timeout_s={READY_TIMEOUT_S}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=500,
        )
        took = time.monotonic() - t0
        out = done.stdout + done.stderr

    assert done.returncode == 3, out  # ServerFailure's documented code, not 4
    assert took < 150, (took, out)  # far above the expected few seconds; three 60 s starts took over 180 s
    assert f"pre-hosted policy server {url}: not ready after {READY_TIMEOUT_S} s" in out, out
    assert "policy.ready_timeout_s" in out and "did not come up" in out
    logs = re.findall(r"^  log: (.+)$", out, re.MULTILINE)
    assert logs and all(Path(p).is_file() for p in logs), out
    assert "shards/*/logs" not in out
    assert "next: shardrun status" in out

    [state] = records.read_worker_states(run_dir)
    assert state.state == records.FAILED and state.server_starts == 0, state
    worker_log = store.worker_log_path(run_dir, state.worker_id)
    assert str(worker_log) in logs
    assert "restarting the servers" not in worker_log.read_text()  # never up: not retried

    status = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "status", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"worker {state.worker_id} failed: ServerFailure" in status.stdout
    assert f"not ready after {READY_TIMEOUT_S} s" in status.stdout
    assert f"  log: {worker_log}" in status.stdout
    assert str(store.shard_log_path(run_dir, 0)) not in status.stdout  # no log that does not exist is named
