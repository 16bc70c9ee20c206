"""`shardrun plan`: the summary table, JSON output, overrides, --write, relative paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import orjson
from typer.testing import CliRunner

from shardrun.cli import app
from tests.planning_helpers import row

runner = CliRunner()


def setup_dir(tmp_path, agents=("a", "a", "b")):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_bytes(
        b"".join(orjson.dumps(row(i, agent=a)) + b"\n" for i, a in enumerate(agents))
    )
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "run.yaml").write_text(
        "input_jsonl: data/in.jsonl\nrun_dir: runs/r1\nnum_repeats: {a: 4, _default: 2}\nsharding:\n  num_shards: 3\n"
    )
    return tmp_path / "conf" / "run.yaml"


def test_plan_prints_the_summary_table(tmp_path, monkeypatch):
    cfg = setup_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(cfg)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "tasks" in out and " 3\n" in out
    assert "rollouts" in out and "10" in out
    assert "agent a" in out and "2 tasks x 4 repeats = 8" in out
    assert "agent b" in out and "1 tasks x 2 repeats = 2" in out
    assert "min 3 / max 4" in out and "array jobs needed" in out
    assert not (tmp_path / "runs").exists()  # without --write nothing is written


def test_relative_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    cfg = setup_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(cfg), "--write"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "r1" / "plan.json").exists()
    assert (tmp_path / "runs" / "r1" / "shards" / "00002" / "rollouts_materialized_inputs.jsonl").exists()
    again = runner.invoke(app, ["plan", str(cfg), "--write"])
    assert "already planned" in again.output


def test_overrides_in_hydra_syntax(tmp_path, monkeypatch):
    cfg = setup_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(
        app,
        [
            "plan",
            str(cfg),
            "num_repeats=3",
            "sharding.slicing=round_robin",
            "++sharding.num_shards=9",
            "+agent_name=a",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["rollouts"] == 9 and data["shards"] == 9 and data["tasks"] == 3


def test_cluster_pick_sets_array_size_for_the_table(tmp_path, monkeypatch):
    cfg = setup_dir(tmp_path, agents=["a"] * 30)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(
        app,
        ["plan", str(cfg), "cluster=slurm-example", "++cluster.max_array_size=4", "sharding.num_shards=10", "--json"],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["array_jobs_needed"] == 3


def test_console_script_runs(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "shardrun")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "plan" in out.stdout
