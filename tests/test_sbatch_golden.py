"""Golden file: the sbatch scripts rendered for the shipped example Slurm cluster config
(cluster_configs/slurm-example.yaml), 2,500 shards with MaxArraySize 1001: three arrays and the merge job.

The scripts are rendered by submitit's own renderer from the parameters slurm.py derives (what `submit --dry-run`
prints and what sbatch receives). A change is deliberate: regenerate with SHARDRUN_UPDATE_GOLDEN=1 and review the
diff."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from shardrun.core import config
from shardrun.launch import submission

GOLDEN = Path(__file__).resolve().parent / "golden" / "sbatch_slurm_example.txt"
RUN_DIR = Path("/lustre/runs/example")
PYTHON = "/opt/shardrun/.venv/bin/python"
FINGERPRINT = "f" * 64


def render(tmp_path: Path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDRUN_CLUSTER_CONFIGS", raising=False)
    (tmp_path / "input.jsonl").write_text('{"responses_create_params": {"input": "1+1?"}}\n')
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "input_jsonl": "input.jsonl",
                "run_dir": str(RUN_DIR),
                "num_repeats": 1,
                "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
                "policy": {"base_url": "http://inference.internal:8000/v1", "model_name": "m", "api_key_env": "MY_KEY"},
                "cluster": "slurm-example",
            }
        )
    )
    cfg = config.load(tmp_path / "run.yaml")
    sp = submission.slurm_plan(
        cfg,
        RUN_DIR,
        FINGERPRINT,
        range(2500),
        max_array_size=1001,
        merge_job=True,
        after=["<array 0 job id>", "<array 1 job id>", "<array 2 job id>"],
    )
    return "".join(
        f"# ==== {title}\n{script}" for title, script in submission.slurm_scripts(sp, RUN_DIR, python=PYTHON)
    )


def test_sbatch_scripts_for_the_example_cluster_config(tmp_path, monkeypatch):
    text = render(tmp_path, monkeypatch)
    if os.environ.get("SHARDRUN_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendered sbatch scripts changed; SHARDRUN_UPDATE_GOLDEN=1 to accept"
    # what the golden pins, said in words
    assert text.count("#!/bin/bash") == 4
    assert "#SBATCH --array=0-1000%26" in text and "#SBATCH --array=0-497%13" in text
    assert "--container-image=/lustre/images/nemo-gym-vllm.sqsh --container-mounts=/lustre:/lustre" in text
    assert "#SBATCH --dependency='afterany:<array 0 job id>:<array 1 job id>:<array 2 job id>'" in text
    assert "#SBATCH --kill-on-invalid-dep=yes" in text and "#SBATCH --requeue" in text
    assert ': "${MY_KEY:?' in text  # the key is passed through from the environment, never written
