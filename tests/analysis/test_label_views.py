"""A blend's labels in the views of a merged run: `report`'s per-label table (the per-agent table's columns over
each label's tasks, a failed lane named), `select --label` (repeatable; an unknown label refused with the labels),
and `api.profile_frame`'s `label` column."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from shardrun import api
from shardrun.analysis import report
from shardrun.cli import app
from shardrun.core import task_rules
from shardrun.core.gym_names import TASK_KEY
from shardrun.profile import intervals, taskstats
from shardrun.profile.merge_and_profile import merge_and_profile
from tests.blendkit import LABELS, REPEATS, label_of, make_blend_run, write_lane_shards
from tests.builders import input_rows, make_run, write_shard


@pytest.fixture()
def blend(tmp_path: Path):
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    write_lane_shards(run, failing="gamma")
    merge_and_profile(run.run_dir)
    return run


def test_report_has_a_per_label_table(blend) -> None:
    tasks = taskstats.load_profile(blend.run_dir)
    rows = report.label_rows(blend.plan, tasks)
    assert [r[:2] for r in rows] == [["alpha", "a"], ["beta", "a"], ["gamma", "b"]]
    alpha = [t for t in tasks if label_of(t.task_index) == "alpha"]
    # the per-agent table's cells, computed on the label's tasks alone (the same intervals and buckets)
    want = report.agent_rows([taskstats.agent_summary("alpha", alpha)], {"alpha": 12})[0]
    assert rows[0][2:] == want[1:]
    counts = {b: 0 for b in task_rules.BUCKETS}
    for t in alpha:  # independently: never / sometimes / always by the task's rewards
        solved = sum(r >= 1.0 for r in t.rewards)
        counts["never" if not solved else "always" if solved == len(t.rewards) else "sometimes"] += 1
    summary = taskstats.agent_summary("alpha", alpha)
    assert summary.buckets == counts and sum(counts.values()) == 4
    assert summary.pass_at_1 == pytest.approx(100 * sum(sum(r >= 1 for r in t.rewards) / 3 for t in alpha) / 4)
    ci = intervals.bootstrap_mean(taskstats.pass_at_k_values(alpha, 1))
    assert ci is not None and summary.pass_at_1_ci == intervals.Interval(100 * ci.low, 100 * ci.high)
    assert rows[2][4] == report.FAILED_LANE
    result = report.build_report(blend.run_dir, use_sacct=False)
    page = result.html.read_text()
    assert "<h2>Per label</h2>" in page and report.FAILED_LANE in page
    text = dict(report.summary_rows(result))
    assert text["  label gamma"] == report.FAILED_LANE and text["  label alpha"].startswith("mean reward")


def test_a_report_without_a_blend_has_no_label_table(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    for i in range(2):
        write_shard(run, i, seed=i)
    merge_and_profile(run.run_dir)
    assert report.label_rows(run.plan, taskstats.load_profile(run.run_dir)) == []
    result = report.build_report(run.run_dir, use_sacct=False)
    assert "Per label" not in result.html.read_text()


def test_select_label_keeps_those_labels_tasks(blend, tmp_path: Path) -> None:
    out = tmp_path / "chosen.jsonl"
    res = CliRunner().invoke(
        app, ["select", str(blend.run_dir), "-o", str(out), "--label", "beta", "--label", "gamma", "--json"]
    )
    assert res.exit_code == 0, res.output
    summary = orjson.loads(res.output)
    assert summary["task_indices"] == [4, 5, 6]  # gamma's tasks have no profile: nothing collected
    assert [s["rule"] for s in summary["steps"]][:2] == ["profiled (has mean/reward)", "--label beta,gamma"]
    rows = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [r["label_hint"] for r in rows] == ["beta"] * 3


def test_select_unknown_label_is_refused_with_the_labels(blend, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["select", str(blend.run_dir), "-o", str(tmp_path / "x.jsonl"), "--label", "alfa"])
    assert res.exit_code == 2
    assert "'alfa'" in res.output and "did you mean 'alpha'" in res.output and "alpha, beta, gamma" in res.output
    assert not (tmp_path / "x.jsonl").exists()


def test_select_label_on_a_run_without_a_blend_is_refused(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=1)
    write_shard(run, 0)
    merge_and_profile(run.run_dir)
    res = CliRunner().invoke(app, ["select", str(run.run_dir), "-o", str(tmp_path / "x.jsonl"), "--label", "a"])
    assert res.exit_code == 2 and "not a blend" in res.output


def test_profile_frame_has_the_label_of_each_task(blend, tmp_path: Path) -> None:
    df = api.profile_frame(blend.run_dir, fields=["label_hint"])
    assert list(df.columns[:4]) == ["agent", "label", "num_rollouts", "expected_num_rollouts"]
    assert df["label"].tolist() == [label_of(t) for t in df.index] == df["label_hint"].tolist()
    assert set(df["label"]) == {"alpha", "beta"}  # gamma collected nothing: no profiled task
    plain = make_run(tmp_path / "plain", input_rows(3), num_repeats=1, num_shards=1)
    write_shard(plain, 0)
    merge_and_profile(plain.run_dir)
    assert "label" not in api.profile_frame(plain.run_dir).columns
    rows = [
        orjson.loads(x)
        for x in (blend.run_dir / "merged" / "rollouts_reward_profiling.jsonl").read_bytes().splitlines()
    ]
    assert sorted(df.index) == [r[TASK_KEY] for r in rows]
