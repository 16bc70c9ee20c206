"""One shard under faults, against real NeMo Gym (ng_run, ng_collect_rollouts) and the stand-in policy server
(tests/fakes/policy_server.py, a fake at the model seam only): a SIGKILLed shard reruns to every identity once; a
dead policy server fails the shard fast with a clear message; a row the model always rejects is recorded as
failed after its attempts while the rest seals."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from shardrun.rundir import ledger
from shardrun.core import gym_adapter
from shardrun.shard import gym_stack
from shardrun.shard import processes
from shardrun.shard import runtime
from shardrun.rundir import store
from shardrun.core.errors import ServerFailure
from tests.fakes import harness

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def shard_env(tmp_path: Path, gym_venv: Path, monkeypatch) -> str:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return tag


def plan_one_shard(
    tmp: Path, gym_venv: Path, policy_url: str, *, repeats: int, gym: dict | None = None, math_rows: int = 3
) -> Path:
    input_jsonl = harness.example_input(tmp / "input.jsonl", gym_venv, math_rows=math_rows, weather_rows=1)
    cfg_path = harness.write_config(
        tmp / "run.yaml", input_jsonl, tmp / "run", policy_url, repeats=repeats, shards=1, gym=gym
    )
    cfg = harness.load_config(cfg_path)
    store.write_plan(cfg)
    return cfg.run_dir


def wait_lines(path: Path, n: int, proc: processes.Proc | None, timeout: float) -> int:
    def enough() -> bool:
        return store.count_complete_lines(path) >= n

    processes.wait_until(
        enough, watch=[proc] if proc else [], timeout=timeout, interval=0.1, what=f"{n} rollouts in {path}"
    )
    return store.count_complete_lines(path)


def identity_prompts(run_dir: Path) -> dict[tuple[int, int], tuple[str, int]]:
    """identity -> (user prompt, seed): what the stand-in server logs for every model call of that identity."""
    out = {}
    for line in store.materialized_path(run_dir, 0).read_text().splitlines():
        row = json.loads(line)
        users = [m["content"] for m in row["responses_create_params"]["input"] if m["role"] == "user"]
        seed = json.loads(row["responses_create_params"]["metadata"]["extra_body"])["seed"]
        out[(row["_ng_task_index"], row["_ng_rollout_index"])] = (users[-1], seed)
    return out


def test_sigkilled_shard_reruns_to_every_identity_exactly_once(tmp_path: Path, gym_venv: Path, shard_env: str):
    with harness.fake_policy(tmp_path, "--delay", "0.5") as fake:
        run_dir = plan_one_shard(tmp_path, gym_venv, fake.base_url, repeats=4, gym={"num_samples_in_parallel": 2})
        rollouts = store.rollouts_path(run_dir, 0)
        shard = processes.start(
            [sys.executable, "-m", "shardrun.cli", "run-shard", str(run_dir), "0"], tmp_path / "first-attempt.log"
        )
        try:
            wait_lines(rollouts, 3, shard, timeout=300)
        finally:
            processes.kill_tree(shard)  # SIGKILL to the whole tree at once: a node failure mid-collection
        assert shard.returncode == -signal.SIGKILL
        time.sleep(1.0)
        assert harness.tagged_processes(shard_env) == [fake.proc.pid]
        with open(rollouts, "ab") as f:  # the killed collector was writing a line
            f.write(b'{"responses_create_params": {"input": [{"content": "Solve')
        done_before = set(harness.keys_complete(rollouts))
        assert 3 <= len(done_before) < 16
        calls_before = len(fake.requests())

        result = runtime.run_shard(run_dir, 0)

        later_calls = {(r["prompt"], r["seed"]) for r in fake.requests()[calls_before:]}
    assert result.state == "sealed"
    keys = harness.keys(rollouts)
    planned = sorted(identity_prompts(run_dir))
    assert sorted(keys) == planned and len(keys) == len(set(keys)) == 16
    prompts = identity_prompts(run_dir)
    assert not later_calls & {prompts[k] for k in done_before}, "the rerun called the model for finished rollouts"
    assert later_calls == {prompts[k] for k in planned if k not in done_before}
    assert "cut a torn last line" in store.shard_log_path(run_dir, 0).read_text()
    assert result.marker["num_rollouts"] == 16 and result.marker["num_failed"] == 0
    assert harness.tagged_processes(shard_env) == []
    assert not store.env_yaml_path(run_dir, 0).exists()


def test_dead_policy_server_fails_the_shard_within_the_stall_timeout(tmp_path: Path, gym_venv: Path, shard_env: str):
    stall = 60.0
    with harness.fake_policy(tmp_path, "--delay", "0.5") as fake:
        run_dir = plan_one_shard(
            tmp_path,
            gym_venv,
            fake.base_url,
            repeats=4,
            gym={"num_samples_in_parallel": 2, "stall_timeout_s": stall, "health_interval_s": 2},
        )
        killed_at: list[float] = []

        def kill_policy_after_first_rollout() -> None:
            wait_lines(store.rollouts_path(run_dir, 0), 1, None, timeout=300)
            processes.kill_tree(fake.proc)
            killed_at.append(time.monotonic())

        killer = threading.Thread(target=kill_policy_after_first_rollout, daemon=True)
        killer.start()
        with pytest.raises(ServerFailure) as err:
            runtime.run_shard(run_dir, 0)
        failed_after = time.monotonic() - killed_at[0]
    message = str(err.value)
    assert "policy server" in message and "does not answer" in message and fake.base_url in message
    assert failed_after < stall, f"took {failed_after:.1f} s, stall timeout {stall} s"
    assert not store.done_path(run_dir, 0).exists()
    failure = json.loads(store.shard_failure_path(run_dir, 0).read_text())
    assert failure["error"].startswith("ServerFailure: policy server")
    assert "FAILED: ServerFailure: policy server" in store.shard_log_path(run_dir, 0).read_text()
    assert not store.env_yaml_path(run_dir, 0).exists()
    assert harness.tagged_processes(shard_env) == []


def test_row_the_model_always_rejects_is_recorded_failed_and_the_rest_seals(
    tmp_path: Path, gym_venv: Path, shard_env: str
):
    bad_prompt = "What is 1 * 2?"  # examples/arith line 2 -> task 1
    with harness.fake_policy(tmp_path, "--fault", f"400:seed=1,match={bad_prompt}") as fake:
        run_dir = plan_one_shard(
            tmp_path, gym_venv, fake.base_url, repeats=2, gym={"max_rollout_attempts": 2, "num_samples_in_parallel": 2}
        )
        result = runtime.run_shard(run_dir, 0)
        rejected = [r for r in fake.requests() if r["fault"] == "400"]
    assert result.state == "sealed"
    assert result.marker["num_rollouts"] == 7 and result.marker["num_failed"] == 1
    failures = [json.loads(line) for line in store.failures_path(run_dir, 0).read_text().splitlines()]
    if gym_adapter.for_venv(gym_venv).series == "0.4":  # Gym 0.4 aborts: shardrun records the identity once
        assert len(failures) == 1
        row = failures[0]
        assert row["_ng_failure_terminal"] is True and row["attempts"] == 2 and "injected 400" in row["reason"]
    else:  # Gym 0.7 records each failed attempt itself (route_failures_to_sidecar) and gates the identity
        assert len(failures) == 2 and {f["_ng_failure_class"] for f in failures} == {"agent_run_error"}
        row = failures[-1]
    assert (row["_ng_task_index"], row["_ng_rollout_index"]) == (1, 1)
    assert "reward" not in row and row["agent_ref"] == {"name": "math_with_judge_simple_agent"}
    assert "injected 400" in ledger.failure_reason(row)
    assert len(rejected) == 2  # two attempts, then never again
    keys = harness.keys(store.rollouts_path(run_dir, 0))
    assert len(keys) == len(set(keys)) == 7 and (1, 1) not in keys
    assert runtime.run_shard(run_dir, 0).state == "already_sealed"
    assert harness.tagged_processes(shard_env) == []
