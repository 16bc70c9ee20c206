"""A warm worker with the real vLLM CPU build (policy.vllm, the tiny random model): one worker runs three shards,
starting vLLM and the Gym stack once, then real `ng_collect_rollouts` per shard through the same runtime a shard
job uses (a shard job starts its servers through the same `runtime.start_servers`); every identity is sealed
exactly once, the answers came from our server's served name, and everything is torn down.

The tiny model's answers are gibberish (math rewards 0; the tool-call agent's verify rewards 1.0 whatever the
model says), which is fine: this test is about the plumbing, the identities and the teardown.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import yaml

from shardrun.core import config
from shardrun.rundir import seal, store
from shardrun.shard import gym_stack
from shardrun.workers import worker
from tests.fakes import harness
from tests.ports import VLLM, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.gym, pytest.mark.slow]
SHARDS = 3
REPEATS = 2
TASKS = 4  # 3 math tasks and 1 tool-call task


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_vllm_config(path: Path, input_jsonl: Path, run_dir: Path, model: Path, vllm_venv: Path) -> Path:
    data = {
        "input_jsonl": str(input_jsonl),
        "run_dir": str(run_dir),
        "num_repeats": REPEATS,
        "sharding": {"num_shards": 1},
        "gym": {
            "config_paths": harness.CONFIG_PATHS,
            "num_samples_in_parallel": 4,
            "stall_timeout_s": 180,
            "ready_timeout_s": 300,
        },
        "policy": {
            "vllm": {
                "model": str(model),
                "served_model_name": "tiny",
                "python": str(vllm_venv),
                "max_model_len": 1024,
                "extra_args": ["--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                "ready_timeout_s": 240,
                "port": free_port(VLLM),
            }
        },
        "cluster": {"executor": "local", "array_parallelism": 1},
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(1500)
def test_one_worker_starts_vllm_once_for_three_shards(
    tmp_path: Path, gym_venv: Path, vllm_venv: Path, tiny_model: Path, monkeypatch
) -> None:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl = harness.example_input(tmp_path / "input.jsonl", gym_venv, math_rows=3, weather_rows=1)
    run_dir = tmp_path / "run"
    path = write_vllm_config(tmp_path / "run.yaml", input_jsonl, run_dir, tiny_model, vllm_venv)
    # the tiny model on a loaded CPU can take minutes for one answer: a generous stall timeout
    cfg = config.load(path, [f"sharding.num_shards={SHARDS}", "++cluster.workers=1", "gym.stall_timeout_s=900"])
    plan, _ = store.write_plan(cfg)
    store.write_launch_settings(run_dir, cfg)

    t0 = time.monotonic()
    state = worker.run_worker(run_dir, "w0", job_id="local-w0")
    elapsed = time.monotonic() - t0

    assert state.server_starts == 1 and sorted(state.sealed) == list(range(SHARDS)), state
    got = []
    for i in range(SHARDS):
        sealed = seal.check(run_dir, plan, i, deep=True)
        assert sealed.sealed, sealed.reason
        assert sealed.marker.worker_id == "w0"
        got += [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows(store.rollouts_path(run_dir, i))]
        assert all(r["response"]["model"] == "tiny" for r in rows(store.rollouts_path(run_dir, i)))
    assert sorted(got) == sorted(set(got)) and len(got) == TASKS * REPEATS  # every identity exactly once
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in range(SHARDS)]
    assert sum(m["num_rollouts"] for m in markers) == TASKS * REPEATS and all(m["num_failed"] == 0 for m in markers)
    assert all(m["extra"]["output_tokens"] > 0 for m in markers if m["num_rollouts"])
    # the tool-call task's reward is its environment's verdict on what the model did: Gym 0.4's verifier gives 1.0
    # whatever the model says, Gym 0.7's gives 1.0 only for a get_weather function call
    tool = [
        (
            r["reward"],
            any(o.get("type") == "function_call" and o.get("name") == "get_weather" for o in r["response"]["output"]),
        )
        for i in range(SHARDS)
        for r in rows(store.rollouts_path(run_dir, i))
        if r["agent_ref"]["name"] == "example_single_tool_call_simple_agent"
    ]
    assert len(tool) == REPEATS
    if plan.gym_version and plan.gym_version.startswith("0.4."):
        assert [reward for reward, _ in tool] == [1.0] * REPEATS
    else:
        assert all(reward == float(called) for reward, called in tool), tool
    warm = [json.loads(store.done_path(run_dir, i).read_text())["worker"]["servers_warm"] for i in state.sealed]
    # the shards claimed before the first seal (up to collector.pipeline_shards at once) found vLLM just started
    assert warm[0] is False and warm.count(False) <= config.CollectorConfig().pipeline_shards, warm
    vllm_log = store.vllm_log_path(store.worker_dir(run_dir, "w0")).read_text()
    assert vllm_log.count("Starting vLLM server") == 1  # one vLLM for the three shards
    assert vllm_log.count('POST /v1/chat/completions HTTP/1.1" 200') >= TASKS * REPEATS
    worker_log = store.worker_log_path(run_dir, "w0").read_text()
    assert "policy ready in" in worker_log and "model tiny" in worker_log
    assert harness.tagged_processes(tag) == []
    assert not any(store.claim_path(run_dir, i).exists() for i in range(SHARDS))
    print(
        f"\none worker, self-hosted vLLM, {SHARDS} shards: {elapsed:.1f} s ({state.startup_s:.1f} s starting servers)"
    )
