"""A job's sandbox against real NeMo Gym (issue 36, item 3): an environment that executes code in a NeMo-Skills
sandbox gets one, its code runs there and rewards follow; the sandbox killed mid-run is restarted in place and no
rollout it broke is scored.

The environment is Gym 0.7's math_formal_lean, the smallest real environment that reads NEMO_SKILLS_SANDBOX_HOST/
PORT (ns_tools needs NeMo-Skills' tools package from git, not installable here without network). The sandbox is
the NeMo-Skills-protocol stand-in (tests/fakes/sandbox_server.py). There is no Lean here: its `lean4` requests run a
checker this test writes, a Python program in a subprocess that "compiles" a proof when the number the stand-in
policy boxed is even, so a rollout's reward says what the sandbox ran for it (1.0 even, 0.0 odd). math_formal_lean
turns a sandbox that does not answer into `process_status: error`, reward 0.0, like every Gym sandbox client: a
rollout broken by the dead sandbox would be an odd-looking zero on an even number, which the test looks for.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import store
from tests.fakes import sandbox_server
from tests.faults import faultkit, gymkit

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(600)]

AGENT = "math_formal_lean_simple_agent"
CONFIG_PATHS = [
    "resources_servers/math_formal_lean/configs/math_formal_lean.yaml",
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
]
REPEATS = 8
BOXED = re.compile(r"\\boxed\{(\d+)\}")
CHECKER = """import re, sys
code = sys.stdin.read()
found = re.findall(r"\\\\boxed\\{(\\d+)\\}", code)
if found and int(found[-1]) % 2 == 0:
    sys.exit(0)
print("error: the boxed number is odd (the test's stand-in for a Lean error)")
sys.exit(1)
"""


def lean_input(gym_venv: Path, path: Path) -> Path:
    site = next(gym_venv.glob("lib/python3*/site-packages"))
    rows = (site / "resources_servers/math_formal_lean/data/example.jsonl").read_text().splitlines()
    path.write_text("".join(json.dumps(json.loads(r) | {"agent_ref": {"name": AGENT}}) + "\n" for r in rows))
    return path


def boxed(row: dict) -> int:
    found = BOXED.findall(json.dumps(row["response"]["output"]).replace("\\\\", "\\"))
    assert found, row["response"]["output"]
    return int(found[-1])


@pytest.mark.parametrize("workers", [None, 1], ids=["shard-job", "warm-worker"])
def test_code_runs_in_the_sandbox_and_a_sandbox_killed_mid_run_is_restarted_with_nothing_it_broke_scored(
    tmp_path: Path, gym_env, gym_venv: Path, policy_key, tag: str, workers: int | None
):
    checker = tmp_path / "lean_checker.py"
    checker.write_text(CHECKER)
    requests, pid_file = tmp_path / "sandbox_requests.jsonl", tmp_path / "sandbox.pid"
    command = " ".join(
        [
            sys.executable,
            sandbox_server.__file__,
            "--port {port}",
            f"--request-log {requests}",
            f"--pid-file {pid_file}",
            "--delay-s 0.3",  # each execution takes a while: the kill lands mid-run
            f"--lean4-command '{sys.executable} {checker}'",
        ]
    )
    with faultkit.fake_policy(tmp_path, "--delay", "0.1", key=policy_key) as fake:
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            lean_input(gym_venv, tmp_path / "input.jsonl"),
            run_dir,
            fake.base_url,
            repeats=REPEATS,
            config_paths=CONFIG_PATHS,
            gym={"max_rollout_attempts": 1},  # a rollout broken by the sandbox must not be retried into a score
            cluster={"max_server_restarts": 1, "workers": workers},
            sandbox={"command": command, "liveness_timeout_s": 10, "ready_timeout_s": 60},
        )
        t0 = time.monotonic()
        job = faultkit.start_cli("submit", str(cfg), log=tmp_path / "submit.log")
        rollouts = store.rollouts_path(run_dir, 0)
        landed = faultkit.wait_for(
            lambda: store.count_complete_lines(rollouts) >= 4, 400, "the first 4 rollouts", proc=job
        )
        assert landed, (tmp_path / "submit.log").read_text() + gymkit.log_text(run_dir)
        first = int(pid_file.read_text())
        os.kill(first, signal.SIGKILL)  # the sandbox dies mid-run
        rc = job.wait(timeout=500)
        took = time.monotonic() - t0
    out = (tmp_path / "submit.log").read_text()
    log = gymkit.log_text(run_dir)
    assert rc == 0, out + log
    planned = 5 * REPEATS
    assert "shard 00000: sealed (40 rollouts, 0 failed)" in out, out + log
    assert "the sandbox died while collecting" in log and "restarting the sandbox (1 of 1)" in log, log
    second = int(pid_file.read_text())
    assert second != first  # restarted: a new process on the same port (the Gym servers kept its address)

    rows = list(store.iter_jsonl_objects(rollouts))
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == sorted(
        gymkit.planned_identities(run_dir)
    )
    # every reward is what the sandbox ran for that rollout: none was scored against the dead sandbox
    for r in rows:
        assert r["reward"] == (1.0 if boxed(r) % 2 == 0 else 0.0), (r["_ng_task_index"], r["_ng_rollout_index"])
        assert r["proof_status"] in ("completed", "error"), r["proof_status"]
    assert {r["reward"] for r in rows} == {0.0, 1.0}  # rewards vary: the code really ran
    ran = [json.loads(line) for line in requests.read_text().splitlines()]
    assert {e["language"] for e in ran} == {"lean4"}
    assert any(e["pid"] == first for e in ran) and any(e["pid"] == second for e in ran)
    assert len(ran) >= planned  # each rollout's verification reached the sandbox (the taken back ones twice)
    summary_ok = faultkit.cli("merge-and-profile", run_dir)
    assert summary_ok.returncode == 0, summary_ok.stderr
    assert orjson.loads(store.merged_summary_path(run_dir).read_bytes())["failed_total"] == 0
    assert faultkit.leftovers(tag, also=run_dir) == []
    faultkit.counts_line("sandbox killed", seconds=round(took), executions=len(ran), rollouts=len(rows))
