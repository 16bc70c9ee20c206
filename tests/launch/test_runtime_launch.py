"""`shardrun submit` through submitit's real LocalExecutor, with shards that fail fast (a stand-in Gym venv whose
ng_run exits at once; it passes submit's preflight, so the shards are launched): the
launch record, the job logs, the outcome per shard and exit code 4, --no-wait, launch.json without secrets, and
the concurrency cap. The policy endpoint is the stand-in server (tests/fakes/policy_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrun.shard import processes
from shardrun.rundir import store
from tests import builders
from tests.fakes import harness

pytestmark = pytest.mark.timeout(300)


def broken_gym_venv(root: Path) -> Path:
    """A venv laid out like a NeMo Gym 0.4.0 install (what `submit`'s preflight checks: the release, bin/ng_run, the
    config paths under site-packages) whose ng_run exits at once: every shard fails fast at its Gym stack."""
    venv = root / "broken-gym"
    site = venv / "lib" / "python3.12" / "site-packages"
    meta = site / "nemo_gym-0.4.0.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text("Metadata-Version: 2.4\nName: nemo-gym\nVersion: 0.4.0\n\n")
    for config_path in harness.CONFIG_PATHS:
        (site / config_path).parent.mkdir(parents=True, exist_ok=True)
        (site / config_path).write_text("{}\n")
    (venv / "bin").mkdir()
    (venv / "bin" / "ng_run").write_text("#!/bin/sh\necho 'ng_run stand-in: no Gym here' >&2\nexit 3\n")
    (venv / "bin" / "ng_run").chmod(0o755)
    return venv


def broken_gym_config(tmp_path: Path, policy_url: str, shards: int, parallelism: int) -> Path:
    input_jsonl = builders.arith_input(tmp_path / "input.jsonl", 4)
    return harness.write_config(
        tmp_path / "run.yaml",
        input_jsonl,
        tmp_path / "run",
        policy_url,
        repeats=1,
        shards=shards,
        gym={"venv": str(broken_gym_venv(tmp_path))},
        cluster={"array_parallelism": parallelism},
    )


def submit(cfg: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, harness.API_KEY_ENV: harness.API_KEY}
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "submit", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cfg.parent,
        env=env,
    )


def test_submit_waits_and_reports_every_failed_shard(tmp_path: Path) -> None:
    with harness.fake_policy(tmp_path) as fake:
        cfg = broken_gym_config(tmp_path, fake.base_url, shards=3, parallelism=2)
        done = submit(cfg)
    run_dir = tmp_path / "run"
    assert done.returncode == 3, done.stdout + done.stderr  # the Gym servers did not start: ServerFailure's code
    assert f"run directory: {run_dir}" in done.stdout
    assert "failed: ServerFailure: Gym servers (ng_run" in done.stderr and "  log: " in done.stderr
    for i in range(3):
        assert f"shard 0000{i}: failed (ServerFailure: Gym servers (ng_run" in done.stdout
        failure = json.loads(store.shard_failure_path(run_dir, i).read_text())
        assert failure["error"].startswith("ServerFailure") and "exited with code 3" in failure["error"]
        assert failure["job_id"]
    records = [rec.to_json() for rec in store.read_launches(run_dir)]
    assert len(records) == 1 and records[0]["mode"] == "local_jobs"
    jobs = records[0]["jobs"]
    assert sorted(jobs) == ["0", "1", "2"] and len(set(jobs.values())) == 2  # cap 2: two workers for 3 shards
    assert jobs["0"] == jobs["2"] != jobs["1"]
    assert set(records[0]["pid_start"]) == set(jobs.values())
    for job_id in set(jobs.values()):
        assert (
            "exited with code 3"
            in store.job_log_path(run_dir, job_id).read_text()
            + store.job_log_path(run_dir, job_id).with_suffix(".err").read_text()
        )
    saved = json.loads(store.launch_settings_path(run_dir).read_text())["config"]
    assert saved["policy"]["api_key_env"] == harness.API_KEY_ENV
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert harness.API_KEY.encode() not in path.read_bytes(), path


def test_submit_no_wait_returns_while_shards_run(tmp_path: Path) -> None:
    with harness.fake_policy(tmp_path, "--delay", "0") as fake:
        cfg = broken_gym_config(tmp_path, fake.base_url, shards=1, parallelism=1)
        t0 = time.monotonic()
        done = submit(cfg, "--no-wait")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "jobs: shard 0 -> " in done.stdout and "shard 00000:" not in done.stdout
        job_id = done.stdout.split("shard 0 -> ")[1].split()[0]
        failure = store.shard_failure_path(tmp_path / "run", 0)
        processes.wait_until(failure.exists, timeout=60, what="the background shard job to record its failure")
        assert time.monotonic() - t0 < 60
        assert json.loads(failure.read_text())["job_id"] == job_id
