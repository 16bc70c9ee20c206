"""Hostile Slurm values: anything that reaches an sbatch script or a Slurm command.

A newline in a value ends the `#SBATCH` block early (sbatch stops reading directives at the first line that is
not a comment, silently dropping `--time`, `--signal`, `--requeue`); a comma in a job name makes `squeue --name`
a list; `additional_parameters` could replace what shardrun sets itself. Each is refused at config validation
(exit 2, the key named, nothing written, nothing submitted). The valid-but-unusual values render as one
`#SBATCH` block with every directive shardrun needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostilekit import invoke, refused, stand_in_venv
from reportkit import input_row, write_input

from shardrun.core import config


GYM_CONFIG = "resources_servers/math_with_judge/configs/math_with_judge.yaml"


def slurm_config(tmp: Path, cluster: dict | None = None, run_dir: str | None = None) -> Path:
    inp = write_input(tmp / "input.jsonl", [input_row(i) for i in range(4)])
    data = {
        "input_jsonl": str(inp),
        "run_dir": run_dir if run_dir is not None else str(tmp / "run"),
        "num_repeats": 2,
        "sharding": {"num_shards": 2},
        "gym": {"venv": str(stand_in_venv(tmp, configs=(GYM_CONFIG,))), "config_paths": [GYM_CONFIG]},
        "policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
        "cluster": {"executor": "slurm", "partition": "batch", "max_array_size": 1001} | (cluster or {}),
    }
    path = tmp / "run.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML, and keeps every control character as written
    return path


HOSTILE: dict[str, tuple[dict, str]] = {
    "newline in partition": ({"partition": "batch\n#SBATCH --time=1"}, "cluster.partition"),
    "comma in partition": ({"partition": "batch,debug"}, "cluster.partition"),
    "space in partition": ({"partition": "batch debug"}, "cluster.partition"),
    "empty partition": ({"partition": ""}, "cluster.partition"),
    "carriage return in account": ({"account": "acct\r"}, "cluster.account"),
    "shell in qos": ({"qos": "normal;touch /tmp/x"}, "cluster.qos"),
    "newline in merge partition": ({"merge_partition": "cpu\nx"}, "cluster.merge_partition"),
    "comma in job name prefix": ({"job_name_prefix": "shardrun,other"}, "cluster.job_name_prefix"),
    "space in job name prefix": ({"job_name_prefix": "my run"}, "cluster.job_name_prefix"),
    "NUL in job name prefix": ({"job_name_prefix": "a\x00b"}, "cluster.job_name_prefix"),
    "newline in a timeouts key": ({"timeouts": {"batch\n#SBATCH": "04:00:00"}}, "cluster.timeouts"),
    "newline in a timeouts value": ({"timeouts": {"batch": "04:00:00\n#SBATCH --x"}}, "cluster.timeouts"),
    "newline in time_limit": ({"time_limit": "04:00:00\n"}, "cluster.time_limit"),
    "words in time_limit": ({"time_limit": "tomorrow"}, "cluster.time_limit"),
    "escape in merge_time_limit": ({"merge_time_limit": "01:00:00\x1b"}, "cluster.merge_time_limit"),
    "newline in a setup line": ({"setup": ["module load cuda\n#SBATCH --requeue"]}, "cluster.setup"),
    "newline in an exported value": ({"env_vars": ["HF_HOME=/x\nexport Y=1"]}, "cluster.env_vars"),
    "newline in a container image": ({"containers": {"shardrun": "/img.sqsh\n#x"}}, "cluster.containers"),
    "comma in a mount": ({"mounts": ["/a:/a,/etc:/etc"]}, "cluster.mounts"),
    "newline in a mount": ({"mounts": ["/a:/a\n"]}, "cluster.mounts"),
    "newline in an option value": (
        {"additional_parameters": {"constraint": "h100\n#SBATCH --time=1"}},
        "cluster.additional_parameters",
    ),
    "newline in an option name": ({"additional_parameters": {"constraint\n#SBATCH": "h"}}, "additional_parameters"),
    "space in an option name": ({"additional_parameters": {"a b": "x"}}, "cluster.additional_parameters"),
    "false for a flag": ({"additional_parameters": {"exclusive": False}}, "cluster.additional_parameters"),
    "null for a value": ({"additional_parameters": {"constraint": None}}, "cluster.additional_parameters"),
    "a list for a value": ({"additional_parameters": {"constraint": ["a", "b"]}}, "cluster.additional_parameters"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_value_slurm_cannot_take_is_refused_with_its_key(tmp_path, unchanged, case):
    cluster, key = HOSTILE[case]
    cfg = slurm_config(tmp_path, cluster)
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run"), key)
        refused(invoke("plan", cfg, "--write"), key)
    assert not (tmp_path / "run").exists()


OWNED_SPELLINGS = [
    "job_name",
    "job-name",
    "--job-name",
    "JOB_NAME",
    "job",
    "output",
    "out",
    "error",
    "export",
    "export_file",
    "requeue",
    "no-requeue",
    "signal",
    "array",
    "dependency",
    "dep",
    "open_mode",
    "kill_on_invalid_dep",
    "partition",
    "time",
    "mem",
]


@pytest.mark.parametrize("key", OWNED_SPELLINGS)
def test_additional_parameters_may_not_set_what_shardrun_owns(tmp_path, unchanged, key):
    cfg = slurm_config(tmp_path, {"additional_parameters": {key: "x"}})
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run"), "cluster.additional_parameters", key, "set by shardrun")


def test_a_newline_in_the_run_directory_is_refused(tmp_path, unchanged):
    cfg = slurm_config(tmp_path, run_dir=str(tmp_path / "run\n#SBATCH --time=1"))
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run"), "run_dir")
        refused(invoke("plan", cfg, "--write"), "run_dir")


def test_a_percent_in_the_run_directory_is_refused_for_slurm_only(tmp_path, unchanged):
    cfg = slurm_config(tmp_path, run_dir=str(tmp_path / "run-100%j"))
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run"), "run_dir", "%")
    local = slurm_config(tmp_path, {"executor": "local"}, run_dir=str(tmp_path / "run-100%j"))
    done = invoke("plan", local, "--write")
    assert done.exit_code == 0, done.output


def test_a_hostile_override_is_refused_like_the_file(tmp_path, unchanged):
    cfg = slurm_config(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("submit", cfg, "--dry-run", "cluster.partition=a,b"), "cluster.partition")
        refused(invoke("submit", cfg, "--dry-run", "cluster.job_name_prefix=x,y"), "cluster.job_name_prefix")


def test_resume_refuses_tampered_launch_settings_and_launches_nothing(tmp_path, unchanged):
    """launch.json is a run file: a value edited into it is refused like the config's, never a traceback."""
    cfg_path = slurm_config(tmp_path, {"executor": "local"})
    assert invoke("plan", cfg_path, "--write").exit_code == 0
    run_dir = tmp_path / "run"
    data = config.load(cfg_path).model_dump(mode="json")
    data["cluster"]["partition"] = "batch\n#SBATCH --time=1"
    (run_dir / "launch.json").write_text(json.dumps({"config": data}))
    with unchanged(tmp_path):
        refused(invoke("resume", run_dir), "launch.json", "cluster.partition")
    assert not (run_dir / "launches.jsonl").exists()


