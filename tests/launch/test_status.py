"""`shardrun status` on synthetic run directories: sealed / running / pending / failed / never started, counts
tolerant of torn lines, throughput and ETA, GPU-hours, JSON, the CLI. Slurm's answers are given as parsed
squeue/sacct text here (the real squeue is exercised in tests/slurm/)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.core import config
from shardrun.launch import scheduler
from shardrun.launch import status
from shardrun.rundir import store
from shardrun.shard import processes
from tests import builders


def make_run(tmp_path: Path, num_tasks: int = 12, repeats: int = 2, shards: int = 6) -> tuple[Path, object]:
    src = tmp_path / "input.jsonl"
    src.write_bytes(
        b"".join(
            orjson.dumps(
                {
                    "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
                    "expected_answer": str(i + 1),
                    "agent_ref": {"name": "agent"},
                }
            )
            + b"\n"
            for i in range(num_tasks)
        )
    )
    cfg = config.validate(
        {
            "input_jsonl": str(src),
            "run_dir": str(tmp_path / "run"),
            "num_repeats": repeats,
            "sharding": {"num_shards": shards},
        }
    )
    plan, _ = store.write_plan(cfg)
    return cfg.run_dir, plan


def write_rollouts(run_dir: Path, plan, i: int, n: int, torn: bool = False, failed: int = 0) -> None:
    rows = [orjson.dumps({"_ng_task_index": k, "_ng_rollout_index": 0, "reward": 1.0}) + b"\n" for k in range(n)]
    store.rollouts_path(run_dir, i).write_bytes(b"".join(rows) + (b'{"_ng_task_index": 99, "rew' if torn else b""))
    if failed:
        store.failures_path(run_dir, i).write_bytes(b'{"_ng_task_index": 1, "error": "x"}\n' * failed)


def complete_and_seal(run_dir: Path, plan, i: int, gpus: int = 2, hours: float = 0.5) -> None:
    planned = plan.shards[i].num_rollouts
    write_rollouts(run_dir, plan, i, planned)
    builders.seal_shard(
        run_dir,
        i,
        plan=plan,
        started_at=1000.0,
        finished_at=1000.0 + hours * 3600 / gpus,
        host="h",
        job_id="7_0",
        collect_s=2.0,
        gpus=gpus,
    )


def record(run_dir: Path, jobs: dict[int, str], **kw) -> None:
    rec = {
        "executor": "slurm",
        "submitted_at": kw.pop("submitted_at", time.time() - 60),
        "tag": "sr-test",
        "jobs": {str(k): v for k, v in jobs.items()},
        "done_at_submit": 0,
        "max_attempts": 3,
        "gpus_per_shard": 2,
    }
    rec.update(kw)
    store.append_launch(run_dir, rec)


def squeue(text: str):
    return lambda names: scheduler.parse_squeue(text)


def no_sacct(ids):
    return {}


def test_states_counts_and_reasons(tmp_path):
    run_dir, plan = make_run(tmp_path)
    complete_and_seal(run_dir, plan, 0)
    complete_and_seal(run_dir, plan, 1)
    write_rollouts(run_dir, plan, 2, 2, torn=True)  # running, torn tail not counted
    write_rollouts(run_dir, plan, 4, 1, failed=1)  # failed, one rollout and one failed rollout recorded
    store.atomic_write_json(
        store.shard_failure_path(run_dir, 4), {"job_id": "7_4", "error": "ServerFailure: vLLM died", "attempt": 1}
    )
    now = time.time()
    record(
        run_dir,
        {0: "7_0", 1: "7_1", 2: "7_2", 3: "7_3", 4: "7_4"},
        submitted_at=now - 120,
        merge_job_name="sr-test-merge",
        merge_job_id="8",
    )
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 1800))
    live = squeue(
        f"7_2|RUNNING|None|{start}|sr-test\n7_3|PENDING|JobArrayTaskLimit|N/A|sr-test\n"
        f"8|PENDING|Dependency|N/A|sr-test-merge\n"
    )
    st = status.collect(run_dir, now=now, query_live=live, query_ended=no_sacct)

    by = {s.index: s for s in st.shards}
    assert [by[i].state for i in range(6)] == ["sealed", "sealed", "running", "pending", "failed", "never_started"]
    assert by[2].rollouts == 2 and by[2].planned == 4
    assert by[3].reason == "JobArrayTaskLimit"
    assert by[4].reason == "ServerFailure: vLLM died" and by[4].log.endswith("jobs/7_4_0_log.out")
    assert by[4].done == 2 and not by[4].gave_up
    assert by[5].attempts == 0 and by[5].job_id is None
    assert st.counts == {"sealed": 2, "running": 1, "pending": 1, "failed": 1, "damaged": 0, "never_started": 1}
    assert st.done == 4 + 4 + 2 + 2 and st.planned == 24
    # throughput: 12 rollouts in 2 minutes since the launch; ETA for the 12 left
    assert st.throughput_per_min == pytest.approx(6.0, rel=1e-6)
    assert st.eta_s == pytest.approx(120.0, rel=1e-6)
    # GPU-hours: two sealed shards at 0.5 each + shard 2 running for 30 min on 2 GPUs
    assert st.gpu_hours == pytest.approx(0.5 + 0.5 + 1.0, rel=1e-3)

    text = status.render(st)
    assert "sealed 2 · running 1 · pending 1 · failed 1 · never started 1" in text
    assert "ServerFailure: vLLM died" in text and "7_4_0_log.out" in text
    assert "shardrun resume" in text
    assert st.merge_jobs == [{"job_id": "8", "state": "PENDING", "reason": "Dependency"}]
    assert "8 pending (Dependency)" in text
    data = orjson.loads(status.render_json(st))
    assert data["counts"]["failed"] == 1 and data["shards"][2]["done"] == 2 and data["complete"] is False


def test_failure_reason_from_sacct_and_gave_up(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=3)
    for attempt in range(3):
        record(run_dir, {0: f"{10 + attempt}_0", 1: f"{10 + attempt}_1"})
    sacct = "12_0|TIMEOUT|0:0|x|y|60|cpu=1\n12_1|CANCELLED by 0|0:15|x|y|60|cpu=1\n"
    asked = []

    def ended(ids):
        asked.append(sorted(ids))
        return scheduler.parse_sacct(sacct)

    st = status.collect(run_dir, query_live=squeue(""), query_ended=ended)
    by = {s.index: s for s in st.shards}
    assert asked == [["12"]]  # one sacct call, for the array of the latest attempt
    assert by[0].reason == "Slurm job 12_0 hit its time limit" and by[0].gave_up and by[0].attempts == 3
    assert by[1].reason == "Slurm job 12_1 was cancelled"
    assert st.gave_up == 2
    assert "failed max_attempts times" in status.render(st)


def test_marker_of_another_plan_is_not_sealed(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=2)
    complete_and_seal(run_dir, plan, 0)
    marker = orjson.loads(store.done_path(run_dir, 0).read_bytes())
    marker["plan_fingerprint"] = "0" * 64
    store.atomic_write_json(store.done_path(run_dir, 0), marker)
    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct)
    assert st.shards[0].state == "never_started"
    assert "another plan" in st.shards[0].reason
    assert st.shards[0].rollouts == plan.shards[0].num_rollouts  # counted from the file


def test_local_pids_running_and_gone(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=2)
    me = os.getpid()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.append_launch(
        run_dir,
        {
            "executor": "local",
            "submitted_at": time.time(),
            "host": os.uname().nodename,
            "jobs": {"0": str(me), "1": str(dead.pid)},
            "pid_start": {str(me): processes.start_ticks(me), str(dead.pid): 1},
        },
    )
    store.shard_log_path(run_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    store.shard_log_path(run_dir, 0).write_text("start\n")
    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct)
    assert [s.state for s in st.shards] == ["running", "failed"]
    assert "ended without sealing" in st.shards[1].reason


def test_local_worker_shards_not_started_yet_are_pending(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=2)
    me = os.getpid()
    store.append_launch(
        run_dir,
        {
            "executor": "local",
            "submitted_at": time.time() - 5,
            "host": os.uname().nodename,
            "jobs": {"0": str(me), "1": str(me)},
            "pid_start": {str(me): processes.start_ticks(me)},
        },
    )
    log = store.shard_log_path(run_dir, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("start: attempt 1\n")  # the worker started shard 0; shard 1 waits its turn
    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct)
    assert [s.state for s in st.shards] == ["running", "pending"]
    assert "waiting for its local worker" in st.shards[1].reason


def test_reused_pid_is_not_running(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=1)
    me = os.getpid()
    store.append_launch(
        run_dir,
        {
            "executor": "local",
            "submitted_at": time.time(),
            "host": os.uname().nodename,
            "jobs": {"0": str(me)},
            "pid_start": {str(me): processes.start_ticks(me) + 1},
        },
    )
    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct)
    assert st.shards[0].state == "failed"


def test_squeue_unavailable_is_a_warning(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=1)
    record(run_dir, {0: "5_0"})

    def broken(names):
        raise scheduler.SlurmError("squeue not found")

    st = status.collect(run_dir, query_live=broken, query_ended=no_sacct)
    assert st.shards[0].state == "failed"
    assert any("cannot ask Slurm" in w for w in st.warnings)


def test_complete_run(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=3)
    for i in range(3):
        complete_and_seal(run_dir, plan, i)
    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct)
    assert st.complete and st.done == st.planned and st.eta_s is None
    assert "100.0%" in status.render(st)


def test_progress_bar():
    assert status.progress_bar(0, 10, width=10) == "[..........]   0.0%"
    assert status.progress_bar(5, 10, width=10) == "[#####.....]  50.0%"
    assert status.progress_bar(10, 10, width=10) == "[##########] 100.0%"
    assert status.progress_bar(0, 0, width=4) == "[####] 100.0%"


def test_cli_status_json_and_watch(tmp_path):
    run_dir, plan = make_run(tmp_path, shards=2)
    complete_and_seal(run_dir, plan, 0)
    shardrun = [sys.executable, "-m", "shardrun.cli"]
    out = subprocess.run(shardrun + ["status", str(run_dir), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = orjson.loads(out.stdout)
    assert [s["state"] for s in data["shards"]] == ["sealed", "never_started"]
    # nothing live: --watch draws once and stops
    out = subprocess.run(
        shardrun + ["status", str(run_dir), "--watch", "--interval", "0.1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "sealed 1" in out.stdout and "[###############" in out.stdout
    out = subprocess.run(shardrun + ["status", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "run directory not found" in out.stderr


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"{}", b"\n", b"\n\n", b"xyz\n"]), max_size=40))
def test_count_complete_lines_matches_complete_lines(tmp_path_factory, parts):
    path = tmp_path_factory.mktemp("c") / "f.jsonl"
    path.write_bytes(b"".join(parts))
    assert store.count_complete_lines(path) == sum(1 for _ in store.complete_lines(path))


def test_count_complete_lines_across_blocks(tmp_path):
    path = tmp_path / "f.jsonl"
    block = 1 << 20
    path.write_bytes(b"x" * (block - 1) + b"\n" + b"\n" + b"y\n" + b"z")  # blank line right at the block boundary
    assert store.count_complete_lines(path) == 2 == sum(1 for _ in store.complete_lines(path))


@pytest.mark.parametrize("mode", [{"mode": "slurm_arrays"}, {"executor": "slurm"}], ids=["typed", "old line"])
def test_slurm_array_records_typed_or_old_ask_sacct_for_the_latest_array(tmp_path, mode):
    run_dir, plan = make_run(tmp_path, shards=2)
    for attempt in range(2):
        store.append_launch(
            run_dir,
            mode | {"submitted_at": time.time() - 60, "tag": "sr-test", "jobs": {"0": f"{10 + attempt}_0"}},
        )
    asked = []

    def ended(ids):
        asked.append(sorted(ids))
        return scheduler.parse_sacct("11_0|TIMEOUT|0:0|x|y|60|cpu=1\n")

    st = status.collect(run_dir, query_live=squeue(""), query_ended=ended)
    assert asked == [["11"]] and st.shards[0].reason == "Slurm job 11_0 hit its time limit"
    assert st.shards[0].attempts == 2 and st.shards[1].state == "never_started"
    assert st.live_source.startswith("squeue --name=sr-test")


@pytest.mark.parametrize("mode", [{"mode": "local_jobs"}, {"executor": "local"}], ids=["typed", "old line"])
def test_local_job_records_typed_or_old_never_reach_sacct_and_wait_in_turn(tmp_path, mode):
    run_dir, plan = make_run(tmp_path, shards=3)
    me = os.getpid()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store.append_launch(
        run_dir,
        mode
        | {
            "submitted_at": time.time() - 5,
            "host": os.uname().nodename,
            "jobs": {"0": str(me), "1": str(me), "2": str(dead.pid)},
            "pid_start": {str(me): processes.start_ticks(me), str(dead.pid): 1},
        },
    )
    log = store.shard_log_path(run_dir, 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("start: attempt 1\n")

    def no_sacct_here(ids):
        raise AssertionError(f"sacct asked about local pids {ids}")

    st = status.collect(run_dir, query_live=squeue(""), query_ended=no_sacct_here)
    assert [s.state for s in st.shards] == ["running", "pending", "failed"]
    assert "waiting for its local worker" in st.shards[1].reason
    assert st.live_source == "local pids: 1 live"
