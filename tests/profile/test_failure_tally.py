"""Failures per label and class (docs/failures.md): a judge failing a label's rollouts makes them failures, not
zeros; the merge summary, merged/failures_by_class.json, labels.json and `status` say so per label and class, and
a label above report.unreliable_failure_rate is named unreliable."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core.errors import BadRecord
from shardrun.analysis import report
from shardrun.launch import status
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import records, store
from tests.blendkit import LABELS, REPEATS, make_blend_run, write_lane_shards
from tests.builders import input_rows, make_run, write_shard


def judge_failed_blend(tmp_path: Path):
    """Label gamma's every rollout failed at its judge (Gym 0.7's judge_failsafe rows: reward 0.0 on the row)."""
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    got = write_lane_shards(run, failing="gamma")
    for i in range(run.num_shards):
        path = store.failures_path(run.run_dir, i)
        rows = [orjson.loads(x) for x in path.read_bytes().splitlines()]
        for r in rows:
            r.update(_ng_failure_class="judge_failed", _ng_failure_judge_error="TimeoutError: judge", reward=0.0)
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return run, got


def test_judge_failures_are_counted_per_label_and_class_and_the_label_named_unreliable(tmp_path: Path) -> None:
    run, got = judge_failed_blend(tmp_path)
    result = CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir)])
    assert result.exit_code == 0, result.output
    assert re.search(r"failed rollouts +4: judge 4 \(", result.output), result.output
    assert (
        "warning: label gamma is unreliable, not hard: 4 of its 4 planned rollouts failed (100.0%: judge 4), "
        "above report.unreliable_failure_rate 5%" in result.output
    )
    tally = records.read_failure_tally(run.run_dir)
    assert tally is not None and tally.group == "label" and tally.by_class == {"judge": 4}
    assert [(g.name, g.failed, g.by_class, g.unreliable) for g in tally.groups] == [
        ("alpha", 0, {}, False),
        ("beta", 0, {}, False),
        ("gamma", 4, {"judge": 4}, True),
    ]
    labels = records.read_labels(run.run_dir)
    assert labels is not None and labels.labels[2].failures == {"judge": 4} and labels.labels[2].unreliable
    summary = orjson.loads(store.merged_summary_path(run.run_dir).read_bytes())
    assert summary["failures_by_class"] == {"judge": 4} and summary["unreliable_labels"] == ["gamma"]
    assert summary["unreliable_failure_rate"] == 0.05
    # never a score: no judge-failed row is a rollout, and the failures leave the denominator
    merged = store.merged_dir(run.run_dir)
    assert all(
        orjson.loads(x).get("_ng_failure_class") is None for x in (merged / "rollouts.jsonl").read_bytes().splitlines()
    )
    assert {f["failure_class"] for f in summary["failed"]} == {"judge"}


def test_status_gives_failures_per_label_and_class(tmp_path: Path) -> None:
    run, _ = judge_failed_blend(tmp_path)
    st = status.collect(run.run_dir, query_live=lambda names: {}, query_ended=lambda ids: {})
    text = status.render(st)
    assert "failed rollouts by class: judge 4 (failures, never scores)" in text
    assert "label gamma is unreliable, not hard" in text
    gamma = next(r for r in st.labels if r["label"] == "gamma")
    assert gamma["failed_by_class"] == {"judge": 4}
    assert "failed: judge 4" in text


def test_a_tally_of_unknown_classes_is_refused(tmp_path: Path) -> None:
    run, _ = judge_failed_blend(tmp_path)
    CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir)])
    path = store.failure_tally_path(run.run_dir)
    path.write_bytes(path.read_bytes().replace(b'"judge"', b'"jury"'))
    with pytest.raises(BadRecord, match="failures_by_class.json: invalid a failure tally: 'by_class' is an object"):
        records.read_failure_tally(run.run_dir)


def test_the_report_gives_failure_rates_per_label_and_names_the_unreliable_ones(tmp_path: Path) -> None:
    run, _ = judge_failed_blend(tmp_path)
    CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir)])
    data = report.gather(run.run_dir, use_sacct=False)
    page = report.render_html(data, [], "now")
    assert "<h2>Failures per label and class</h2>" in page
    assert "Unreliable, not hard: gamma (failed rollouts above report.unreliable_failure_rate 5% of planned)" in page
    assert report.failure_rows(data.tally) == [
        ["alpha", "12", "0", "0.0%", "—", "ok"],
        ["beta", "9", "0", "0.0%", "—", "ok"],
        ["gamma", "4", "4", "100.0%", "judge 4", "unreliable"],
    ]
    assert "failed for good: judge 4 (failures, never scores)" in dict(report.headline_rows(data))["failures"]


def test_a_run_without_a_blend_is_one_group_under_its_own_threshold(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=1)
    write_shard(run, 0, failed=2)  # two rollouts failed (an http_500 class Gym does not name: other)
    cfg = {"run_dir": str(run.run_dir), "input_jsonl": run.plan.input.path, "report": {"unreliable_failure_rate": 0.5}}
    settings = {"config": cfg}
    store.launch_settings_path(run.run_dir).write_bytes(orjson.dumps(settings))
    merge_and_profile(run.run_dir)
    tally = records.read_failure_tally(run.run_dir)
    assert tally is not None and tally.group == "run" and tally.unreliable_failure_rate == 0.5
    (group,) = tally.groups
    assert (group.name, group.planned, group.failed, group.rate, group.unreliable) == ("run", 8, 2, 0.25, False)
    assert group.by_class == {"other": 2}