UNUSUAL = {
    "partition": "gpu-h100.long_2",
    "account": "my.acct-1",
    "qos": "_low",
    "job_name_prefix": "a_b.c-d",
    "timeouts": {"gpu-h100.long_2": "2-00:00:00"},
    "setup": ["echo \"quoted; $HOME\" 'single' `tick`\tdone"],
    "env_vars": ["WEIRD=a b 'c' \"d\" $e"],
    "additional_parameters": {
        "exclusive": True,
        "constraint": "h100&nvlink|a100",
        "ntasks": 1,
        "gpus": 8,
        "comment_extra": "x",
        "mail_user": "me+runs@example.com",
    },
}


def test_valid_but_unusual_values_render_one_directive_block(tmp_path, unchanged):
    run_dir = tmp_path / "runs with space" / "ünï'quote"
    cfg = slurm_config(tmp_path, UNUSUAL, run_dir=str(run_dir))
    with unchanged(tmp_path):
        done = invoke("submit", cfg, "--dry-run")
    assert done.exit_code == 0, done.output
    scripts = done.output.split("# ---- sbatch script for ")[1:]
    assert len(scripts) == 2  # the shard array and the merge job
    for script in scripts:
        lines = script.splitlines()
        start = lines.index("# Parameters") + 1
        end = lines.index("", start)
        block = lines[start:end]
        assert all(line.startswith("#SBATCH --") for line in block), block
        after = [line for line in lines[end:] if line.startswith("#SBATCH")]
        assert not after, after
        names = {line.split("=", 1)[0] for line in block}
        assert {"#SBATCH --time", "#SBATCH --signal", "#SBATCH --job-name", "#SBATCH --output"} <= names
    assert "#SBATCH --constraint='h100&nvlink|a100'" in scripts[0]
    assert "#SBATCH --requeue" in scripts[0] and "#SBATCH --partition=gpu-h100.long_2" in scripts[0]
    assert "#SBATCH --job-name=a_b.c-d-" in scripts[0]
    assert "#SBATCH --time=2880" in scripts[0]


@pytest.mark.parametrize("name", ["a,b", "a b", "x\ny", "", "-x"])
def test_squeue_is_never_asked_for_a_name_that_is_not_one(name):
    """The last line of defence: names from launch records reach `squeue --name` only as Slurm names."""
    from shardrun.core.errors import RunDirError
    from shardrun.launch import scheduler

    with pytest.raises(RunDirError, match="not a Slurm name"):
        scheduler.squeue_command(["shardrun-0123456789", name])


@pytest.mark.parametrize("job_id", ["--user=root", "-u", "7,8", "7_0 8", ""])
def test_scancel_is_never_given_an_option_for_a_job_id(job_id, monkeypatch):
    from shardrun.launch import scheduler

    ran: list[list[str]] = []
    monkeypatch.setattr(scheduler, "_run", lambda cmd, *a, **k: ran.append(cmd) or "")
    with pytest.raises(scheduler.SlurmError, match="not a Slurm job id"):
        scheduler.cancel(["7", job_id])
    assert not ran


def test_resume_checks_the_run_directory_it_is_given_like_the_configs(tmp_path, unchanged):
    """RUN_DIR on resume's command line replaces the config's run_dir; a Slurm job script gets it the same way."""
    planned = tmp_path / "run-100%j"
    local = slurm_config(tmp_path, {"executor": "local"}, run_dir=str(planned))
    assert invoke("plan", local, "--write").exit_code == 0
    on_slurm = slurm_config(tmp_path, run_dir=str(tmp_path / "elsewhere"))  # a run_dir Slurm takes; RUN_DIR wins
    with unchanged(tmp_path):
        refused(invoke("resume", planned, "--config", on_slurm, "--dry-run"), "run_dir", "%")
