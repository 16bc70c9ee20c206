"""shardrun's merged profile equals the real profiler of each supported NeMo Gym version (`ng_reward_profile` of
0.4.0, `gym eval profile` of 0.7.0: gym_each) on the merged files, file by file and row by row, and its
aggregate metrics equal Gym's `compute_aggregate_metrics` + `compute_pass_majority_metrics` (0.4.0; with masked
rollouts, each version's)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import store
from shardrun.core import gym_adapter
from tests.builders import Run, input_rows, make_run, rollout_row, write_shard

pytestmark = [pytest.mark.gym, pytest.mark.slow]


def same(got: Any, want: Any, where: str = "") -> None:
    """Equal keys in equal order, equal types, floats to 1e-9 relative."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for k in want:
            same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want), (where, got, want)
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
        else:
            assert got == want, where


@pytest.fixture()
def gym_each(gym_venv_each: Path, monkeypatch) -> Path:
    """Each supported Gym version's venv, as the venv the run is planned with (so its profile is that version's)."""
    monkeypatch.setenv("SHARDRUN_GYM_VENV", str(gym_venv_each))
    return gym_venv_each


def gym_profile(gym_venv: Path, merged: Path, work: Path, partial: bool) -> tuple[list[dict], list[dict]]:
    work.mkdir()
    for name in ("rollouts.jsonl", "rollouts_materialized_inputs.jsonl"):
        shutil.copy(merged / name, work / name)
    release = gym_adapter.for_venv(gym_venv)
    cmd = release.profile_command(
        gym_venv, work / "rollouts_materialized_inputs.jsonl", work / "rollouts.jsonl", partial
    )
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [orjson.loads(x) for x in (work / "rollouts_reward_profiling.jsonl").read_bytes().splitlines()]
    return rows, orjson.loads((work / "rollouts_agent_metrics.json").read_bytes())


def assert_profile_equals_gym(gym_venv: Path, run_dir: Path, work: Path, partial: bool, empty: bool = False) -> None:
    """The merged profile files equal the version's profiler's on the merged files (`empty`: no per-task row)."""
    merged = store.merged_dir(run_dir)
    want_rows, want_agents = gym_profile(gym_venv, merged, work, partial)
    got_rows = [orjson.loads(x) for x in (merged / "rollouts_reward_profiling.jsonl").read_bytes().splitlines()]
    assert len(got_rows) == len(want_rows) and (len(want_rows) == 0) == empty
    for got, want in zip(got_rows, want_rows):
        same(got, want, f"task {want['_ng_task_index']}")
    same(orjson.loads((merged / "rollouts_agent_metrics.json").read_bytes()), want_agents, "agents")
    ours = {p.name for p in merged.glob("rollouts_*_metrics.json")} - {"rollouts_aggregate_metrics.json"}
    assert ours == {p.name for p in work.glob("rollouts_*_metrics.json")}  # the version's files, no more
    for name in ours - {"rollouts_agent_metrics.json"}:  # 0.7: rollouts_repeat_level_metrics.json
        same(orjson.loads((merged / name).read_bytes()), orjson.loads((work / name).read_bytes()), name)


def test_partial_run_with_duplicates_torn_foreign_and_failures(gym_each: Path, tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        input_rows(12, agents=("math", "tool"), explicit_index=True, shuffle_seed=2),
        num_repeats={"math": 4, "_default": 2},
        num_shards=4,
        slicing="round_robin",
    )
    for i in range(4):
        write_shard(run, i, duplicates=i, torn=i == 1, foreign=i == 2, failed=i == 3, missing=i == 0, seed=i)
    merge_and_profile(run.run_dir)
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=True)


def odd_row(m: dict[str, Any]) -> dict[str, Any]:
    """Rows that exercise Gym's corner cases: usage keys shadowing top-level keys, a null or bool reward,
    fields only some rows have, rows without usage. (Integers near 2**60 are left out: Gym's own histogram
    step fails on them; tests/merge/test_merge.py covers them.)"""
    row = rollout_row(m)
    t, r = m["_ng_task_index"], m["_ng_rollout_index"]
    variant = (t * 3 + r) % 6
    if variant == 0:
        row["input_tokens"] = 999  # also in response.usage: usage wins in stats, top level in rollout_infos
    elif variant == 1:
        row["reward"] = None
    elif variant == 2:
        row["reward"] = bool(r % 2)
    elif variant == 3:
        row["only_some"] = 3.25
        row["negative"] = -7
    elif variant == 4:
        row["response"]["usage"] = None
    return row


