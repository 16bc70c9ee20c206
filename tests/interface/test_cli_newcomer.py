"""The small things a newcomer meets first (issue 34, item 3): --version, --debug after the command, a "next:" line
after each stage, plan --json's warnings, the hint for a misspelt override, status's advice on a run only planned,
a blend's data root (every missing file named at once), cluster=NAME over a manifest's sbatch block."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from reportkit import input_row, merge_run, planned_run, seal_shards
from shardrun import __version__
from shardrun.cli import app
from shardrun.core import config, gym_version
from shardrun.launch import submission
from tests.planning_helpers import row

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_and_the_default_gym_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"shardrun {__version__} (default NeMo Gym version {gym_version.DEFAULT_VERSION})"
    # the default is the release scripts/setup.sh installs
    setup = (REPO / "scripts/setup.sh").read_text()
    assert re.search(rf"^GYM_DEFAULT_VERSION={re.escape(gym_version.DEFAULT_VERSION)}$", setup, re.MULTILINE)


def test_debug_after_the_command_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "no-such-run")
    plain = runner.invoke(app, ["status", missing])
    assert plain.exit_code == 2 and "error:" in plain.output and plain.exception.__class__ is SystemExit
    for args in (["status", missing, "--debug"], ["--debug", "status", missing]):
        result = runner.invoke(app, args)
        assert result.exception is not None and not isinstance(result.exception, SystemExit), result.output


def small_run_config(tmp_path: Path, **extra) -> Path:
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps(row(i)) + b"\n" for i in range(6)))
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"input_jsonl": str(tmp_path / "in.jsonl"), "run_dir": str(tmp_path / "run"), **extra})
    )
    return path


def test_plan_write_says_submit_comes_next(tmp_path):
    path = small_run_config(tmp_path)
    result = runner.invoke(app, ["plan", str(path), "sharding.num_shards=2", "--write"])
    assert result.exit_code == 0, result.output
    assert f"next: shardrun submit {path} sharding.num_shards=2" in result.output


def test_plan_json_carries_the_plans_warnings(tmp_path):
    path = small_run_config(tmp_path, cluster={"rollouts_per_slot": 2})
    result = runner.invoke(app, ["plan", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # the JSON alone on stdout
    assert summary["warnings"] and any("rollouts_per_slot" in w for w in summary["warnings"])
    (tmp_path / "quiet").mkdir()
    quiet = runner.invoke(app, ["plan", str(small_run_config(tmp_path / "quiet")), "--json"])
    assert quiet.exit_code == 0 and json.loads(quiet.stdout)["warnings"] == []


def test_a_misspelt_key_gets_the_hint_at_once(tmp_path):
    path = small_run_config(tmp_path)
    result = runner.invoke(app, ["plan", str(path), "sharding.num_shard=4"])
    assert result.exit_code == 2
    assert "did you mean sharding.num_shards?" in result.output
    assert "use '+" not in result.output and "+sharding" not in result.output
    known = runner.invoke(app, ["plan", str(path), "sharding.num_shards=4"])
    assert known.exit_code == 0, known.output


def test_status_of_a_run_only_planned_recommends_submit(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_shards=2)
    result = runner.invoke(app, ["status", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "shardrun submit CONFIG" in result.output and "shardrun resume" not in result.output
    # and resume indeed refuses there
    refused = runner.invoke(app, ["resume", str(run_dir)])
    assert refused.exit_code == 2 and "nothing was launched" in refused.output


def test_submit_says_what_comes_next(tmp_path, monkeypatch):
    run_dir, cfg = planned_run(tmp_path, [input_row(i) for i in range(4)], num_shards=2)
    from shardrun.rundir import store

    plan = store.load_plan(run_dir)
    sealed = [submission.ShardOutcome(i, "sealed", "8 rollouts, 0 failed") for i in (0, 1)]
    outcome = submission.SubmitResult(run_dir, plan, True, {0: "1", 1: "2"}, [], [], sealed)
    monkeypatch.setattr(submission, "submit", lambda *a, **k: outcome)
    result = runner.invoke(app, ["submit", str(tmp_path / "run.yaml")])
    assert result.exit_code == 0, result.output
    assert f"next: shardrun merge-and-profile {run_dir}" in result.output
    no_wait = submission.SubmitResult(run_dir, plan, True, {0: "1", 1: "2"}, [], [], None)
    monkeypatch.setattr(submission, "submit", lambda *a, **k: no_wait)
    result = runner.invoke(app, ["submit", str(tmp_path / "run.yaml"), "--no-wait"])
    assert f"next: shardrun status {run_dir} --watch" in result.output


def test_merge_and_profile_says_report_comes_next(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, lambda t, r: 1.0)
    result = runner.invoke(app, ["merge-and-profile", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith(f"next: shardrun report {run_dir}")
    merge_run(run_dir)  # merging again is fine (the test's own check that the run is mergeable)


def blend_manifest(tmp_path: Path, data: list[str], **extra) -> Path:
    path = tmp_path / "manifest.yaml"
    entries = [{"label": f"e{i}", "agent": "a", "data": d} for i, d in enumerate(data)]
    path.write_text(yaml.safe_dump({"nickname": "n", "num_shards": 1, "entries": entries, **extra}))
    return path


def test_a_data_root_rebases_every_entry_and_every_missing_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lustre = ["/lustre/fsw/team/data/math/train.jsonl", "/lustre/fsw/team/data/code/train.jsonl", "rel.jsonl"]
    path = blend_manifest(tmp_path, lustre)
    root = tmp_path / "mydata"
    result = runner.invoke(app, ["plan", str(path), f"data_root={root}"])
    assert result.exit_code == 2
    for name in ("math/train.jsonl", "code/train.jsonl", "rel.jsonl"):  # all three at once, rebased
        assert str(root / name) in result.output, result.output
    assert "3 of 3 entries' data files are missing" in result.output
    for i, name in enumerate(("math/train.jsonl", "code/train.jsonl", "rel.jsonl")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"".join(orjson.dumps(row(j, agent="a")) + b"\n" for j in range(i + 2)))
    result = runner.invoke(app, ["plan", str(path), f"data_root={root}", "--json"])
    assert result.exit_code == 0, result.output
    assert [e["tasks"] for e in json.loads(result.stdout)["entries"]] == [2, 3, 4]
    # an explicit base, and a path outside it refused by entry
    cfg = config.load(path, [f"data_root={root}", "data_root_from=/lustre/fsw/team"])
    assert [e.data for e in cfg.entries or ()][0] == root / "data/math/train.jsonl"
    with pytest.raises(Exception, match=r"entries.0.data \(entry 'e0'\).*not below data_root_from /elsewhere"):
        config.load(path, [f"data_root={root}", "data_root_from=/elsewhere"])


def test_without_a_data_root_every_missing_file_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = blend_manifest(tmp_path, ["/lustre/a.jsonl", "/lustre/b.jsonl"])
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert "entries.0.data (entry 'e0'): /lustre/a.jsonl" in result.output
    assert "entries.1.data (entry 'e1'): /lustre/b.jsonl" in result.output
    assert "data_root=DIR" in result.output


def test_cluster_name_over_a_manifest_merges_and_warns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_bytes(b"".join(orjson.dumps(row(j, agent="a")) + b"\n" for j in range(3)))
    sbatch = {"account": "nv_acct", "partition": "nv_batch", "constraint": "h100"}
    path = blend_manifest(tmp_path, ["d.jsonl"], sbatch=sbatch)
    (tmp_path / "cluster_configs").mkdir()
    (tmp_path / "cluster_configs/mine.yaml").write_text(yaml.safe_dump({"executor": "slurm", "partition": "mine"}))
    cfg = config.load(path, ["cluster=mine"])
    assert cfg.cluster is not None
    assert (cfg.cluster.account, cfg.cluster.partition) == ("nv_acct", "mine")  # kept, and the cluster's wins
    assert cfg.cluster.additional_parameters == {"constraint": "h100"}
    (warning,) = cfg.not_carried_out
    assert "sbatch.partition='nv_batch'" in warning and "cluster=mine" in warning
    result = runner.invoke(app, ["plan", str(path), "cluster=mine"])
    assert result.exit_code == 0, result.output
    assert "warning: not carried out: sbatch.partition='nv_batch'" in result.output
