"""Hostile plan.json edits: every field a command reads back from the plan is covered by its fingerprint, so an edit
of any of them (the Gym version whose layout the merge writes, the input's path and line count, the config a shard
run by hand falls back to, the warnings, ...) is refused like any other plan change: exit 2, the file named, nothing
written. A plan of the same rollouts planned again (another cluster, another place for the same input) is not an
edit: the run directory keeps the plan it recorded."""

from __future__ import annotations

import shutil
from typing import Any, Callable

import orjson
import pytest
from hostilekit import invoke_bounded, refused
from reportkit import input_row, merge_run, planned_run, seal_shards

from shardrun.plan import planner
from shardrun.rundir import store


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a") for i in range(4)]
    run_dir, cfg = planned_run(tmp_path, rows, num_repeats=2, num_shards=2)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    return run_dir


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict], None]:
    def edit(plan: dict) -> None:
        node = plan
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _other_gym(release: str) -> Callable[[dict], None]:
    def edit(plan: dict) -> None:
        plan["gym_version"] = release if plan.get("gym_version") != release else "0.4.1"

    return edit


EDITS: dict[str, Callable[[dict], None]] = {
    "gym_version 0.7": _other_gym("0.7.0"),  # the named case: the merge would write 0.7's layout
    "gym_version 0.4": _other_gym("0.4.0"),
    "input path": _set(("input", "path"), "/etc/passwd"),
    "input line count": _set(("input", "num_lines"), 3),
    "input sha256": _set(("input", "sha256"), "0" * 64),
    "warnings": _set(("warnings",), ["all is well"]),
    "config: the policy endpoint": _set(("config", "policy"), {"base_url": "http://evil:1/v1", "model_name": "m"}),
    "config: the executor": _set(("config", "cluster"), {"executor": "slurm"}),
    "config: num_repeats": _set(("config", "num_repeats"), 7),
    "agents": _set(("agents", "agent_a", "repeats"), 3),
    "num_tasks": _set(("num_tasks",), 5),
    "a shard's size": _set(("shards", 0, "num_rollouts"), 3),
    "planner version": _set(("planner_version",), "0"),
}


@pytest.mark.parametrize("command", ["status", "merge-and-profile", "report", "select"])
@pytest.mark.parametrize("field", list(EDITS))
def test_an_edited_plan_field_is_refused_by_every_command(run, tmp_path, unchanged, field, command):
    path = store.plan_path(run)
    plan = orjson.loads(path.read_bytes())
    EDITS[field](plan)
    path.write_bytes(orjson.dumps(plan))
    args = {
        "status": ("status", run),
        "merge-and-profile": ("merge-and-profile", run),
        "report": ("report", run, "--no-sacct"),
        "select": ("select", run, "-o", tmp_path / "chosen.jsonl"),
    }[command]
    with unchanged(tmp_path):
        refused(invoke_bounded(*args), str(path), "edited by hand")


def test_the_fingerprint_covers_every_field_of_the_plan_but_the_run_directory(run):
    """A new field in plan.json must be covered too (or be the config's run_dir): each one, changed, changes it."""
    plan = store.load_plan(run)
    data = plan.to_json()
    data.pop("fingerprint")
    for key in data:
        changed = orjson.loads(orjson.dumps(data))
        value = changed[key]
        # each edit keeps the plan's shape (Plan.from_json checks every field's type)
        if isinstance(value, str) or value is None:
            changed[key] = (value or "") + "x"
        elif isinstance(value, int):
            changed[key] = value + 1
        elif key == "agents":
            changed[key] = {**value, "x": {"tasks": 1}}
        elif isinstance(value, dict):
            changed[key] = {**value, "x": 1}
        if key == "input":
            changed[key] = {**value, "num_lines": value["num_lines"] + 1}
        if key == "shards":
            changed[key] = [{**value[0], "num_rollouts": value[0]["num_rollouts"] + 1}, *value[1:]]
        if key == "warnings":
            changed[key] = ["w"]
        assert changed[key] != value, key
        edited = planner.Plan.from_json({**changed, "fingerprint": plan.fingerprint})
        assert planner.fingerprint(edited) != plan.fingerprint, key
    moved = planner.Plan.from_json({**plan.to_json(), "config": {**plan.config, "run_dir": "/elsewhere"}})
    assert planner.fingerprint(moved) == plan.fingerprint


def test_planning_again_with_another_cluster_keeps_the_recorded_plan(run, tmp_path, unchanged):
    before = store.plan_path(run).read_bytes()
    with unchanged(run):
        done = invoke_bounded("plan", tmp_path / "run.yaml", "cluster.array_parallelism=2", "--write")
    assert done.exit_code == 0, done.output
    assert "already planned" in done.output
    assert store.load_plan(run).fingerprint in done.output  # the plan shown is the one recorded
    assert store.plan_path(run).read_bytes() == before


def test_the_same_input_in_another_place_plans_the_same_rollouts(run, tmp_path, unchanged):
    moved = tmp_path / "moved.jsonl"
    shutil.copy(tmp_path / "input.jsonl", moved)
    with unchanged(run):
        done = invoke_bounded("plan", tmp_path / "run.yaml", f"input_jsonl={moved}", "--write")
    assert done.exit_code == 0, done.output
    assert "already planned" in done.output and str(tmp_path / "input.jsonl") in done.output
