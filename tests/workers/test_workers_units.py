"""Warm workers without servers: which shard a worker takes next, its time limit, the config keys, and what
`shardrun status` shows for a run on workers (claims, worker records, stale claims) read from real files."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from shardrun.core import config
from shardrun.core.errors import BadInput
from shardrun.launch import after_workers, status, submission, warm_workers
from shardrun.rundir import records, store
from shardrun.rundir.records import Seal, WorkerState
from shardrun.shard import processes
from shardrun.workers import claims, worker, worker_view
from tests import builders


def test_order_partial_progress_first_then_longest_expected() -> None:
    cands = [
        worker.Candidate(0, planned=10, done=0, attempts=0),
        worker.Candidate(1, planned=30, done=0, attempts=0),
        worker.Candidate(2, planned=10, done=4, attempts=1),
        worker.Candidate(3, planned=20, done=0, attempts=0),
        worker.Candidate(4, planned=50, done=49, attempts=0),
    ]
    assert [c.index for c in worker.order(cands)] == [2, 4, 1, 3, 0]


def test_rate_and_whether_a_shard_fits_before_the_limit() -> None:
    base = {"plan_fingerprint": "f", "shard_index": 0, "rollouts_sha256": "0", "rollouts_bytes": 0, "num_failed": 0}
    markers = [
        Seal.model_validate(base | {"num_rollouts": 90, "num_failed": 10, "collect_s": 50.0}),
        Seal.model_validate(base | {"num_rollouts": 100, "collect_s": 50.0}),
    ]
    rate = worker.rate_per_s(markers)
    assert rate == pytest.approx(2.0)
    big, small = worker.Candidate(0, 300, 0, 0), worker.Candidate(1, 100, 0, 0)
    assert not worker.fits(big, rate, 100.0) and worker.fits(small, rate, 100.0)
    assert worker.fits(big, None, 100.0) and worker.fits(big, rate, None)
    assert (
        worker.rate_per_s([]) is None
        and worker.rate_per_s([Seal.model_validate(base | {"num_rollouts": 3, "collect_s": 0})]) is None
    )


def test_deadline_from_slurm_or_the_configured_limit() -> None:
    slurm_cluster = config.ClusterConfig(executor="slurm", time_limit="01:00:00")
    assert warm_workers.deadline(slurm_cluster, {"SLURM_JOB_END_TIME": "1800000000"}) == 1800000000.0
    assert warm_workers.deadline(slurm_cluster, {}) == pytest.approx(time.time() + 3600, abs=5)
    assert warm_workers.deadline(config.ClusterConfig(), {}) is None
    assert warm_workers.deadline(config.ClusterConfig(time_limit="00:10:00"), {}) == pytest.approx(
        time.time() + 600, abs=5
    )


def test_worker_keys_are_validated(tmp_path: Path) -> None:
    base = {"input_jsonl": "in.jsonl", "run_dir": "run"}
    assert config.validate({**base, "cluster": {"workers": 2}}).cluster_or_default.workers == 2
    assert config.validate(base).cluster_or_default.workers is None
    with pytest.raises(BadInput, match="cluster.workers"):
        config.validate({**base, "cluster": {"workers": 0}})
    with pytest.raises(BadInput, match="claim_lease_s .10. must be at least twice"):
        config.validate({**base, "cluster": {"claim_lease_s": 10, "claim_heartbeat_s": 30}})
    local = config.find_cluster_config("local", None)
    assert "workers: 2" in local.read_text()


def test_worker_ids_are_file_names() -> None:
    assert worker.worker_id_for("123_4") == "123_4"
    assert worker.worker_id_for("a/b c") == "a_b_c"
    assert worker.worker_id_for(None) == f"{socket.gethostname()}-{os.getpid()}"


def test_dry_run_describes_the_workers(tmp_path: Path) -> None:
    run = builders.make_run(tmp_path, builders.input_rows(6), num_shards=3)
    cfg = run.cfg.model_copy(update={"cluster": config.ClusterConfig(workers=2, executor="slurm")})
    text = submission.describe_submission(cfg, run.run_dir, [0, 1, 2])
    assert "warm workers: 2 job(s) for 3 shard(s) (0-2)" in text and "--array=0-1" in text
    assert "up to 3 round(s), then merge-and-profile" in text


def test_status_shows_workers_claims_and_stale_claims(tmp_path: Path) -> None:
    run = builders.make_run(tmp_path, builders.input_rows(8), num_shards=4)
    cluster = config.ClusterConfig(workers=2, claim_heartbeat_s=1, claim_lease_s=10)
    store.write_launch_settings(run.run_dir, run.cfg.model_copy(update={"cluster": cluster}))
    builders.write_shard(run, 0)  # sealed
    me = os.getpid()
    store.append_launch(
        run.run_dir,
        {
            "executor": "local",
            "submitted_at": time.time(),
            "host": socket.gethostname(),
            "jobs": {},
            "workers": {"0": str(me)},
            "worker_shards": [0, 1, 2, 3],
            "pid_start": {str(me): processes.start_ticks(me)},
            "max_attempts": 3,
        },
    )
    state = WorkerState(
        worker_id="w-live",
        job_id=str(me),
        host=socket.gethostname(),
        pid=me,
        pid_start=processes.start_ticks(me),
        started_at=time.time() - 100,
        gpus=0,
        state=records.COLLECTING,
        current_shard=1,
        servers_up_since=time.time() - 50,
        server_starts=1,
        sealed=[0],
    )
    store.worker_dir(run.run_dir, "w-live").mkdir(parents=True)
    records.write_worker_state(run.run_dir, state)
    live = claims.ClaimBook(run.run_dir, claims.Holder("w-live", str(me)), 10).try_claim(1)
    dead = claims.ClaimBook(run.run_dir, claims.Holder("w-dead", "4242"), 10).try_claim(2)
    assert live is not None and dead is not None
    past = time.time() - 60
    os.utime(claims.handle_path(run.run_dir, 2, dead.token), (past, past))
    store.atomic_write_json(
        store.shard_failure_path(run.run_dir, 3),
        {"job_id": "4242", "error": "ShardFailed: boom", "attempt": 3, "at": time.time(), "host": "x"},
    )

    st = status.collect(run.run_dir)
    by = {s.index: s for s in st.shards}
    assert by[0].state == status.SEALED
    assert by[1].state == status.RUNNING and by[1].reason.startswith("worker w-live") and by[1].job_id == str(me)
    assert by[2].state == status.PENDING and "stale claim of worker w-dead" in by[2].reason
    assert by[3].state == status.FAILED and by[3].gave_up and by[3].reason == "ShardFailed: boom"
    assert [w.worker_id for w in st.workers] == ["w-live"]
    assert st.workers[0].state == worker.COLLECTING and st.workers[0].current_shards == [1] and st.workers[0].live
    assert [c.shard for c in st.stale_claims] == [2] and st.stale_claims[0].worker_id == "w-dead"
    text = status.render(st)
    assert "w-live" in text and "stale claim: shard 2 by worker w-dead" in text
    assert "worker GPU-hours" in text and st.worker_cost["workers"] == 1
    assert json.loads(status.render_json(st))["workers"][0]["sealed"] == 1

    # the worker's process is gone: its record says so, and its shards wait for a resume
    state.job_id, state.pid_start = "99999999", -1
    records.write_worker_state(run.run_dir, state)
    launched = json.loads(store.launches_path(run.run_dir).read_text())  # and the job the launch started with it
    store.launches_path(run.run_dir).unlink()
    store.append_launch(run.run_dir, {**launched, "pid_start": {str(me): -1}})
    st = status.collect(run.run_dir)
    assert st.workers[0].state == "gone" and not st.workers[0].live
    assert {s.index: s.state for s in st.shards}[2] == status.FAILED


def test_shards_of_workers_still_starting_are_pending_not_failed(tmp_path: Path) -> None:
    """Before a warm worker writes its first record, its live job means a worker starting: the first progress line
    of a submit says pending, not failed; once the job is gone without a record, they are failed."""
    from shardrun.launch import progress

    run = builders.make_run(tmp_path, builders.input_rows(8), num_shards=4)
    me = os.getpid()
    launch = {
        "executor": "local",
        "submitted_at": time.time(),
        "host": socket.gethostname(),
        "jobs": {},
        "workers": {"0": str(me)},
        "worker_shards": [0, 1, 2, 3],
        "pid_start": {str(me): processes.start_ticks(me)},
        "max_attempts": 3,
    }
    store.append_launch(run.run_dir, launch)
    st = status.collect(run.run_dir)
    assert {s.state for s in st.shards} == {status.PENDING}
    assert all(s.reason == "waiting for a warm worker" for s in st.shards)
    assert "failed 0 pending 4" in progress.line(st)

    store.launches_path(run.run_dir).unlink()
    store.append_launch(run.run_dir, {**launch, "pid_start": {str(me): -1}})  # that job is no longer there
    st = status.collect(run.run_dir)
    assert {s.state for s in st.shards} == {status.FAILED}


def test_progress_line_and_ticker_print_only_changes(tmp_path: Path) -> None:
    from shardrun.launch import progress

    run = builders.make_run(tmp_path, builders.input_rows(4), num_shards=2)
    builders.write_shard(run, 0)
    printed: list[str] = []
    ticker = progress.Ticker(run.run_dir, run.plan, printed.append, tty=False, every_s=0.0)
    st = ticker.tick()
    ticker.tick()
    assert len(printed) == 1
    text = progress.line(st)
    assert printed[0].endswith(text)
    assert f"rollouts {st.done}/{st.planned}" in text and "shards sealed 1 running 0 failed 0 pending 1" in text
    assert "workers" not in text
    builders.write_shard(run, 1)
    ticker.tick()
    assert len(printed) == 2 and "sealed 2" in printed[1] and "ETA done" in printed[1]


def test_progress_view_renders_workers_with_rich(tmp_path: Path) -> None:
    from rich.console import Console

    from shardrun.launch import progress

    run = builders.make_run(tmp_path, builders.input_rows(4), num_shards=2)
    st = status.collect(run.run_dir)
    st.workers.append(
        worker_view.WorkerRow(
            worker_id="w7",
            job_id="77_1",
            host="node3",
            state="collecting",
            current_shard=1,
            current_shards=[1],
            sealed=4,
            servers_up_since=None,
            server_starts=1,
            exit_reason=None,
        )
    )
    console = Console(record=True, width=120, force_terminal=True)
    console.print(progress.view(st))
    shown = console.export_text()
    assert "rollouts" in shown and f"0/{st.planned}" in shown and "w7" in shown and "77_1" in shown
    assert "workers 1 live (1 collecting)" in progress.line(st)


def test_worker_cost_splits_start_up_collecting_and_idle() -> None:
    from shardrun.rundir import cost

    state = {
        "worker_id": "w0",
        "job_id": "9_0",
        "gpus": 8,
        "started_at": 1000.0,
        "ended_at": 4600.0,
        "startup_s": 600.0,
        "collecting_s": {"0": 1800.0, "1": 600.0},
        "sealed": [0, 1],
        "server_starts": 1,
    }
    w = cost.worker_cost(WorkerState.model_validate(state | {"host": "n", "pid": 7, "pid_start": None}), now=99999.0)
    assert (w.gpu_hours, w.startup_gpu_hours, w.collecting_gpu_hours) == pytest.approx((8.0, 4 / 3, 16 / 3))
    assert w.idle_gpu_hours == pytest.approx(4 / 3)
    running = cost.worker_cost(
        WorkerState.model_validate(state | {"ended_at": None, "host": "n", "pid": 7, "pid_start": None}), now=2800.0
    )  # still running: counted up to now
    assert running.wall_s == 1800.0 and running.idle_gpu_hours == 0.0
    row = cost.workers_row([w, w])
    assert row["workers"] == 2 and row["server_starts"] == 2 and row["utilization"] == pytest.approx(2400 / 3600)
    text = dict(cost.workers_rows(row))
    assert text["worker GPU-hours"] == "16.00: start-up 2.67, collecting 10.67, idle 2.67"
    assert cost.workers_row([]) == {} and cost.workers_rows({}) == []


def test_the_job_after_the_workers_resubmits_only_what_may_still_run(tmp_path: Path) -> None:
    run = builders.make_run(tmp_path, builders.input_rows(8), num_shards=4)
    builders.write_shard(run, 0)
    for i, attempt in ((2, 1), (3, 3)):
        store.atomic_write_json(
            store.shard_failure_path(run.run_dir, i),
            {"job_id": "5_0", "error": "ShardFailed: boom", "attempt": attempt, "at": time.time(), "host": "x"},
        )
    todo, gave_up = after_workers.unfinished(run.run_dir, run.plan, max_attempts=3)
    assert (todo, gave_up) == ([1, 2], [3])
    assert warm_workers.after_command(run.run_dir, 2)[-3:] == [str(run.run_dir), "--round", "2"]


def test_resume_says_it_launched_workers(tmp_path: Path) -> None:
    from shardrun.launch import resume

    run = builders.make_run(tmp_path, builders.input_rows(4), num_shards=2)
    result = submission.SubmitResult(run.run_dir, run.plan, False, {}, [0], [], None, workers={0: "41", 1: "42"})
    text = resume.render(result)
    assert "launched 2 warm worker(s) (41, 42)" in text and "sealed: 1 of 2" in text


def test_a_worker_reaps_the_servers_a_dead_worker_on_its_host_left(tmp_path: Path) -> None:
    """A SIGKILLed worker's servers outlive it (only their leaders get SIGTERM from the kernel): its worker.json names
    their processes (pid and start time: the leaders and what they started), and a worker on the same host kills what
    is left of them; a live worker's are left alone. A group whose leader is gone is not signalled as a group."""
    run = builders.make_run(tmp_path, builders.input_rows(4), num_shards=2)
    cfg = run.cfg.model_copy(
        update={
            "gym": config.GymConfig(config_paths=["x.yaml"]),
            "policy": config.PolicyConfig(base_url="http://127.0.0.1:1/v1", model_name="m"),
        }
    )
    store.write_launch_settings(run.run_dir, cfg)
    pidfile = tmp_path / "member"
    leader = processes.start(
        ["sh", "-c", f"sleep 300 & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait"], tmp_path / "s.log"
    )
    live = processes.start(["sleep", "300"], tmp_path / "live.log")
    try:
        processes.wait_until(pidfile.exists, watch=[leader], timeout=20, what="the server's child")
        member = int(pidfile.read_text())
        dead_pid = processes.start(["true"], tmp_path / "t.log").popen
        dead_pid.wait(5)  # a pid that no longer runs

        def record(worker_id: str, pid: int, ticks: int | None, groups: list, procs: list | None = None) -> None:
            state = WorkerState(
                worker_id=worker_id,
                job_id=None,
                host=socket.gethostname(),
                pid=pid,
                pid_start=ticks,
                started_at=time.time(),
                gpus=0,
            )
            state.server_groups = groups
            state.server_processes = procs or []
            store.worker_dir(run.run_dir, worker_id).mkdir(parents=True)
            records.write_worker_state(run.run_dir, state)

        seen = worker.merge_recorded([], processes.descendants([leader.group]))
        assert sorted(p[0] for p in seen) == sorted([leader.pid, member])
        record("w-dead", dead_pid.pid, 12345, [list(leader.group)], seen)
        record("w-live", live.pid, live.group[1], [list(live.group)])  # a live worker (its pid runs)
        os.kill(leader.pid, signal.SIGKILL)
        leader.popen.wait(5)
        assert processes.start_ticks(member) is not None

        me = worker.Worker(run.run_dir, "w-me")
        me.reap_leftovers(records.read_worker_states(run.run_dir))
        assert processes.start_ticks(member) is None and live.alive()
        log = store.worker_log_path(run.run_dir, "w-me").read_text()
        assert "killed 1 process(es) that worker w-dead" in log and "w-live" not in log
    finally:
        processes.stop(live, grace=2)
        processes.stop(leader, grace=2)


