"""shardrun.api on real small runs: planned by the planner, every shard written in NeMo Gym's formats and sealed
(tests/builders.py, no servers), merged by `shardrun merge-and-profile`. Expected values are recomputed from the
builders' rows (a pure function of the identity), not read back from the files the API reads."""

from __future__ import annotations

import dataclasses
import statistics
import tracemalloc
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import builders
from tests.machine_env import without_machine_gym_venv
from shardrun import api
from shardrun.cli import app
from shardrun.core.errors import BadInput, RunDirError
from shardrun.rundir import fileio, store

TASKS = 12
REPEATS = {"math": 4, "_default": 2}


def merge(run_dir: Path) -> None:
    res = CliRunner().invoke(app, ["merge-and-profile", str(run_dir)], catch_exceptions=False)
    assert res.exit_code == 0, res.output


def planned_rows(run: builders.Run) -> list[dict]:
    return [m for i in range(run.num_shards) for m in run.materialized(i)]


@pytest.fixture(scope="session")  # once per xdist worker, however its tests interleave with others
def merged_run(tmp_path_factory) -> builders.Run:
    """12 tasks of two agents (4 and 2 repeats), 3 shards, one with rollouts written twice (a resumed attempt)."""
    with without_machine_gym_venv():  # as the tests that read it (tests/machine_env.py)
        run = builders.make_run(
            tmp_path_factory.mktemp("api"),
            builders.input_rows(TASKS, agents=("math", "tool")),
            num_repeats=REPEATS,
            num_shards=3,
            slicing="round_robin",
        )
        for i in range(run.num_shards):
            builders.write_shard(run, i, duplicates=3 if i == 1 else 0)
        merge(run.run_dir)
    return run


def test_load_plan_is_the_plan_the_run_was_planned_with(merged_run):
    plan = api.load_plan(str(merged_run.run_dir))
    assert plan == merged_run.plan
    assert plan.num_tasks == TASKS and plan.num_rollouts == 6 * 4 + 6 * 2 and len(plan.shards) == 3


def test_status_of_a_sealed_run(merged_run):
    st = api.status(merged_run.run_dir)
    assert st.complete and st.counts["sealed"] == 3
    assert st.done == st.planned == merged_run.plan.num_rollouts and st.failed_rollouts == 0
    assert [s.state for s in st.shards] == ["sealed"] * 3
    assert dataclasses.asdict(st)["shards"][0]["index"] == 0  # plain data for a notebook


def test_profile_frame_has_one_row_per_task_with_the_asked_input_fields(merged_run):
    df = api.profile_frame(merged_run.run_dir, fields=["question", "expected_answer"])
    assert isinstance(df, pd.DataFrame)
    assert df.index.name == "task_index" and list(df.index) == list(range(TASKS))
    assert list(df.columns[:7]) == [
        "agent",
        "num_rollouts",
        "expected_num_rollouts",
        "question",
        "expected_answer",
        "mean/reward",
        "std/reward",
    ]
    rows = builders.input_rows(TASKS, agents=("math", "tool"))  # task i is input row i
    assert list(df["question"]) == [r["question"] for r in rows]
    assert list(df["expected_answer"]) == [r["expected_answer"] for r in rows]
    assert list(df["agent"]) == [r["agent_ref"]["name"] for r in rows]

    rewards = defaultdict(list)
    tokens = defaultdict(list)
    for m in planned_rows(merged_run):
        row = builders.rollout_row(m)
        rewards[m["_ng_task_index"]].append(row["reward"])
        tokens[m["_ng_task_index"]].append(row["response"]["usage"]["output_tokens"])
    for t in range(TASKS):
        expected = REPEATS["math"] if t % 2 == 0 else REPEATS["_default"]
        assert df.loc[t, "num_rollouts"] == df.loc[t, "expected_num_rollouts"] == expected
        assert df.loc[t, "mean/reward"] == pytest.approx(statistics.mean(rewards[t]))
        assert df.loc[t, "std/reward"] == pytest.approx(statistics.stdev(rewards[t]))
        assert df.loc[t, "max/output_tokens"] == max(tokens[t])
    assert df["mean/reward"].between(0, 1).all()


def test_profile_frame_without_fields_and_with_one_field_by_name(merged_run):
    bare = api.profile_frame(merged_run.run_dir)
    assert list(bare.columns[:4]) == ["agent", "num_rollouts", "expected_num_rollouts", "mean/reward"]
    one = api.profile_frame(merged_run.run_dir, fields="question")
    assert list(one.columns[:4]) == ["agent", "num_rollouts", "expected_num_rollouts", "question"]
    assert one.drop(columns="question").equals(bare)


def test_a_field_no_task_has_or_that_names_a_column_is_refused(merged_run):
    with pytest.raises(BadInput, match=r"no task's input row has a field 'questoin' \(did you mean 'question'\?\)"):
        api.profile_frame(merged_run.run_dir, fields=["questoin"])
    with pytest.raises(BadInput, match="'agent' is the name of one of the profile's own columns"):
        api.profile_frame(merged_run.run_dir, fields=["agent"])
    with pytest.raises(BadInput, match="'mean/reward' is the name of one of the profile's own columns"):
        api.profile_frame(merged_run.run_dir, fields=["mean/reward"])


def test_iter_rollouts_yields_each_merged_rollout_once_in_identity_order(merged_run):
    got = api.iter_rollouts(merged_run.run_dir)
    assert iter(got) is got  # an iterator, not a list
    expected = sorted(planned_rows(merged_run), key=lambda m: (m["_ng_task_index"], m["_ng_rollout_index"]))
    assert list(got) == [builders.rollout_row(m) for m in expected]


def test_before_the_merge_the_profile_and_rollouts_are_refused_with_what_to_run(tmp_path):
    run = builders.make_run(tmp_path, builders.input_rows(3), num_shards=1)
    builders.write_shard(run, 0)
    assert api.load_plan(run.run_dir).num_tasks == 3
    assert api.status(run.run_dir).complete
    with pytest.raises(RunDirError, match="merge-and-profile"):
        api.profile_frame(run.run_dir, fields=["question"])
    with pytest.raises(RunDirError, match="no merged rollouts.*merge-and-profile"):
        api.iter_rollouts(run.run_dir)  # refused at the call, not at the first row
    with pytest.raises(RunDirError, match="no plan here"):
        api.load_plan(tmp_path)


def test_iter_rollouts_streams_in_bounded_memory(tmp_path, monkeypatch):
    """Rows of ~40 kB each, ~6 MB in all, read through the store's JSONL reader with its block made small (64 KiB,
    so the file spans about a hundred blocks): reading them one after another holds about a block and a row, never
    the file."""
    run = builders.make_run(tmp_path, builders.input_rows(40), num_repeats=4, num_shards=2)
    for i in range(run.num_shards):
        builders.write_shard(run, i, make_row=lambda m: builders.rollout_row(m, text_chars=40_000))
    merge(run.run_dir)
    size = store.merged_rollouts_path(run.run_dir).stat().st_size
    assert size > 6_000_000
    monkeypatch.setattr(fileio, "LINE_BLOCK", 64 << 10)
    tracemalloc.start()
    try:
        n = sum(1 for _ in api.iter_rollouts(run.run_dir))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 160
    assert peak < size / 4, f"peak {peak:,} bytes while streaming a {size:,}-byte file"
