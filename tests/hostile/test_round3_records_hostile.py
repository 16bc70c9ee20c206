"""Hostile round 3, the run directory's records (issue 34): a launch record keying a job by a unicode digit ("²",
which str.isdigit() takes for one), a live worker's servers up since the year 10000, and a seal counting 1e308
output tokens. Each is refused naming the file and the field, or read without a crash: never a traceback."""

from __future__ import annotations

import json
import os
import socket
import time

import orjson
import pytest
from hostilekit import invoke_bounded, refused
from reportkit import input_row, planned_run, seal_shards

from shardrun.rundir import records, store
from shardrun.shard import processes


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


@pytest.fixture()
def sealed(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    seal_shards(run_dir, reward)
    return run_dir


def launch(jobs: dict[str, str], **extra) -> dict:
    return {
        "executor": "local",
        "submitted_at": 1_700_000_000.0,
        "host": socket.gethostname(),
        "jobs": jobs,
        "pid_start": {},
        "max_attempts": 3,
        **extra,
    }


@pytest.mark.parametrize("key", ["²", "١", "0²"])
@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_job_keyed_by_a_unicode_digit_is_refused(sealed, tmp_path, unchanged, key, command):
    store.launches_path(sealed).write_text(json.dumps(launch({key: "1"})) + "\n")
    with unchanged(tmp_path, sealed / store.LOCK_FILE):
        refused(invoke_bounded(command, sealed), f"{store.launches_path(sealed)}:1", "jobs")


def live_worker(**edit) -> dict:
    return {
        "worker_id": "w0",
        "job_id": None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": processes.start_ticks(os.getpid()),
        "started_at": time.time(),
        "gpus": 0,
        "state": "collecting",
        "updated_at": time.time(),
    } | edit


@pytest.mark.parametrize(
    "field, value", [("servers_up_since", 253402300800.0 * 1.0001), ("started_at", 1e18), ("updated_at", -5.0)]
)
def test_a_worker_time_out_of_range_is_refused_naming_its_field(sealed, tmp_path, unchanged, field, value):
    records.append_launch(sealed, launch({}, workers={"0": str(os.getpid())}, worker_shards=[0, 1, 2]))
    path = store.worker_state_path(sealed, "w0")
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps(live_worker(**{field: value})))
    with unchanged(tmp_path, sealed / store.LOCK_FILE):
        refused(invoke_bounded("status", sealed), str(path), field)


def test_a_worker_time_in_range_is_shown(sealed):
    records.append_launch(sealed, launch({}, workers={"0": str(os.getpid())}, worker_shards=[0, 1, 2]))
    path = store.worker_state_path(sealed, "w0")
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps(live_worker(servers_up_since=time.time())))
    out = invoke_bounded("status", sealed)
    assert out.exit_code == 0 and "Traceback" not in out.output, out.output


@pytest.mark.parametrize("count", [1e308, 2.0**60, -5])
def test_a_seal_counting_absurd_tokens_is_read_without_a_crash(sealed, count):
    for index in range(3):
        path = store.done_path(sealed, index)
        seal = orjson.loads(path.read_bytes())
        seal["extra"] = (seal.get("extra") or {}) | {"output_tokens": count, "total_tokens": count}
        path.write_bytes(orjson.dumps(seal))
    status = invoke_bounded("status", sealed, "--json")
    assert status.exit_code == 0 and "Traceback" not in status.output, status.output
    assert json.loads(status.output)["counts"].get("sealed", json.loads(status.output)["counts"].get("done")) == 3
    merged = invoke_bounded("merge-and-profile", sealed)
    assert merged.exit_code == 0 and "Traceback" not in merged.output, merged.output
    assert "OverflowError" not in merged.output
    shown = invoke_bounded("status", sealed)
    assert shown.exit_code == 0 and "Traceback" not in shown.output, shown.output
    report = invoke_bounded("report", sealed)
    assert "Traceback" not in report.output and not isinstance(report.exception, OverflowError), report.output
