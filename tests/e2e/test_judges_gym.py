"""Judges with the real Gym stack (issue #36, item 2; docs/judges.md): Gym 0.7's math_with_judge with
`should_use_judge: true`, its judge bound to the model server `math_judge`, which only `judges.math_judge` defines.

The policy stand-in answers every task wrongly (`--correct-share 0`: `\\boxed{value + 1}`), so math-verify never
passes a rollout and every reward is the judge's verdict. The judge is the same stand-in in judge mode
(`--judge --judge-equal QUESTION`): it says "[[A=B]]" for one chosen question and "[[A!=B]]" for the others, so
exactly the chosen task's rollouts score 1. Once the judge is self-hosted (shardrun starts the stand-in as the
judge's vLLM command, on the policy's readiness rules), once external (a stand-in the test starts, reached
through Gym's openai_model with a concurrency cap). Each judge requires its key, given only by the NAME of an
environment variable: every judge request carried it, and it is in no file of the run directory, no log and no
output. A self-hosted judge that dies while collecting fails the shard as a server failure.
"""

from __future__ import annotations

import json
import secrets as pysecrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from shardrun.rundir import store
from shardrun.shard import gym_stack, judges as judge_servers
from tests import builders
from tests.fakes import harness
from tests.faults import faultkit

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]

TASKS = 4
REPEATS = 2
JUDGE = "math_judge"
JUDGE_KEY_ENV = "SHARDRUN_TEST_JUDGE_KEY"
MATH = "math_with_judge.resources_servers.math_with_judge"
JUDGE_OVERRIDES = [f"++{MATH}.should_use_judge=true", f"++{MATH}.judge_model_server.name={JUDGE}"]


def questions(input_jsonl: Path) -> list[str]:
    return [json.loads(line)["question"] for line in input_jsonl.read_text().splitlines() if line.strip()]


