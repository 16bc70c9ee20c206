"""Submission, cancel and resume rules on the real local Slurm, with jobs held in the queue (`--hold`), so nothing
runs: what was submitted (sbatch calls, arrays, names), `shardrun cancel`, the attempt cap, and the refusal to
resume a run whose input changed. Fast: no shard ever starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardrun.rundir import store
from slurm_helpers import launches, math_input, shardrun, squeue, status_json, wait_for, write_config
from tests.fakes import harness

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

HELD = {"additional_parameters": {"hold": True}}


@pytest.fixture
def env(slurm_cluster, monkeypatch):
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    return slurm_cluster


def held_run(tmp_path: Path, **cluster) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    inp = math_input(tmp_path / "input.jsonl", 5)
    cfg = write_config(
        tmp_path / "run.yaml", inp, run_dir, "http://127.0.0.1:9/v1", repeats=1, shards=5, cluster={**HELD, **cluster}
    )
    return run_dir, cfg


def test_split_arrays_held_then_cancel(tmp_path, env):
    run_dir, cfg = held_run(tmp_path, max_array_size=2, array_parallelism=3)
    out = shardrun("submit", cfg, cwd=tmp_path)
    rec = launches(run_dir)[0]
    try:
        assert len(rec["arrays"]) == 3  # 5 shards, MaxArraySize 2: three arrays, three sbatch calls
        scripts = "".join((store.jobs_dir(run_dir) / f"{a}_submission.sh").read_text() for a in rec["arrays"])
        # the cap of 3 shared by the arrays (2, 2 and 1 shards): one slot each; the single shard is a plain job
        assert [line for line in scripts.splitlines() if "--array=" in line] == ["#SBATCH --array=0-1%1"] * 2
        live = squeue(rec["tag"], rec["merge_job_name"])
        assert len(live) == 5 + 1 and all(state == "PENDING" for _, state, _ in live)
        st = status_json(run_dir, tmp_path)
        assert st["counts"]["pending"] == 5 and {s["reason"] for s in st["shards"]} == {"JobHeldUser"}
        # a second submit sees the queued jobs and submits nothing
        again = shardrun("submit", cfg, cwd=tmp_path)
        assert "still queued or running, not submitted again: 5 shard(s)" in again.stdout
        assert len(launches(run_dir)) == 1
        assert f"merge job: {rec['merge_job_id']}" in out.stdout
    finally:
        cancelled = shardrun("cancel", run_dir, cwd=tmp_path)
    assert "cancelled Slurm job(s)" in cancelled.stdout
    wait_for(lambda: not squeue(rec["tag"], rec["merge_job_name"]), 60, "the run's jobs to leave the queue")
    st = status_json(run_dir, tmp_path)
    assert st["counts"]["failed"] == 5
    assert shardrun("cancel", run_dir, cwd=tmp_path).stdout.strip() == "no live jobs for this run"


def test_resume_gives_up_after_max_attempts_and_refuses_a_changed_input(tmp_path, env):
    run_dir, cfg = held_run(tmp_path, max_attempts=2)
    shardrun("submit", cfg, "--no-merge-job", cwd=tmp_path)
    tag = launches(run_dir)[0]["tag"]
    try:
        shardrun("cancel", run_dir, cwd=tmp_path)
        wait_for(lambda: not squeue(tag), 60, "cancelled jobs to leave the queue")
        dry = shardrun("resume", run_dir, "--dry-run", cwd=tmp_path)
        assert "--array=0-4%" in dry.stdout and len(launches(run_dir)) == 1
        second = shardrun("resume", run_dir, "--no-merge-job", cwd=tmp_path)
        assert "resubmitted 5 shard(s)" in second.stdout
        assert len(launches(run_dir)) == 2
        shardrun("cancel", run_dir, cwd=tmp_path)
        wait_for(lambda: not squeue(tag), 60, "cancelled jobs to leave the queue")
        third = shardrun("resume", run_dir, cwd=tmp_path, check=False)
        assert third.returncode == 4, third.stdout + third.stderr
        assert "gave up on shard 0 after 2 attempt(s)" in third.stdout
        # the reason: sacct's, once accounting has the cancellation (it may lag a moment behind scancel)
        assert third.stdout.count("was cancelled") + third.stdout.count("ended without sealing the shard") == 5
        assert len(launches(run_dir)) == 2
        st = status_json(run_dir, tmp_path)
        assert st["gave_up"] == 5
        # raising the cap (an override on the saved settings) lets them run again
        more = shardrun("resume", run_dir, "cluster.max_attempts=3", "--no-merge-job", cwd=tmp_path)
        assert "resubmitted 5 shard(s)" in more.stdout
        shardrun("cancel", run_dir, cwd=tmp_path)

        # a planning setting changed: resume refuses (exit 2) and submits nothing
        other = shardrun("resume", run_dir, "num_repeats=3", cwd=tmp_path, check=False)
        assert other.returncode == 2 and "no longer match the plan" in other.stderr, other.stderr
        # the input changed: resume refuses (exit 2) and submits nothing
        src = tmp_path / "input.jsonl"
        src.write_text(src.read_text().replace("What is", "What's", 1))
        changed = shardrun("resume", run_dir, "cluster.max_attempts=9", cwd=tmp_path, check=False)
        assert changed.returncode == 2 and "no longer match the plan" in changed.stderr, changed.stderr
        assert len(launches(run_dir)) == 3
    finally:
        shardrun("cancel", run_dir, cwd=tmp_path, check=False)


def test_submit_refuses_when_the_key_is_not_exported(tmp_path, env, monkeypatch):
    monkeypatch.delenv(harness.API_KEY_ENV)
    run_dir, cfg = held_run(tmp_path)
    out = shardrun("submit", cfg, cwd=tmp_path, check=False)
    assert out.returncode == 2 and f"${harness.API_KEY_ENV} is not set in this shell" in out.stderr
    assert not store.launches_path(run_dir).exists()
