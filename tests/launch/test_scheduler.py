"""launch/scheduler.py without Slurm: the squeue/sacct/scontrol parsers, and the real command lines run against
stand-in programs on PATH (the real ones are exercised in tests/slurm/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardrun.launch import scheduler


def test_parse_max_array_size():
    text = "Configuration data as of ...\nMaxArraySize            = 1001\nMaxJobCount             = 10000\n"
    assert scheduler.parse_max_array_size(text) == 1001
    assert scheduler.parse_max_array_size("MaxJobCount = 3\n") is None


def test_parse_squeue():
    text = (
        "5_2|PENDING|JobArrayTaskLimit|N/A|sr-x\n5_0|RUNNING|None|2026-11-22T00:20:07|sr-x\n"
        "9|PENDING|Dependency|N/A|sr-x-merge\n\n"
    )
    jobs = scheduler.parse_squeue(text)
    assert set(jobs) == {"5_2", "5_0", "9"}
    assert jobs["5_0"].running and not jobs["5_2"].running and jobs["5_2"].array_id == "5"
    assert jobs["9"].reason == "Dependency" and jobs["9"].name == "sr-x-merge"
    with pytest.raises(scheduler.SlurmError):
        scheduler.parse_squeue("garbage")


SACCT = """7_0|COMPLETED|0:0|a|b|3600|billing=64,cpu=64,gres/gpu=8,mem=512G,node=1
7_1|CANCELLED by 0|0:15|a|b|5400|billing=64,cpu=64,gres/gpu:h100=4,gres/gpu:a100=2,mem=512G,node=1
7_[2-4]|CANCELLED by 0|0:0|None|b|0|
8|TIMEOUT|0:0|a|b|120|cpu=2,mem=4G,node=1
|ignored|x|y|z|1|cpu=1
"""


def test_parse_sacct_states_and_gpu_hours():
    jobs = scheduler.parse_sacct(SACCT)
    assert set(jobs) == {"7_0", "7_1", "7_2", "7_3", "7_4", "8"}  # the range that never started is expanded
    assert jobs["7_1"].state == "CANCELLED" and jobs["7_3"].state == "CANCELLED"
    assert jobs["7_0"].gpu_hours == 8.0 and jobs["7_1"].gpus == 6 and jobs["7_1"].gpu_hours == pytest.approx(9.0)
    assert jobs["8"].gpus == 0 and jobs["8"].gpu_hours == 0.0 and jobs["7_3"].elapsed_s == 0
    assert scheduler.describe_ended(jobs["8"]) == "Slurm job 8 hit its time limit"
    failed = scheduler.SacctJob("3", "FAILED", "1:0", "", "", 5, 0)
    assert "exit code 1:0" in scheduler.describe_ended(failed)


def stand_in(folder: Path, name: str, out: str, code: int = 0) -> Path:
    """A program `name` on PATH that records its arguments and prints `out`."""
    folder.mkdir(exist_ok=True)
    exe = folder / name
    args = folder / f"{name}.args"
    exe.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {args}\ncat <<'EOF'\n{out}EOF\nexit {code}\n")
    exe.chmod(0o755)
    return args


def test_query_sacct_runs_one_sacct_call(tmp_path, monkeypatch):
    args = stand_in(tmp_path / "bin", "sacct", SACCT)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    jobs = scheduler.query_sacct(["8", "7", "7"])
    assert jobs["7_1"].gpu_hours == pytest.approx(9.0) and jobs["8"].state == "TIMEOUT"
    assert args.read_text().split() == [
        "--noheader",
        "--parsable2",
        "--allocations",
        f"--format={scheduler.SACCT_FORMAT}",
        "--jobs",
        "7,8",
    ]
    args.unlink()
    assert scheduler.query_sacct([]) == {} and not args.exists()  # no ids: no call


def test_query_sacct_without_accounting_is_empty(tmp_path, monkeypatch):
    stand_in(tmp_path / "bin", "sacct", "", code=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert scheduler.query_sacct(["1"]) == {}  # slurmdbd down or accounting off
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert scheduler.query_sacct(["1"]) == {}  # no sacct at all


def test_squeue_and_scancel_command_lines(tmp_path, monkeypatch):
    squeue_args = stand_in(tmp_path / "bin", "squeue", "5_0|RUNNING|None|N/A|sr-b\n")
    scancel_args = stand_in(tmp_path / "bin", "scancel", "")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert list(scheduler.query_live_jobs(["sr-b", "sr-a", ""])) == ["5_0"]
    assert squeue_args.read_text().split() == ["--noheader", "--array", "--name=sr-a,sr-b", "--format=%i|%T|%r|%S|%j"]
    assert scheduler.cancel(["9", "5", "9"]) == ["5", "9"]
    assert scancel_args.read_text().split() == ["5", "9"]
    stand_in(tmp_path / "bin", "squeue", "", code=1)
    with pytest.raises(scheduler.SlurmError, match="squeue"):
        scheduler.query_live_jobs(["sr-a"])