def rewards(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for row in store.iter_jsonl_objects(store.rollouts_path(run_dir, 0)):
        out.setdefault(row["_ng_task_index"], []).append(row["reward"])
    return out


def files_holding(root: Path, key: str) -> list[str]:
    needle = key.encode()
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def judge_requests(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


@pytest.fixture
def judged_run(tmp_path: Path, gym_venv: Path, monkeypatch: pytest.MonkeyPatch):
    """(tmp, input, run_dir, judge key, policy stand-in, config writer): the environment and the stand-in policy;
    the test gives the judges section."""
    tag = uuid.uuid4().hex
    key = "judge-" + pysecrets.token_hex(16)
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(JUDGE_KEY_ENV, key)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl = builders.arith_input(tmp_path / "input.jsonl", TASKS)
    run_dir = tmp_path / "run"
    with harness.fake_policy(tmp_path, "--correct-share", "0", tagged=False) as policy:

        def write(judges: dict, **cluster) -> Path:
            return harness.write_config(
                tmp_path / "run.yaml",
                input_jsonl,
                run_dir,
                policy.base_url,
                repeats=REPEATS,
                config_paths=builders.MATH_CONFIG_PATHS,
                gym={"overrides": JUDGE_OVERRIDES, "health_interval_s": 1},
                cluster={"max_attempts": 1} | cluster,
                judges=judges,
            )

        yield tmp_path, input_jsonl, run_dir, key, tag, write


def submit(cfg: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "submit", str(cfg), *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=800,
    )


def assert_scored_by_the_judge(run_dir: Path, chosen: int) -> None:
    got = rewards(run_dir)
    assert sorted(got) == list(range(TASKS)) and all(len(v) == REPEATS for v in got.values()), got
    assert got == {t: [1.0 if t == chosen else 0.0] * REPEATS for t in range(TASKS)}, got


def assert_no_key_anywhere(tmp: Path, run_dir: Path, key: str, out: str) -> None:
    assert key not in out
    assert (store.shard_dir(run_dir, 0) / "logs").is_dir()
    assert files_holding(run_dir, key) == []
    # outside the run directory too (the judge's request log), but for the test's own stand-ins' logs: the test
    # started the external judge with its key on the command line
    assert [f for f in files_holding(tmp, key) if not Path(f).name.startswith("policy-")] == []
    assert not store.env_yaml_path(run_dir, 0).exists()


def test_a_self_hosted_judge_scores_the_rollouts(judged_run) -> None:
    tmp, input_jsonl, run_dir, key, tag, write = judged_run
    qs = questions(input_jsonl)
    chosen = 1
    log = tmp / "judge-requests.jsonl"
    judge_cmd = [sys.executable, str(harness.FAKE), "--judge", "--judge-equal", qs[chosen], "--request-log", str(log)]
    cfg = write(
        {JUDGE: {"vllm": {"model": "judge-model", "command": judge_cmd, "device": "cpu"}, "api_key_env": JUDGE_KEY_ENV}}
    )
    done = submit(cfg, tmp)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out + "\n".join(
        p.read_text()[-3000:] for p in run_dir.rglob("*.log") if p.name in ("shard.log", "ng_run.log", "vllm.log")
    )

    assert_scored_by_the_judge(run_dir, chosen)
    reqs = judge_requests(log)
    # every wrong answer was judged (a "different" verdict ends a rollout's judging, "equal" asks again reversed)
    assert len(reqs) == TASKS * REPEATS + REPEATS, reqs
    assert all(r["auth_ok"] and r["route"] == "/v1/chat/completions" and r["model"] == "judge-model" for r in reqs)
    assert {q for q in qs if any(q in r["prompt"] for r in reqs)} == set(qs)

    shard_log = store.shard_log_path(run_dir, 0).read_text()
    assert f"judge {JUDGE} ready (self-hosted)" in shard_log
    judge_log = store.shard_dir(run_dir, 0) / judge_servers.JUDGES_DIR / JUDGE / "logs" / "vllm.log"
    assert "fake policy server on http://127.0.0.1:" in judge_log.read_text()
    assert_no_key_anywhere(tmp, run_dir, key, out)
    assert faultkit.leftovers(tag, also=run_dir) == []


def test_an_external_judge_with_a_key_by_name_and_a_cap(judged_run) -> None:
    tmp, input_jsonl, run_dir, key, tag, write = judged_run
    qs = questions(input_jsonl)
    chosen = 2
    with harness.fake_policy(
        tmp,
        "--judge",
        "--judge-equal",
        qs[chosen],
        "--answer-log",
        str(tmp / "judge-answers.jsonl"),
        key=key,
        tagged=False,
    ) as judge:
        cfg = write(
            {
                JUDGE: {
                    "base_url": judge.base_url,
                    "model_name": "judge-ext",
                    "api_key_env": JUDGE_KEY_ENV,
                    "max_concurrent_requests": 2,
                }
            }
        )
        done = submit(cfg, tmp)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out + "\n".join(
            p.read_text()[-3000:] for p in run_dir.rglob("*.log") if p.name in ("shard.log", "ng_run.log")
        )
        reqs = [r for r in judge.requests() if r.get("route")]

    assert_scored_by_the_judge(run_dir, chosen)
    assert len(reqs) == TASKS * REPEATS + REPEATS, reqs
    assert all(r["auth_ok"] and r["route"] == "/v1/responses" and r["model"] == "judge-ext" for r in reqs)
    # the cap: Gym's openai_model got it, and never more than 2 judge requests were open at once
    written = yaml.safe_load((store.gym_dir(run_dir, 0) / gym_stack.JUDGES_YAML).read_text())
    assert written[JUDGE]["responses_api_models"]["openai_model"]["max_concurrent_requests"] == 2
    spans = [json.loads(line) for line in (tmp / "judge-answers.jsonl").read_text().splitlines()]
    assert len(spans) == len(reqs)
    assert max(sum(1 for s in spans if s["t0"] <= a["t0"] < s["t1"]) for a in spans) <= 2
    assert f"judge {JUDGE} ready (external)" in store.shard_log_path(run_dir, 0).read_text()
    assert_no_key_anywhere(tmp, run_dir, key, out)
    assert faultkit.leftovers(tag, also=run_dir) == []


def test_a_judge_that_dies_while_collecting_fails_the_shard_as_a_server_failure(judged_run) -> None:
    tmp, input_jsonl, run_dir, key, tag, write = judged_run
    judge_cmd = [sys.executable, str(harness.FAKE), "--judge", "--fault", "die:nth=1", "--die-code", "0"]
    cfg = write(
        {JUDGE: {"vllm": {"model": "judge-model", "command": judge_cmd, "device": "cpu"}, "api_key_env": JUDGE_KEY_ENV}}
    )
    done = submit(cfg, tmp)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    failure = store.shard_failure_path(run_dir, 0)
    assert failure.exists(), out
    error = json.loads(failure.read_text())["error"]
    assert error.startswith("ServerFailure") and f"judge {JUDGE}" in error and "exited" in error, error
    # no rollout the dead judge should have scored was scored
    assert list(store.iter_jsonl_objects(store.rollouts_path(run_dir, 0))) == []
    assert_no_key_anywhere(tmp, run_dir, key, out)
    assert faultkit.leftovers(tag, also=run_dir) == []
