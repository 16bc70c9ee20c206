"""Hostile run-directory records (docs/reliability.md, "Hostile input"): what shardrun reads back from a run
directory is checked like any other input.

- A FIFO, a socket or a directory where shardrun reads a file of its own (seal, rollouts, ledger, plan, ...) is
  refused at once naming the path: `status` and `merge-and-profile` never wait on it.
- A record of the wrong shape (launch record, claim, worker state, a shard's `.failed`, plan.json) is refused with
  exit 2 naming the file, the line (JSONL) and the field, never a traceback.
- A seal whose counts disagree with its rollouts file is never trusted: `status` shows the shard damaged with the
  reason, `merge-and-profile` and `resume` take it as unsealed. One that only the merge can refute (it reads every
  row) it sets aside as `.done.damaged`, so that `status` and `resume` see it damaged too.
- `cancel` never signals a process shardrun cannot confirm it started: a launch record whose start time is unknown
  or another process's; it says which record it could not confirm, and that process lives on.

Every case runs the command under a time bound (invoke_bounded), and nothing in the run directory changes but a seal
the merge sets aside.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hostilekit import invoke_bounded, refused
from reportkit import input_row, planned_run, seal_shards

from shardrun.launch import submission
from shardrun.rundir import records, store
from shardrun.shard import processes


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


@pytest.fixture()
def sealed(tmp_path):
    """A planned run, 3 shards of 4 rollouts, every shard sealed; identity (1, 0) failed (shard 0's sidecar)."""
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    seal_shards(run_dir, reward, failed={(1, 0)})
    return run_dir


@pytest.fixture()
def unsealed(tmp_path):
    """A planned run whose shards never ran."""
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    return run_dir


def fifo_at(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def socket_at(path: Path, monkeypatch) -> socket.socket:
    """A listening Unix socket in place of `path` (bound by its name from its folder: socket paths are short)."""
    path.unlink(missing_ok=True)
    monkeypatch.chdir(path.parent)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path.name)
    sock.listen(1)
    return sock


# ---------------------------------------------------------------- only regular files are read


FIFO_CASES = [
    # (what is replaced, the command that reads it)
    ("seal", "status"),
    ("seal", "merge-and-profile"),
    ("rollouts", "status"),
    ("rollouts", "merge-and-profile"),
    ("launches", "status"),
    ("launches", "cancel"),
    ("plan.json", "status"),
    ("plan.json", "merge-and-profile"),
    ("materialized", "merge-and-profile"),
    ("failures", "merge-and-profile"),
]


def target(run_dir: Path, what: str) -> Path:
    return {
        "seal": store.done_path(run_dir, 0),
        "rollouts": store.rollouts_path(run_dir, 2),
        "launches": store.launches_path(run_dir),
        "plan.json": store.plan_path(run_dir),
        "materialized": store.materialized_path(run_dir, 1),
        "failures": store.failures_path(run_dir, 0),
        "launch settings": store.launch_settings_path(run_dir),
    }[what]


@pytest.mark.parametrize("what, command", FIFO_CASES)
def test_a_fifo_in_place_of_a_run_file_is_refused_at_once(sealed, tmp_path, unchanged, what, command):
    path = fifo_at(target(sealed, what))
    with unchanged(tmp_path, store.merged_dir(sealed), sealed / store.LOCK_FILE):
        refused(invoke_bounded(command, sealed), str(path), "FIFO")


def test_a_fifo_in_place_of_the_launch_settings_is_not_waited_on(sealed, tmp_path, unchanged):
    """The merge reads the launch settings only for gym.max_rollout_attempts and takes the default when they cannot
    be read: a correct answer, at once."""
    fifo_at(target(sealed, "launch settings"))
    with unchanged(tmp_path, store.merged_dir(sealed)):
        done = invoke_bounded("merge-and-profile", sealed)
    assert done.exit_code == 0 and "Traceback" not in done.output, done.output


@pytest.mark.parametrize("what", ["seal", "rollouts", "plan.json"])
def test_a_socket_in_place_of_a_run_file_is_refused_at_once(sealed, tmp_path, unchanged, monkeypatch, what):
    sock = socket_at(target(sealed, what), monkeypatch)
    try:
        with unchanged(tmp_path, store.merged_dir(sealed)):
            refused(invoke_bounded("status", sealed), str(target(sealed, what)), "socket")
    finally:
        sock.close()


def test_a_fifo_in_place_of_a_failed_shards_error_record_is_refused(unsealed, tmp_path, unchanged):
    dead = subprocess.Popen(["true"])
    dead.wait()
    records.append_launch(unsealed, local_record({"1": dead.pid}, {dead.pid: 1}))
    path = fifo_at(store.shard_failure_path(unsealed, 1))
    with unchanged(tmp_path):
        refused(invoke_bounded("status", unsealed), str(path), "FIFO")


def test_a_fifo_in_place_of_a_claim_is_refused(unsealed, tmp_path, unchanged):
    records.append_launch(unsealed, worker_record())
    path = fifo_at(store.claim_path(unsealed, 2))
    with unchanged(tmp_path):
        refused(invoke_bounded("status", unsealed), str(path), "FIFO")


def test_a_directory_in_place_of_the_plan_is_refused(sealed, tmp_path, unchanged):
    path = store.plan_path(sealed)
    path.unlink()
    path.mkdir()
    with unchanged(tmp_path):
        refused(invoke_bounded("status", sealed), str(path), "directory")


# ---------------------------------------------------------------- records of the wrong shape


def local_record(jobs: dict[str, int], pid_start: dict[int, int | None], **extra) -> dict:
    return {
        "executor": "local",
        "submitted_at": 1_700_000_000.0,
        "host": socket.gethostname(),
        "jobs": {k: str(v) for k, v in jobs.items()},
        "pid_start": {str(p): t for p, t in pid_start.items()},
        "max_attempts": 3,
        **extra,
    }


def worker_record() -> dict:
    """Warm workers on this host for every shard; worker 0's pid names no process."""
    return local_record({}, {}, workers={"0": "999999999"}, worker_shards=[0, 1, 2])


GOOD_LOCAL = json.dumps(local_record({"0": 999999999}, {999999999: 5}))


@pytest.mark.parametrize(
    "line, named",
    [
        (json.dumps(local_record({"0": 1}, {}) | {"pid_start": {"999999999": "yesterday"}}), "pid_start"),
        (json.dumps(local_record({"0": 1}, {}) | {"pid_start": {"../x": 5}}), "pid_start"),
        (json.dumps(local_record({"0": 1}, {}) | {"workers": ["1", "2"]}), "workers"),
        (json.dumps(local_record({"0": 1}, {}) | {"worker_shards": ["a"]}), "worker_shards"),
        (json.dumps(local_record({"0": 1}, {}) | {"executor": 5}), "executor"),
        (json.dumps(local_record({"0": 1}, {}) | {"jobs": {"0": True}}), "jobs"),
        (json.dumps(local_record({"0": 1}, {}) | {"max_attempts": "3"}), "max_attempts"),
        (json.dumps(local_record({"0": 1}, {}) | {"done_at_submit": -1}), "done_at_submit"),
    ],
)
@pytest.mark.parametrize("command", ["status", "cancel"])
def test_a_launch_record_of_the_wrong_type_is_refused_naming_line_and_field(
    sealed, tmp_path, unchanged, line, named, command
):
    store.launches_path(sealed).write_text(GOOD_LOCAL + "\n" + line + "\n")
    with unchanged(tmp_path, sealed / store.LOCK_FILE):
        refused(invoke_bounded(command, sealed), f"{store.launches_path(sealed)}:2", named)


@pytest.mark.parametrize(
    "claim, named",
    [
        ({"worker_id": "w", "host": "h", "pid": "7", "claimed_at": 1.0, "token": "ab"}, "pid"),
        ({"worker_id": "w", "host": "h", "pid": 7, "claimed_at": 1.0, "token": "../../plan.json"}, "token"),
        ({"worker_id": "w", "host": "h", "pid": 7, "claimed_at": 1.0}, "token"),
        ({"worker_id": ["w"], "host": "h", "pid": 7, "claimed_at": 1.0, "token": "ab"}, "worker_id"),
        ({"worker_id": "w", "host": "h", "pid": 7, "claimed_at": "now", "token": "ab"}, "claimed_at"),
        ("not json", "not a claim"),
    ],
)
def test_a_claim_of_the_wrong_shape_is_refused_naming_its_field(unsealed, tmp_path, unchanged, claim, named):
    records.append_launch(unsealed, worker_record())
    path = store.claim_path(unsealed, 1)
    path.write_bytes(claim.encode() if isinstance(claim, str) else orjson.dumps(claim))
    with unchanged(tmp_path):
        refused(invoke_bounded("status", unsealed), str(path), named)


WORKER = {
    "worker_id": "w0",
    "job_id": None,
    "host": "elsewhere",
    "pid": 4242,
    "pid_start": 1,
    "started_at": 1_700_000_000.0,
    "gpus": 0,
}


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"pid": "4242"}, "pid"),
        ({"sealed": "0,1"}, "sealed"),
        ({"collecting_s": {"0": "long"}}, "collecting_s"),
        ({"gpus": -1}, "gpus"),
        ({"server_starts": 1.5}, "server_starts"),
    ],
)
def test_a_worker_state_of_the_wrong_type_is_refused_naming_its_field(unsealed, tmp_path, unchanged, edit, named):
    records.append_launch(unsealed, worker_record())
    path = store.worker_state_path(unsealed, "w0")
    path.parent.mkdir(parents=True)
    path.write_bytes(orjson.dumps(WORKER | edit))
    with unchanged(tmp_path):
        refused(invoke_bounded("status", unsealed), str(path), named)


