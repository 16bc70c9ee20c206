"""One small shard against real NeMo Gym (ng_run with math_with_judge + the vllm_model adapter: 3 servers, the
quickest real stack) and the stand-in policy server, for the fault tests that need servers.

The run: the first 4 tasks of examples/arith x 4 repeats = 16 rollouts in 1 shard. The API key is a fresh random
value per test session, given to shardrun only as an environment variable (policy.api_key_env); the secrets test
searches every file for it.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from shardrun.rundir import store
from tests import builders

CONFIG_PATHS = builders.MATH_CONFIG_PATHS
JUDGE_KEY = "judge-key-not-a-secret"  # the judge stand-in's key, literal in the Gym config judge_config writes
KEY_ENV = "SHARDRUN_FAULTS_POLICY_KEY"
TASKS = 4
REPEATS = 4

# shard.log lines that mark where an attempt is (runtime.py writes them as it gets there)
STARTED, POLICY_READY, GYM_READY, COLLECTING, SEALED, TORN_DOWN, FAILED = (
    "start: attempt",
    "policy ready",
    "Gym servers ready",
    "collector round",
    "sealed; stopping servers",
    "sealed: ",
    "FAILED: ",
)
STAGES = ("shard start", "server start-up", "mid-collection", "sealing/teardown")


def write_input(path: Path, tasks: int = TASKS) -> Path:
    return builders.arith_input(path, tasks)


# the fault suite's runs: 4 repeats in 1 shard, the quickest real stack, one retry per rollout, a health check every 2 s,
# shard attempts without limit (a killed attempt is resumed, however often a test kills it)
STACK = builders.Stack(
    api_key_env=KEY_ENV,
    repeats=REPEATS,
    config_paths=CONFIG_PATHS,
    gym={
        "num_samples_in_parallel": 2,
        "stall_timeout_s": 120,
        "ready_timeout_s": 300,
        "max_rollout_attempts": 2,
        "health_interval_s": 2,
    },
    cluster={"executor": "local", "array_parallelism": 1, "max_attempts": 1000},
)
write_config = functools.partial(builders.write_config, stack=STACK)


def log_text(run_dir: Path, index: int = 0) -> str:
    try:
        return store.shard_log_path(run_dir, index).read_text()
    except FileNotFoundError:
        return ""


def stage_of(new_log: str) -> str:
    """Where an attempt was when it was killed, from the shard.log lines it wrote."""
    if SEALED in new_log:
        return "sealing/teardown"
    if COLLECTING in new_log:
        return "mid-collection"
    if POLICY_READY in new_log:
        return "server start-up"
    return "shard start"


def planned_identities(run_dir: Path) -> list[tuple[int, int]]:
    return [
        (r["_ng_task_index"], r["_ng_rollout_index"])
        for r in store.iter_jsonl_objects(store.materialized_path(run_dir, 0))
    ]


def prompt_and_seed(run_dir: Path) -> dict[tuple[int, int], tuple[str, int]]:
    out = {}
    for r in store.iter_jsonl_objects(store.materialized_path(run_dir, 0)):
        users = [m["content"] for m in r["responses_create_params"]["input"] if m["role"] == "user"]
        seed = json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"]
        out[(r["_ng_task_index"], r["_ng_rollout_index"])] = (users[-1], seed)
    return out


@dataclass
class Milestones:
    """Seconds from the command's start to each shard.log milestone of one watched attempt."""

    at: dict[str, float] = field(default_factory=dict)

    def watch(self, run_dir: Path, t0: float, offset: int) -> None:
        text = log_text(run_dir)[offset:]
        for m in (STARTED, POLICY_READY, GYM_READY, COLLECTING, SEALED, TORN_DOWN):
            if m in text and m not in self.at:
                self.at[m] = time.monotonic() - t0


def judge_config(path: Path, judge_url: str, gym_venv: Path) -> Path:
    """A Gym config: a judge model server (vllm_model at the judge stand-in, configured as Gym's own vllm_model
    config has it) and math_with_judge judging with it."""
    site = next(gym_venv.glob("lib/python3*/site-packages"))
    vllm = yaml.safe_load((site / "responses_api_models/vllm_model/configs/vllm_model.yaml").read_text())[
        "policy_model"
    ]["responses_api_models"]["vllm_model"]
    data = {
        "judge_model": {
            "responses_api_models": {
                "vllm_model": vllm | {"base_url": judge_url, "api_key": JUDGE_KEY, "model": "fake-model"}
            }
        },
        "math_with_judge": {
            "resources_servers": {
                "math_with_judge": {
                    "should_use_judge": True,
                    "judge_model_server": {"type": "responses_api_models", "name": "judge_model"},
                }
            }
        },
    }
    path.write_text(yaml.safe_dump(data))
    return path
