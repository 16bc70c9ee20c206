"""The collector settings' section (`collector:`) and their old names under `cluster.`, which still work with a
warning in the plan (issue #33)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config
from shardrun.rundir import store
from tests.planning_helpers import row

runner = CliRunner()


def plan(tmp_path: Path, **settings) -> tuple[str, Path]:
    (tmp_path / "input.jsonl").write_text(json.dumps(row(0)) + "\n")
    data = {"input_jsonl": str(tmp_path / "input.jsonl"), "run_dir": str(tmp_path / "run"), **settings}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps(data))
    result = runner.invoke(app, ["plan", str(cfg), "--write"])
    assert result.exit_code == 0, result.output
    return result.output, tmp_path / "run"


def test_the_collector_section_is_read_and_stored_in_the_plan(tmp_path):
    out, run_dir = plan(tmp_path, collector={"rollouts_per_slot": 2, "pipeline_shards": 1, "service": False})
    assert "deprecated" not in out
    stored = config.RunConfig.model_validate(store.load_plan(run_dir).config)
    assert stored.collector == config.CollectorConfig(service=False, rollouts_per_slot=2.0, pipeline_shards=1)


def test_the_old_cluster_keys_still_work_with_a_warning_each(tmp_path):
    out, run_dir = plan(
        tmp_path, cluster={"rollouts_per_slot": 2, "pipeline_shards": 1, "collector_service": False, "workers": 2}
    )
    for old, new in config.MOVED_TO_COLLECTOR.items():
        assert f"cluster.{old} is deprecated: it is now collector.{new}" in out, out
    p = store.load_plan(run_dir)
    assert sum("deprecated" in w for w in p.warnings) == 3
    stored = config.RunConfig.model_validate(p.config)  # stored under the new names: no old key left
    assert stored.collector == config.CollectorConfig(service=False, rollouts_per_slot=2.0, pipeline_shards=1)
    assert stored.deprecations == [] and "rollouts_per_slot" not in p.config["cluster"]
    assert stored.cluster_or_default.workers == 2  # the rest of the cluster section is untouched


def test_the_defaults_are_those_of_before(tmp_path):
    c = config.CollectorConfig()
    assert (c.service, c.rollouts_per_slot, c.pipeline_shards) == (True, 3.0, 4)
