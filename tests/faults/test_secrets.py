"""The policy API key exists only in the environment variable policy.api_key_env names (read at shard start) and,
while a shard's Gym stack runs, in its env.yaml (0600, deleted before the seal; test_kill_shard.py checks the mode
all along a chaos run and that no kill leaves it behind a sealed shard). Searched for here, by value, and found
nowhere: plan.json, launch settings and records, `.done` markers, every log, submitit's pickles and job logs, the
sbatch scripts (rendered by `submit --dry-run`, and those a real Slurm submission wrote), merged outputs, report
inputs, the command's own output, and the command lines of every process a shard started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shardrun.rundir import store
from tests.faults import faultkit, gymkit, synthetic
from tests.slurm.conftest import slurm_cluster  # noqa: F401  (the real local Slurm, started once per session)


def files_holding(root: Path, key: str) -> list[str]:
    needle = key.encode()
    return [str(p) for p in sorted(root.rglob("*")) if p.is_file() and needle in p.read_bytes()]


def kinds(root: Path) -> set[str]:
    """What kinds of files the search covered (so an empty search cannot pass)."""
    found = set()
    for p in root.rglob("*"):
        name = p.name
        if name == "plan.json":
            found.add("plan.json")
        elif name == ".done":
            found.add(".done")
        elif name in ("launch.json", "launches.jsonl"):
            found.add("launch records")
        elif name.endswith(".pkl"):
            found.add("submitit pickles")
        elif p.parent.name == "logs" or name.endswith((".out", ".err", ".log")):
            found.add("logs")
        elif p.parent.name == "merged":
            found.add("merged outputs")
        elif name.endswith(".sh"):
            found.add("sbatch scripts")
    return found


@pytest.mark.gym
@pytest.mark.slow
def test_the_key_is_in_no_file_of_a_real_gym_run(gym_reference):
    ref = gym_reference
    assert ref.key not in ref.submit_output
    assert kinds(ref.tmp) >= {"plan.json", ".done", "launch records", "submitit pickles", "logs", "merged outputs"}
    assert {p.name for p in store.logs_dir(ref.run_dir, 0).iterdir()} >= {"shard.log", "ng_run.log", "collector.log"}
    assert files_holding(ref.tmp, ref.key) == []
    if (store.load_plan(ref.run_dir).gym_version or "").startswith("0.4."):
        # Gym 0.4's model adapter prints a refused request's headers: the key was there, masked (0.7 prints none)
        assert "'Authorization': 'Bearer ***'" in store.gym_log_path(ref.run_dir, 0).read_text()
    assert not store.env_yaml_path(ref.run_dir, 0).exists()  # deleted at the seal
    # the fake policy did get it, from Gym's model adapter (so the key really travelled, through env.yaml)
    assert all(r["auth_ok"] for r in ref.fake.requests())
    report = faultkit.cli("report", ref.run_dir, "--no-sacct")
    if report.returncode == 0:  # matplotlib present: the report is one more output to search
        assert files_holding(store.merged_dir(ref.run_dir), ref.key) == []


def test_a_server_log_never_gets_the_key_even_when_the_server_prints_it(tmp_path: Path, policy_key):
    """processes.start(redact=...): what the command prints reaches its log with the key masked, whole lines and
    a 1 MB line alike, from the command and from a child that inherited its output."""
    from shardrun.shard import processes

    log = tmp_path / "server.log"
    code = (
        "import os, subprocess, sys\nk = os.environ['K']\nprint('Authorization: Bearer ' + k, flush=True)\n"
        "print('x' * 1_000_000 + k + 'y')\nsys.stderr.write('err ' + k + '\\n')\n"
        "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", os.environ[\"K\"])'])\n"
    )
    proc = processes.start([sys.executable, "-c", code], log, env={"K": policy_key}, redact=[policy_key])
    assert proc.popen.wait(timeout=60) == 0
    processes.stop(proc)
    text = log.read_text()
    assert policy_key not in text and text.count("***") == 4, text[-300:]
    assert proc.redactor is not None and proc.redactor.returncode == 0


def test_rendered_sbatch_scripts_hold_the_variable_name_not_the_key(tmp_path: Path, policy_key, monkeypatch):
    run = synthetic.make(tmp_path, tasks=30, shards=3, seal=False)
    cfg = synthetic.launch_config_file(
        run,
        tmp_path / "run.yaml",
        api_key_env=gymkit.KEY_ENV,
        executor="slurm",
        env_vars=[gymkit.KEY_ENV],
        max_array_size=2,
    )
    monkeypatch.setenv(gymkit.KEY_ENV, policy_key)
    res = faultkit.cli("submit", cfg, "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("#!/bin/bash") == 3  # two arrays and the merge job
    assert gymkit.KEY_ENV in res.stdout and policy_key not in res.stdout + res.stderr


@pytest.mark.slurm
def test_a_real_slurm_submission_writes_the_key_nowhere(
    tmp_path: Path,
    slurm_cluster,  # noqa: F811
    policy_key,
    monkeypatch,
):
    """Shards that seal without servers, submitted as a job array to the real local Slurm with the key passed
    through: submitit's sbatch scripts, pickles and job logs, the markers and the merged outputs hold no key."""
    run = synthetic.make(tmp_path, tasks=60, shards=2, seal=False)
    cfg = synthetic.launch_config_file(
        run,
        tmp_path / "run.yaml",
        api_key_env=gymkit.KEY_ENV,
        executor="slurm",
        env_vars=[gymkit.KEY_ENV],
        partition=os.environ.get("SLURM_LOCAL_PARTITION", "debug"),
        time_limit="00:05:00",
        cpus_per_task=1,
        mem_gb=1,
        job_name_prefix="srfault",
    )
    monkeypatch.setenv(gymkit.KEY_ENV, policy_key)
    res = faultkit.cli("submit", cfg, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    run_dir = run.run_dir
    plan = store.load_plan(run_dir)

    def merged() -> bool:
        return store.merged_summary_path(run_dir).exists()

    faultkit.wait_for(merged, 300, "the shards and the merge job", interval=1.0)
    from shardrun.rundir import seal

    assert all(seal.check(run_dir, plan, i, deep=True).sealed for i in range(2))
    assert kinds(run_dir) >= {
        "plan.json",
        ".done",
        "launch records",
        "submitit pickles",
        "logs",
        "merged outputs",
        "sbatch scripts",
    }
    scripts = list(store.jobs_dir(run_dir).rglob("*.sh"))
    assert scripts and all(gymkit.KEY_ENV in s.read_text() for s in scripts if "merge" not in s.read_text())
    assert files_holding(run_dir, policy_key) == []
    assert policy_key not in res.stdout + res.stderr
