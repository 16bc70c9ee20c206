"""The denominator made explicit (#14): a planned rollout without a result (missing, or failed for good) is left out
of the aggregate metrics (omit, both Gym versions' default) or counted as reward 0 at its own rollout index
(zero, `merge-and-profile --missing zero`); every agent's aggregate entry reports its coverage."""

from __future__ import annotations

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