def test_slot_occupancy_counts_overlapping_shards_once_per_worker_and_for_the_run() -> None:
    """Two shards held at once (collector.pipeline_shards): the collecting time is the time with a shard held
    (holding_s), not the sum of the shards' times; occupancy = gate request-seconds / (slots x that time)."""
    from shardrun.rundir import cost

    base = {"job_id": None, "gpus": 1, "started_at": 0.0, "ended_at": 1000.0, "host": "n", "pid": 7, "pid_start": None}
    a = WorkerState.model_validate(
        base
        | {"worker_id": "a", "collecting_s": {"0": 600.0, "1": 600.0}, "holding_s": 800.0, "slots": 8}
        | {"request_s": 8 * 800.0 * 0.9}
    )
    b = WorkerState.model_validate(base | {"worker_id": "b", "holding_s": 500.0, "slots": 4, "request_s": 1000.0})
    old = WorkerState.model_validate(base | {"worker_id": "c", "collecting_s": {"2": 300.0}})  # before the gate
    wa, wb, wc = (cost.worker_cost(s, now=0.0) for s in (a, b, old))
    assert wa.collecting_s == 800.0 and wa.occupancy == pytest.approx(0.9)
    assert wb.occupancy == pytest.approx(0.5) and wc.collecting_s == 300.0 and wc.occupancy is None
    row = cost.workers_row([wa, wb, wc])
    assert row["occupancy"] == pytest.approx((5760.0 + 1000.0) / (8 * 800 + 4 * 500))
    assert row["worker_occupancy"] == {"a": pytest.approx(0.9), "b": pytest.approx(0.5), "c": None}
    text = dict(cost.workers_rows(row))
    assert text["slot occupancy"] == "0.80 of the policy's slots busy while collecting (a 0.90, b 0.50)"
    assert "slot occupancy" not in dict(cost.workers_rows(cost.workers_row([wc])))


