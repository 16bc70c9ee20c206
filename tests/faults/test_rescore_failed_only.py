"""`shardrun rescore --failed-only` against real NeMo Gym 0.7: only the source's judge-failed rollouts are verified
again, every other row is carried unchanged (docs/rescore.md).

The source run is test_judge_failures' set-up: math_with_judge judging every rollout (the policy is always wrong)
with a judge model server of its own, the judge a stand-in (tests/fakes/policy_server.py, the fake at the model
seam) that answers HTTP 500 to every judge request about task 1's question, so task 1's 4 rollouts are Gym 0.7
judge_failsafe rows (`_ng_failure_class: judge_failed`, with the response) in the shard's failures sidecar. The
re-score points that judge model server at a healthy judge stand-in that says "equal" for task 1's question only:
those 4 rollouts now have reward 1, the healthy judge is asked about task 1 only, every other row is the source's
byte for byte, and `compare` pairs the 12 rollouts scored in both (none changed) and counts the 4 scored in the
re-score only.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shardrun.rundir import seal, store
from shardrun.shard import gym_stack
from tests.conftest import gym_venv_of_version
from tests.faults import faultkit, gymkit

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
FAILING_QUESTION = "What is 1 * 2?"  # task 1 of examples/arith
FAILING_TASK = 1


def rows_by_key(path: Path) -> dict[tuple[int, int], dict]:
    return {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in store.iter_jsonl_objects(path)}


def test_rescore_failed_only_verifies_the_judge_failed_rollouts_and_carries_the_rest(
    tmp_path: Path, gym_env, policy_key, tag: str, monkeypatch
) -> None:
    gym_venv = gym_venv_of_version("0.7.0")
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    source = tmp_path / "run"
    judge_yaml = gymkit.judge_config(tmp_path / "judge.yaml", "http://127.0.0.1:9/v1", gym_venv)
    with (
        faultkit.fake_policy(tmp_path, "--correct-share", "0", key=policy_key) as policy,
        faultkit.fake_policy(
            tmp_path, "--judge", "--fault", f"500:match={FAILING_QUESTION}", key=gymkit.JUDGE_KEY
        ) as failing,
    ):
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            source,
            policy.base_url,
            config_paths=[*gymkit.CONFIG_PATHS, str(judge_yaml)],
            gym={"overrides": [f"++judge_model.responses_api_models.vllm_model.base_url={failing.base_url}"]},
        )
        res = faultkit.cli("submit", cfg, timeout=580)
    assert res.returncode == 0, res.stdout + res.stderr + gymkit.log_text(source)
    assert "shard 00000: sealed (12 rollouts, 4 failed)" in res.stdout, res.stdout
    src_rows = rows_by_key(store.rollouts_path(source, 0))
    sidecar = list(store.iter_jsonl_objects(store.failures_path(source, 0)))
    assert len(src_rows) == 12 and FAILING_TASK not in {k[0] for k in src_rows}
    assert {r["_ng_failure_class"] for r in sidecar} == {"judge_failed"} and all("response" in r for r in sidecar)
    failed = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in sidecar}
    assert failed == {(FAILING_TASK, i) for i in range(gymkit.REPEATS)}
    assert faultkit.cli("merge-and-profile", source).returncode == 0

    # the same judge model server, now at a healthy judge that says "equal" for the failed task's question
    rescored = tmp_path / "rescored"
    with faultkit.fake_policy(tmp_path, "--judge", "--judge-equal", FAILING_QUESTION, key=gymkit.JUDGE_KEY) as healthy:
        res = faultkit.cli(
            "rescore",
            source,
            f"gym.overrides=['++judge_model.responses_api_models.vllm_model.base_url={healthy.base_url}']",
            "-o",
            rescored,
            "--failed-only",
            timeout=580,
        )
        asked = [r for r in healthy.requests() if r.get("route")]
    assert res.returncode == 0, res.stdout + res.stderr + gymkit.log_text(rescored)
    assert "shard 00000: sealed (16 rollouts, 0 failed)" in res.stdout, res.stdout
    # only the judge-failed rollouts were verified again: the healthy judge heard of task 1's question only
    assert asked and all(FAILING_QUESTION in r["prompt"] for r in asked), [r["prompt"][:80] for r in asked]
    new_rows = rows_by_key(store.rollouts_path(rescored, 0))
    assert set(new_rows) == set(src_rows) | failed
    assert {k: new_rows[k] for k in src_rows} == src_rows  # carried unchanged
    assert {k: new_rows[k]["reward"] for k in failed} == dict.fromkeys(failed, 1.0)
    assert list(store.iter_jsonl_objects(store.failures_path(rescored, 0))) == []
    assert store.load_plan(rescored).config["rescore"]["failed_only"] is True

    merged = faultkit.cli("merge-and-profile", rescored)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    aggregate = orjson.loads(store.merged_aggregate_metrics_path(rescored).read_bytes())
    metrics = aggregate[0]["agent_metrics"]
    assert (metrics["coverage/expected"], metrics["coverage/scored"], metrics["coverage/missing"]) == (16, 16, 0)

    done = faultkit.cli("compare", source, rescored, "-o", tmp_path / "cmp", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    got = orjson.loads(done.stdout)["candidates"][0]["rollouts"]
    assert (got["paired"], got["changed"], got["only_base"], got["only_cand"]) == (12, 0, 0, len(failed))
    # Gym read the source's shard files only: they are as sealed
    assert seal.check(source, store.load_plan(source), 0, deep=True).sealed
    assert faultkit.leftovers(tag, also=rescored) == []
