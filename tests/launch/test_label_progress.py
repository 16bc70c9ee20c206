"""`shardrun status` on a blend: rollouts collected and failed per label, a sealed shard's from its seal and any other
shard's from its file while the run goes on, a label that collects nothing while the others progress flagged;
--json has them."""

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


def sealed_by_the_runtime(tmp_path: Path):
    """A blend run whose every shard holds all its rows and was sealed by the shard runtime itself (every identity
    on disk: it seals without starting servers), as a job seals it."""
    from shardrun.shard import runtime
    from tests.faults import synthetic

    run = make_blend_run(tmp_path, LABELS, num_repeats=REPEATS)
    got = write_lane_shards(run)
    store.write_launch_settings(run.run_dir, synthetic.launch_config(run))
    for i in range(run.num_shards):
        store.done_path(run.run_dir, i).unlink()
        runtime.run_shard(run.run_dir, i)
    want = {label: sum(1 for r in got["rows"] if label_of(r[TASK_KEY]) == label) for label, _, _ in LABELS}
    return run, want


def test_a_sealed_shard_is_counted_from_its_seal_not_parsed(tmp_path: Path, monkeypatch) -> None:
    """The seal counts the shard's rollouts per label when it seals; `status` takes them from there and parses no
    sealed shard's rows (only the shards still collecting, and seals written before seals counted labels)."""
    run, want = sealed_by_the_runtime(tmp_path)
    markers = [json.loads(store.done_path(run.run_dir, i).read_text()) for i in range(run.num_shards)]
    per_shard = [
        [sum(1 for r in run.materialized(i) if label_of(r[TASK_KEY]) == label) for label, _, _ in LABELS]
        for i in range(run.num_shards)
    ]
    assert [m["label_rollouts"] for m in markers] == per_shard
    parsed: list[Path] = []
    real = label_progress.task_indices
    monkeypatch.setattr(label_progress, "task_indices", lambda path: parsed.append(path) or real(path))
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    assert st.counts["sealed"] == run.num_shards and parsed == []
    assert {r["label"]: r["collected"] for r in st.labels} == want

    # shard 1 unsealed (still collecting) and shard 2 sealed before seals counted labels: those two are parsed
    store.done_path(run.run_dir, 1).unlink()
    old = {k: v for k, v in markers[2].items() if k != "label_rollouts"}
    store.done_path(run.run_dir, 2).write_bytes(orjson.dumps(old))
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    assert st.counts["sealed"] == run.num_shards - 1
    assert sorted(parsed) == [store.rollouts_path(run.run_dir, 1), store.rollouts_path(run.run_dir, 2)]
    assert {r["label"]: r["collected"] for r in st.labels} == want


def test_a_seal_whose_label_counts_do_not_add_up_is_not_trusted(tmp_path: Path) -> None:
    run, want = sealed_by_the_runtime(tmp_path)
    path = store.done_path(run.run_dir, 0)
    marker = json.loads(path.read_text())
    marker["label_rollouts"][0] += 1
    path.write_bytes(orjson.dumps(marker))
    st = status.collect(run.run_dir, query_live=no_live, query_ended=no_sacct)
    shard0 = st.shards[0]
    assert shard0.state != "sealed" and "label_rollouts" in shard0.reason and "num_rollouts" in shard0.reason
    assert {r["label"]: r["collected"] for r in st.labels} == want  # counted from its file instead