@pytest.mark.parametrize(
    "failure, named",
    [
        ({"job_id": "1", "error": "x", "attempt": "3"}, "attempt"),
        ({"job_id": "1", "error": {"text": "x"}, "attempt": 1}, "error"),
        ([1, 2], "not an object"),
    ],
)
def test_a_shard_failure_record_of_the_wrong_type_is_refused(unsealed, tmp_path, unchanged, failure, named):
    dead = subprocess.Popen(["true"])
    dead.wait()
    records.append_launch(unsealed, local_record({"1": dead.pid}, {dead.pid: 1}))
    path = store.shard_failure_path(unsealed, 1)
    path.write_bytes(orjson.dumps(failure))
    with unchanged(tmp_path):
        refused(invoke_bounded("status", unsealed), str(path), named)


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda p: p["shards"][0].update(num_rollouts="4"), "shards.0.num_rollouts"),
        (lambda p: p["shards"].reverse(), "shards"),
        (lambda p: p.update(input=[]), "input"),
        (lambda p: p["shards"][1].update(kind="spiral"), "shards.1.kind"),
        (lambda p: p["shards"][1].update(step=0), "shards.1.step"),
    ],
)
@pytest.mark.parametrize("command", ["status", "merge-and-profile"])
def test_a_plan_of_the_wrong_shape_is_refused_naming_its_field(sealed, tmp_path, unchanged, edit, named, command):
    path = store.plan_path(sealed)
    plan = orjson.loads(path.read_bytes())
    edit(plan)
    path.write_bytes(orjson.dumps(plan))
    with unchanged(tmp_path, store.merged_dir(sealed)):
        refused(invoke_bounded(command, sealed), str(path), named)