def test_corner_case_rows_complete_run(gym_each: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(9, agents=("a", "b")), num_repeats={"a": 3, "_default": 1}, num_shards=3)
    for i in range(3):
        write_shard(run, i, make_row=odd_row, seed=i)
    summary = merge_and_profile(run.run_dir)
    assert summary.tasks_complete == 9
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=False)


def int_row(m: dict[str, Any]) -> dict[str, Any]:
    t, r = m["_ng_task_index"], m["_ng_rollout_index"]
    return {
        "response": {"usage": {"input_tokens": 10 + t, "output_tokens": 5 * r + t % 3, "total_tokens": 15}},
        "reward": (t + r) % 2,
        "turns": 1 + r,
        "ok": r % 3 == 0,
        "_ng_task_index": t,
        "_ng_rollout_index": r,
        "agent_ref": m["agent_ref"],
    }


def test_all_integer_frame_keeps_integer_max_and_min(gym_each: Path, tmp_path: Path) -> None:
    run = make_run(
        tmp_path, input_rows(6, agents=("a", "b")), num_repeats={"a": 4, "b": 1}, num_shards=2, slicing="round_robin"
    )
    for i in range(2):
        write_shard(run, i, make_row=int_row, seed=i)
    merge_and_profile(run.run_dir)
    first = orjson.loads(store.merged_reward_profiling_path(run.run_dir).read_bytes().splitlines()[0])
    assert isinstance(first["max/reward"], int)
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=False)


GYM_AGGREGATE = r"""
import sys, orjson
from collections import defaultdict
from nemo_gym.reward_profile import compute_aggregate_metrics, compute_pass_majority_metrics, highest_k_metrics
rollouts_path, materialized_path, answer_key = sys.argv[1:4]
agent_of = {}
for line in open(materialized_path, "rb"):
    row = orjson.loads(line)
    agent_of[row["_ng_task_index"]] = row["agent_ref"]["name"]
by_agent = defaultdict(list)
for line in open(rollouts_path, "rb"):
    r = orjson.loads(line)
    entry = {k: v for k, v in r.items() if k not in ("response", "responses_create_params")}
    usage = (r.get("response") or {}).get("usage")
    if usage:
        entry["response"] = {"usage": usage}
    by_agent[agent_of[r["_ng_task_index"]]].append(entry)
def key_metrics(m):
    key = {k: v for k, v in m.items() if k.startswith("mean/")}
    key.update(highest_k_metrics(m, "pass@1[avg-of-{k}]"))
    key.update(highest_k_metrics(m, "pass@{k}", exclude_names=["no_answer"]))
    key.update(highest_k_metrics(m, "majority@{k}", exclude_names=["no_answer"]))
    return key
out = []
for name in sorted(by_agent):
    agg = compute_aggregate_metrics(
        by_agent[name], compute_metrics_fn=lambda tasks: compute_pass_majority_metrics(tasks, answer_key=answer_key)[0],
        get_key_metrics_fn=key_metrics)
    out.append({"agent_ref": {"name": name}, "agent_metrics": agg.agent_metrics, "key_metrics": agg.key_metrics,
                "group_level_metrics": agg.group_level_metrics})
sys.stdout.buffer.write(orjson.dumps(out))
"""


def k_of(key: str) -> int | None:
    """The k of a pass@k / pass@1[avg-of-k] / majority@k key (None for other keys)."""
    k = key.split("/")[0]
    return int(k.split("-of-")[1].rstrip("]")) if "avg-of" in k else (int(k.split("@")[1]) if "@" in k else None)


def ks_of(metrics: dict[str, Any]) -> set[int]:
    """The ks shardrun computes (1, 2, 4, ... and the repeats; Gym computes every k up to the repeats)."""
    keys = (key for key in metrics if key.startswith(("pass@", "majority@")) and not key.startswith("pass@1["))
    return {k for key in keys if (k := k_of(key)) is not None}


