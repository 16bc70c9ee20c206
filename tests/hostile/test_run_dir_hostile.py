"""Hostile run directories: a `run_dir` shardrun must not write into, links inside a run directory that lead out of
it, and `.done` markers whose fields have the wrong types.

Each refused case exits 2, names the key or the path, writes nothing and changes no file (outside the run as well
as inside it). An invalid marker is ignored and reported, never a traceback. The valid-but-unusual cases (an
empty directory, a name with spaces, a run directory that is itself a link, a user's note beside the plan) work."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import orjson
import pytest
import yaml
from hostilekit import invoke, refused
from reportkit import input_row, planned_run, seal_shards, write_input

from shardrun.rundir import store


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


def config_for(tmp: Path, run_dir: str) -> Path:
    inp = write_input(tmp / "input.jsonl", [input_row(i) for i in range(4)])
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump({"input_jsonl": str(inp), "run_dir": run_dir, "num_repeats": 2}))
    return cfg


# ---------------------------------------------------------------- run_dir itself


def test_an_empty_run_dir_is_refused_not_taken_as_the_current_directory(tmp_path, unchanged, monkeypatch):
    cfg = config_for(tmp_path, "")
    monkeypatch.chdir(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", "empty path")


@pytest.mark.parametrize("root", ["/", "/tmp/..", "//"])
def test_the_root_of_the_file_system_is_refused(tmp_path, unchanged, root):
    cfg = config_for(tmp_path, root)
    assert not os.path.exists("/plan.json")
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", root)
    assert not os.path.exists("/plan.json") and not os.path.exists("/.shardrun.lock")


def test_the_home_directory_is_refused(tmp_path, unchanged, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cfg = config_for(tmp_path, str(home))
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", str(home), "home directory")


@pytest.mark.parametrize("spelled", ["~", "~/", "~/."])
def test_the_home_directory_spelled_with_a_tilde_is_refused(tmp_path, unchanged, monkeypatch, spelled):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = config_for(tmp_path, spelled)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", "home directory")
    assert not (tmp_path / "~").exists()


def test_the_home_directory_through_a_link_is_refused(tmp_path, unchanged, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "h").symlink_to(home)
    monkeypatch.setenv("HOME", str(home))
    cfg = config_for(tmp_path, str(tmp_path / "h"))
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", "home directory")


def test_someone_elses_folder_is_refused_and_its_files_named(tmp_path, unchanged):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("months of work\n")
    (theirs / "shards").mkdir()  # a name shardrun uses does not make it a run directory
    cfg = config_for(tmp_path, str(theirs))
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", str(theirs), "thesis.tex", "not empty")


def test_someone_elses_folder_is_refused_by_submit_dry_run_too(tmp_path, unchanged):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("x\n")
    cfg = config_for(tmp_path, str(theirs))
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run"), "run_dir", "notes.txt")


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_run_dir_that_is_not_a_directory_is_refused(tmp_path, unchanged, kind):
    path = tmp_path / "run"
    if kind == "file":
        path.write_text("not a directory\n")
    else:
        os.mkfifo(path)
    cfg = config_for(tmp_path, str(path))
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", str(path), "not a directory")


def test_a_run_dir_under_the_kernel_file_systems_is_refused(tmp_path, unchanged):
    cfg = config_for(tmp_path, "/proc/shardrun-run")
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "run_dir", "/proc/shardrun-run")


@pytest.mark.parametrize("name", ["empty dir", "runs/with space/ünï", "link to an empty dir"])
def test_valid_but_unusual_run_dirs_are_planned(tmp_path, unchanged, name):
    if name == "empty dir":
        run_dir = tmp_path / "empty"
        run_dir.mkdir()
    elif name == "link to an empty dir":
        (tmp_path / "real").mkdir()
        run_dir = tmp_path / "alias"
        run_dir.symlink_to(tmp_path / "real")
    else:
        run_dir = tmp_path / name
    cfg = config_for(tmp_path, str(run_dir))
    with unchanged(tmp_path, run_dir, tmp_path / "real"):
        done = invoke("plan", cfg, "--write")
    assert done.exit_code == 0, done.output
    assert (run_dir / "plan.json").is_file()
    again = invoke("plan", cfg, "--write")
    assert again.exit_code == 0 and "already planned" in again.output


def test_a_run_directory_with_a_note_beside_its_plan_is_still_a_run_directory(tmp_path):
    cfg = config_for(tmp_path, str(tmp_path / "run"))
    assert invoke("plan", cfg, "--write").exit_code == 0
    (tmp_path / "run" / "NOTES.md").write_text("what this run was for\n")
    done = invoke("plan", cfg, "--write")
    assert done.exit_code == 0 and "already planned" in done.output, done.output


def test_an_interrupted_first_write_can_be_planned_again(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "shards" / "00000").mkdir(parents=True)
    (run_dir / ".shardrun.lock").touch()
    (run_dir / ".tmp-plan.json.abc").write_bytes(b"{")
    cfg = config_for(tmp_path, str(run_dir))
    done = invoke("plan", cfg, "--write")
    assert done.exit_code == 0, done.output


# ---------------------------------------------------------------- links inside a run directory


@pytest.fixture()
def sealed(tmp_path):
    """A planned run with every shard sealed, and a folder outside it (what a link would lead to)."""
    run_dir, cfg = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    seal_shards(run_dir, reward)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not shardrun's\n")
    return run_dir, outside


def move_out_and_link(path: Path, outside: Path) -> Path:
    """Move `path` out of the run and leave a symlink to it where it was (what an attacker or a careless user
    does); returns the link."""
    target = outside / path.name
    shutil.move(str(path), str(target))
    path.symlink_to(target, target_is_directory=target.is_dir())
    return path


@pytest.mark.parametrize(
    "what",
    ["merged", "shards", "shard dir", "rollouts", "done marker", "materialized", "plan.json", "launches", "log"],
)
@pytest.mark.parametrize("command", ["status", "merge-and-profile"])
def test_a_link_out_of_the_run_is_refused_with_its_path(sealed, tmp_path, unchanged, what, command):
    run_dir, outside = sealed
    if what == "merged":
        store.merged_dir(run_dir).mkdir()
        (store.merged_dir(run_dir) / "keep.txt").write_text("x\n")
    if what == "launches":
        store.launches_path(run_dir).write_text("")
    if what == "log":
        store.shard_log_path(run_dir, 1).parent.mkdir(parents=True, exist_ok=True)
        store.shard_log_path(run_dir, 1).write_text("attempt 1\n")
    path = {
        "merged": store.merged_dir(run_dir),
        "shards": run_dir / "shards",
        "shard dir": store.shard_dir(run_dir, 1),
        "rollouts": store.rollouts_path(run_dir, 2),
        "done marker": store.done_path(run_dir, 0),
        "materialized": store.materialized_path(run_dir, 1),
        "plan.json": store.plan_path(run_dir),
        "launches": store.launches_path(run_dir),
        "log": store.shard_log_path(run_dir, 1),
    }[what]
    link = move_out_and_link(path, outside)
    with unchanged(tmp_path):
        refused(invoke(command, run_dir), str(link), "symlink")


@pytest.mark.parametrize("command", ["select", "report"])
def test_select_and_report_refuse_a_linked_merged_directory(sealed, tmp_path, unchanged, command):
    run_dir, outside = sealed
    assert invoke("merge-and-profile", run_dir).exit_code == 0
    link = move_out_and_link(store.merged_dir(run_dir), outside)
    args = ["-o", str(tmp_path / "subset.jsonl")] if command == "select" else []
    with unchanged(tmp_path):
        refused(invoke(command, run_dir, *args), str(link), "symlink")


@pytest.mark.parametrize("command", ["select", "report", "merge-and-profile"])
def test_a_linked_merged_file_is_refused(sealed, tmp_path, unchanged, command):
    run_dir, outside = sealed
    assert invoke("merge-and-profile", run_dir).exit_code == 0
    link = move_out_and_link(store.merged_reward_profiling_path(run_dir), outside)
    args = ["-o", str(tmp_path / "subset.jsonl")] if command == "select" else []
    with unchanged(tmp_path):
        refused(invoke(command, run_dir, *args), str(link), "symlink")


def test_report_does_not_write_through_a_linked_report_page(sealed, tmp_path, unchanged):
    run_dir, outside = sealed
    assert invoke("merge-and-profile", run_dir).exit_code == 0
    (outside / "report.html").write_text("someone else's page\n")
    store.report_path(run_dir).symlink_to(outside / "report.html")
    with unchanged(tmp_path):
        refused(invoke("report", run_dir), str(store.report_path(run_dir)), "symlink")


def test_plan_write_refuses_a_shard_link_in_an_interrupted_run(tmp_path, unchanged):
    """No plan.json yet (a first write was interrupted) and shards/00001 leads elsewhere: planning would write the
    shard's inputs there."""
    run_dir = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep\n")
    (run_dir / "shards").mkdir(parents=True)
    (run_dir / "shards" / "00001").symlink_to(outside, target_is_directory=True)
    inp = write_input(tmp_path / "input.jsonl", [input_row(i) for i in range(6)])
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"input_jsonl": str(inp), "run_dir": str(run_dir), "num_repeats": 2, "sharding": {"num_shards": 3}}
        )
    )
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), str(run_dir / "shards" / "00001"), "symlink")