# ---------------------------------------------------------------- a seal checked against its file


def reseal(run_dir: Path, index: int, **changes) -> None:
    """Edit a shard's seal as a hand or a bug would: fields changed, bytes and hash made to match the file."""
    path = store.done_path(run_dir, index)
    marker = orjson.loads(path.read_bytes())
    data = store.rollouts_path(run_dir, index).read_bytes()
    marker.update(rollouts_bytes=len(data), rollouts_sha256=hashlib.sha256(data).hexdigest(), **changes)
    path.write_bytes(orjson.dumps(marker))


def drop_last_row(run_dir: Path, index: int) -> None:
    path = store.rollouts_path(run_dir, index)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]))


def damaged_everywhere(run_dir: Path, index: int, why: str, tmp_path: Path, unchanged, lost: bool = True) -> None:
    """status: the shard is damaged with the reason and the run is not complete; merge: unsealed (exit 5); resume:
    the shard is among those to run."""
    with unchanged(tmp_path, store.merged_dir(run_dir)):
        st = invoke_bounded("status", run_dir, "--json")
        assert st.exit_code == 0 and "Traceback" not in st.output, st.output
        data = json.loads(st.output)
        shard = data["shards"][index]
        assert not data["complete"] and data["counts"]["damaged"] == 1, data["counts"]
        assert shard["state"] == "damaged" and "damaged seal" in shard["reason"] and why in shard["reason"], shard
        text = invoke_bounded("status", run_dir)
        assert "damaged 1" in text.output and f"{index}  damaged" in text.output, text.output
        assert not lost or "100.0%" not in text.output, text.output  # rows lost: the progress does not count them
        merged = invoke_bounded("merge-and-profile", run_dir)
    assert merged.exit_code == 5 and isinstance(merged.exception, SystemExit), merged.output
    assert "damaged seal" in merged.output and f"shard {index:05d}" in merged.output, merged.output
    todo, done, _ = submission.unsealed(run_dir, store.load_plan(run_dir))
    assert index in todo and index not in done


