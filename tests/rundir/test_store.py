"""The run directory: materialization, fingerprint refusal, atomic writes, locking, torn-line repair."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import orjson
import pytest

from shardrun.core import config
from shardrun.rundir import store
from shardrun.core.errors import PlanMismatch, RunDirError
from tests.planning_helpers import row


def make(tmp_path: Path, n: int = 6, **kw) -> config.RunConfig:
    inp = tmp_path / "input.jsonl"
    if not inp.exists():
        inp.write_bytes(b"".join(orjson.dumps(row(i)) + b"\n" for i in range(n)))
    data = {"input_jsonl": str(inp), "run_dir": str(tmp_path / "run"), "num_repeats": 2, "sharding": {"num_shards": 3}}
    data.update(kw)
    return config.validate(data)


def test_write_plan_materializes_every_shard(tmp_path):
    cfg = make(tmp_path)
    plan, written = store.write_plan(cfg)
    assert written
    loaded = store.load_plan(cfg.run_dir)
    assert loaded == plan
    seen = []
    for spec in plan.shards:
        rows = [orjson.loads(x) for x in store.materialized_path(cfg.run_dir, spec.index).read_bytes().splitlines()]
        assert len(rows) == spec.num_rollouts
        seen += [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows]
    assert sorted(seen) == [(t, r) for t in range(6) for r in range(2)]
    assert [p.name for p in (cfg.run_dir / "shards").iterdir()] == sorted(["00000", "00001", "00002"])
    assert not list(cfg.run_dir.rglob(store.TMP_PREFIX + "*"))


def test_plan_json_holds_config_input_hash_and_no_secret_values(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-very-secret")
    cfg = make(tmp_path, policy={"base_url": "http://h/v1", "model_name": "m", "api_key_env": "MY_KEY"})
    store.write_plan(cfg)
    text = store.plan_path(cfg.run_dir).read_text()
    data = json.loads(text)
    assert data["input"]["sha256"] == store.sha256_file(cfg.input_jsonl)
    assert data["planner_version"] and len(data["fingerprint"]) == 64
    assert data["config"]["policy"]["api_key_env"] == "MY_KEY"
    assert "sk-very-secret" not in text


def test_same_plan_again_is_a_no_op(tmp_path):
    cfg = make(tmp_path)
    store.write_plan(cfg)
    before = {p: p.stat().st_mtime_ns for p in cfg.run_dir.rglob("*") if p.is_file()}
    _, written = store.write_plan(cfg)
    assert not written
    assert before == {p: p.stat().st_mtime_ns for p in cfg.run_dir.rglob("*") if p.is_file()}


def test_other_settings_are_refused_saying_what_differs(tmp_path):
    store.write_plan(make(tmp_path))
    with pytest.raises(PlanMismatch, match=r"num_repeats: 2 -> 3"):
        store.write_plan(make(tmp_path, num_repeats=3))
    with pytest.raises(PlanMismatch, match=r"sharding"):
        store.write_plan(make(tmp_path, sharding={"num_shards": 2}))


def test_changed_input_is_refused(tmp_path):
    cfg = make(tmp_path)
    store.write_plan(cfg)
    with open(cfg.input_jsonl, "ab") as f:
        f.write(orjson.dumps(row(99)) + b"\n")
    with pytest.raises(PlanMismatch, match="input content changed"):
        store.write_plan(cfg)


def test_hand_edited_plan_is_detected(tmp_path):
    cfg = make(tmp_path)
    store.write_plan(cfg)
    p = store.plan_path(cfg.run_dir)
    data = json.loads(p.read_text())
    data["shards"][0]["num_rollouts"] += 1
    p.write_text(json.dumps(data))
    with pytest.raises(PlanMismatch, match="edited by hand"):
        store.load_plan(cfg.run_dir)


def test_shard_outputs_without_a_plan_are_not_overwritten(tmp_path):
    cfg = make(tmp_path)
    store.write_plan(cfg)
    store.rollouts_path(cfg.run_dir, 0).write_text('{"x": 1}\n')
    store.plan_path(cfg.run_dir).unlink()
    with pytest.raises(RunDirError, match="no plan.json"):
        store.write_plan(cfg)


def test_atomic_writer_leaves_old_content_when_interrupted(tmp_path):
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with store.atomic_writer(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


def _kill_mid_write(path: str) -> None:
    with store.atomic_writer(Path(path)) as f:
        f.write(b"partial")
        f.flush()
        os._exit(9)  # like SIGKILL: no cleanup runs


def test_a_killed_writer_leaves_only_a_temp_file_that_is_cleaned(tmp_path):
    target = tmp_path / "f.json"
    target.write_bytes(b"old")
    proc = multiprocessing.get_context("fork").Process(target=_kill_mid_write, args=(str(target),))
    proc.start()
    proc.join()
    assert target.read_bytes() == b"old"
    assert store.remove_stale_temps(tmp_path) == 1
    assert list(tmp_path.iterdir()) == [target]


def test_repair_torn_tail(tmp_path):
    p = tmp_path / "rollouts.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a": ')
    assert list(store.complete_lines(p)) == [b'{"a": 1}\n', b'{"a": 2}\n']
    assert store.repair_torn_tail(p) == 6
    assert p.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert store.repair_torn_tail(p) == 0
    p.write_bytes(b"no newline at all")
    store.repair_torn_tail(p)
    assert p.read_bytes() == b""


def test_cut_back_takes_back_what_a_round_appended(tmp_path):
    p = tmp_path / "rollouts_failures.jsonl"
    assert store.cut_back(p, 0) == 0  # nothing there yet
    p.write_bytes(b'{"before": 1}\n')
    mark = p.stat().st_size
    with open(p, "ab") as f:
        f.write(b'{"round": 1}\n{"round": 2}\n')
    assert store.cut_back(p, mark) == 26
    assert p.read_bytes() == b'{"before": 1}\n'
    assert store.cut_back(p, mark) == 0 and store.cut_back(p, mark + 100) == 0  # never grows a file


def _plan_in_child(cfg_json: str, q) -> None:
    cfg = config.RunConfig.model_validate_json(cfg_json)
    q.put(store.write_plan(cfg)[1])


def test_concurrent_writers_are_serialised(tmp_path):
    cfg = make(tmp_path, n=3000, sharding={"num_shards": 40, "slicing": "round_robin"})
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plan_in_child, args=(cfg.model_dump_json(), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = sorted(q.get() for _ in procs)
    assert results == [False, False, True]  # exactly one wrote, the others saw the same plan
    assert store.load_plan(cfg.run_dir).num_rollouts == 6000


def test_many_round_robin_shards_bound_open_files(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "MAX_OPEN_SHARD_FILES", 4)
    cfg = make(tmp_path, n=20, sharding={"num_shards": 10, "slicing": "round_robin"})
    plan, _ = store.write_plan(cfg)
    total = sum(len(store.materialized_path(cfg.run_dir, s.index).read_bytes().splitlines()) for s in plan.shards)
    assert total == 40
