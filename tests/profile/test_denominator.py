"""The denominator made explicit (#14): a planned rollout without a result (missing, or failed for good) is left out
of the aggregate metrics (omit, both Gym versions' default) or counted as reward 0 at its own rollout index
(zero, `merge-and-profile --missing zero`); every agent's aggregate entry reports its coverage. A masked rollout
(Gym 0.7's `mask_sample`) has a result: it is neither missing nor imputed, only left out of the statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core.errors import BadInput
from shardrun.profile import denominator
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import store
from tests.builders import input_rows, make_run, rollout_row, write_shard

REPEATS = 4


def test_zeros_go_in_at_their_own_keys() -> None:
    keys, reward, answers = denominator.with_zeros(
        np.array([10, 12, 20]), np.array([1.0, 0.5, 1.0]), np.array([3, 4, 5]), np.array([11, 13]), 0
    )
    assert keys.tolist() == [10, 11, 12, 13, 20] and reward.tolist() == [1.0, 0.0, 0.5, 0.0, 1.0]
    assert answers is not None and answers.tolist() == [3, 0, 4, 0, 5]
    assert denominator.coverage(8, 5, None) == {"coverage/expected": 8, "coverage/scored": 5, "coverage/missing": 3}
    assert denominator.coverage(8, 5, 3)["coverage/scored"] == 8
    with pytest.raises(BadInput, match="--missing 'nan'"):
        denominator.check_policy("nan")


@pytest.fixture()
def gappy(tmp_path):
    """4 tasks x 4 repeats over 2 shards; shard 0 lost 2 rollouts, shard 1 failed 1 for good."""
    run = make_run(tmp_path, input_rows(4, agents=("math",)), num_repeats=REPEATS, num_shards=2)
    gone = write_shard(run, 0, missing=2).missing + write_shard(run, 1, failed=1).failed
    return run, set(gone)


def rewards_by_task(run, gone: set, zero: bool) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for shard in range(run.num_shards):
        for m in run.materialized(shard):
            key = (m["_ng_task_index"], m["_ng_rollout_index"])
            if key in gone and not zero:
                continue
            out.setdefault(key[0], []).append(0.0 if key in gone else rollout_row(m)["reward"])
    return out


@pytest.mark.parametrize("policy", ["omit", "zero"])
def test_the_policy_decides_the_denominator_and_coverage_is_reported(gappy, policy) -> None:
    run, gone = gappy
    merge_and_profile(run.run_dir, missing=policy)
    (entry,) = orjson.loads(store.merged_aggregate_metrics_path(run.run_dir).read_bytes())
    metrics = entry["agent_metrics"]
    planned, counted = 4 * REPEATS, 4 * REPEATS - len(gone)
    assert metrics["coverage/expected"] == planned and metrics["coverage/missing"] == len(gone) == 3
    assert metrics["coverage/scored"] == (planned if policy == "zero" else counted)
    assert ("coverage/imputed" in metrics) == (policy == "zero")
    by_task = rewards_by_task(run, gone, policy == "zero")
    flat = [r for rs in by_task.values() for r in rs]
    assert metrics["pass@1/accuracy"] == pytest.approx(100 * np.mean([np.mean(rs) for rs in by_task.values()]))
    if policy == "zero":
        assert metrics["mean/reward"] == pytest.approx(np.mean(flat))
    # the per-task profile stays as Gym writes it: collected rollouts only, with their own coverage
    profile = [orjson.loads(x) for x in store.merged_reward_profiling_path(run.run_dir).read_bytes().splitlines()]
    assert sum(p["num_rollouts"] for p in profile) == counted
    assert sum(p["expected_num_rollouts"] for p in profile) == planned


def test_cli_missing_flag(gappy) -> None:
    run, gone = gappy
    res = CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir), "--missing", "zero"])
    assert res.exit_code == 0, res.output
    (entry,) = orjson.loads(store.merged_aggregate_metrics_path(run.run_dir).read_bytes())
    assert entry["agent_metrics"]["coverage/imputed"] == len(gone)
    res = CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir), "--missing", "half"])
    assert res.exit_code == 2 and "--missing 'half'" in res.output


def gym_07_venv(root: Path) -> Path:
    """A directory that reads as a nemo-gym 0.7.0 venv (its metadata only: enough to plan and profile with)."""
    venv = root / "gym-0.7.0"
    meta = venv / "lib" / "python3.13" / "site-packages" / "nemo_gym-0.7.0.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text("Metadata-Version: 2.4\nName: nemo-gym\nVersion: 0.7.0\n")
    return venv


def test_masked_coverage() -> None:
    assert denominator.masked_coverage(np.array([1, 1, 2]), np.zeros(0, np.int64)) == {}
    assert denominator.masked_coverage(np.array([1, 1, 2]), np.array([2, 3, 3])) == {
        "coverage/measured_rollouts": 3,
        "coverage/masked_rollouts": 3,
        "coverage/measured_tasks": 2,
        "coverage/fully_masked_tasks": 1,
    }


@pytest.mark.parametrize("policy", ["omit", "zero"])
def test_a_masked_rollout_is_completed_but_not_measured(tmp_path, monkeypatch, policy) -> None:
    monkeypatch.setenv("SHARDRUN_GYM_VENV", str(gym_07_venv(tmp_path)))
    run = make_run(tmp_path, input_rows(4, agents=("math",)), num_repeats=REPEATS, num_shards=2)

    def row(m: dict) -> dict:
        masked = m["_ng_task_index"] == 0 or (m["_ng_task_index"] + m["_ng_rollout_index"]) % 3 == 0
        return rollout_row(m) | ({"mask_sample": True} if masked else {})

    written = write_shard(run, 0, missing=2, make_row=row).rows + write_shard(run, 1, failed=1, make_row=row).rows
    masked = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in written if r.get("mask_sample")}
    measured = [r for r in written if not r.get("mask_sample")]
    gone = 4 * REPEATS - len(written)
    summary = merge_and_profile(run.run_dir, missing=policy)
    assert summary.masked_rollouts == len(masked) > 4 and summary.rollouts == len(written)
    (entry,) = orjson.loads(store.merged_aggregate_metrics_path(run.run_dir).read_bytes())
    metrics = entry["agent_metrics"]
    imputed = gone if policy == "zero" else 0
    assert metrics["coverage/missing"] == gone == 3 and metrics.get("coverage/imputed", 0) == imputed
    assert metrics["coverage/masked_rollouts"] == len(masked)
    assert metrics["coverage/measured_rollouts"] == len(measured) + imputed
    assert metrics["coverage/scored"] == metrics["coverage/measured_rollouts"] + metrics["coverage/masked_rollouts"]
    planned = {k for shard in range(run.num_shards) for k in run.identities(shard)}
    lost_in_0 = any(t == 0 for t, _ in planned - {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in written})
    fully = 0 if policy == "zero" and lost_in_0 else 1  # task 0: every collected rollout masked; an imputed one counts
    assert metrics["coverage/fully_masked_tasks"] == fully == entry["key_metrics"]["coverage/fully_masked_tasks"]
    if policy == "omit":
        by_task: dict[int, list[float]] = {}
        for r in measured:
            by_task.setdefault(r["_ng_task_index"], []).append(r["reward"])
        assert metrics["mean/reward"] == pytest.approx(np.mean([r["reward"] for r in measured]))
        assert metrics["pass@1/accuracy"] == pytest.approx(100 * np.mean([np.mean(v) for v in by_task.values()]))
    profile = [orjson.loads(x) for x in store.merged_reward_profiling_path(run.run_dir).read_bytes().splitlines()]
    assert 0 not in {p["_ng_task_index"] for p in profile}
    assert sum(p["num_rollouts"] for p in profile) == len(measured)
    assert sum(p["expected_num_rollouts"] for p in profile) + len(masked) <= 4 * REPEATS
    assert len(store.merged_rollouts_path(run.run_dir).read_bytes().splitlines()) == len(written)
