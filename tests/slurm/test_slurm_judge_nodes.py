"""A self-hosted judge on a node of its own (`cluster.judge_nodes`; issue #36 item 2; docs/judges.md), on the real
local Slurm of two nodes (scripts/local-slurm.sh --nodes 2: each node a slurmd in its own network namespace, with
its own hostname and address).

A shard job over both nodes with `cluster.nodes: 2, judge_nodes: 1`: the shard runs on the first node with Gym,
the collector and the policy (one server: started by the shard itself); the judge runs on the second node in the
judges' server step (`srun --kill-on-bad-exit=1 --nodelist=...`), bound to that node's hostname, and the Gym
stack reaches it there through its gate. The environment is Gym 0.7's math_with_judge with `should_use_judge:
true`: the policy answers every task wrongly (`--correct-share 0`), so every reward is the judge's verdict; the
judge says "equal" for one chosen task only. Rewards follow the verdicts, every judge request was served on the
second node (the stand-in's request log records `served_by` host:port) with the judge's key, the policy's on the
first, every identity lands once, and the key is in no file of the run directory.

Real Slurm, `ng_run` and `ng_collect_rollouts`; the policy and the judge are the stand-in model server
(tests/fakes/policy_server.py) given vLLM's command line: a fake at the seam shardrun does not own, the GPU model
server.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets as pysecrets
import sys
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import store
from shardrun.shard import gym_stack, judges as judge_servers, server_layout
from slurm_helpers import math_input, planned_identities, shardrun, wait_for, write_config
from tests.fakes import harness
from tests.slurm.test_slurm_nodes import merged_identities
from tests.slurm.test_slurm_nodes import no_jobs_left  # noqa: F401 (autouse: cancels what a test leaves queued)

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1200)]
TASKS = 4
REPEATS = 2
JUDGE = "math_judge"
JUDGE_KEY_ENV = "SHARDRUN_TEST_JUDGE_KEY"
MATH = "math_with_judge.resources_servers.math_with_judge"
# every node binds its own ports (each has its own network namespace); each test its own, apart from the other
# tests on the nodes cluster (tests/slurm/test_slurm_nodes.py starts at 24917)
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = itertools.count(25300 + 50 * WORKER, 5)


def log_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stand_in(*args: str) -> list[str]:
    return [sys.executable, str(harness.FAKE), *args]


@pytest.fixture
def judge_env(slurm_nodes_cluster, gym_venv) -> tuple[dict[str, str], str]:
    env = slurm_nodes_cluster.env
    key = "judge-" + pysecrets.token_hex(16)
    env[harness.API_KEY_ENV] = harness.API_KEY
    env[JUDGE_KEY_ENV] = key
    env[gym_stack.VENV_ENV] = str(gym_venv)
    return env, key


def test_a_self_hosted_judge_on_a_node_of_its_own_scores_every_rollout(tmp_path: Path, judge_env, slurm_nodes_cluster):
    env, key = judge_env
    first, second = list(slurm_nodes_cluster.nodes)
    inp = math_input(tmp_path / "input.jsonl", TASKS)
    questions = [json.loads(line)["question"] for line in inp.read_text().splitlines() if line.strip()]
    chosen = 2
    run_dir = tmp_path / "run"
    policy_log, judge_log = tmp_path / "policy-requests.jsonl", tmp_path / "judge-requests.jsonl"
    port = next(PORTS)
    judge_port = port + 1
    cfg = write_config(
        tmp_path / "run.yaml",
        inp,
        run_dir,
        None,
        repeats=REPEATS,
        shards=1,
        policy={
            "base_url": None,
            "model_name": None,
            "vllm": {
                "model": "fake-model",
                "command": stand_in("--correct-share", "0", "--request-log", str(policy_log)),
                "port": port,
                "device": "cpu",
                "ready_timeout_s": 300,
            },
        },
        judges={
            JUDGE: {
                "vllm": {
                    "model": "judge-model",
                    "command": stand_in("--judge", "--judge-equal", questions[chosen], "--request-log", str(judge_log)),
                    "port": judge_port,
                    "device": "cpu",
                    "ready_timeout_s": 300,
                    "liveness_timeout_s": 120,
                },
                "api_key_env": JUDGE_KEY_ENV,
            }
        },
        gym={"overrides": [f"++{MATH}.should_use_judge=true", f"++{MATH}.judge_model_server.name={JUDGE}"]},
        cluster={"nodes": 2, "judge_nodes": 1, "gpus_per_node": 0, "max_attempts": 1},
    )
    dry = shardrun("submit", cfg, "--dry-run", cwd=tmp_path, env=env)
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE1 bash" in dry.stdout, dry.stdout
    assert f"# judge {JUDGE}: self-hosted on judge node NODE1" in dry.stdout
    shardrun("submit", cfg, cwd=tmp_path, env=env)

    def merged_or_failed():
        if store.merged_summary_path(run_dir).exists():
            return "merged"
        failure = store.shard_failure_path(run_dir, 0)
        return failure.read_text() if failure.exists() else None

    outcome = wait_for(merged_or_failed, 900, "the merged run")
    logs = "\n".join(
        f"--- {p}\n{p.read_text()[-3000:]}" for p in run_dir.rglob("*.log") if p.is_file() and p.stat().st_size
    )
    assert outcome == "merged", f"{outcome}\n{logs}"

    # every identity once; every reward the judge's verdict (1 exactly for the chosen task)
    assert merged_identities(run_dir) == planned_identities(run_dir, 1)
    rows = [orjson.loads(line) for line in store.merged_rollouts_path(run_dir).read_bytes().splitlines() if line]
    got: dict[int, list[float]] = {}
    for r in rows:
        got.setdefault(r["_ng_task_index"], []).append(r["reward"])
    assert got == {t: [1.0 if t == chosen else 0.0] * REPEATS for t in range(TASKS)}, got

    # every judge request was served on the second node, at the judge's port, with its key; the policy's on the first
    judged = log_rows(judge_log)
    assert len(judged) == TASKS * REPEATS + REPEATS, judged  # "equal" asks again, reversed
    assert {r["served_by"] for r in judged} == {f"{second}:{judge_port}"}, judged
    assert all(r["auth_ok"] and r["model"] == "judge-model" for r in judged), judged
    assert {r["served_by"] for r in log_rows(policy_log)} == {f"{first}:{port}"}

    # the judges' step: the script bound the judge to the second node's hostname; the shard's log says where it was
    home = store.shard_dir(run_dir, 0)
    script = (home / server_layout.JUDGES_DIR / server_layout.JUDGE_SCRIPT_NAME).read_text()
    assert f"--host {second} --port {judge_port}" in script and key not in script
    shard_log = store.shard_log_path(run_dir, 0).read_text()
    assert f"judge {JUDGE} ready (self-hosted): http://{second}:{judge_port}/v1" in shard_log, shard_log
    assert (home / "logs" / judge_servers.STEP_LOG).exists()
    # the key is in no file of the run directory
    assert [p for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()] == []
