"""A judge that fails a quarter of its requests, against real NeMo Gym 0.7 and 0.4 (math_with_judge with its judge on,
bound to a judge model server of its own): those rollouts are failures (class `judge` under 0.7), never zeros; the profile's
denominators, the merge summary, `status` and the report say so per class, and the run is named unreliable
(docs/failures.md).

The judge is a second stand-in (tests/fakes/policy_server.py: the fake at the model seam) that answers HTTP 500 to
every judge request about task 1's question, by content, whatever order requests arrive in. The policy answers
every question wrongly, so math_with_judge asks the judge about every rollout.
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