def test_a_seal_counting_a_row_its_file_lost_is_damaged(sealed, tmp_path, unchanged):
    """The named case: a row gone from rollouts.jsonl, the seal's bytes and hash made to match (status said 100%,
    the merge exited 0 with a task missing)."""
    drop_last_row(sealed, 1)
    reseal(sealed, 1)
    damaged_everywhere(sealed, 1, "rollouts.jsonl has 3 rows", tmp_path, unchanged)


def test_a_seal_counting_a_failed_rollout_as_done_is_damaged(sealed, tmp_path, unchanged):
    marker = orjson.loads(store.done_path(sealed, 0).read_bytes())
    assert marker["num_failed"] == 1
    reseal(sealed, 0, num_rollouts=marker["num_rollouts"] + 1, num_failed=0)
    damaged_everywhere(sealed, 0, "it counts 4 rollouts", tmp_path, unchanged, lost=False)


def test_a_seal_claiming_duplicate_lines_its_file_lacks_is_damaged(sealed, tmp_path, unchanged):
    reseal(sealed, 2, num_duplicate_lines=2)
    damaged_everywhere(sealed, 2, "2 duplicate lines", tmp_path, unchanged, lost=False)


def test_a_seal_whose_rollouts_file_was_emptied_is_damaged(sealed, tmp_path, unchanged):
    store.rollouts_path(sealed, 1).write_bytes(b"")
    reseal(sealed, 1)
    damaged_everywhere(sealed, 1, "has 0 rows", tmp_path, unchanged)


def set_aside_by_the_merge(run_dir: Path, index: int, why: str, tmp_path: Path, unchanged) -> None:
    """What status cannot tell without reading every row, the merge finds (exit 5) and sets the seal aside, and from
    then on status shows the shard damaged and resume runs it: never "merge says resume, resume says sealed"."""
    seal_bytes = store.done_path(run_dir, index).read_bytes()
    before = json.loads(invoke_bounded("status", run_dir, "--json").output)
    assert before["shards"][index]["state"] == "sealed"  # the quick check cannot see it
    with unchanged(
        tmp_path, store.merged_dir(run_dir), store.done_path(run_dir, index), store.damaged_seal_path(run_dir, index)
    ):
        merged = invoke_bounded("merge-and-profile", run_dir)
    assert merged.exit_code == 5 and "damaged seal" in merged.output and why in merged.output, merged.output
    assert "set aside as .done.damaged" in merged.output, merged.output
    assert not store.done_path(run_dir, index).exists()
    aside = records.read_set_aside_seal(run_dir, index)  # the seal as it was, and why
    assert aside is not None and aside.seal == orjson.loads(seal_bytes) and why in aside.reason
    st = json.loads(invoke_bounded("status", run_dir, "--json").output)
    shard = st["shards"][index]
    assert shard["state"] == "damaged" and "set aside" in shard["reason"] and why in shard["reason"], shard
    assert not st["complete"]
    todo, done, _ = submission.unsealed(run_dir, store.load_plan(run_dir))
    assert index in todo and index not in done
    again = invoke_bounded("merge-and-profile", run_dir)  # the merge says the same, from the set-aside seal
    assert again.exit_code == 5 and f"shard {index:05d}" in again.output and "set aside" in again.output
    assert why in again.output


def test_a_seal_counting_fewer_rollouts_than_its_file_holds_is_set_aside_by_the_merge(sealed, tmp_path, unchanged):
    marker = orjson.loads(store.done_path(sealed, 1).read_bytes())
    reseal(sealed, 1, num_rollouts=marker["num_rollouts"] - 1, num_failed=marker["num_failed"] + 1)
    set_aside_by_the_merge(sealed, 1, "4 planned identities", tmp_path, unchanged)


