"""A judge that fails a quarter of its requests, against real NeMo Gym 0.7 and 0.4 (math_with_judge with its judge on,
bound to a judge model server of its own): those rollouts are failures (class `judge` under 0.7), never zeros; the profile's
denominators, the merge summary, `status` and the report say so per class, and the run is named unreliable
(docs/failures.md).

The judge is a second stand-in (tests/fakes/policy_server.py: the fake at the model seam) that answers HTTP 500 to
every judge request about task 1's question, by content, whatever order requests arrive in; or, in the last test,
never answers it (a judge that times out: shardrun's gate before the judge ends the request, judges.NAME.
request_timeout_s), in an adaptive run whose early stopping must not settle task 1 from its failed rollouts. The
policy answers every question wrongly, so math_with_judge asks the judge about every rollout.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shardrun.analysis import report
from shardrun.rundir import records, store
from shardrun.shard import gym_stack
from tests.conftest import gym_venv_of_version
from tests.faults import faultkit, gymkit

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(600)]
JUDGE_KEY = gymkit.JUDGE_KEY
FAILING_QUESTION = "What is 1 * 2?"  # task 1 of examples/arith


# what each version lets shardrun see: 0.7 says the judge failed (judge_failsafe); 0.4's math_with_judge does not
# check the judge's status, so its /verify fails on the error body and /run names only the agent's inner call
# (docs/failures.md): a failure all the same, of class environment
@pytest.mark.parametrize("version, klass", [("0.7.0", "judge"), ("0.4.0", "environment")])
def test_a_judge_failing_a_quarter_of_its_requests_makes_failures_not_zeros(
    tmp_path: Path, gym_env, policy_key, tag: str, monkeypatch, version: str, klass: str
) -> None:
    gym_venv = gym_venv_of_version(version)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    with (
        faultkit.fake_policy(tmp_path, "--correct-share", "0", key=policy_key) as policy,
        faultkit.fake_policy(tmp_path, "--fault", f"500:match={FAILING_QUESTION}", key=JUDGE_KEY) as judge,
    ):
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            run_dir,
            policy.base_url,
            config_paths=[
                *gymkit.CONFIG_PATHS,
                str(gymkit.judge_config(tmp_path / "judge.yaml", judge.base_url, gym_venv)),
            ],
        )
        res = faultkit.cli("submit", cfg, timeout=580)
        out = res.stdout + res.stderr
        judged = judge.requests()
    assert res.returncode == 0, out + gymkit.log_text(run_dir)
    assert "shard 00000: sealed (12 rollouts, 4 failed)" in out, out
    assert any(r["fault"] == "500" for r in judged) and any(r["fault"] is None for r in judged)

    sidecar = list(store.iter_jsonl_objects(store.failures_path(run_dir, 0)))
    assert sidecar and {r["_ng_task_index"] for r in sidecar} == {1}
    if version == "0.7.0":  # Gym 0.7's judge_failsafe: every attempt of task 1 is a sidecar row of class judge_failed
        assert {r["_ng_failure_class"] for r in sidecar} == {"judge_failed"}
    else:  # Gym 0.4: /run failed; shardrun's terminal row after the attempts records its class, from the reason
        assert {(r["reason"], r["failure_class"]) for r in sidecar} == {
            ("/run failed with HTTP 500 (SimpleAgent___math_with_judge_simple_agent)", "environment")
        }
    # never a score: task 1 has no rollout, every other rollout was judged (the policy is always wrong: reward 0)
    rows = list(store.iter_jsonl_objects(store.rollouts_path(run_dir, 0)))
    assert len(rows) == 12 and 1 not in {r["_ng_task_index"] for r in rows}

    merged = faultkit.cli("merge-and-profile", run_dir)
    assert merged.returncode == 0, merged.stderr
    assert f"4: {klass} 4" in merged.stdout, merged.stdout
    assert f"warning: the run is unreliable, not hard: 4 of its 16 planned rollouts failed (25.0%: {klass} 4)" in (
        merged.stdout
    ), merged.stdout
    summary = orjson.loads(store.merged_summary_path(run_dir).read_bytes())
    assert summary["failures_by_class"] == {klass: 4} and summary["unreliable_labels"] == ["run"]
    assert {(f["task"], f["failure_class"]) for f in summary["failed"]} == {(1, klass)}
    # the denominators: task 1 is planned, has no result, and counts in no reward statistic
    aggregate = orjson.loads(store.merged_aggregate_metrics_path(run_dir).read_bytes())
    metrics = aggregate[0]["agent_metrics"]
    assert (metrics["coverage/expected"], metrics["coverage/scored"], metrics["coverage/missing"]) == (16, 12, 4)
    profile = {r["_ng_task_index"] for r in store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir))}
    assert 1 not in profile and len(profile) == 3

    status = faultkit.cli("status", run_dir)
    assert status.returncode == 0, status.stderr
    assert f"failed rollouts by class: {klass} 4 (failures, never scores)" in status.stdout, status.stdout
    data = report.gather(run_dir, use_sacct=False)
    assert report.failure_rows(data.tally) == [["run", "16", "4", "25.0%", f"{klass} 4", "unreliable"]]
    tally = records.read_failure_tally(run_dir)
    assert tally is not None and tally.by_class == {klass: 4}
    assert faultkit.leftovers(tag, also=run_dir) == []


JUDGE_KEY_ENV = "SHARDRUN_TEST_JUDGE_KEY"
MATH = "math_with_judge.resources_servers.math_with_judge"


def test_a_judge_that_hangs_on_a_quarter_of_its_requests_makes_failures_that_early_stopping_never_settles(
    tmp_path: Path, gym_env, policy_key, tag: str, monkeypatch
) -> None:
    """Gym 0.7, the judge shardrun's own (`judges.judge_model`, external): it never answers a request about task 1's
    question (the stand-in's `hang`, held until the test ends), so only the judge's gate (request_timeout_s 2) ends
    those requests. The policy is always wrong and the judge says "different" to every other question: every
    reward is 0, so after the first wave (shard 0) tasks 0, 2 and 3 are decided by `max_mean: 0.5` (their mean
    cannot exceed 0.5 whatever their last two rollouts give) and their second wave (shard 1) is skipped. Task 1's
    rollouts all failed: they are open, never evidence, so task 1 is not decided and its second wave runs (and
    fails again). A rule that took the failures for zeros would have skipped it with the others."""
    monkeypatch.setenv(JUDGE_KEY_ENV, JUDGE_KEY)
    with (
        faultkit.fake_policy(tmp_path, "--correct-share", "0", key=policy_key) as policy,
        faultkit.fake_policy(tmp_path, "--judge", "--fault", f"hang:match={FAILING_QUESTION}", key=JUDGE_KEY) as judge,
    ):
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            run_dir,
            policy.base_url,
            shards=2,
            gym={
                "overrides": [
                    f"++{MATH}.should_use_judge=true",
                    f"++{MATH}.judge_model_server.name=judge_model",
                ]
            },
            judges={
                "judge_model": {
                    "base_url": judge.base_url,
                    "model_name": "fake-model",
                    "api_key_env": JUDGE_KEY_ENV,
                    "request_timeout_s": 2,
                }
            },
            sampling={"stop_when_decided": {"max_mean": 0.5}, "wave": 2},
        )
        res = faultkit.cli("submit", cfg, timeout=580)
        out = res.stdout + res.stderr
        judged = judge.requests()
    assert res.returncode == 0, out + gymkit.log_text(run_dir) + gymkit.log_text(run_dir, 1)
    # the hung requests reached the judge and were ended by the gate; the others were answered
    assert any(r["fault"] == "hang" for r in judged) and any(r["fault"] is None for r in judged)
    assert all(FAILING_QUESTION in r["prompt"] for r in judged if r["fault"] == "hang")
    gym_logs = "".join(store.shard_dir(run_dir, i).joinpath("logs", "ng_run.log").read_text() for i in range(2))
    said = "gate: the judge judge_model did not answer within 2 s (judges.judge_model.request_timeout_s = 2)"
    assert said in gym_logs  # Gym's judge model server heard the gate's 504 (and retried it before giving up)

    markers = [orjson.loads(store.done_path(run_dir, i).read_bytes()) for i in range(2)]
    assert markers[0].get("num_skipped_decided", 0) == 0
    assert markers[1]["skipped_decided_tasks"] == [0, 2, 3] and markers[1]["num_skipped_decided"] == 6
    failed = {
        (r["_ng_task_index"], r["_ng_rollout_index"], r["_ng_failure_class"])
        for i in range(2)
        for r in store.iter_jsonl_objects(store.failures_path(run_dir, i))
    }
    # every rollout of task 1 failed, in both waves, as Gym 0.7's judge failure
    assert {(t, k) for t, k, _ in failed} == {(1, k) for k in range(4)} and {c for *_, c in failed} == {"judge_failed"}
    reasons = {
        r.get("_ng_failure_judge_error", "")
        for i in range(2)
        for r in store.iter_jsonl_objects(store.failures_path(run_dir, i))
    }
    assert reasons and all(reason for reason in reasons), reasons
    # never a score: no row of task 1, every other row a real verdict of 0
    rows = [r for i in range(2) for r in store.iter_jsonl_objects(store.rollouts_path(run_dir, i))]
    assert sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows) == [
        (t, k) for t in (0, 2, 3) for k in (0, 1)
    ]
    assert {r["reward"] for r in rows} == {0.0}

    merged = faultkit.cli("merge-and-profile", run_dir)
    assert merged.returncode == 0, merged.stderr
    summary = orjson.loads(store.merged_summary_path(run_dir).read_bytes())
    assert summary["failures_by_class"] == {"judge": 4} and summary["unreliable_labels"] == ["run"], summary
    profile = {r["_ng_task_index"] for r in store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir))}
    assert profile == {0, 2, 3}
    status = faultkit.cli("status", run_dir)
    assert "failed rollouts by class: judge 4 (failures, never scores)" in status.stdout, status.stdout
    data = report.gather(run_dir, use_sacct=False)
    [row] = report.failure_rows(data.tally)
    assert row[0] == "run" and row[2:] == ["4", row[3], "judge 4", "unreliable"], row
    assert faultkit.leftovers(tag, also=run_dir) == []