def test_a_small_measured_occupancy_is_never_shown_as_zero_and_says_who_set_the_pace() -> None:
    """A pre-hosted policy that answers at once (or the stand-in) keeps its slots busy a tiny share of the time:
    status and the report show that share, not 0.00, and say the environments, not the policy, set the pace."""
    from shardrun.rundir import cost

    base = {"job_id": None, "gpus": 0, "started_at": 0.0, "ended_at": 1000.0, "host": "n", "pid": 7, "pid_start": None}
    fast = WorkerState.model_validate(base | {"worker_id": "a", "holding_s": 600.0, "slots": 64, "request_s": 120.0})
    text = dict(cost.workers_rows(cost.workers_row([cost.worker_cost(fast, now=0.0)])))["slot occupancy"]
    assert text.startswith("0.0031 of the policy's slots busy") and "the environments set the pace" in text
    assert cost.share(0.8) == "0.80" and cost.share(0.00001) == "<0.0001" and cost.share(0.0) == "0.00"


def test_a_further_shard_is_claimed_only_when_the_held_ones_leave_the_budget_unfilled() -> None:
    """The pipeline (collector.pipeline_shards): the first shard always; a further one only below the depth, once the
    held shards have left the collector service's budget unfilled for SETTLE_S, when a look is due."""
    s = worker.SETTLE_S
    assert worker.room_for_another(held=0, depth=1, waited_s=0.0, look_due=False)
    assert not worker.room_for_another(held=1, depth=1, waited_s=60.0, look_due=True)
    assert worker.room_for_another(held=1, depth=4, waited_s=s, look_due=True)
    assert not worker.room_for_another(held=1, depth=4, waited_s=s / 2, look_due=True)  # the budget is full: no
    assert not worker.room_for_another(held=2, depth=4, waited_s=60.0, look_due=False)  # just looked: wait
    assert not worker.room_for_another(held=4, depth=4, waited_s=60.0, look_due=True)
