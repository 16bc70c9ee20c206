"""Hostile `shardrun select` input: outputs that would overwrite what they must not, and rules no task can meet.

Each case is refused with exit 2, names the path or the flag, writes nothing and changes no file."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
from hostilekit import invoke, refused
from reportkit import input_row, merge_run, planned_run, seal_shards


def reward(t: int, r: int) -> float:
    return float((t + r) % 3 == 0)


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a") for i in range(6)]
    run_dir, cfg = planned_run(tmp_path, rows, num_repeats=3, num_shards=2)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    return run_dir, cfg.input_jsonl


def inside(run_dir: Path) -> dict[str, Path]:
    return {
        "plan": run_dir / "plan.json",
        "rollouts": run_dir / "shards" / "00000" / "rollouts.jsonl",
        "merged": run_dir / "merged" / "rollouts.jsonl",
        "new file": run_dir / "curriculum.jsonl",
        "run dir": run_dir,
        "dot-dot": run_dir / "merged" / ".." / "plan.json",
    }


@pytest.mark.parametrize("where", ["plan", "rollouts", "merged", "new file", "run dir", "dot-dot"])
def test_an_output_inside_the_run_directory_is_refused(run, tmp_path, unchanged, where):
    run_dir, _ = run
    target = inside(run_dir)[where]
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", target), str(target))


def test_a_symlink_into_the_run_directory_is_refused_and_stays_a_link(run, tmp_path, unchanged):
    run_dir, _ = run
    link = tmp_path / "out.jsonl"
    link.symlink_to(run_dir / "plan.json")
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", link), str(link), "inside the run directory")


def test_the_input_file_is_refused_directly_and_through_a_link(run, tmp_path, unchanged):
    run_dir, input_path = run
    link = tmp_path / "also-input.jsonl"
    link.symlink_to(input_path)
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", input_path), str(input_path), "input file itself")
        refused(invoke("select", run_dir, "-o", link), str(link), "input file itself")


def test_the_planned_input_is_refused_when_another_input_is_named(run, tmp_path, unchanged):
    """--input names where the input is now; the file the plan was made from is still not an output."""
    run_dir, input_path = run
    moved = tmp_path / "moved-input.jsonl"
    moved.write_bytes(input_path.read_bytes())
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "--input", moved, "-o", input_path), str(input_path), "input file itself")


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_an_input_that_is_not_a_regular_file_is_refused_without_hanging(run, tmp_path, unchanged, kind):
    """--input names where the planned input is now; a FIFO would wait for a writer, a device never end."""
    run_dir, _ = run
    if kind == "fifo":
        source = tmp_path / "input-pipe"
        os.mkfifo(source)
    elif kind == "device":
        source = a_character_device(tmp_path)
    else:
        source = tmp_path / "input-dir"
        source.mkdir()
    out = tmp_path / "subset.jsonl"
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "--input", source, "-o", out), str(source), "not a regular JSONL file")
    assert not out.exists()


def test_a_hard_link_to_the_input_is_refused(run, tmp_path, unchanged):
    run_dir, input_path = run
    hard = tmp_path / "hard-link.jsonl"
    os.link(input_path, hard)
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", hard), str(hard), "input file itself")


def a_character_device(tmp_path: Path) -> Path:
    """A character device that surely exists: made here with mknod (the null device's numbers, 1:3) where this
    user may (root, as in CI), else /dev/null, /dev/zero, ... whichever this machine really has as a character
    device. A sandbox may put a regular file at /dev/null; that would prove nothing about devices, and missing
    every device is a broken environment: a failure in CI, a skip elsewhere."""
    made = tmp_path / "null-device"
    try:
        os.mknod(made, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        return made
    except (PermissionError, OSError):
        pass
    for candidate in ("/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random", "/dev/tty"):
        if os.path.exists(candidate) and stat.S_ISCHR(os.stat(candidate).st_mode):
            return Path(candidate)
    message = "no character device: mknod is not permitted and /dev has none"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def test_a_device_is_refused(run, tmp_path, unchanged):
    run_dir, _ = run
    device = a_character_device(tmp_path)
    before = os.stat(device)
    assert stat.S_ISCHR(before.st_mode)
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", device), str(device), "character device")
    after = os.lstat(device)
    assert (after.st_mode, after.st_rdev, after.st_ino) == (before.st_mode, before.st_rdev, before.st_ino)


def test_a_link_to_a_device_is_refused_and_stays_a_link(run, tmp_path, unchanged):
    run_dir, _ = run
    link = tmp_path / "to-device.jsonl"
    link.symlink_to(a_character_device(tmp_path))
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", link), str(link), "character device")


@pytest.mark.parametrize("path", ["/dev/null", "/dev/shardrun-not-a-device.jsonl", "/proc/self/comm", "/sys/x"])
def test_a_path_under_the_kernel_file_systems_is_refused_whatever_it_is_here(run, tmp_path, unchanged, path):
    """/dev/null may be a regular file in a sandbox, and a new name under /dev is no file either: the location
    decides, not what this machine happens to have there (a root user's atomic rename would replace the node)."""
    run_dir, _ = run
    before = os.lstat("/dev/null")
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", path), path, "kernel files")
    after = os.lstat("/dev/null")
    assert (after.st_mode, after.st_rdev, after.st_ino) == (before.st_mode, before.st_rdev, before.st_ino)
    assert not os.path.lexists("/dev/shardrun-not-a-device.jsonl")


def test_a_fifo_and_a_link_to_one_are_refused(run, tmp_path, unchanged):
    run_dir, _ = run
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "to-pipe.jsonl"
    link.symlink_to(fifo)
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", fifo), str(fifo), "FIFO")
        refused(invoke("select", run_dir, "-o", link), str(link), "FIFO")


def test_a_socket_is_refused(run, tmp_path, unchanged):
    run_dir, _ = run
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with unchanged(tmp_path):
            refused(invoke("select", run_dir, "-o", path), str(path), "socket")


def test_a_directory_is_refused(run, tmp_path, unchanged):
    run_dir, _ = run
    (tmp_path / "outdir").mkdir()
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", tmp_path / "outdir"), str(tmp_path / "outdir"), "directory")


def test_a_link_to_a_regular_file_elsewhere_is_followed_and_kept(run, tmp_path, unchanged):
    """Valid but unusual: the link stays a link, its target gets the subset (atomically), nothing else changes."""
    run_dir, _ = run
    target = tmp_path / "elsewhere" / "curriculum.jsonl"
    target.parent.mkdir()
    target.write_bytes(b"old\n")
    link = tmp_path / "curriculum.jsonl"
    link.symlink_to(target)
    with unchanged(tmp_path, target):
        done = invoke("select", run_dir, "-o", link)
    assert done.exit_code == 0, done.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes().count(b"\n") == 6 and b"old" not in target.read_bytes()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--min-mean", "nan"], "--min-mean"),
        (["--max-mean", "nan"], "--max-mean"),
        (["--min-std", "nan"], "--min-std"),
        (["--max-mean", "inf"], "--max-mean"),
        (["--solved-threshold", "nan", "--drop-solved"], "--solved-threshold"),
        (["--min-mean", "0.8", "--max-mean", "0.2"], "--min-mean 0.8 is above --max-mean 0.2"),
        (["--min-std", "-1"], "--min-std"),
        (["--top-k-hardest", "0"], "--top-k-hardest"),
    ],
)
def test_rules_no_task_can_meet_are_refused_before_anything_is_read_or_written(run, tmp_path, unchanged, flags, named):
    run_dir, _ = run
    out = tmp_path / "c.jsonl"
    with unchanged(tmp_path):
        refused(invoke("select", run_dir, "-o", out, *flags), named)
    assert not out.exists()
