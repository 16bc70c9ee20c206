"""One shard end to end with a self-hosted policy: shardrun starts the real vLLM CPU build itself (policy.vllm,
the tiny random model), then real `ng_run` and `ng_collect_rollouts` through shardrun.shard.runtime, and seals.

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
from shardrun.shard import gym_stack
from shardrun.shard import runtime
from shardrun.rundir import seal
from shardrun.rundir import store
from tests.fakes import harness
from tests.test_vllm import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.gym, pytest.mark.slow]
REPEATS = 2


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
                "port": free_port(),
            }
        },
        "cluster": {"executor": "local", "array_parallelism": 1},
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(600)
def test_one_shard_with_self_hosted_vllm_seals_every_identity_once(
    tmp_path: Path, gym_venv: Path, vllm_venv: Path, tiny_model: Path, monkeypatch
) -> None:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl = harness.example_input(tmp_path / "input.jsonl", gym_venv, math_rows=3, weather_rows=1)
    run_dir = tmp_path / "run"
    cfg = config.load(write_vllm_config(tmp_path / "run.yaml", input_jsonl, run_dir, tiny_model, vllm_venv))
    plan, _ = store.write_plan(cfg)

    t0 = time.monotonic()
    result = runtime.run_shard(run_dir, 0)
    elapsed = time.monotonic() - t0

    assert result.state == "sealed"
    state = seal.check(run_dir, plan, 0, deep=True)
    assert state.sealed, state.reason
    planned = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows(store.materialized_path(run_dir, 0))]
    got = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows(store.rollouts_path(run_dir, 0))]
    assert len(planned) == 4 * REPEATS
    assert sorted(got) == sorted(planned) and len(set(got)) == len(got)  # every identity exactly once
    assert state.marker["num_rollouts"] == 4 * REPEATS and state.marker["num_failed"] == 0
    assert state.marker["server_wait_s"] > 0 and state.marker["extra"]["output_tokens"] > 0

    by_agent = {}
    for r in rows(store.rollouts_path(run_dir, 0)):
        by_agent.setdefault(r["agent_ref"]["name"], []).append(r["reward"])
        assert r["response"]["model"] == "tiny"  # answered by the served name of our own vLLM
    assert by_agent["example_single_tool_call_simple_agent"] == [1.0] * REPEATS

    vllm_log = store.vllm_log_path(store.shard_dir(run_dir, 0)).read_text()
    assert "Starting vLLM server" in vllm_log
    assert vllm_log.count("POST /v1/chat/completions HTTP/1.1\" 200") >= 4 * REPEATS
    shard_log = store.shard_log_path(run_dir, 0).read_text()
    assert "policy ready in" in shard_log and "model tiny" in shard_log
    assert harness.tagged_processes(tag) == []  # vLLM, Ray, Gym servers and the collector are all gone
    print(
        f"\nself-hosted vLLM shard: {elapsed:.1f} s ({state.marker['server_wait_s']:.1f} s servers, "
        f"{state.marker['collect_s']:.1f} s collecting)"
    )