# ---------------------------------------------------------------- markers with fields of the wrong type


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_rollouts", "16"),
        ("num_rollouts", None),
        ("num_rollouts", -4),
        ("num_rollouts", 1.5),
        ("num_rollouts", True),
        ("num_failed", "0"),
        ("num_failed", []),
        ("rollouts_bytes", "123"),
        ("rollouts_sha256", 7),
        ("gpu_hours", "lots"),
        ("started_at", {"t": 1}),
        ("extra", [1, 2]),
        ("plan_fingerprint", None),
    ],
)
def test_a_marker_with_a_field_of_the_wrong_type_is_ignored_and_reported(sealed, tmp_path, unchanged, field, value):
    run_dir, _ = sealed
    path = store.done_path(run_dir, 0)
    marker = orjson.loads(path.read_bytes())
    marker[field] = value
    path.write_bytes(orjson.dumps(marker))
    with unchanged(tmp_path):
        st = invoke("status", run_dir, "--all")
        assert st.exit_code == 0, st.output
        assert "Traceback" not in st.output and str(path) in st.output, st.output
        if field != "plan_fingerprint":
            assert "invalid marker" in st.output and field in st.output, st.output
        merged = invoke("merge-and-profile", run_dir)
    assert merged.exit_code == 5, merged.output
    assert isinstance(merged.exception, SystemExit) and "Traceback" not in merged.output
    assert str(path) in merged.output


