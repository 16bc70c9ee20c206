"""Warm workers on the local executor with the real NeMo Gym stack (ng_run with math_with_judge and the vllm_model
adapter, ng_collect_rollouts) and the stand-in policy server (tests/fakes/policy_server.py: the model is the one
seam we do not own).

- 2 workers over 8 shards: every identity exactly once, each worker started its servers once, and the merged
  reward profile equals one unsharded `ng_collect_rollouts` + `ng_reward_profile` run.
- SIGKILL one worker while a shard's request hangs in the model: its claim goes stale after the lease, the other
  worker takes the shard over and resumes it from its last complete rollout; nothing is lost or duplicated.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from shardrun.core import config
from shardrun.rundir import records, store
from shardrun.shard import gym_stack
from shardrun.workers import worker
from tests import builders
from tests.fakes import harness
from tests.faults import gymkit
from tests.e2e.test_e2e_local import REPEATS, essentials, profile_rows, rows, unsharded_reference

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
SHARDS = 8


# 2 warm workers over 8 shards, a claim's lease 10 s; the fault suite's stack with the runtime tests' key
STACK = gymkit.STACK.but(
    api_key_env=harness.API_KEY_ENV,
    repeats=REPEATS,
    shards=SHARDS,
    gym={"max_rollout_attempts": 3},
    cluster={"workers": 2, "claim_heartbeat_s": 1, "claim_lease_s": 10, "max_attempts": 3},
)
write_config = functools.partial(builders.write_config, stack=STACK)


def submit(cfg_path: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path), *extra],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def all_rollouts(run_dir: Path) -> list[dict]:
    return [r for i in range(SHARDS) for r in rows(store.rollouts_path(run_dir, i))]


def markers(run_dir: Path) -> list[dict]:
    return [json.loads(store.done_path(run_dir, i).read_text()) for i in range(SHARDS)]


@pytest.fixture
def env(tmp_path: Path, gym_venv: Path, monkeypatch) -> str:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return tag


def test_two_workers_over_eight_shards_equal_one_unsharded_gym_run(tmp_path: Path, gym_venv: Path, env: str) -> None:
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS)
    run_dir = tmp_path / "run"
    with harness.fake_policy(tmp_path, "--correct-share", "0.5") as fake:
        cfg_path = write_config(tmp_path / "run.yaml", input_jsonl, run_dir, fake.base_url)
        proc = submit(cfg_path, tmp_path)
        out, _ = proc.communicate(timeout=800)
        assert proc.returncode == 0, out
        assert "warm workers: 2 job(s)" in out and all(f"shard {i:05d}: sealed" in out for i in range(SHARDS)), out
        n_requests = len(fake.requests())
        reference = unsharded_reference(tmp_path, cfg_path, input_jsonl, gym_venv)
        assert len(fake.requests()) - n_requests == n_requests  # the reference made as many model calls

    got = all_rollouts(run_dir)
    assert len(got) == SHARDS * REPEATS
    assert essentials(got) == essentials(rows(reference / "rollouts.jsonl"))  # every identity exactly once

    states = records.read_worker_states(run_dir)
    assert len(states) == 2 and all(s.server_starts == 1 and s.state == worker.STOPPED for s in states), states
    assert sorted(i for s in states for i in s.sealed) == list(range(SHARDS))
    sealed_by = {m["shard_index"]: m["worker"] for m in markers(run_dir)}
    assert {w["id"] for w in sealed_by.values()} == {s.worker_id for s in states}
    depth = config.CollectorConfig().pipeline_shards
    for s in states:  # the shards claimed before a worker's first seal (up to collector.pipeline_shards at once)
        # found its servers just started; the rest found them warm
        warm = [sealed_by[i]["servers_warm"] for i in s.sealed]
        assert warm[0] is False and warm.count(False) <= depth, (s.worker_id, warm)
    assert all(m["server_wait_s"] == 0 for m in markers(run_dir))
    for i in range(SHARDS):
        assert not store.claim_path(run_dir, i).exists()
        assert list(store.shard_dir(run_dir, i).glob(".claim*")) == []

    merged = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "merge-and-profile", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert profile_rows(store.merged_reward_profiling_path(run_dir)) == profile_rows(
        reference / "rollouts_reward_profiling.jsonl"
    )
    assert harness.tagged_processes(env) == []
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert harness.API_KEY.encode() not in path.read_bytes(), f"API key written to {path}"


def wait_for(what: str, check, timeout: float = 600.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_sigkilled_worker_s_shard_is_taken_over_after_the_lease(tmp_path: Path, gym_venv: Path, env: str) -> None:
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS)
    run_dir = tmp_path / "run"
    question = json.loads(input_jsonl.read_text().splitlines()[1])["question"]  # shard 1: task 1's 3 rollouts
    with harness.fake_policy(tmp_path, "--fault", f"hang:match={question},seed=2") as fake:
        # one shard at a time: the killed worker holds only shard 1, so the model answers each rollout once (with
        # two shards in flight the killed one's other requests are asked again: tests/e2e/test_pipeline_local.py)
        cfg_path = write_config(
            tmp_path / "run.yaml", input_jsonl, run_dir, fake.base_url, collector={"pipeline_shards": 1}
        )
        proc = submit(cfg_path, tmp_path)
        try:
            # the shard's third rollout hangs in the model: its worker is in the middle of the shard
            wait_for("the hanging request", lambda: [r for r in fake.requests() if r["fault"] == "hang"])
            claim = wait_for("shard 1's claim", lambda: json.loads(store.claim_path(run_dir, 1).read_text()))
            # Gym sends the shard's requests at once and writes each rollout when it ends: wait for the two that
            # do not hang to land (rollout 2 hangs, so there can never be a third)
            done_before = wait_for(
                "rollouts 0 and 1 to land",
                lambda: keys if len(keys := harness.keys_complete(store.rollouts_path(run_dir, 1))) >= 2 else None,
            )
            assert len(done_before) == 2  # rollouts 0 and 1 landed, rollout 2 hangs
            os.kill(claim["pid"], signal.SIGKILL)
            fake.set_faults([])
            out, _ = proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        log = store.worker_log_path(
            run_dir, [s for s in records.read_worker_states(run_dir) if s.pid != claim["pid"]][0].worker_id
        )
        assert f"shard 1: took over the stale claim of worker {claim['worker_id']}" in log.read_text()
        requests = fake.requests()

    got = all_rollouts(run_dir)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == SHARDS * REPEATS  # nothing lost, nothing twice
    assert harness.keys(store.rollouts_path(run_dir, 1))[:2] == done_before  # resumed, not redone
    answered = [(r["prompt"], r["seed"]) for r in requests if r["fault"] is None]
    assert len(answered) == len(set(answered)) == SHARDS * REPEATS  # the model answered each rollout once
    sealer = markers(run_dir)[1]["worker"]
    assert sealer["id"] != claim["worker_id"]
    # the killed worker's ng_run got SIGTERM from the kernel; whatever of its servers outlived it (ng_run may or may
    # not stop them in time) the other worker reaped (worker.reap_leftovers; tests/launch/test_workers_units.py)
    assert harness.tagged_processes(env) == []


def test_a_worker_whose_servers_keep_dying_restarts_them_then_exits_non_zero(
    tmp_path: Path, gym_venv: Path, env: str
) -> None:
    """A self-hosted policy (the stand-in with vLLM's command line) that exits on its first request: the shard's
    attempt fails as a shard job's would, the worker restarts its servers once (cluster.max_server_restarts: 1),
    the policy dies again, and the worker exits non-zero with its claim released."""
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=2)
    run_dir = tmp_path / "run"
    cfg_path = write_config(
        tmp_path / "run.yaml",
        input_jsonl,
        run_dir,
        "http://unused/v1",
        cluster={"workers": 1, "max_server_restarts": 1},
    )
    data = yaml.safe_load(cfg_path.read_text())
    data["sharding"] = {"num_shards": 2}
    data["policy"] = {
        "api_key_env": harness.API_KEY_ENV,
        "vllm": {
            "model": "stand-in",
            "served_model_name": "fake-model",
            "command": [sys.executable, str(harness.FAKE), "--fault=die:nth=1"],
        },
    }
    cfg_path.write_text(yaml.safe_dump(data))
    proc = submit(cfg_path, tmp_path)
    out, _ = proc.communicate(timeout=800)
    assert proc.returncode == 3, out  # no shard sealed: its servers kept dying (ServerFailure's exit code)

    [state] = records.read_worker_states(run_dir)
    reason = state.exit_reason
    assert state.state == worker.FAILED and "died or failed to start 2 time(s)" in reason, state
    assert "cluster.max_server_restarts = 1" in reason
    # two starts, each ended by the policy's death (a start that fails on a loaded machine counts the same)
    assert 1 <= state.server_starts <= 2, state
    paths = [store.shard_failure_path(run_dir, i) for i in range(2)]
    failures = [json.loads(p.read_text()) for p in paths if p.exists()]
    assert failures and all(f["error"].startswith("ServerFailure") for f in failures), failures
    assert any("vLLM server exited" in f["error"] for f in failures), failures
    assert not any(store.claim_path(run_dir, i).exists() for i in range(2))  # released on the way out
    assert harness.tagged_processes(env) == []
