"""A NeMo Gym reward-profiling manifest wherever a run config goes: translated (core/sweep_manifest.py), planned
from the command line, with overrides after the translation (docs/blends.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config, sweep_manifest
from shardrun.core.errors import BadInput
from tests.planning_helpers import row

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
WHEEL = (
    Path.home()
    / ".cache/shardrun/gym-venv-0.7.0/lib/python3.13/site-packages/benchmarks/nemotron_3.5_super/reward_profiling"
)


def manifest(**extra) -> dict:
    return {
        "nickname": "sweep",
        "num_shards": 2,
        "gym_env_start": {"config_paths": ["model.yaml"], "judge": {"server": {"name": "j", "key": "${judge_key}"}}},
        "gym_eval_run": {"num_repeats": 3, "num_samples_in_parallel": 16, "max_tokens": 512},
        "sbatch": {"account": "acct", "qos": "normal", "timelimit": "04:00:00", "constraint": "gpu"},
        "vllm": {"model": "/models/m", "prefill_nodes": 2, "decode_nodes": 8},
        "vllm_router": {"request_timeout_s": 3600},
        "srun": {"container": "/x.sqsh"},
        "entries": [
            {"label": "one", "agent": "a", "configs": ["one.yaml", "model.yaml"], "data": "one.jsonl", "owner": "me"},
            {"label": "two", "agent": "a", "configs": ["two.yaml"], "data": "two.jsonl", "limit": 2, "notes": {"x": 1}},
        ],
    } | extra


def test_the_translation_maps_every_block():
    out = sweep_manifest.translate(manifest(), "m.yaml")
    assert out["nickname"] == "sweep" and out["run_dir"] == "runs/sweep"
    assert out["sharding"] == {"num_shards": 2} and out["num_repeats"] == 3
    assert out["gym"]["config_paths"] == ["model.yaml"] and out["gym"]["num_samples_in_parallel"] == 16
    assert out["gym"]["collect_overrides"] == ["++max_tokens=512"]
    assert out["cluster"] == {
        "executor": "slurm",
        "account": "acct",
        "qos": "normal",
        "time_limit": "04:00:00",
        "additional_parameters": {"constraint": "gpu"},
        "nodes": 10,  # prefill_nodes + decode_nodes: a replica on each, behind vllm-router
    }
    assert out["policy"] == {
        "vllm": {"model": "/models/m", "replicas": 10},
        "router": "vllm-router",
        "router_options": {"request_timeout_s": 3600},
    }
    assert [e["label"] for e in out["entries"]] == ["one", "two"] and out["entries"][1]["notes"] == {"x": 1}
    skipped = " | ".join(out["not_carried_out"])
    for block in ("vllm.decode_nodes", "vllm.prefill_nodes", "srun: container"):
        assert block in skipped
    assert "vllm_router" not in skipped and "become cluster.nodes 10 with one policy.vllm replica each" in skipped
    # the Gym overlay goes to ng_run as an override Hydra parses back to the same value
    (overlay,) = out["gym"]["overrides"]
    parsed = OverridesParser.create().parse_override(overlay)
    assert parsed.key_or_group == "judge" and parsed.value() == {"server": {"name": "j", "key": "${judge_key}"}}


@pytest.mark.parametrize(
    "change, says",
    [
        ({"nick": "x"}, "nick: unknown key (did you mean 'nickname'?)"),
        ({"entries": [{"label": "x", "agent": "a", "data": "d", "agent_ref_override": "b"}]}, "agent_ref_override"),
        ({"entries": [{"label": "x", "agent": "a", "data": "d", "datas": 1}]}, "datas: unknown key"),
        ({"entries": []}, "non-empty list of entries"),
    ],
)
def test_what_cannot_be_carried_out_is_refused_by_name(change, says):
    with pytest.raises(BadInput, match=None) as e:
        sweep_manifest.translate(manifest(**change), "m.yaml")
    assert says in str(e.value)


def test_a_run_config_is_not_a_manifest():
    assert not sweep_manifest.is_manifest({"input_jsonl": "x", "run_dir": "r"})
    assert not sweep_manifest.is_manifest({"run_dir": "r", "entries": [], "nickname": "n"})
    assert sweep_manifest.is_manifest({"entries": [], "nickname": "n"})
    assert sweep_manifest.is_manifest({"gym_eval_run": {}})


def write_blend(tmp_path: Path) -> Path:
    (tmp_path / "one.jsonl").write_bytes(b"".join(orjson.dumps(row(i, agent=None)) + b"\n" for i in range(5)))
    (tmp_path / "two.jsonl").write_bytes(b"".join(orjson.dumps(row(i, agent="a")) + b"\n" for i in range(4)))
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest(), sort_keys=False))
    return path


# a manifest states no GPUs per node and no parallel sizes: given after it, as overrides
GPUS = ["cluster.gpus_per_node=8", "policy.vllm.tensor_parallel_size=8"]


def test_a_manifest_self_hosting_on_slurm_is_refused_until_its_gpus_are_given(tmp_path, monkeypatch):
    """The manifest's vllm.model is a self-hosted policy, its sbatch block a Slurm job of prefill + decode nodes
    with no GPU unless told (#35). `plan` refuses naming what to set; the translation's note says what it made of
    the manifest's shape."""
    path = write_blend(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(path), "run_dir=runs/x"])
    assert result.exit_code == 2, result.output
    assert "cluster.gpus_per_node: 0" in result.output
    assert "policy.vllm.replicas 10 x tensor_parallel_size 1" in result.output
    small = runner.invoke(app, ["plan", str(path), "run_dir=runs/x", "cluster.gpus_per_node=4", GPUS[1]])
    assert small.exit_code == 2
    assert "needs 80 GPUs; cluster.nodes 10 x cluster.gpus_per_node 4 gives 40" in small.output
    fits = runner.invoke(app, ["plan", str(path), "run_dir=runs/x", *GPUS])
    assert fits.exit_code == 0, fits.output
    assert "its 10 node(s) per shard become cluster.nodes 10" in fits.output and "cluster.gpus_per_node" in fits.output