@pytest.mark.parametrize("content", [b"[1, 2]", b"null", b'"sealed"', b"", b"\xff\xfe", b"{" * 2000, "dir"])
def test_a_marker_that_is_no_object_is_ignored_and_reported(sealed, tmp_path, unchanged, content):
    run_dir, _ = sealed
    path = store.done_path(run_dir, 1)
    path.unlink()
    if content == "dir":
        path.mkdir()
    else:
        path.write_bytes(content)
    with unchanged(tmp_path):
        st = invoke("status", run_dir, "--all")
        assert st.exit_code == 0 and "Traceback" not in st.output and str(path) in st.output, st.output
        merged = invoke("merge-and-profile", run_dir)
    assert merged.exit_code == 5 and isinstance(merged.exception, SystemExit), merged.output


def test_a_marker_without_a_field_it_needs_is_ignored_and_reported(sealed, tmp_path, unchanged):
    run_dir, _ = sealed
    path = store.done_path(run_dir, 2)
    marker = orjson.loads(path.read_bytes())
    del marker["rollouts_bytes"]
    path.write_bytes(orjson.dumps(marker))
    with unchanged(tmp_path):
        st = invoke("status", run_dir, "--all")
    assert st.exit_code == 0 and "invalid marker" in st.output and "rollouts_bytes" in st.output, st.output


# ---------------------------------------------------------------- launch records edited or damaged

SLURM_RECORD = {
    "executor": "slurm",
    "submitted_at": 1_700_000_000.0,
    "host": "login1",
    "jobs": {"0": "7_0", "1": "7_1", "2": "7_2"},
    "tag": "shardrun-0123456789",
    "merge_job_name": "shardrun-0123456789-merge",
    "arrays": ["7"],
}


@pytest.mark.parametrize(
    "line, named",
    [
        (json.dumps(SLURM_RECORD | {"tag": "shardrun-0123456789,other-users-job"}), "'tag'"),
        (json.dumps(SLURM_RECORD | {"merge_job_name": "x\ny"}), "'merge_job_name'"),
        (json.dumps(SLURM_RECORD | {"jobs": {"zero": "7_0"}}), "'jobs'"),
        (json.dumps(SLURM_RECORD | {"jobs": ["7_0"]}), "'jobs'"),
        (json.dumps(SLURM_RECORD | {"submitted_at": "yesterday"}), "'submitted_at'"),
        (json.dumps([SLURM_RECORD]), "not an object"),
        ('{"executor": "slurm", "jobs": {"0": ', None),  # a torn last line: no newline, skipped
        ("not json at all", "not a launch record"),
    ],
)
def test_an_edited_launch_record_is_refused_with_its_line(sealed, tmp_path, unchanged, line, named):
    run_dir, _ = sealed
    good = json.dumps(SLURM_RECORD | {"jobs": {"0": "7_0"}})
    torn = named is None
    store.launches_path(run_dir).write_text(good + "\n" + line + ("" if torn else "\n"))
    with unchanged(tmp_path):
        done = invoke("status", run_dir)
        if torn:
            assert done.exit_code == 0 and "Traceback" not in done.output, done.output
            return
        refused(done, f"{store.launches_path(run_dir)}:2", named)
        refused(invoke("cancel", run_dir), f"{store.launches_path(run_dir)}:2")
