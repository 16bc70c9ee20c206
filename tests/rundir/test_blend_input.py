"""A blend's input read from its entries' files, planned and written (rundir/blend_input.py, store.write_plan)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import orjson
import pytest

from shardrun.core import config
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.rundir import blend_input, store
from tests.planning_helpers import row


def write_rows(path: Path, rows: list[dict | bytes]) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    """Three entries: math (10 rows, no agent_ref), tool (6 rows naming agent t), more_math (8 rows, agent m)."""
    return {
        "math": write_rows(tmp_path / "math.jsonl", [row(i, agent=None) for i in range(10)]),
        "tool": write_rows(tmp_path / "tool.jsonl", [row(100 + i, agent="t") for i in range(6)]),
        "more_math": write_rows(tmp_path / "more.jsonl", [row(200 + i, agent="m") for i in range(8)]),
    }


def blend_cfg(tmp_path: Path, files: dict[str, Path], order=("math", "tool", "more_math"), **kw) -> config.RunConfig:
    agents = {"math": "m", "tool": "t", "more_math": "m"}
    entries = [{"label": x, "data": str(files[x]), "agent": agents[x]} | kw.pop(x, {}) for x in order]
    return config.validate({"run_dir": str(tmp_path / "run"), "entries": entries, "num_repeats": 2} | kw)


def chosen(cfg: config.RunConfig) -> dict[str, list[str]]:
    """Per label, the questions of its chosen rows (in blend order)."""
    plan = store.scan_input(cfg)
    layout = blend_input.layout(cfg)
    out: dict[str, list[str]] = {e.label: [] for e in plan.blend}
    for n, raw in blend_input.lines(layout):
        out[plan.blend[layout.entry_at(n)].label].append(orjson.loads(raw)["question"])
    return out


def test_blend_plan_entries_and_task_ranges(tmp_path, files):
    cfg = blend_cfg(tmp_path, files, tool={"limit": 4, "num_repeats": 3}, materialize={"limit_per_entry": 5})
    plan = store.scan_input(cfg)
    assert plan.labels == ("math", "tool", "more_math")
    by = {e.label: e for e in plan.blend}
    assert [(e.rows_in_file, e.num_tasks, e.repeats, e.num_rollouts, e.tasks) for e in plan.blend] == [
        (10, 5, 2, 10, ((0, 5),)),
        (6, 4, 3, 12, ((5, 9),)),  # its own limit wins over limit_per_entry; its own repeats
        (8, 5, 2, 10, ((9, 14),)),
    ]
    assert by["math"].sha256 == store.sha256_file(files["math"]) and by["math"].data == str(files["math"])
    assert plan.num_tasks == 14 and plan.num_rollouts == 32
    assert plan.agents == {
        "m": {"tasks": 10, "rollouts": 20, "repeats": 2},
        "t": {"tasks": 4, "rollouts": 12, "repeats": 3},
    }
    assert plan.input.path == str(store.blend_input_path(cfg.run_dir))
    assert [plan.label_of(t) for t in (0, 4, 5, 8, 9, 13)] == ["math", "math", "tool", "tool", "more_math", "more_math"]
    assert plan.repeats_of(6, "t") == 3 and plan.repeats_of(0, "m") == 2


def test_write_plan_writes_the_blended_input_and_every_label_in_every_shard(tmp_path, files):
    cfg = blend_cfg(tmp_path, files, sharding={"num_shards": 3})
    plan, written = store.write_plan(cfg)
    assert written and plan.planning["sharding"]["slicing"] == "round_robin"
    blended = store.blend_input_path(cfg.run_dir).read_bytes()
    assert store.sha256_file(store.blend_input_path(cfg.run_dir)) == plan.input.sha256
    rows = [orjson.loads(x) for x in blended.splitlines()]
    assert len(rows) == 24 and [r["agent_ref"]["name"] for r in rows] == ["m"] * 10 + ["t"] * 6 + ["m"] * 8
    # rows with an agent_ref are byte for byte as in their file
    assert blended.splitlines()[10:16] == files["tool"].read_bytes().splitlines()
    assert store.load_plan(cfg.run_dir) == plan
    for spec in plan.shards:  # each label has at least num_shards rollouts: every shard carries every label
        got = [orjson.loads(x) for x in store.materialized_path(cfg.run_dir, spec.index).read_bytes().splitlines()]
        labels = Counter(plan.label_of(r["_ng_task_index"]) for r in got)
        assert set(labels) == set(plan.labels), (spec.index, labels)
    assert store.write_plan(cfg)[1] is False  # the same blend again: nothing written


def test_a_row_naming_another_agent_is_refused_with_its_file_and_line(tmp_path, files):
    write_rows(files["tool"], [row(1, agent="t"), row(2, agent="t"), row(3, agent="intruder")])
    with pytest.raises(BadInput) as e:
        store.scan_input(blend_cfg(tmp_path, files))
    msg = str(e.value)
    assert f"{files['tool']}:3: field agent_ref: names agent 'intruder'" in msg and "entry 'tool'" in msg


def test_row_problems_name_the_entry_file_and_line(tmp_path, files):
    write_rows(files["more_math"], [row(1, agent=None), b"{not json", row(3, agent=None, _ng_task_index=0)])
    with pytest.raises(BadInput) as e:
        store.scan_input(blend_cfg(tmp_path, files))
    msg = str(e.value)
    assert f"{files['more_math']}:2: not valid JSON" in msg
    # a task index clash names both files and lines
    assert (
        f"{files['more_math']}:3: field _ng_task_index: task index 0 is used by another row ({files['math']}:1)" in msg
    )


def test_a_missing_data_file_names_the_entry(tmp_path, files):
    files["tool"].unlink()
    files["more_math"].unlink()
    with pytest.raises(BadInput) as e:
        store.scan_input(blend_cfg(tmp_path, files))
    assert "2 of 3 entries' data files are missing" in str(e.value)
    assert [p.split(": ")[0] for p in e.value.problems] == [
        "entries.1.data (entry 'tool')",
        "entries.2.data (entry 'more_math')",
    ]


def test_head_takes_the_first_rows_and_blank_lines_are_skipped(tmp_path, files):
    files["math"].write_bytes(b"\n" + files["math"].read_bytes())
    got = chosen(blend_cfg(tmp_path, files, materialize={"limit_per_entry": 3}))
    assert got == {"math": ["q0", "q1", "q2"], "tool": ["q100", "q101", "q102"], "more_math": ["q200", "q201", "q202"]}


def test_random_samples_are_stable_under_adding_removing_and_reordering_entries(tmp_path, files):
    spec = {"limit_per_entry": 3, "sample": "random", "seed": 7}
    full = chosen(blend_cfg(tmp_path, files, materialize=spec))
    for label, rows in full.items():
        questions = [f"q{i}" for i in range({"math": 0, "tool": 100, "more_math": 200}[label], 300)]
        assert len(rows) == 3 and rows == sorted(rows, key=questions.index)  # kept in file order
    assert chosen(blend_cfg(tmp_path, files, ("more_math", "math"), materialize=spec)) == {
        "more_math": full["more_math"],
        "math": full["math"],
    }
    assert chosen(blend_cfg(tmp_path, files, ("tool",), materialize=spec)) == {"tool": full["tool"]}
    other_seed = chosen(blend_cfg(tmp_path, files, materialize=spec | {"seed": 8}))
    assert other_seed != full  # the seed matters (3 of 10, 6 and 8 rows: a collision on all three is negligible)
    whole = chosen(blend_cfg(tmp_path, files, materialize={"sample": "random"}))  # no limit: every row
    assert whole["math"] == [f"q{i}" for i in range(10)]


def test_the_fingerprint_covers_each_entry_file_and_settings(tmp_path, files):
    base = store.scan_input(blend_cfg(tmp_path, files))
    write_rows(files["tool"], [row(100 + i, agent="t") for i in range(5)] + [row(999, agent="t")])
    changed = store.scan_input(blend_cfg(tmp_path, files))
    assert changed.fingerprint != base.fingerprint and changed.blend[1].sha256 != base.blend[1].sha256
    from shardrun.plan import planner

    assert any(d.startswith("entry tool: its file changed") for d in planner.plan_differences(base, changed))
    write_rows(files["tool"], [row(100 + i, agent="t") for i in range(6)])
    assert store.scan_input(blend_cfg(tmp_path, files)).fingerprint == base.fingerprint
    for kw in (
        {"tool": {"limit": 5}},
        {"tool": {"num_repeats": 4}},
        {"materialize": {"sample": "random", "limit_per_entry": 9}},
        {"materialize": {"sample": "random", "limit_per_entry": 9, "seed": 1}},
    ):
        other = store.scan_input(blend_cfg(tmp_path, files, **json.loads(json.dumps(kw))))
        assert other.fingerprint != base.fingerprint, kw
    renamed = blend_cfg(tmp_path, files)
    renamed = renamed.model_copy(
        update={"entries": [e.model_copy(update={"label": e.label + "_x"}) for e in renamed.entries or ()]}
    )
    assert store.scan_input(renamed).fingerprint != base.fingerprint


def test_a_moved_entry_file_with_the_same_bytes_keeps_the_run_directory(tmp_path, files):
    """Where an entry's file lies does not decide the rollouts (its bytes do): a run directory planned from it is
    resumed from the file's new place, as a run planned from a moved input_jsonl is; other bytes are refused."""
    plan, written = store.write_plan(blend_cfg(tmp_path, files))
    assert written
    moved = tmp_path / "elsewhere" / "tool.jsonl"
    moved.parent.mkdir()
    files["tool"].rename(moved)
    again, written = store.write_plan(blend_cfg(tmp_path, files | {"tool": moved}))
    assert written is False and again == plan  # the run directory keeps the plan it recorded
    write_rows(moved, [row(100 + i, agent="t") for i in range(5)] + [row(999, agent="t")])
    with pytest.raises(ShardrunError, match="other settings"):
        store.write_plan(blend_cfg(tmp_path, files | {"tool": moved}))


