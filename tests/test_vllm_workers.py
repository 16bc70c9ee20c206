"""A warm worker with the real vLLM CPU build (policy.vllm, the tiny random model): one worker runs three shards,
starting vLLM and the Gym stack once, then real `ng_collect_rollouts` per shard through the same runtime a shard
job uses; every identity is sealed exactly once and everything is torn down."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from shardrun.core import config
from shardrun.rundir import seal, store
from shardrun.shard import gym_stack, worker
from tests.fakes import harness
from tests.test_vllm_shard import REPEATS, rows, write_vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.gym, pytest.mark.slow]
SHARDS = 3


@pytest.mark.timeout(1500)
def test_one_worker_starts_vllm_once_for_three_shards(
    tmp_path: Path, gym_venv: Path, vllm_venv: Path, tiny_model: Path, monkeypatch
) -> None:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl = harness.example_input(tmp_path / "input.jsonl", gym_venv, math_rows=3, weather_rows=0)
    run_dir = tmp_path / "run"
    path = write_vllm_config(tmp_path / "run.yaml", input_jsonl, run_dir, tiny_model, vllm_venv)
    # the tiny model on a loaded CPU can take minutes for one answer: a generous stall timeout
    cfg = config.load(path, [f"sharding.num_shards={SHARDS}", "++cluster.workers=1", "gym.stall_timeout_s=900"])
    plan, _ = store.write_plan(cfg)
    store.write_launch_settings(run_dir, cfg)

    state = worker.run_worker(run_dir, "w0", job_id="local-w0")

    assert state.server_starts == 1 and sorted(state.sealed) == list(range(SHARDS)), state
    got = []
    for i in range(SHARDS):
        sealed = seal.check(run_dir, plan, i, deep=True)
        assert sealed.sealed, sealed.reason
        assert sealed.marker["worker"]["id"] == "w0"
        got += [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows(store.rollouts_path(run_dir, i))]
        assert all(r["response"]["model"] == "tiny" for r in rows(store.rollouts_path(run_dir, i)))
    assert sorted(got) == sorted(set(got)) and len(got) == 3 * REPEATS  # every identity exactly once
    warm = [json.loads(store.done_path(run_dir, i).read_text())["worker"]["servers_warm"] for i in state.sealed]
    assert warm == [False, True, True]
    vllm_log = store.vllm_log_path(store.worker_dir(run_dir, "w0")).read_text()
    assert vllm_log.count("Starting vLLM server") == 1  # one vLLM for the three shards
    assert harness.tagged_processes(tag) == []
    assert not any(store.claim_path(run_dir, i).exists() for i in range(SHARDS))
