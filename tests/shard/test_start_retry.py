"""A Gym stack start that loses its head server's port to a race is started again, in every launch mode (issue 20,
item 10): the head port is taken before Gym's head server binds it (tests/faults/head_port.py: deterministic, not
by timing), Gym prints `[Errno 98] ... address already in use` and many lines after it, and the shard still seals
with one attempt. What counts as transient is read from everything that start wrote to ng_run's log, not from the
last lines a failure message carries. Real NeMo Gym, the stand-in policy server; the Slurm arrays' case is in
tests/slurm/test_slurm_start_retry.py.

Shard-level retries are off (cluster.max_attempts=1, and a warm worker may not restart its servers), so only the
start's own retry can seal the shard.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from shardrun.rundir import store
from shardrun.shard import gym_stack
from tests.fakes import harness
from tests.faults import gymkit
from tests.faults.head_port import PortTaken, port_taken_venv

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
SHARDS = 2
BIND_ERROR = "address already in use"


def stack_logs(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob(store.GYM_LOG))


def check_the_race_was_lost_and_recovered(run_dir: Path, taken: PortTaken) -> None:
    """The port was taken for one start; its log says so and shows a second start; every shard sealed once."""
    assert taken.port is not None, "no stack start was given a taken head port"
    hit = [p for p in stack_logs(run_dir) if BIND_ERROR in p.read_text().lower()]
    assert len(hit) == 1, [str(p) for p in stack_logs(run_dir)]
    text = hit[0].read_text()
    assert f"+head_server.port={taken.port}" in text and "start ng_run:" in text
    assert text.count("start ng_run:") == 2, text[-3000:]  # started again, once
    assert text.lower().index(BIND_ERROR) < text.rindex("start ng_run:")  # the error came first
    for i in range(SHARDS):
        marker = json.loads(store.done_path(run_dir, i).read_text())
        assert marker["num_rollouts"] == 2, marker
    assert not store.shard_failure_path(run_dir, 0).exists() and not store.shard_failure_path(run_dir, 1).exists()


@pytest.fixture
def taken(tmp_path: Path, gym_venv: Path, monkeypatch) -> PortTaken:
    pt = port_taken_venv(gym_venv, tmp_path)
    monkeypatch.setenv(harness.TAG_ENV, uuid.uuid4().hex)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(pt.venv))
    return pt


@pytest.mark.parametrize(
    "cluster",
    [
        pytest.param({}, id="per-shard-local-jobs"),
        pytest.param({"workers": 1, "max_server_restarts": 0}, id="warm-workers-local"),
    ],
)
def test_a_lost_head_port_is_started_again_and_the_shard_seals(tmp_path: Path, taken: PortTaken, cluster) -> None:
    run_dir = tmp_path / "run"
    with harness.fake_policy(tmp_path) as fake:
        cfg_path = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS),
            run_dir,
            fake.base_url,
            repeats=2,
            shards=SHARDS,
            api_key_env=harness.API_KEY_ENV,
            cluster={"array_parallelism": 2, "max_attempts": 1} | cluster,
        )
        done = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=800,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    check_the_race_was_lost_and_recovered(run_dir, taken)
