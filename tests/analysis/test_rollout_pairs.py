"""`compare`'s rollout-by-rollout pairing of a run and its re-score (analysis/rollout_pairs.py)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shardrun.analysis import rollout_pairs
from shardrun.core.errors import BadInput
from shardrun.rundir import store


def test_changed_rewards_are_counted_per_agent_and_label_with_examples() -> None:
    base = {(0, 0): ("a", 1.0), (0, 1): ("a", 0.0), (1, 0): ("b", 1.0), (1, 1): ("b", 1.0), (2, 0): ("b", 0.0)}
    cand = {(0, 0): ("a", 0.0), (0, 1): ("a", 0.0), (1, 0): ("b", 1.0), (1, 1): ("b", 0.5), (3, 0): ("b", 1.0)}
    got = rollout_pairs.pair(base, cand, {0: "math", 1: "tools"}, examples=1)
    assert (got["paired"], got["changed"], got["up"], got["down"]) == (4, 2, 0, 2)
    assert (got["only_base"], got["only_cand"]) == (1, 1)
    by = {(g["kind"], g["group"]): (g["paired"], g["changed"]) for g in got["groups"]}
    assert by == {
        ("all", "all"): (4, 2),
        ("agent", "a"): (2, 1),
        ("agent", "b"): (2, 1),
        ("label", "math"): (2, 1),
        ("label", "tools"): (2, 1),
    }
    assert got["groups"][0]["kind"] == "all"
    assert got["examples"] == [
        {"task_index": 0, "rollout_index": 0, "agent": "a", "label": "math", "reward_base": 1.0, "reward_cand": 0.0}
    ]
    lines = rollout_pairs.text(got)
    assert lines[0] == "  rollouts: 4 paired, 2 changed reward (+0/-2), scored only in base 1, only in candidate 1"
    assert "    task 0 rollout 0 (a): 1 -> 0" in lines


def test_identical_scorings_change_nothing() -> None:
    rewards = {(t, r): ("a", float((t + r) % 2)) for t in range(5) for r in range(3)}
    got = rollout_pairs.pair(rewards, dict(rewards))
    assert (got["paired"], got["changed"], got["examples"]) == (15, 0, [])


def test_merged_rows_are_checked_before_they_are_trusted(tmp_path: Path) -> None:
    path = store.merged_rollouts_path(tmp_path)
    path.parent.mkdir(parents=True)
    good = {"_ng_task_index": 0, "_ng_rollout_index": 0, "reward": 1, "agent_ref": {"name": "a"}}
    path.write_bytes(orjson.dumps(good) + b"\n")
    assert rollout_pairs.read_rewards(tmp_path) == {(0, 0): ("a", 1.0)}
    for bad in ({**good, "reward": "1"}, {**good, "reward": float("nan")}, {**good, "_ng_task_index": "0"}):
        path.write_bytes(orjson.dumps(good) + b"\n" + orjson.dumps(bad, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        with pytest.raises(BadInput, match="line 2"):
            rollout_pairs.read_rewards(tmp_path)
    with pytest.raises(BadInput, match="no merged rollouts"):
        rollout_pairs.read_rewards(tmp_path / "elsewhere")


def test_compare_pairs_rollouts_only_when_the_runs_hold_the_same_rollouts(tmp_path: Path) -> None:
    from reportkit import input_row, merge_run, planned_run, seal_shards

    from shardrun.analysis import comparison

    rows = [input_row(i, ("agent_a", "agent_b")[i % 2]) for i in range(6)]
    for name in ("base", "cand", "other"):
        (tmp_path / name).mkdir()
    base, _ = planned_run(tmp_path / "base", rows, num_repeats=3)
    cand, _ = planned_run(tmp_path / "cand", rows, num_repeats=3)
    other, _ = planned_run(tmp_path / "other", rows, num_repeats=2)

    def old(t: int, r: int) -> float:
        return float((t + r) % 2)

    def new(t: int, r: int) -> float:  # task 0's and task 3's rollouts 1 flip
        return 1.0 - old(t, r) if (t, r) in {(0, 1), (3, 1)} else old(t, r)

    for run, reward in ((base, old), (cand, new), (other, old)):
        seal_shards(run, reward)
        merge_run(run)
    summary = comparison.compare(base, [cand, other], resamples=10).summary
    got = summary["candidates"][0]["rollouts"]
    assert (got["paired"], got["changed"], got["up"], got["down"]) == (18, 2, 1, 1)
    agents = {g["group"]: g["changed"] for g in got["groups"] if g["kind"] == "agent"}
    assert agents == {"agent_a": 1, "agent_b": 1}
    assert [(e["task_index"], e["rollout_index"], e["reward_base"], e["reward_cand"]) for e in got["examples"]] == [
        (0, 1, 1.0, 0.0),
        (3, 1, 0.0, 1.0),
    ]
    assert "rollouts" not in summary["candidates"][1]  # other repeats: task by task only