def test_adaptive_sampling_plans_a_blend_wave_major(tmp_path, files):
    cfg = blend_cfg(
        tmp_path,
        files,
        tool={"num_repeats": 6},
        num_repeats=4,
        sharding={"num_shards": 4},
        sampling={"stop_when_decided": {"drop_solved": True}, "wave": 2},
    )
    plan, _ = store.write_plan(cfg)
    assert plan.planning["sharding"]["slicing"] == "contiguous"
    waves = []
    for spec in plan.shards:
        for raw in store.materialized_path(cfg.run_dir, spec.index).read_bytes().splitlines():
            r = orjson.loads(raw)
            waves.append((spec.index, r["_ng_rollout_index"] // 2, r["_ng_task_index"]))
    assert len(waves) == plan.num_rollouts == 18 * 4 + 6 * 6
    order = sorted(waves)  # shards in index order run the waves in order
    assert [w for _, w, _ in order] == sorted(w for _, w, _ in order)
    assert Counter(w for _, w, _ in waves) == {0: 48, 1: 48, 2: 12}


def test_the_plan_table_shows_each_entry(tmp_path, files):
    from shardrun.plan import render

    cfg = blend_cfg(tmp_path, files, tool={"limit": 4}, nickname="mix")
    plan = store.scan_input(cfg)
    text = render.plan_table(plan, 1001)
    assert text.splitlines()[0].split() == ["blend", "mix"]
    assert "entry tool" in text and "agent t: 4 of 6 rows x 2 repeats = 8" in text
    assert "agent m: 10 of 10 rows x 2 repeats = 20" in text
    data = json.loads(render.plan_json(plan, 1001))
    assert data["entries"][1] == {
        "label": "tool",
        "agent": "t",
        "rows_in_file": 6,
        "tasks": 4,
        "repeats": 2,
        "rollouts": 8,
    }


def test_entries_sharing_an_agent_keep_their_own_repeats(tmp_path, files):
    plan = store.scan_input(blend_cfg(tmp_path, files, more_math={"num_repeats": 5}))
    assert [(e.label, e.repeats, e.num_rollouts) for e in plan.blend] == [
        ("math", 2, 20),
        ("tool", 2, 12),
        ("more_math", 5, 40),
    ]
    assert plan.agents["m"] == {"tasks": 18, "rollouts": 60, "repeats": 5}  # the largest, with a warning
    assert any("agent 'm' runs entries at different repeats (2, 5)" in w for w in plan.warnings)
    assert plan.repeats_of(0, "m") == 2 and plan.repeats_of(16, "m") == 5


GYM_VENV = Path.home() / ".cache/shardrun/gym-venv-0.7.0"
RECIPE = GYM_VENV / "lib/python3.13/site-packages/benchmarks/nemotron_3.5_super/reward_profiling"


@pytest.mark.gym  # the nemo-gym 0.7.0 wheel's own files
@pytest.mark.skipif(not (RECIPE / "infra").is_dir(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is absent")
def test_random_sampling_picks_the_rows_nemo_gym_materialize_picks(tmp_path):
    import subprocess

    rows = [row(i, agent="m") for i in range(40)]
    data = write_rows(tmp_path / "d.jsonl", rows[:13] + [b""] + rows[13:])  # a blank line is not a row
    cfg = config.validate(
        {
            "run_dir": str(tmp_path / "run"),
            "entries": [{"label": "some.label", "data": str(data), "agent": "m"}],
            "materialize": {"limit_per_entry": 7, "sample": "random", "seed": 3},
        }
    )
    ours = [raw for _, raw in blend_input.lines(blend_input.layout(cfg))]
    script = (
        "import sys, zlib; sys.path.insert(0, sys.argv[1]); from infra.materialize import _select_random\n"
        "with open(sys.argv[2], 'rb') as f:\n"
        "    sys.stdout.buffer.write(b''.join(_select_random(f, 7, 3 + (zlib.crc32(b'some.label') & 0xFFFFFFFF))))"
    )
    theirs = subprocess.run(
        [str(GYM_VENV / "bin" / "python"), "-c", script, str(RECIPE), str(data)],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    assert ours == theirs and len(ours) == 7
