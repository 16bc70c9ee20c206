"""Warm workers on the real local Slurm: 2 workers as ONE job array over 8 shards, the job after them (afterany)
that merges; a worker preempted with USR2 in the middle of a shard stops it cleanly (completed rollouts kept,
claim released), is requeued by submitit as the same worker, and the run completes with every identity once;
workers SIGKILLed while each holds two shards in flight are resubmitted by the job after them, and the run completes
with every sealed rollout kept and every identity once.

Real `ng_run` and `ng_collect_rollouts`; the stand-in policy server (tests/fakes/policy_server.py) replaces vLLM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import orjson
import pytest

from shardrun.rundir import records, store
from shardrun.workers import worker
from slurm_helpers import (
    ended_state,
    fake_policy,
    launches,
    math_input,
    planned_identities,
    scancel_names,
    shardrun,
    status_json,
    wait_for,
    write_config,
)
from tests.fakes import harness
from tests.e2e.test_e2e_local import profile_rows, unsharded_reference

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1200)]
SHARDS = 8


@pytest.fixture
def env(slurm_cluster, gym_venv, monkeypatch):
    from shardrun.shard import gym_stack

    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return dict(slurm_cluster, gym_venv=gym_venv)


@contextmanager
def hanging(
    tmp_path: Path, run_dir: Path, shards: range, auto_resume_rounds: int
) -> Iterator[tuple[Path, Path, object]]:
    """The input (one task per shard), a config for 2 workers over SHARDS shards (2 repeats,
    num_samples_in_parallel 2: both rollouts of a shard in flight at once) and the stand-in policy, on which the
    second rollout (seed 1) of each shard in `shards` hangs, the first time it is asked for: a worker holding one of
    them is in the middle of it when the test strikes, however loaded the machine. Both rollouts must be in flight:
    Gym's collector starts a shard's rollouts in no fixed order (asyncio.as_completed over a set), so with one at a
    time the hanging one may go first and hold back the other."""
    inp = math_input(tmp_path / "input.jsonl", SHARDS)
    questions = [orjson.loads(line)["question"] for line in inp.read_text().splitlines()]
    # each hangs once: the first request, from the first worker to hold the shard; a worker that takes the shard
    # over (after a USR2 requeue released it, or a kill) gets its answer even before the test lifts the faults
    faults = [arg for i in shards for arg in ("--fault", f"hang:match={questions[i]},seed=1,times=1")]
    with fake_policy(tmp_path, *faults) as fake:
        cfg = write_config(
            tmp_path / "run.yaml",
            inp,
            run_dir,
            fake.base_url,
            repeats=2,
            shards=SHARDS,
            cluster={
                "workers": 2,
                "claim_heartbeat_s": 1,
                "claim_lease_s": 20,
                "auto_resume_rounds": auto_resume_rounds,
            },
            gym={"num_samples_in_parallel": 2},
        )
        yield inp, cfg, fake


def test_worker_array_usr2_requeue_and_the_job_after_them(tmp_path, env) -> None:
    run_dir = tmp_path / "run"
    with hanging(tmp_path, run_dir, range(3, 4), auto_resume_rounds=1) as (inp, cfg, fake):
        out = shardrun("submit", cfg, cwd=tmp_path)
        rec = launches(run_dir)[0]
        tag, after_job = rec["tag"], rec["merge_job_id"]
        try:
            array = rec["arrays"][0]
            assert rec["mode"] == "warm_workers" and rec["executor"] == "slurm" and "jobs" not in rec
            assert rec["workers"] == {"0": f"{array}_0", "1": f"{array}_1"}
            assert sorted(rec["worker_shards"]) == list(range(SHARDS))
            assert "warm workers: 2 job(s)" in out.stdout
            script = (store.jobs_dir(run_dir) / f"{array}_submission.sh").read_text()
            assert "#SBATCH --array=0-1%2" in script and f"#SBATCH --job-name={tag}" in script
            after_script = (store.jobs_dir(run_dir) / f"{after_job}_submission.sh").read_text()
            assert f"#SBATCH --dependency=afterany:{array}" in after_script

            def shard3_held() -> dict | None:
                claim = store.claim_path(run_dir, 3)
                hung = [r for r in fake.requests() if r["fault"] == "hang"]
                return orjson.loads(claim.read_bytes()) if hung and claim.exists() else None

            claim = wait_for(shard3_held, 500, "shard 3's last rollout to hang at the policy")
            st = status_json(run_dir, tmp_path)
            by = {s["index"]: s for s in st["shards"]}
            assert by[3]["state"] == "running" and by[3]["job_id"] == claim["job_id"]
            assert {w["job_id"] for w in st["workers"]} <= {f"{array}_0", f"{array}_1"}
            # the rollout that does not hang may be written after the hanging request arrives: wait for it to land
            kept = wait_for(
                lambda: harness.keys_complete(store.rollouts_path(run_dir, 3)), 300, "shard 3's first rollout to land"
            )
            assert len(kept) == 1  # rollout 1 hangs, so there can never be a second

            subprocess.run(["scancel", "--signal=USR2", claim["job_id"]], check=True, timeout=60)
            log = store.job_log_path(run_dir, claim["job_id"])
            wait_for(lambda: log.exists() and "Requeued job" in log.read_text(), 300, "the worker to be requeued")
            fake.set_faults([])
            state = ended_state(after_job, 700, "the after job")
            after_log = store.job_log_path(run_dir, after_job).read_text()
            assert state == "COMPLETED", after_log[-3000:]
            assert "after the workers (round 1): 8 sealed, 0 to resubmit" in after_log
        finally:
            scancel_names(tag, rec["merge_job_name"])

    text = log.read_text()
    assert "claim released, servers stopped, completed rollouts kept" in text
    states = {s.worker_id: s for s in records.read_worker_states(run_dir)}
    preempted = states[claim["job_id"]]
    # requeued, it starts its servers again (once) when it finds shard 3 to collect; the other worker, idle and
    # asking to help at the end of the run, may have claimed shard 3 first once it was released: then there was
    # nothing for the requeued worker to start its servers for
    sealed_by = orjson.loads(store.done_path(run_dir, 3).read_bytes())["worker"]["id"]
    assert sealed_by in states and preempted.state == worker.STOPPED
    assert preempted.server_starts == (2 if sealed_by == preempted.worker_id else 1)
    # shard 3 resumed from its kept rollout; every identity once; merged by the job after the workers
    ids = harness.keys(store.rollouts_path(run_dir, 3))
    assert ids[: len(kept)] == kept and len(ids) == len(set(ids)) == 2
    merged = harness.keys(store.merged_dir(run_dir) / "rollouts.jsonl")
    assert sorted(merged) == planned_identities(run_dir, SHARDS) and len(set(merged)) == len(merged) == 16
    assert not any(store.claim_path(run_dir, i).exists() for i in range(SHARDS))
    st = status_json(run_dir, tmp_path)
    assert st["complete"]
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert harness.API_KEY.encode() not in path.read_bytes(), f"API key written to {path}"


def test_workers_killed_with_two_shards_in_flight_each_are_resubmitted_by_the_job_after_them(tmp_path, env) -> None:
    """Every live worker SIGKILLed while one holds two shards in flight, as a node failure does: the array ends
    (FAILED), the job after it finds the four unsealed shards, resubmits workers for them and queues itself again
    (cluster.auto_resume_rounds); the new workers take the stale claims over after the lease, no sealed rollout is
    lost, round 2 merges every identity exactly once, and the merged profile equals one unsharded Gym run's. No
    watcher process is kept alive by hand."""
    run_dir = tmp_path / "run"
    # shards are claimed in index order and each hanging rollout holds one of its worker's two slots: once 0 to 3 are
    # sealed the workers hold 4 to 7, and one of them has two shards in flight (a third may wait in its queue)
    with hanging(tmp_path, run_dir, range(4, 8), auto_resume_rounds=2) as (inp, cfg, fake):
        shardrun("submit", cfg, cwd=tmp_path)
        rec = launches(run_dir)[0]
        tag, first_after = rec["tag"], rec["merge_job_id"]
        try:
            questions = [orjson.loads(line)["question"] for line in inp.read_text().splitlines()]

            def two_in_flight() -> list | None:
                live = [s for s in records.read_worker_states(run_dir) if not worker.gone(s)]
                held = sorted(i for s in live for i in s.current_shards)
                hung = {
                    i
                    for r in fake.requests()
                    if r["fault"] == "hang"
                    for i in range(4, 8)
                    if questions[i] in r["prompt"]
                }
                both = [s for s in live if len(set(s.current_shards) & hung) >= 2]
                return live if len(live) == 2 and held == [4, 5, 6, 7] and both else None

            killed = wait_for(two_in_flight, 600, "the workers to hold shards 4 to 7, one with two in flight")
            sealed_before = {i: store.done_path(run_dir, i).read_bytes() for i in range(4)}
            for s in killed:
                os.kill(s.pid, signal.SIGKILL)
            fake.set_faults([])
            state = ended_state(first_after, 600, "round 1")
            first_log = store.job_log_path(run_dir, first_after).read_text()
            assert state == "COMPLETED", first_log[-3000:]
            counts = re.search(r"after the workers \(round 1\): (\d+) sealed, (\d+) to resubmit", first_log)
            assert counts and int(counts[2]) == 4, first_log[-3000:]  # shards 4 to 7
            second_after = re.search(r"next: job (\d+)", first_log)[1]
            state = ended_state(second_after, 700, "round 2")
            second_log = store.job_log_path(run_dir, second_after).read_text()
            assert state == "COMPLETED", second_log[-3000:]
            assert "after the workers (round 2): 8 sealed, 0 to resubmit" in second_log
        finally:
            scancel_names(tag, rec["merge_job_name"])
        # the merged reward profile equals one unsharded Gym run's, made with the release's own profiler
        reference = unsharded_reference(tmp_path, cfg, inp, env["gym_venv"], repeats=2)

    assert profile_rows(store.merged_reward_profiling_path(run_dir)) == profile_rows(
        reference / "rollouts_reward_profiling.jsonl"
    )
    for i, marker in sealed_before.items():  # no sealed rollout lost: each seal and its file are as they were
        assert store.done_path(run_dir, i).read_bytes() == marker
        assert store.sha256_file(store.rollouts_path(run_dir, i)) == orjson.loads(marker)["rollouts_sha256"]
    launched = launches(run_dir)
    assert len(launched) == 2 and sorted(launched[1]["worker_shards"]) == [4, 5, 6, 7]  # what round 1 resubmitted
    merged = harness.keys(store.merged_dir(run_dir) / "rollouts.jsonl")
    assert sorted(merged) == planned_identities(run_dir, SHARDS) and len(set(merged)) == len(merged) == 16
    for i in range(4, SHARDS):  # each taken over from its kept rollout, nothing twice
        ids = harness.keys(store.rollouts_path(run_dir, i))
        assert len(ids) == len(set(ids)) == 2
    assert status_json(run_dir, tmp_path)["complete"]
