"""merge-and-profile on a blend: merged/by_label/<label>/ (each label's profile, from its rows alone) and
merged/labels.json (per label counts, reward, rate), a failed lane named; a run without a blend writes neither."""

from __future__ import annotations

from pathlib import Path
import orjson
import pytest
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core.gym_names import TASK_KEY
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import records, store
from tests.blendkit import LABELS, REPEATS, label_of, make_blend_run, write_lane_shards
from tests.builders import input_rows, make_run, write_shard


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def test_each_label_is_profiled_from_its_rows_and_counted(tmp_path: Path) -> None:
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS, owners={"beta": "team-b"})
    got = write_lane_shards(run, skip=(5, 1))
    summary = merge_and_profile(run.run_dir)
    merged = store.merged_dir(run.run_dir)
    whole = {orjson.loads(x)[TASK_KEY]: x for x in lines(merged / "rollouts_reward_profiling.jsonl")}
    for label, agent, n in LABELS:
        d = merged / "by_label" / label
        names = {p.name for p in d.iterdir()}
        assert names == {p.name for p in merged.glob("rollouts_*_metrics.json")} | {"rollouts_reward_profiling.jsonl"}
        rows = lines(d / "rollouts_reward_profiling.jsonl")
        tasks = [orjson.loads(x)[TASK_KEY] for x in rows]
        assert tasks == sorted(t for t in whole if label_of(t) == label)
        assert rows == [whole[t] for t in tasks]  # one shape of row everywhere: the same bytes as the run's rows
        agents = orjson.loads((d / "rollouts_agent_metrics.json").read_bytes())
        rewards = [r["reward"] for r in got["rows"] if label_of(r[TASK_KEY]) == label]
        assert [a["agent_ref"]["name"] for a in agents] == [agent]
        assert agents[0]["mean/reward"] == pytest.approx(sum(rewards) / len(rewards))
        aggregate = orjson.loads((d / "rollouts_aggregate_metrics.json").read_bytes())
        assert aggregate[0]["agent_metrics"]["coverage/expected"] == n * REPEATS[agent]

    doc = orjson.loads(store.labels_path(run.run_dir).read_bytes())
    assert [r["label"] for r in doc["labels"]] == ["alpha", "beta", "gamma"] and doc["failed_lanes"] == []
    by = {r["label"]: r for r in doc["labels"]}
    assert by["beta"]["owner"] == "team-b" and by["alpha"]["owner"] is None
    assert by["beta"]["collected"] == 3 * 3 - 1 and by["beta"]["missing"] == 1
    assert (by["beta"]["tasks_complete"], by["beta"]["tasks_partial"], by["beta"]["tasks_missing"]) == (2, 1, 0)
    assert by["alpha"]["collected"] == by["alpha"]["rollouts_planned"] == 12
    assert by["gamma"]["rollouts_planned"] == 4 and by["gamma"]["failed"] == 0
    for label, _, _ in LABELS:
        mine = [r for r in got["rows"] if label_of(r[TASK_KEY]) == label]
        assert by[label]["mean_reward"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine))
        rate = by[label]["rate"]
        assert rate["basis"] == "output_tokens" and rate["rollouts"] == len(mine)
        tokens = sum(r["response"]["usage"]["output_tokens"] for r in mine)
        assert rate["output_tokens"] == tokens
        assert rate["rollouts_per_gpu_hour"] == pytest.approx(len(mine) / rate["gpu_hours"])
    # the shards' GPU-hours are shared out whole among the labels (three shards of 0.25 h on one GPU)
    assert sum(r["rate"]["gpu_hours"] for r in doc["labels"]) == pytest.approx(0.75)
    assert [r.label for r in summary.labels] == ["alpha", "beta", "gamma"]
    read_back = records.read_labels(run.run_dir)  # the one reader, through the model
    assert (
        read_back is not None and read_back.labels == summary.labels and read_back.fingerprint == run.plan.fingerprint
    )
    assert "labels" in orjson.loads(store.merged_summary_path(run.run_dir).read_bytes())


def test_a_label_that_collected_nothing_is_a_failed_lane(tmp_path: Path) -> None:
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    got = write_lane_shards(run, failing="gamma")
    result = CliRunner().invoke(app, ["merge-and-profile", str(run.run_dir)])
    assert result.exit_code == 0, result.output
    assert "label gamma collected nothing: that lane failed" in result.output
    doc = orjson.loads(store.labels_path(run.run_dir).read_bytes())
    assert doc["failed_lanes"] == ["gamma"]
    gamma = doc["labels"][2]
    assert (gamma["collected"], gamma["failed"], gamma["tasks_missing"]) == (0, len(got["failed"]), 2) == (0, 4, 2)
    assert gamma["mean_reward"] is None and gamma["rate"]["rollouts_per_hour"] is None
    gamma_dir = store.merged_dir(run.run_dir) / "by_label" / "gamma"
    assert (gamma_dir / "rollouts_reward_profiling.jsonl").read_bytes() == b""
    assert doc["labels"][0]["collected"] == 12 and lines(
        store.merged_dir(run.run_dir) / "by_label" / "alpha" / "rollouts_reward_profiling.jsonl"
    )


def test_a_run_without_a_blend_writes_no_labels(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(6, agents=("a", "b")), num_repeats=2, num_shards=2)
    for i in range(2):
        write_shard(run, i, seed=i)
    merge_and_profile(run.run_dir)
    merged = store.merged_dir(run.run_dir)
    assert not (merged / "by_label").exists() and not store.labels_path(run.run_dir).exists()
    summary = orjson.loads(store.merged_summary_path(run.run_dir).read_bytes())
    assert "labels" not in summary and "failed_lanes" not in summary and "failed_ids" not in summary
