"""Golden file: the sbatch scripts rendered for the shipped example Slurm cluster config
(cluster_configs/slurm-example.yaml), 2,500 shards with MaxArraySize 1001: three arrays and the merge job.

The scripts are rendered by submitit's own renderer from the parameters slurm.py derives (what `submit --dry-run`
prints and what sbatch receives). A change is deliberate: regenerate with SHARDRUN_UPDATE_GOLDEN=1 and review the
diff."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from shardrun.core import config
from shardrun.launch import slurm

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "sbatch_slurm_example.txt"
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
    sp = slurm.slurm_plan(
        cfg,
        RUN_DIR,
        FINGERPRINT,
        range(2500),
        max_array_size=1001,
        merge_job=True,
        after=["<array 0 job id>", "<array 1 job id>", "<array 2 job id>"],
    )
    return "".join(f"# ==== {title}\n{script}" for title, script in slurm.slurm_scripts(sp, RUN_DIR, python=PYTHON))


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
    # in the image the jobs run its interpreter (cluster.container_python), not the submitting checkout's
    image_python = "/opt/shardrun/.venv/bin/python3 -u -m submitit.core._submit"
    assert text.count(image_python) == 4 and f"{PYTHON} -u" not in text


# ---------------------------------------------------------------- hostile and unusual configs (#13)

UNUSUAL_GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "sbatch_unusual.txt"
UNUSUAL_RUN_DIR = Path("/lustre/runs/with space/ünï'quote")
UNUSUAL_CLUSTER = {
    "executor": "slurm",
    "partition": "gpu-h100.long_2",
    "account": "my.acct-1",
    "qos": "_low",
    "job_name_prefix": "a_b.c-d",
    "timeouts": {"gpu-h100.long_2": "2-00:00:00"},
    "setup": ["echo \"quoted; $HOME\" 'single' `tick`\tdone"],
    "env_vars": ["WEIRD=a b 'c' \"d\" $e", "MY_KEY"],
    "containers": {"shardrun": "/images/with space.sqsh"},
    "container_python": "/opt/with space/bin/python3",
    "mounts": ["/lustre/a b:/data"],
    "additional_parameters": {"exclusive": True, "constraint": "h100&nvlink|a100", "ntasks": 1, "gpus": 8},
}


def render_config(tmp_path: Path, monkeypatch, cluster: dict, run_dir: Path) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.jsonl").write_text('{"responses_create_params": {"input": "1+1?"}}\n')
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "input_jsonl": "input.jsonl",
                "run_dir": str(run_dir),
                "num_repeats": 1,
                "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
                "policy": {"base_url": "http://inference.internal:8000/v1", "model_name": "m"},
                "cluster": cluster,
            }
        )
    )
    cfg = config.load(tmp_path / "run.yaml")
    sp = slurm.slurm_plan(
        cfg, run_dir, FINGERPRINT, range(3), max_array_size=1001, merge_job=True, after=["<array 0 job id>"]
    )
    return "".join(f"# ==== {title}\n{script}" for title, script in slurm.slurm_scripts(sp, run_dir, python=PYTHON))


def test_a_hostile_cluster_config_is_refused_before_anything_is_rendered(tmp_path, monkeypatch):
    """Each value would end the #SBATCH block early or widen a job name into a list: refused, every key named."""
    from shardrun.core.errors import BadInput

    hostile = UNUSUAL_CLUSTER | {
        "partition": "batch\n#SBATCH --time=1",
        "account": "a\rb",
        "job_name_prefix": "shardrun,other",
        "setup": ["module load x\n#SBATCH --requeue"],
        "additional_parameters": {"job_name": "mine", "constraint": "h100\n#x"},
    }
    with pytest.raises(BadInput) as e:
        render_config(tmp_path, monkeypatch, hostile, UNUSUAL_RUN_DIR)
    text = str(e.value)
    for key in ("cluster.partition", "cluster.account", "cluster.job_name_prefix", "cluster.setup"):
        assert key in text, text
    assert "cluster.additional_parameters" in text and "job_name" in text


def test_valid_but_unusual_values_render_safely(tmp_path, monkeypatch):
    text = render_config(tmp_path, monkeypatch, UNUSUAL_CLUSTER, UNUSUAL_RUN_DIR)
    if os.environ.get("SHARDRUN_UPDATE_GOLDEN") == "1":
        UNUSUAL_GOLDEN.write_text(text)
    assert text == UNUSUAL_GOLDEN.read_text(), "rendered sbatch scripts changed; SHARDRUN_UPDATE_GOLDEN=1 to accept"
    for script in text.split("# ==== ")[1:]:
        lines = script.splitlines()
        start = lines.index("# Parameters") + 1
        end = lines.index("", start)
        assert all(line.startswith("#SBATCH --") for line in lines[start:end])  # one unbroken directive block
        assert not any(line.startswith("#SBATCH") for line in lines[end:])
        assert {"--time", "--signal", "--job-name", "--output"} <= {
            line.split("=", 1)[0][len("#SBATCH ") :] for line in lines[start:end]
        }
    assert "#SBATCH --constraint='h100&nvlink|a100'" in text and "#SBATCH --requeue" in text
    assert text.count("'/opt/with space/bin/python3' -u -m submitit.core._submit") == 2 and f"{PYTHON} -u" not in text


def test_without_an_image_the_jobs_run_the_submitting_interpreter(tmp_path, monkeypatch):
    bare = {k: v for k, v in UNUSUAL_CLUSTER.items() if k not in ("containers", "mounts", "container_python")}
    text = render_config(tmp_path, monkeypatch, bare, RUN_DIR)
    assert text.count(f"{PYTHON} -u -m submitit.core._submit") == 2 and "--container-image" not in text


def test_an_image_without_its_interpreter_is_refused_before_anything_is_rendered(tmp_path, monkeypatch):
    from shardrun.core.errors import BadInput

    no_python = {k: v for k, v in UNUSUAL_CLUSTER.items() if k != "container_python"}
    with pytest.raises(BadInput, match="cluster.container_python: not set"):
        render_config(tmp_path, monkeypatch, no_python, RUN_DIR)


def test_the_jobs_after_the_run_run_the_images_interpreter_too(tmp_path, monkeypatch):
    """The merge job and the job after warm workers run a command in the image: the image's interpreter."""
    from shardrun.launch import warm_workers

    render_config(tmp_path, monkeypatch, UNUSUAL_CLUSTER, RUN_DIR)
    cfg = config.load(tmp_path / "run.yaml")
    sp = slurm.slurm_plan(cfg, RUN_DIR, FINGERPRINT, range(3), max_array_size=1001, merge_job=True)
    assert sp.python == "/opt/with space/bin/python3"
    assert slurm.merge_command(RUN_DIR, sp.python)[0] == sp.python
    assert warm_workers.after_command(RUN_DIR, 1, sp.python)[0] == sp.python
    assert slurm.merge_command(RUN_DIR)[0] == sys.executable  # in the job after the workers: its own interpreter