def test_a_seal_whose_rows_changed_but_not_their_size_is_set_aside_by_the_merge(sealed, tmp_path, unchanged):
    path = store.rollouts_path(sealed, 2)
    data = path.read_bytes()
    first, second, *rest = data.splitlines(keepends=True)
    path.write_bytes(b"".join([second, first, *rest]))  # the same rows and bytes, in another order
    assert path.read_bytes() != data and len(path.read_bytes()) == len(data)
    set_aside_by_the_merge(sealed, 2, "sha256 differs", tmp_path, unchanged)


def test_a_true_seal_is_still_trusted(sealed, tmp_path, unchanged):
    with unchanged(tmp_path, store.merged_dir(sealed)):
        st = invoke_bounded("status", sealed)
    assert st.exit_code == 0 and "sealed 3" in st.output and "100.0%" in st.output, st.output


# ---------------------------------------------------------------- cancel signals only what shardrun started


@pytest.fixture()
def foreign():
    """A process shardrun did not start (someone else's, whose pid a launch record names)."""
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(1000)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    ticks = processes.start_ticks(proc.pid)
    assert ticks is not None
    yield proc, ticks
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def cancel_leaves_it_alive(run_dir: Path, proc: subprocess.Popen, tmp_path: Path, unchanged, says: list[str]) -> None:
    with unchanged(tmp_path, run_dir / store.LOCK_FILE):
        st = invoke_bounded("status", run_dir, "--json")
        assert st.exit_code == 0, st.output
        assert json.loads(st.output)["counts"]["running"] == 0
        out = invoke_bounded("cancel", run_dir)
    assert out.exit_code == 0 and "Traceback" not in out.output, out.output
    for needle in says:
        assert needle in out.output, out.output
    assert "interrupted local job" not in out.output
    assert proc.poll() is None, "cancel signalled a process shardrun did not start"


def test_cancel_does_not_signal_a_pid_whose_start_time_is_unknown(unsealed, tmp_path, unchanged, foreign):
    """The named case: the record names a live pid with no start time."""
    proc, _ = foreign
    records.append_launch(unsealed, local_record({"0": proc.pid}, {proc.pid: None}))
    says = [f"{store.LAUNCHES_FILE}:1", str(proc.pid), "not signalled", "no start time"]
    cancel_leaves_it_alive(unsealed, proc, tmp_path, unchanged, says)


def test_cancel_does_not_signal_a_pid_that_is_now_another_process(unsealed, tmp_path, unchanged, foreign):
    proc, ticks = foreign
    records.append_launch(unsealed, local_record({"0": 999999999}, {999999999: 5}))
    records.append_launch(unsealed, local_record({"1": proc.pid}, {proc.pid: ticks + 1}))
    says = [f"{store.LAUNCHES_FILE}:2", str(proc.pid), "not signalled", f"the live process's {ticks}"]
    cancel_leaves_it_alive(unsealed, proc, tmp_path, unchanged, says)


def test_cancel_does_not_signal_a_pid_with_no_start_time_recorded_at_all(unsealed, tmp_path, unchanged, foreign):
    proc, _ = foreign
    records.append_launch(unsealed, local_record({"0": proc.pid}, {}))
    cancel_leaves_it_alive(unsealed, proc, tmp_path, unchanged, ["no live jobs"])


def test_cancel_does_not_signal_a_warm_worker_pid_it_cannot_confirm(unsealed, tmp_path, unchanged, foreign):
    proc, _ = foreign
    records.append_launch(
        unsealed, local_record({}, {proc.pid: None}, workers={"0": str(proc.pid)}, worker_shards=[0, 1, 2])
    )
    cancel_leaves_it_alive(unsealed, proc, tmp_path, unchanged, [str(proc.pid), "not signalled"])


def test_cancel_does_not_signal_a_pid_recorded_on_another_host(unsealed, tmp_path, unchanged, foreign):
    proc, ticks = foreign
    records.append_launch(unsealed, local_record({"0": proc.pid}, {proc.pid: ticks}) | {"host": "elsewhere"})
    cancel_leaves_it_alive(unsealed, proc, tmp_path, unchanged, ["no live jobs"])


def test_cancel_interrupts_a_job_it_can_confirm(unsealed, foreign):
    """The correct answer when the record is right: the pid with its recorded start time is interrupted."""
    proc, ticks = foreign
    records.append_launch(unsealed, local_record({"0": proc.pid}, {proc.pid: ticks}))
    out = invoke_bounded("cancel", unsealed)
    assert out.exit_code == 0 and f"interrupted local job(s) {proc.pid}" in out.output, out.output
    assert proc.wait(30) != 0