def test_aggregate_metrics_equal_gyms_compute_pass_majority_metrics(gym_each: Path, tmp_path: Path) -> None:
    """Each version's `compute_aggregate_metrics` + `compute_pass_majority_metrics` on the merged rollouts: the same
    per-task rows, stats, pass@k and majority@k (Gym 0.7's `num_repeats` and across-repeat keys are not in
    shardrun's aggregate file: they are in the agent metrics of the profile)."""
    run = make_run(
        tmp_path,
        input_rows(10, agents=("math", "tool")),
        num_repeats={"math": 8, "_default": 4},
        num_shards=3,
        slicing="round_robin",
    )
    for i in range(3):
        write_shard(
            run,
            i,
            duplicates=1,
            failed=i == 0,
            seed=i,
            make_row=lambda m: rollout_row(m, continuous=m["agent_ref"]["name"] == "tool"),
        )
    merge_and_profile(run.run_dir, answer_field="extracted_answer")
    want = gym_aggregate(gym_each, store.merged_dir(run.run_dir), "extracted_answer")
    got = orjson.loads(store.merged_aggregate_metrics_path(run.run_dir).read_bytes())
    assert [e["agent_ref"] for e in got] == [e["agent_ref"] for e in want]
    for g, w in zip(got, want):
        same(g["group_level_metrics"], w["group_level_metrics"], "groups")
        ours, gyms = g["agent_metrics"], w["agent_metrics"]
        ks = ks_of(ours)
        assert ks == {1, 2, 4} | ({8} if g["agent_ref"]["name"] == "math" else set())
        for key, value in gyms.items():
            if key != "num_repeats" and "_across_repeats/" not in key and (k_of(key) is None or k_of(key) in ks):
                assert key in ours, key
                same(ours[key], value, key)
        same(
            {k: v for k, v in g["key_metrics"].items() if "@" in k},
            {k: v for k, v in w["key_metrics"].items() if "@" in k},
            "key_metrics",
        )


# ---------------------------------------------------------------- mask_sample (Gym 0.7: not a measurement)

MASKED = (True, 1, "yes", 2.5)  # truthy: Gym 0.7 leaves the rollout out of the quality stats
MEASURED = (False, 0, None, 0.0, "")  # falsy: measured, as a rollout without the field
COVERAGE_KEYS = (  # Gym 0.7's, for an agent with a masked rollout
    "coverage/measured_rollouts",
    "coverage/masked_rollouts",
    "coverage/measured_tasks",
    "coverage/fully_masked_tasks",
)


def masked_row(m: dict[str, Any]) -> dict[str, Any]:
    """Agents cycle over the tasks (math, tool, judge). judge: every rollout masked; math: its first task fully
    masked, its second partly (rollouts 1 and 3), the rest measured; tool: nothing masked. Masked rows alone carry
    `judge_error` (a column the measured frame does not have); measured rows carry a falsy flag or none."""
    row = rollout_row(m)
    t, r, agent = m["_ng_task_index"], m["_ng_rollout_index"], m["agent_ref"]["name"]
    nth = t // 3  # the agent's nth task
    if agent == "judge" or (agent == "math" and (nth == 0 or (nth == 1 and r in (1, 3)))):
        row["mask_sample"] = MASKED[(t + r) % len(MASKED)]
        row["judge_error"] = 1 + r
    elif (t + r) % 3:
        row["mask_sample"] = MEASURED[(t + r) % len(MEASURED)]
    return row


def masked_run(tmp_path: Path, tasks: int = 12) -> Run:
    return make_run(
        tmp_path,
        input_rows(tasks, agents=("math", "tool", "judge")),
        num_repeats={"math": 4, "tool": 3, "_default": 2},
        num_shards=3,
        slicing="round_robin",
    )


def test_masked_rollouts_partial_run(gym_each: Path, tmp_path: Path) -> None:
    run = masked_run(tmp_path)
    for i in range(3):
        write_shard(run, i, make_row=masked_row, duplicates=i == 1, missing=i == 0, failed=i == 2, seed=i)
    summary = merge_and_profile(run.run_dir)
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=True)

    merged = store.merged_dir(run.run_dir)
    kept = [orjson.loads(x) for x in (merged / "rollouts.jsonl").read_bytes().splitlines()]
    masked = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in kept if r.get("mask_sample")]
    assert len(masked) > 10 and summary.rollouts == len(kept)  # collected, so merged and counted as completed
    agents = orjson.loads((merged / "rollouts_agent_metrics.json").read_bytes())
    profiled = {
        orjson.loads(x)["_ng_task_index"]
        for x in (merged / "rollouts_reward_profiling.jsonl").read_bytes().splitlines()
    }
    if gym_adapter.for_venv(gym_each).mask_field is None:  # 0.4: a field like any other
        assert summary.masked_rollouts == 0 and profiled == {r["_ng_task_index"] for r in kept}
        assert [a["agent_ref"]["name"] for a in agents] == ["judge", "math", "tool"]
        assert all("mean/mask_sample" in a for a in agents)
        return
    assert summary.masked_rollouts == len(masked)
    assert 0 not in profiled and not profiled & {t for t in range(12) if t % 3 == 2}  # fully masked tasks
    assert 3 in profiled  # partly masked
    assert [a["agent_ref"]["name"] for a in agents] == ["math", "tool", "judge"]  # judge: nothing measured
    math, tool, judge = agents
    assert not any("mask_sample" in k or "judge_error" in k for a in agents for k in a)
    assert math["coverage/fully_masked_tasks"] == 1 and math["coverage/masked_rollouts"] >= 5
    assert not any(k.startswith("coverage/") for k in tool)
    assert list(judge) == ["agent_ref", *COVERAGE_KEYS] and judge["coverage/measured_rollouts"] == 0


