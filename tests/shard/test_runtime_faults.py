"""One shard under faults, against real NeMo Gym (ng_run, ng_collect_rollouts) and the stand-in policy server
(tests/fakes/policy_server.py, a fake at the model seam only): a row the model always rejects is recorded as
failed after its attempts (in the way of the Gym version in use) while the rest seals.

SIGKILLed shards (torn last lines included) are tested by tests/faults/test_kill_shard.py, dead and wedged servers
by tests/faults/test_server_faults.py."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from shardrun.rundir import ledger
from shardrun.core import gym_adapter
from shardrun.shard import gym_stack
from shardrun.shard import runtime
from shardrun.rundir import store
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
    assert result.marker.num_rollouts == 7 and result.marker.num_failed == 1
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
