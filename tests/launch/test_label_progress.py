"""`shardrun status` on a blend: rollouts collected and failed per label, counted from the shards' files while the run
goes on (sealed or not), a label that collects nothing while the others progress flagged; --json has them."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY
from shardrun.launch import label_progress, status
from shardrun.rundir import store
from tests.blendkit import LABELS, REPEATS, label_of, make_blend_run, write_lane_shards
from tests.builders import input_rows, make_run, rollout_row


def no_live(names):
    return {}


def no_sacct(ids):
    return {}


def test_progress_per_label_and_a_silent_lane(tmp_path: Path) -> None:
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    got = write_lane_shards(run, failing="gamma")
    # the shard's file as it is now counts (a rollout added after the seal too), a torn last line does not
    extra = next(m for m in run.materialized(0) if label_of(m[TASK_KEY]) == "alpha")
    row = rollout_row(extra) | {"meta": {"note": 1}}
    path = store.rollouts_path(run.run_dir, 0)
    path.write_bytes(path.read_bytes() + orjson.dumps(row) + b"\n" + b'{"_ng_task_index": 8, "_ng_roll')
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    by = {r["label"]: r for r in st.labels}
    want = {
        label: sum(1 for r in got["rows"] if label_of(r[TASK_KEY]) == label) + (label == "alpha")
        for label, _, _ in LABELS
    }
    assert {k: v["collected"] for k, v in by.items()} == want
    assert [by[x]["planned"] for x in ("alpha", "beta", "gamma")] == [12, 9, 4]
    assert by["gamma"]["failed"] == 4 and by["gamma"]["silent"] and not by["alpha"]["silent"]
    assert by["beta"]["agent"] == "a"
    text = status.render(st)
    assert "gamma" in text and label_progress.SILENT in text
    assert "label(s) gamma collected nothing" in text
    data = json.loads(status.render_json(st))
    assert [r["label"] for r in data["labels"]] == ["alpha", "beta", "gamma"]
    assert data["labels"][2]["silent"] is True


def test_no_label_is_silent_before_any_collected(tmp_path: Path) -> None:
    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    assert [r["collected"] for r in st.labels] == [0, 0, 0] and not any(r["silent"] for r in st.labels)


def test_task_indices_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    lines = [
        {TASK_KEY: 3, ROLLOUT_KEY: 0},
        {"x": {TASK_KEY: 9}, TASK_KEY: 4},  # twice in the line: parsed
        {"x": 1},  # none
    ]
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines) + b"not json\n" + b'{"_ng_task_index": 5')
    assert label_progress.task_indices(path).tolist() == [3, 4, -1, -1]
    assert label_progress.task_indices(tmp_path / "absent.jsonl").tolist() == []


def test_a_run_without_a_blend_has_no_labels_in_status(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    assert st.labels == [] and "labels" not in json.loads(status.render_json(st))