def test_masked_rollouts_complete_run(gym_each: Path, tmp_path: Path) -> None:
    run = masked_run(tmp_path, tasks=9)
    for i in range(3):
        write_shard(run, i, make_row=masked_row, seed=i)
    assert merge_and_profile(run.run_dir).tasks_complete == 9
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=False)


def test_every_rollout_masked(gym_each: Path, tmp_path: Path) -> None:
    """Gym 0.7: no per-task row, no repeat row, one coverage-only entry per agent; 0.4: an ordinary profile."""
    run = make_run(tmp_path, input_rows(4, agents=("a", "b")), num_repeats=2, num_shards=2)
    for i in range(2):
        write_shard(run, i, make_row=lambda m: rollout_row(m) | {"mask_sample": True}, seed=i)
    merge_and_profile(run.run_dir)
    masks = gym_adapter.for_venv(gym_each).mask_field is not None
    assert_profile_equals_gym(gym_each, run.run_dir, tmp_path / "gym", partial=False, empty=masks)


def gym_aggregate(gym_venv: Path, merged: Path, answer_key: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [
            str(gym_venv / "bin" / "python"),
            "-c",
            GYM_AGGREGATE,
            str(merged / "rollouts.jsonl"),
            str(merged / "rollouts_materialized_inputs.jsonl"),
            answer_key,
        ],
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return orjson.loads(done.stdout)


def test_aggregate_metrics_with_masked_rollouts_equal_gyms(gym_each: Path, tmp_path: Path) -> None:
    """Each version's `compute_aggregate_metrics` on the merged rollouts (0.7: the measured ones, and the coverage
    of the masked ones): the same per-task rows, stats, pass@k, majority@k and coverage (Gym 0.7's
    `num_repeats` and across-repeat keys are not in shardrun's aggregate file)."""
    run = masked_run(tmp_path)
    for i in range(3):
        write_shard(run, i, make_row=masked_row, duplicates=1, failed=i == 0, seed=i)
    merge_and_profile(run.run_dir, answer_field="extracted_answer")
    want = gym_aggregate(gym_each, store.merged_dir(run.run_dir), "extracted_answer")
    got = orjson.loads(store.merged_aggregate_metrics_path(run.run_dir).read_bytes())
    assert [e["agent_ref"] for e in got] == [e["agent_ref"] for e in want]
    masks = gym_adapter.for_venv(gym_each).mask_field is not None
    for g, w in zip(got, want):
        where = g["agent_ref"]["name"]
        same(g["group_level_metrics"], w["group_level_metrics"], f"{where} groups")
        ks = ks_of(g["agent_metrics"])
        gyms = {
            k: v
            for k, v in w["agent_metrics"].items()
            if k != "num_repeats" and "_across_repeats/" not in k and (k_of(k) is None or k_of(k) in ks)
        }
        assert gyms, where
        for key, value in gyms.items():
            assert key in g["agent_metrics"], (where, key)
            same(g["agent_metrics"][key], value, f"{where} {key}")
        headline = ("@", "coverage/measured", "coverage/masked", "coverage/fully")
        same(
            {k: v for k, v in g["key_metrics"].items() if any(h in k for h in headline)},
            {k: v for k, v in w["key_metrics"].items() if any(h in k for h in headline)},
            f"{where} key_metrics",
        )
        has_coverage = any(k in w["agent_metrics"] for k in COVERAGE_KEYS)
        assert has_coverage == (masks and where != "tool"), where
    if masks:
        judge = got[0]["agent_metrics"]
        assert got[0]["group_level_metrics"] == [] and judge["coverage/measured_rollouts"] == 0
        assert judge["coverage/scored"] == judge["coverage/masked_rollouts"]  # collected, none measured