def test_plan_a_manifest_from_the_command_line(tmp_path, monkeypatch):
    path = write_blend(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(path), "run_dir=runs/x", *GPUS, "--json"])
    assert result.exit_code == 0, result.output
    # the JSON first, then the plan's warnings (a note names the ${judge_key} the Gym override references)
    summary, _end = json.JSONDecoder().raw_decode(result.output[result.output.index("{") :])
    assert "manifest: gym_env_start.judge references ${judge_key}" in result.output
    assert [(e["label"], e["tasks"], e["rollouts"]) for e in summary["entries"]] == [("one", 5, 15), ("two", 2, 6)]
    assert "warning: not carried out: vllm_router" not in result.output  # the router is carried out
    # overrides apply after the translation; on the command line limit_per_entry caps every entry
    result = runner.invoke(
        app,
        [
            "plan",
            str(path),
            "run_dir=runs/x",
            *GPUS,
            "materialize.limit_per_entry=1",
            "entries.0.num_repeats=5",
            "--write",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "runs/x/plan.json").read_text())
    assert [(e["label"], e["num_tasks"], e["repeats"]) for e in plan["blend"]] == [("one", 1, 5), ("two", 1, 3)]
    assert plan["config"]["gym"]["config_paths"] == ["model.yaml", "one.yaml", "two.yaml"]
    assert plan["config"]["gym"]["overrides"] == ["++judge={server:{name:'j',key:'${judge_key}'}}"]
    assert len((tmp_path / "runs/x/input.jsonl").read_bytes().splitlines()) == 2


def test_a_missing_data_file_exits_2_naming_it_and_its_entry(tmp_path, monkeypatch):
    path = write_blend(tmp_path)
    (tmp_path / "two.jsonl").unlink()
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2
    assert f"entries.1.data (entry 'two'): {tmp_path / 'two.jsonl'}: no such file" in result.output


@pytest.mark.gym  # the nemo-gym 0.7.0 wheel's own files
@pytest.mark.skipif(not WHEEL.is_dir(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is not installed")
@pytest.mark.parametrize("name", ["nemotron_3_5_super.yaml", "example_basic.yaml"])
def test_the_manifests_shipped_with_gym_translate(name, tmp_path, monkeypatch):
    path = WHEEL / "manifests" / name
    cfg = config.load(path, [f"run_dir={tmp_path / 'run'}"])
    raw = yaml.safe_load(path.read_text())
    assert [e.label for e in cfg.entries or ()] == [e["label"] for e in raw["entries"]]
    assert cfg.nickname == raw["nickname"]
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", str(path), f"run_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    for i, entry in enumerate(raw["entries"]):  # every missing file is named, each with its entry, in one error
        assert f"entries.{i}.data (entry {entry['label']!r}): {entry['data']}: no such file" in result.output


@pytest.mark.gym  # the nemo-gym 0.7.0 wheel's own files
@pytest.mark.skipif(not WHEEL.is_dir(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is not installed")
def test_nvidias_super_manifest_is_refused_on_slurm_until_its_gpus_are_given(tmp_path):
    """nemotron_3_5_super.yaml self-hosts its model (vllm.model) in Slurm jobs (sbatch) over prefill_nodes +
    decode_nodes nodes, and states no GPUs per node: the translation says what it asked, the GPU check what to set."""
    from shardrun.launch import preflight

    path = WHEEL / "manifests" / "nemotron_3_5_super.yaml"
    raw = yaml.safe_load(path.read_text())
    cfg = config.load(path, [f"run_dir={tmp_path / 'run'}"])
    nodes = raw["vllm"]["prefill_nodes"] + raw["vllm"]["decode_nodes"]
    assert cfg.cluster is not None and cfg.cluster.nodes == nodes and cfg.cluster.gpus_per_node == 0
    assert cfg.policy.vllm.replicas == nodes and cfg.policy.router == "vllm-router"
    # the recipe's router settings carried over (its health checks tolerate busy engines)
    ro = cfg.policy.router_options
    assert (ro.health_timeout_s, ro.health_interval_s, ro.health_failures) == (60, 120, 10)
    assert ro.request_timeout_s == 3600 and ro.circuit_breaker is False
    assert ro.extra_args == ["--queue-timeout-secs", "600", "--log-level", "info"]
    problems = "\n".join(preflight.gpu_problems(cfg))
    assert "cluster.gpus_per_node: 0" in problems and "policy.vllm.device: cpu" in problems
    assert any(f"its {nodes} node(s) per shard become cluster.nodes {nodes}" in w for w in cfg.not_carried_out)
    given = config.load(path, [f"run_dir={tmp_path / 'run'}", *GPUS])
    assert preflight.gpu_problems(given) == []


def test_the_example_blend_plans(tmp_path, monkeypatch):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "examples/blend/manifest.yaml", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[: result.output.rindex("}") + 1])
    entries = {e["label"]: e for e in summary["entries"]}
    assert entries["other_ops"]["tasks"] == 12 and entries["tool_call"]["repeats"] == 2
    assert entries["addition"]["agent"] == entries["other_ops"]["agent"]
