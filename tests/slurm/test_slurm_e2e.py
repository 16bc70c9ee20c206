"""shardrun on a real Slurm (the local single-node cluster the session fixture starts): job arrays with a parallelism
cap split by MaxArraySize, status while jobs run, a preempted shard (USR2) requeued and resumed, scancel then resume
(two at once submit once), the dependent merge job, and a shard with a 1-minute time limit that is checkpointed,
requeued and completes.

Every shard runs the real runtime: real `ng_run` and `ng_collect_rollouts`; the stand-in policy server
(tests/fakes/policy_server.py) replaces vLLM. Slurm is never mocked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import seal
from shardrun.rundir import store
from slurm_helpers import (
    ended_state,
    fake_policy,
    launches,
    math_input,
    planned_identities,
    sacct_state,
    scancel_names,
    shardrun,
    squeue,
    status_json,
    wait_for,
    write_config,
)
from tests.fakes import harness

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture
def env(slurm_cluster, gym_venv, monkeypatch):
    from shardrun.shard import gym_stack

    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return slurm_cluster


class RunningSampler:
    """Samples squeue every second: the most shard jobs of the run seen RUNNING at once."""

    def __init__(self, name: str):
        self.name, self.max_running, self.samples = name, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                running = [j for j in squeue(self.name) if j[1] == "RUNNING"]
            except subprocess.SubprocessError:
                running = []
            self.max_running = max(self.max_running, len(running))
            self.samples += 1
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def merged_identities(run_dir: Path) -> list[tuple[int, int]]:
    return harness.keys(store.merged_dir(run_dir) / "rollouts.jsonl")


def test_arrays_status_preempt_cancel_concurrent_resume_and_merge_job(tmp_path: Path, env) -> None:
    run_dir = tmp_path / "run"
    inp = math_input(tmp_path / "input.jsonl", 3)
    # Shard 0 (task 0, rollouts 0-3, all four requests at once) must still be collecting when the preemption comes:
    # the requests of rollouts 1-3 get no answer until the test lifts the fault after the preemption, so shard 0
    # holds exactly one rollout, however loaded the machine and in whatever order Gym sends the requests (the event
    # the test waits on, not a race it hopes to win).
    task0 = orjson.loads(inp.read_text().splitlines()[0])["question"]
    hold_shard0 = [arg for seed in (1, 2, 3) for arg in ("--fault", f"hang:match={task0},seed={seed}")]
    with fake_policy(tmp_path, "--delay", "1", *hold_shard0) as fake:
        cfg = write_config(
            tmp_path / "run.yaml",
            inp,
            run_dir,
            fake.base_url,
            repeats=4,
            shards=3,
            cluster={"array_parallelism": 2, "max_array_size": 2},
            gym={"num_samples_in_parallel": 4},
        )
        out = shardrun("submit", cfg, cwd=tmp_path)
        rec = launches(run_dir)[0]
        tag, merge_name = rec["tag"], rec["merge_job_name"]
        sampler = RunningSampler(tag)
        try:
            # two arrays (MaxArraySize 2): shards 0-1 as tasks 0-1 of the first, shard 2 alone; one sbatch each
            a0, a1 = rec["arrays"]
            assert {task for task, _ in harness.keys(store.materialized_path(run_dir, 0))} == {0}  # held above
            assert rec["jobs"] == {"0": f"{a0}_0", "1": f"{a0}_1", "2": a1}
            assert f"merge job: {rec['merge_job_id']}" in out.stdout
            script = (store.jobs_dir(run_dir) / f"{a0}_submission.sh").read_text()
            assert "#SBATCH --array=0-1%1" in script and f"#SBATCH --job-name={tag}" in script
            merge_script = (store.jobs_dir(run_dir) / f"{rec['merge_job_id']}_submission.sh").read_text()
            assert f"#SBATCH --dependency=afterany:{a0}:{a1}" in merge_script
            assert "#SBATCH --kill-on-invalid-dep=yes" in merge_script
            assert harness.API_KEY not in script + merge_script

            # status while the jobs run: shard 0 running with its one rollout, shard 1 held back by the array throttle
            def shard0_mid_collection():
                st = status_json(run_dir, tmp_path)
                by = {s["index"]: s for s in st["shards"]}
                return st if by[0]["state"] == "running" and by[0]["rollouts"] == 1 else None

            st = wait_for(shard0_mid_collection, 400, "shard 0 running, part-way through")
            by = {s["index"]: s for s in st["shards"]}
            assert by[1]["state"] == "pending" and by[1]["reason"] == "JobArrayTaskLimit"
            assert by[2]["state"] in ("running", "sealed")
            assert st["counts"]["running"] <= 2 and tag in st["live_source"]
            human = shardrun("status", run_dir, cwd=tmp_path).stdout
            assert "running" in human and "JobArrayTaskLimit" in human

            # a preemption of shard 0 mid-collection (USR2, as Slurm sends before preempting): it stops cleanly,
            # keeps its rollouts and is requeued by submitit. scancel of shard 1 (pending) and shard 2. When the
            # arrays have ended the merge job runs (afterany), finds shards 1 and 2 unsealed and fails, saying to
            # run `shardrun resume`.
            kept = store.count_complete_lines(store.rollouts_path(run_dir, 0))
            subprocess.run(["scancel", "--signal=USR2", f"{a0}_0"], check=True, timeout=60)
            subprocess.run(["scancel", f"{a0}_1", a1], check=True, timeout=60)
            fake.set_faults([])  # the requeued shard 0 gets its last answer
            merge1 = rec["merge_job_id"]
            assert ended_state(merge1, 500, "first merge job") == "FAILED"
            merge_log = store.job_log_path(run_dir, merge1).read_text()
            # shard 2 runs beside shard 0 and may seal before the scancel reaches it: the run then has 1 hole
            plan = store.load_plan(run_dir)
            holes = [i for i in (1, 2) if not seal.check(run_dir, plan, i).sealed]
            assert holes[0] == 1, holes
            assert f"{len(holes)} of 3 shards are not sealed" in merge_log, merge_log[-2000:]
            assert f"shardrun resume {run_dir}" in merge_log
            st = status_json(run_dir, tmp_path)
            by = {s["index"]: s for s in st["shards"]}
            assert [by[i]["state"] for i in range(3)] == ["sealed", "failed", "failed" if 2 in holes else "sealed"], st
            assert "cancelled" in by[1]["reason"]
            if 2 in holes:
                assert by[2]["log"].endswith(f"{a1}_0_log.out")
            job0_log = store.job_log_path(run_dir, f"{a0}_0").read_text()
            assert "this job is preempted" in job0_log and "Requeued job" in job0_log
            starts = re.findall(
                r"(\d+) of 4 planned rollouts to run \((\d+) done", store.shard_log_path(run_dir, 0).read_text()
            )
            assert kept == 1 and starts == [("4", "0"), ("3", "1")], (kept, starts)  # resumed from its rollout

            # two resumes at once: the run lock makes the second see the first one's jobs and submit nothing
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "shardrun.cli", "resume", str(run_dir)],
                    cwd=tmp_path,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(2)
            ]
            outs = [p.communicate(timeout=300) for p in procs]
            assert [p.returncode for p in procs] == [0, 0], outs
            texts = [o[0] for o in outs]
            left = "1-2" if len(holes) == 2 else "1"
            assert sum(f"resubmitted {len(holes)} shard(s)" in t for t in texts) == 1, texts
            assert sum(f"left alone, still queued or running: {left}" in t for t in texts) == 1, texts
            recs = launches(run_dir)
            assert len(recs) == 2 and sorted(recs[1]["jobs"]) == [str(i) for i in holes]

            # the resumed shards complete; the new merge job merges and profiles the run
            merge2 = recs[1]["merge_job_id"]
            state = ended_state(merge2, 500, "second merge job")
            assert state == "COMPLETED", store.job_log_path(run_dir, merge2).read_text()[-3000:]
        finally:
            sampler.stop()
            scancel_names(tag, merge_name)

    # every planned identity exactly once in the merged rollouts; shard 0 kept what it had before the preemption
    planned = planned_identities(run_dir, 3)
    assert len(planned) == 12
    merged = merged_identities(run_dir)
    assert sorted(merged) == planned and len(set(merged)) == len(merged)
    assert (store.merged_dir(run_dir) / "rollouts_reward_profiling.jsonl").stat().st_size > 0
    for i in range(3):
        ids = harness.keys(store.rollouts_path(run_dir, i))
        assert len(ids) == len(set(ids)) == 4
        assert store.count_complete_lines(store.failures_path(run_dir, i)) == 0
    st = status_json(run_dir, tmp_path)
    assert st["complete"] and st["counts"]["sealed"] == 3
    # the cap: never more than array_parallelism shard jobs running at once
    assert sampler.samples > 10 and 1 <= sampler.max_running <= 2
    # the key reached the jobs through the environment only: not in a script, pickle, log or marker
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert harness.API_KEY.encode() not in path.read_bytes(), f"API key written to {path}"


def test_time_limit_checkpoint_requeue_and_resume_inside_the_shard(tmp_path: Path, env) -> None:
    """A 1-minute shard: the policy answers the first requests and then hangs, so the shard cannot finish before
    its time limit. USR2 arrives; the shard stops its collector and servers, keeps its completed rollouts, and
    submitit requeues it. Once requeued the policy answers again and the same job completes the shard."""
    run_dir = tmp_path / "run"
    inp = math_input(tmp_path / "input.jsonl", 4)
    with fake_policy(tmp_path, "--fault", "hang:after=3") as fake:
        cfg = write_config(
            tmp_path / "run.yaml",
            inp,
            run_dir,
            fake.base_url,
            repeats=2,
            shards=1,
            cluster={"time_limit": "00:01:00", "signal_delay_s": 5, "max_requeues": 10, "array_parallelism": 1},
        )
        shardrun("submit", cfg, "--no-merge-job", cwd=tmp_path)
        rec = launches(run_dir)[0]
        job = rec["jobs"]["0"]
        log = store.job_log_path(run_dir, job)
        try:
            wait_for(lambda: log.exists() and "Requeued job" in log.read_text(), 300, "the checkpoint and requeue")
            at_checkpoint = store.rollouts_path(run_dir, 0).read_bytes()
            # the requeued job gets time enough to start the Gym stack and finish on a loaded machine too (starting
            # the servers alone can take longer than a minute here); the time limit it hit stays the first one's
            subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=20"], check=True, timeout=60)
            fake.set_faults([])
            wait_for(lambda: status_json(run_dir, tmp_path)["complete"], 400, "the requeued shard to seal")
            wait_for(lambda: sacct_state(job) == "COMPLETED", 120, "the job to complete")
        finally:
            scancel_names(rec["tag"])

    text = log.read_text()
    assert "checkpoint signal SIGUSR2: collector and servers stopped, completed rollouts kept" in text
    assert "Job has timed out" in text  # submitit saw the time limit, not a preemption
    shard_log = store.shard_log_path(run_dir, 0).read_text()
    assert shard_log.count("start: attempt 1") >= 2, shard_log  # the same attempt, requeued
    assert "FAILED" not in shard_log
    # every identity exactly once; what was complete at the checkpoint is kept byte for byte
    final = store.rollouts_path(run_dir, 0).read_bytes()
    kept = at_checkpoint[: at_checkpoint.rfind(b"\n") + 1]
    assert final.startswith(kept)
    ids = harness.keys(store.rollouts_path(run_dir, 0))
    assert sorted(ids) == planned_identities(run_dir, 1) and len(set(ids)) == 8
    # rollouts in flight at the checkpoint were run again, never recorded as failed
    assert store.count_complete_lines(store.failures_path(run_dir, 0)) == 0
    marker = orjson.loads(store.done_path(run_dir, 0).read_bytes())
    assert marker["num_failed"] == 0 and marker["num_rollouts"] == 8
    assert not store.shard_failure_path(run_dir, 0).exists()
