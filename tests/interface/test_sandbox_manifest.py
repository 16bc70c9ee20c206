"""NVIDIA's example_sandbox_judge.yaml (the nemo-gym 0.7.0 wheel's reward-profiling manifests) runs as it is (issue
36, item 4, its sandbox half): planned and `submit --dry-run` with only its data path (a local file under
data_root), the model (a pre-hosted endpoint) and the environment supplied. Its srun.sandbox_container (commented
out in the example; uncommented here as a user would) becomes sandbox.image; what else its srun block holds is named
and skipped. The judge half of the manifest (its `${nv_inference_api_key}`) is gym.secrets' and the judges' work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config, sweep_manifest
from shardrun.shard import gym_stack

runner = CliRunner()
WHEEL = (
    Path.home()
    / ".cache/shardrun/gym-venv-0.7.0/lib/python3.13/site-packages/benchmarks/nemotron_3.5_super/reward_profiling"
)
MANIFEST = WHEEL / "manifests" / "example_sandbox_judge.yaml"
MODEL = ["policy.base_url=http://127.0.0.1:9/v1", "policy.model_name=the-model"]

JUDGE_KEY_ENV = "NV_INFERENCE_API_KEY"  # its math_judge_model block reads ${nv_inference_api_key}
JUDGE_KEY = "sk-sandbox-manifest-judge-key"


def test_the_srun_block_maps_its_sandbox_and_names_the_rest():
    out = sweep_manifest.translate(
        {
            "nickname": "n",
            "entries": [{"label": "a", "agent": "x", "data": "d.jsonl"}],
            "srun": {
                "container": "/eval.sqsh",
                "sandbox_container": "/sandbox.sqsh",
                "sandbox_workers": 64,
                "sandbox_port": 6000,
                "sandbox_nodes": 2,
                "mounts": "/lustre:/lustre",
            },
        },
        "m.yaml",
    )
    assert out["sandbox"] == {"image": "/sandbox.sqsh", "workers": 64, "port": 6000}
    (skipped,) = out["not_carried_out"]
    assert skipped.startswith("srun: container, mounts, sandbox_nodes (")
    # without a sandbox image its sandbox settings have nothing to set: named and skipped with the rest
    bare = sweep_manifest.translate(
        {"nickname": "n", "entries": [{"label": "a", "agent": "x", "data": "d"}], "srun": {"sandbox_workers": 8}}, "m"
    )
    assert "sandbox" not in bare and bare["not_carried_out"][0].startswith("srun: sandbox_workers (")
    assert not sweep_manifest.is_manifest({"entries": [], "nickname": "n", "sandbox": {"image": "i"}})


def write_data(tmp_path: Path) -> Path:
    """The manifest's one data file, as a local file under data_root (its /lustre path rebased there)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"question": q, "expected_answer": a, "responses_create_params": {"input": [{"role": "user", "content": q}]}}
        for q, a in (("What is 2 + 2?", "4"), ("What is 3 * 3?", "9"), ("What is 7 - 5?", "2"))
    ]
    (data / "math_tir_260501.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def with_srun(tmp_path: Path, also_sbatch: bool = False) -> Path:
    """The example with its srun block uncommented (and its sbatch block, for a Slurm run), as a user would."""
    text = MANIFEST.read_text()
    lines = ["# srun:", "#   container:", "#   sandbox_container:"]
    if also_sbatch:
        lines += ["# sbatch:", "#   account:", "#   qos:", "#   timelimit:"]
    for commented in lines:
        assert f"\n{commented}" in text, commented
        text = text.replace(f"\n{commented}", "\n" + commented.removeprefix("# "))
    path = tmp_path / ("example_sandbox_judge_slurm.yaml" if also_sbatch else "example_sandbox_judge.yaml")
    path.write_text(text)
    return path


@pytest.mark.gym
@pytest.mark.skipif(not MANIFEST.is_file(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is not installed")
def test_the_example_plans_and_dry_run_submits_as_it_is(tmp_path, monkeypatch, gym_venv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    monkeypatch.setenv(JUDGE_KEY_ENV, JUDGE_KEY)  # its judge's key, by the name its block maps to (docs/judges.md)
    data = write_data(tmp_path)
    given = [f"data_root={data}", f"run_dir={tmp_path / 'run'}", *MODEL]
    planned = runner.invoke(app, ["plan", str(MANIFEST), *given, "--json"])
    assert planned.exit_code == 0, planned.output
    summary, _ = json.JSONDecoder().raw_decode(planned.output)  # warnings may follow, braces in them
    assert [(e["label"], e["tasks"], e["rollouts"]) for e in summary["entries"]] == [("math_tir", 3, 24)]
    # as shipped its srun block is commented out: no sandbox, and the plan says what ns_tools will miss
    assert "ns_tools execute(s) code in a NeMo-Skills sandbox, but there is no sandbox section" in planned.output
    cfg = config.load(MANIFEST, given)
    assert cfg.sandbox is None and "resources_servers/ns_tools/configs/ns_tools.yaml" in cfg.gym.config_paths

    # the sandbox given as a command (Hydra's grammar: the braces quoted): the dry run says what each job starts
    command = "+sandbox.command='python -m my_sandbox --port {port}'"
    dry = runner.invoke(app, ["submit", "--dry-run", str(MANIFEST), *given, command])
    assert dry.exit_code == 0, dry.output
    assert "sandbox per job: python -m my_sandbox --port {port}, port free, GET /health" in dry.output
    assert "there is no sandbox section" not in dry.output
    assert "judges.math_judge_model" in planned.output and JUDGE_KEY not in planned.output + dry.output
    assert not (tmp_path / "run").exists()  # a rehearsal writes nothing


@pytest.mark.gym
@pytest.mark.skipif(not MANIFEST.is_file(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is not installed")
def test_its_sandbox_container_becomes_the_jobs_sandbox_image(tmp_path, monkeypatch, gym_venv):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    monkeypatch.setenv(JUDGE_KEY_ENV, JUDGE_KEY)  # its judge's key, by the name its block maps to (docs/judges.md)
    data = write_data(tmp_path)
    given = [f"data_root={data}", f"run_dir={tmp_path / 'run'}", *MODEL]
    path = with_srun(tmp_path)
    cfg = config.load(path, given)
    assert cfg.sandbox is not None and cfg.sandbox.image == "/path/to/nemo-skills-sandbox-0.7.1-arm64.sqsh"
    (skipped,) = [w for w in cfg.not_carried_out if w.startswith("srun:")]
    assert skipped.startswith("srun: container (")  # the eval image: shardrun's jobs run in cluster.containers
    # on the local executor an image needs a container runtime: refused before anything is launched, by name
    refused = runner.invoke(app, ["submit", "--dry-run", str(path), *given])
    assert refused.exit_code == 2, refused.output
    assert "sandbox.image: outside a Slurm job an image needs a container runtime" in refused.output
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    local = runner.invoke(app, ["submit", "--dry-run", str(path), *given, "sandbox.runtime=docker"])
    assert local.exit_code == 0, local.output
    assert "sandbox per job: image /path/to/nemo-skills-sandbox-0.7.1-arm64.sqsh (docker)" in local.output
    # with its sbatch block too: Slurm job arrays, the sandbox a pyxis step of each job
    slurm = runner.invoke(app, ["submit", "--dry-run", str(with_srun(tmp_path, also_sbatch=True)), *given])
    assert slurm.exit_code == 0, slurm.output
    assert "launch mode: Slurm job arrays" in slurm.output
    assert "sandbox per job: image /path/to/nemo-skills-sandbox-0.7.1-arm64.sqsh, port free" in slurm.output
