"""The bad-input catalogue: each kind is rejected before anything is written or submitted.

Every case runs `shardrun plan --write` and checks exit code 2, that the message names the file, line and field,
and that no plan.json was written. docs/reliability.md counts these cases.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from shardrun.core import config
from shardrun.plan import planner
from shardrun.rundir import store
from shardrun.cli import app
from shardrun.core.errors import BadInput
from tests import builders
from tests.planning_helpers import row

runner = CliRunner()


def write_input(tmp_path: Path, lines: list[bytes]) -> Path:
    p = tmp_path / "input.jsonl"
    p.write_bytes(b"".join(line + b"\n" for line in lines))
    return p


def config_file(tmp_path: Path, **settings) -> Path:
    """The run config beside input.jsonl (JSON, which is YAML), with these top-level settings."""
    return builders.write_config(
        tmp_path / "run.yaml", tmp_path / "input.jsonl", tmp_path / "run", as_json=True, **settings
    )


def good() -> bytes:
    return orjson.dumps(row(0))


def plan_fails(tmp_path: Path, lines: list[bytes], *needles: str, **cfg_kw) -> str:
    write_input(tmp_path, lines)
    cfg_file = config_file(tmp_path, **cfg_kw)
    result = runner.invoke(app, ["plan", str(cfg_file), "--write"])
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert needle in result.output, (needle, result.output)
    assert not (tmp_path / "run" / "plan.json").exists()
    return result.output


INPUT = "input.jsonl"

CASES = {
    "invalid JSON": ([good(), b'{"responses_create_params": {'], [f"{INPUT}:2", "not valid JSON"]),
    "non-object row": ([good(), b"[1, 2]"], [f"{INPUT}:2", "must be a JSON object"]),
    "missing params": (
        [orjson.dumps({"agent_ref": {"name": "a"}})],
        [f"{INPUT}:1", "responses_create_params", "missing"],
    ),
    "params not an object": (
        [orjson.dumps({"responses_create_params": "hi", "agent_ref": {"name": "a"}})],
        [f"{INPUT}:1", "responses_create_params", "must be an object"],
    ),
    "agent_ref malformed": ([orjson.dumps(row(0) | {"agent_ref": "a"})], [f"{INPUT}:1", "agent_ref"]),
    "missing agent, no default": (
        [good(), orjson.dumps(row(1, agent=None))],
        [f"{INPUT}:2", "agent_ref", "agent_name"],
    ),
    "duplicate explicit task index": (
        [orjson.dumps(row(0, _ng_task_index=5)), orjson.dumps(row(1, _ng_task_index=5))],
        [f"{INPUT}:2", "_ng_task_index", "line 1"],
    ),
    "explicit index clashes with a position": (
        [good(), orjson.dumps(row(1, _ng_task_index=0))],
        [f"{INPUT}:2", "_ng_task_index"],
    ),
    "negative task index": ([orjson.dumps(row(0, _ng_task_index=-1))], [f"{INPUT}:1", "_ng_task_index"]),
    "bool task index": ([orjson.dumps(row(0, _ng_task_index=True))], [f"{INPUT}:1", "_ng_task_index"]),
    "extra_body not a JSON string": (
        [orjson.dumps(row(0) | {"responses_create_params": {"input": "x", "metadata": {"extra_body": {"seed": 1}}}})],
        [f"{INPUT}:1", "metadata.extra_body"],
    ),
    "non-UTF-8 bytes": ([good(), b'{"responses_create_params": {"input": "\xff\xfe"}}'], [f"{INPUT}:2", "UTF-8"]),
    "empty input": ([b"", b"  "], ["no tasks"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_rejected_with_line_and_field(tmp_path, name):
    lines, needles = CASES[name]
    plan_fails(tmp_path, lines, *needles)


def test_every_problem_is_listed_at_once(tmp_path):
    out = plan_fails(
        tmp_path,
        [b"nope", good(), b"[]", orjson.dumps({"x": 1})],
        f"{INPUT}:1",
        f"{INPUT}:3",
        f"{INPUT}:4",
        "3 problem(s)",
    )
    assert out.count("  - ") == 3


def test_unknown_agent_in_dict_repeats_names_every_missing_agent(tmp_path):
    lines = [orjson.dumps(row(0, agent="a")), orjson.dumps(row(1, agent="b")), orjson.dumps(row(2, agent="c"))]
    plan_fails(tmp_path, lines, "num_repeats", "'b' (first at", f"{INPUT}:2", "'c'", "_default", num_repeats={"a": 2})


def test_oversized_row_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(planner, "MAX_ROW_BYTES", 1000)
    big = orjson.dumps(row(0, blob="x" * 2000))
    plan_fails(tmp_path, [good(), big], f"{INPUT}:2", "over the")


@pytest.mark.parametrize(
    "repeats,needle", [(0, "num_repeats"), (-3, "num_repeats"), ({"a": 0}, "num_repeats"), ("many", "num_repeats")]
)
def test_bad_repeats_in_config(tmp_path, repeats, needle):
    plan_fails(tmp_path, [good()], needle, num_repeats=repeats)


def test_unknown_config_key_gets_a_did_you_mean(tmp_path):
    plan_fails(
        tmp_path, [good()], "sharding.num_shard", "did you mean 'sharding.num_shards'", sharding={"num_shard": 3}
    )


def test_wrong_type_in_config(tmp_path):
    plan_fails(tmp_path, [good()], "seed_offset", seed_offset="abc")


def test_both_shard_sizes_is_an_error(tmp_path):
    plan_fails(tmp_path, [good()], "not both", sharding={"num_shards": 2, "rollouts_per_shard": 3})


def test_secret_values_are_refused_in_config(tmp_path):
    plan_fails(
        tmp_path,
        [good()],
        "policy.api_key",
        "environment variable",
        policy={"base_url": "http://x/v1", "model_name": "m", "api_key": "sk-123"},
    )


def test_unknown_cluster_name(tmp_path):
    write_input(tmp_path, [good()])
    result = runner.invoke(app, ["plan", str(config_file(tmp_path)), "cluster=slurm-exampel", "--write"])
    assert result.exit_code == 2
    assert "unknown cluster 'slurm-exampel'" in result.output and "did you mean 'slurm-example'" in result.output


def test_run_dir_that_is_a_file(tmp_path):
    write_input(tmp_path, [good()])
    (tmp_path / "run").write_text("I am a file")
    result = runner.invoke(app, ["plan", str(config_file(tmp_path)), "--write"])
    assert result.exit_code == 2 and "run_dir" in result.output and "not a directory" in result.output


def test_missing_input_file(tmp_path):
    result = runner.invoke(app, ["plan", str(config_file(tmp_path))])
    assert result.exit_code == 2 and "input file not found" in result.output


def test_api_key_env_must_be_a_name(tmp_path):
    with pytest.raises(BadInput, match="policy.api_key_env"):
        config.validate(
            {
                "input_jsonl": "x",
                "run_dir": "y",
                "policy": {"base_url": "http://h/v1", "model_name": "m", "api_key_env": "sk-abc def"},
            }
        )


def test_nothing_is_written_on_bad_input(tmp_path):
    write_input(tmp_path, [good(), b"{broken"])
    cfg = config.load(config_file(tmp_path))
    with pytest.raises(BadInput):
        store.write_plan(cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.jsonl"))


def test_a_50_mb_single_line_is_rejected(tmp_path):
    big = orjson.dumps(row(0, blob="x" * (50 * 1024 * 1024)))
    plan_fails(tmp_path, [good(), big], f"{INPUT}:2", "over the 16 MiB limit")


def test_input_changed_after_planning_is_refused(tmp_path):
    inp = write_input(tmp_path, [good()])
    cfg_file = config_file(tmp_path)
    assert runner.invoke(app, ["plan", str(cfg_file), "--write"]).exit_code == 0
    plan_before = (tmp_path / "run" / "plan.json").read_bytes()
    inp.write_bytes(inp.read_bytes() + orjson.dumps(row(1)) + b"\n")
    result = runner.invoke(app, ["plan", str(cfg_file), "--write"])
    assert result.exit_code == 2 and "input content changed" in result.output
    assert (tmp_path / "run" / "plan.json").read_bytes() == plan_before


def test_run_dir_planned_with_other_settings_is_refused(tmp_path):
    write_input(tmp_path, [good(), orjson.dumps(row(1))])
    cfg_file = config_file(tmp_path)
    assert runner.invoke(app, ["plan", str(cfg_file), "--write"]).exit_code == 0
    result = runner.invoke(app, ["plan", str(cfg_file), "seed_offset=5", "--write"])
    assert result.exit_code == 2 and "seed_offset: 0 -> 5" in result.output


def test_wrong_type_deep_in_config(tmp_path):
    plan_fails(tmp_path, [good()], "gym.num_samples_in_parallel", gym={"num_samples_in_parallel": "lots"})


def test_unknown_top_level_key_gets_a_did_you_mean(tmp_path):
    plan_fails(tmp_path, [good()], "num_repeat", "did you mean 'num_repeats'", num_repeat=3)


@pytest.mark.parametrize("value", [0.5, 0, "lots"])
def test_fewer_than_one_rollout_per_slot_is_refused(tmp_path, value):
    plan_fails(tmp_path, [good()], "collector.rollouts_per_slot", collector={"rollouts_per_slot": value})


@pytest.mark.parametrize("value", [0.5, "lots"])
def test_a_bad_value_under_a_collector_setting_s_old_name_is_named_as_the_user_wrote_it(tmp_path, value):
    plan_fails(
        tmp_path,
        [good()],
        "cluster.rollouts_per_slot (now collector.rollouts_per_slot)",
        cluster={"rollouts_per_slot": value},
    )


def test_a_collector_setting_under_both_its_names_is_refused(tmp_path):
    out = plan_fails(
        tmp_path,
        [good()],
        "cluster.pipeline_shards and collector.pipeline_shards are both set",
        cluster={"pipeline_shards": 2},
        collector={"pipeline_shards": 3},
    )
    assert "(got" not in out  # the whole config is not echoed back
