"""What `submit` says when shards did not seal (issue 34, item 2), without servers: the recorded cause with a log
that exists, and the exit code (3 for a server that did not start, 4 otherwise; docs/troubleshooting.md)."""

from __future__ import annotations

import time
from pathlib import Path

from reportkit import input_row, planned_run
from shardrun.launch import submission
from shardrun.rundir import store


def result_of(run_dir: Path, errors: dict[int, str]) -> submission.SubmitResult:
    plan = store.load_plan(run_dir)
    for i, error in errors.items():
        store.atomic_write_json(
            store.shard_failure_path(run_dir, i),
            {"job_id": "7", "error": error, "attempt": 1, "at": time.time(), "host": "h"},
        )
    outcomes = submission.shard_outcomes(run_dir, plan, [s.index for s in plan.shards])
    return submission.SubmitResult(run_dir, plan, True, {0: "7", 1: "8"}, [], [], outcomes)


def test_a_server_that_did_not_start_exits_3_with_its_cause_and_an_existing_log(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_shards=2)
    cause = "ServerFailure: Gym stack: not ready after 5 s\n--- last lines of gym.log ---\nTraceback ..."
    store.shard_log_path(run_dir, 0).parent.mkdir(parents=True, exist_ok=True)
    store.shard_log_path(run_dir, 0).write_text("start\n")
    result = result_of(run_dir, {0: cause})
    found = submission.failures(run_dir, result)
    assert [(f.what, f.cause, f.log) for f in found] == [("shard 00000", cause, store.shard_log_path(run_dir, 0))]
    assert submission.failure_exit_code(found) == 3
    text = submission.failure_text(run_dir, result, found)
    assert text.startswith("error: 2 shard(s) did not seal\nshard 00000 failed: ServerFailure: Gym stack")
    assert f"  log: {store.shard_log_path(run_dir, 0)}" in text and "last lines of gym.log" in text


def test_another_failure_exits_4_and_no_missing_log_is_named(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_shards=2)
    result = result_of(run_dir, {1: "ShardFailed: the collector exited 1"})
    found = submission.failures(run_dir, result)
    assert [(f.what, f.log) for f in found] == [("shard 00001", None)]  # it wrote no log: none named
    assert submission.failure_exit_code(found) == 4
    assert "log:" not in submission.failure_text(run_dir, result, found)
    store.shard_failure_path(run_dir, 1).unlink()
    nothing = result_of(run_dir, {})
    nothing_text = submission.failure_text(run_dir, nothing, submission.failures(run_dir, nothing))
    assert "no cause was recorded" in nothing_text and "shards/*/logs" not in nothing_text
