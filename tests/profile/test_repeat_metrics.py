"""Gym 0.7's repeat-level metrics (shardrun.profile.repeat_metrics): by hand on a small frame, and equal to the real
nemo-gym 0.7 RewardProfiler on generated rows with missing repeats, missing fields, bools and single-repeat agents."""

from __future__ import annotations

import math
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from shardrun.profile import repeat_metrics
from shardrun.profile.repeat_metrics import RolloutFrame
from tests.conftest import gym_venv_of_version
from tests.e2e.test_profile_vs_gym import same


def frame_of(rows: list[dict[str, Any]], agent_of: dict[int, str]) -> RolloutFrame:
    """The numeric frame Gym's profiler builds from rollout rows (numeric top-level fields and usage, bools as 0/1,
    keys starting with '_' left out)."""
    names = sorted(set(agent_of.values()))
    records = []
    for r in rows:
        merged = r | ((r.get("response") or {}).get("usage") or {})
        records.append(
            {
                k: int(v) if isinstance(v, bool) else v
                for k, v in merged.items()
                if not k.startswith("_") and isinstance(v, (int, float))
            }
        )
    columns = {k: np.array([rec.get(k, math.nan) for rec in records]) for k in {k for rec in records for k in rec}}
    return RolloutFrame(
        agent_names=names,
        agent=np.array([names.index(agent_of[r["_ng_task_index"]]) for r in rows]),
        task=np.array([r["_ng_task_index"] for r in rows]),
        rollout=np.array([r["_ng_rollout_index"] for r in rows]),
        names=list(columns),
        column=columns.__getitem__,
    )


def test_repeat_rows_and_across_repeats_by_hand() -> None:
    rows = [
        {"_ng_task_index": t, "_ng_rollout_index": r, "reward": float(v)}
        for (t, r, v) in [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1), (2, 0, 0)]
    ] + [{"_ng_task_index": 9, "_ng_rollout_index": 0, "reward": 1.0}]
    got = repeat_metrics.repeat_level_metrics(frame_of(rows, {0: "a", 1: "a", 2: "a", 9: "single"}))
    assert [(g["agent_ref"]["name"], g["_ng_rollout_index"], g["sample_count"], g["missing_count"]) for g in got] == [
        ("a", 0, 3, 0),
        ("a", 1, 2, 1),
    ]  # the agent with one rollout index has no repeat rows
    first = got[0]
    assert first["mean/reward"] == pytest.approx(2 / 3) and first["median/reward"] == 1.0
    assert first["std/reward"] == pytest.approx(math.sqrt(1 / 3)) and first["p25/reward"] == 0.5
    half = 4.302652729911275 * first["sem/reward"]  # t(0.975, df 2)
    assert first["ci_low_95/reward"] == pytest.approx(2 / 3 - half) and first["ci_high_95/reward"] == pytest.approx(
        2 / 3 + half
    )
    assert got[1]["std/reward"] == 0.0 and got[1]["ci_low_95/reward"] == got[1]["ci_high_95/reward"] == 1.0
    across = repeat_metrics.across_repeats(got)
    assert list(across) == ["a"]
    assert across["a"]["mean_across_repeats/mean/reward"] == pytest.approx((2 / 3 + 1) / 2)
    assert list(across["a"])[:6] == [
        f"{s}_across_repeats/mean/reward" for s in ("mean", "median", "std", "min", "max", "se")
    ]
    assert not any(k.startswith(("std_across_repeats/std", "mean_across_repeats/sample")) for k in across["a"])


def test_primary_metrics_follow_gym() -> None:
    assert repeat_metrics.is_primary_metric("mean/reward")
    for name in ("std/reward", "sample_count", "_ng_rollout_index", "mean/score_ci_lower", "mean_across_repeats/x"):
        assert not repeat_metrics.is_primary_metric(name), name


GYM_REPEATS = r"""
import sys, warnings, orjson
warnings.simplefilter("ignore")
from nemo_gym.reward_profile import RewardProfiler
rows = orjson.loads(open(sys.argv[1], "rb").read())
results = orjson.loads(open(sys.argv[2], "rb").read())
rp = RewardProfiler()
_, agents, repeats = rp.profile_from_data(rows, results, allow_partial_rollouts=True)
sys.stdout.buffer.write(orjson.dumps({"agents": rp.prepare_for_serialization(agents), "repeats": repeats}))
"""


def generated(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, str]]:
    rnd = random.Random(seed)
    materialized, results, agent_of = [], [], {}
    for t in range(40):
        agent = ("math", "tool", "solo")[t % 3]
        agent_of[t] = agent
        for r in range({"math": 5, "tool": 3, "solo": 1}[agent]):
            materialized.append({"_ng_task_index": t, "_ng_rollout_index": r, "agent_ref": {"name": agent}})
            if rnd.random() < 0.15:
                continue  # a missing rollout
            row: dict[str, Any] = {
                "_ng_task_index": t,
                "_ng_rollout_index": r,
                "agent_ref": {"name": agent},
                "reward": rnd.choice((0.0, 1.0, 0.5)),
                "response": {"usage": {"input_tokens": rnd.randint(5, 50), "output_tokens": rnd.randint(1, 99)}},
            }
            if agent == "math":
                row["library_reward"] = rnd.random() < 0.5  # a bool field
            if rnd.random() < 0.3:
                row["sometimes"] = rnd.uniform(-3, 3)
            results.append(row)
    return materialized, results, agent_of


@pytest.mark.gym
def test_equal_to_gym_0_7_profiler(tmp_path: Path) -> None:
    venv = gym_venv_of_version("0.7.0")
    materialized, results, agent_of = generated(7)
    (tmp_path / "rows.json").write_bytes(orjson.dumps(materialized))
    (tmp_path / "results.json").write_bytes(orjson.dumps(results))
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", GYM_REPEATS, str(tmp_path / "rows.json"), str(tmp_path / "results.json")],
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    want = orjson.loads(done.stdout)
    got = repeat_metrics.repeat_level_metrics(frame_of(results, agent_of))
    assert len(got) == len(want["repeats"]) == 5 + 3
    same(got, want["repeats"], "repeats")
    across = repeat_metrics.across_repeats(got)
    for agent in want["agents"]:
        name = agent["agent_ref"]["name"]
        tail = {k: v for k, v in agent.items() if "_across_repeats/" in k}
        same(across.get(name, {}), tail, name)
