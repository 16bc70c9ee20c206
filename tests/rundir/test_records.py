"""The run directory's record models (shardrun/rundir/records.py): each record round-trips through its one writer
and reader; a record of the wrong shape is BadRecord naming the file, the line and the field; a torn last line of
launches.jsonl is skipped; only regular files are read (store.open_regular)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import orjson
import pytest

from shardrun.core.errors import BadRecord, NotRegularFile, PlanMismatch
from shardrun.rundir import records, store


def seal(**fields) -> records.Seal:
    base = {"plan_fingerprint": "f", "shard_index": 0, "rollouts_sha256": "0", "rollouts_bytes": 0}
    return records.Seal.model_validate(base | {"num_rollouts": 3, "num_failed": 1} | fields)


def test_a_seal_round_trips_and_writes_only_what_it_holds(tmp_path: Path) -> None:
    s = seal(gpu_hours=1.5, worker={"id": "w0"})
    (tmp_path / "shards" / "00000").mkdir(parents=True)
    records.write_seal(tmp_path, s)
    data = orjson.loads(store.done_path(tmp_path, 0).read_bytes())
    assert records.Seal.model_validate(data) == s
    assert "num_skipped_decided" not in data and "num_duplicate_lines" not in data  # the older seals' layout
    assert data["host"] is None and data["job_id"] is None
    assert (s.rows, s.accounted, s.worker_id) == (3, 4, "w0")


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("num_rollouts", "3", "'num_rollouts'"),
        ("num_rollouts", True, "'num_rollouts'"),
        ("num_failed", -1, "'num_failed'"),
        ("gpu_hours", "lots", "'gpu_hours'"),
        ("skipped_decided_tasks", [1, "2"], "'skipped_decided_tasks.1'"),
        ("extra", [1], "'extra'"),
    ],
)
def test_a_seal_of_the_wrong_type_names_its_field(field, value, said) -> None:
    found, wrong = records.seal_problem(seal().to_json() | {field: value})
    assert found is None and wrong.startswith(said), wrong


def test_a_seal_without_a_field_it_needs_names_it() -> None:
    data = seal().to_json()
    del data["rollouts_bytes"]
    assert records.seal_problem(data) == (None, "no 'rollouts_bytes'")


def test_launch_records_round_trip_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    records.append_launch(tmp_path, {"mode": "local_jobs", "jobs": {"0": "12"}, "pid_start": {"12": None}})
    records.append_launch(tmp_path, records.SlurmArraysLaunch(jobs={"1": "7_1"}, tag="sr-a"))
    with open(store.launches_path(tmp_path), "ab") as f:
        f.write(b'{"mode": "slurm_arrays", "jobs": {"2":')  # a killed writer's half line
    got = records.read_launches(tmp_path)
    assert [type(r) for r in got] == [records.LocalJobsLaunch, records.SlurmArraysLaunch]
    assert got[0].shard_jobs == {0: "12"} and got[0].local_pids == {"12": None} and got[1].slurm_names == {"sr-a"}


EACH_MODE = [
    records.LocalJobsLaunch(
        submitted_at=1.5,
        host="h",
        max_attempts=3,
        gpus_per_shard=2,
        done_at_submit=0,
        jobs={"0": "12", "1": "12"},
        pid_start={"12": 345},
    ),
    records.SlurmArraysLaunch(
        submitted_at=1.5,
        host="h",
        jobs={"0": "7_0", "1": "7_1"},
        tag="sr-a",
        arrays=["7"],
        merge_job_name="sr-a-merge",
        merge_job_id="8",
    ),
    records.WarmWorkersLaunch(executor="local", workers={"0": "55"}, worker_shards=[0, 1], pid_start={"55": 9}),
    records.WarmWorkersLaunch(
        executor="slurm",
        workers={"0": "9_0", "1": "9_1"},
        worker_shards=[0, 1, 2],
        tag="sr-a",
        arrays=["9"],
        merge_job_name="sr-a-merge",
        merge_job_id="10",
    ),
]


@pytest.mark.parametrize("record", EACH_MODE, ids=lambda r: f"{r.mode}")
def test_each_modes_launch_record_round_trips(tmp_path: Path, record) -> None:
    records.append_launch(tmp_path, record)
    records.append_launch(tmp_path, record.to_json())  # as JSON too: checked against the model its mode names
    first, second = records.read_launches(tmp_path)
    assert first == second == record and type(first) is type(record)
    assert orjson.loads(store.launches_path(tmp_path).read_bytes().splitlines()[0])["mode"] == record.mode


@pytest.mark.parametrize(
    "old, model, check",
    [
        (  # local jobs, as submit wrote them before launch records had a mode
            {
                "executor": "local",
                "submitted_at": 1.0,
                "host": "h",
                "jobs": {"0": "12"},
                "max_attempts": 3,
                "gpus_per_shard": 0,
                "done_at_submit": 0,
                "pid_start": {"12": 345},
            },
            records.LocalJobsLaunch,
            lambda r: r.shard_jobs == {0: "12"} and r.local_pids == {"12": 345} and r.max_attempts == 3,
        ),
        (  # Slurm arrays: the Slurm fields, nulls kept
            {
                "executor": "slurm",
                "jobs": {"0": "7_0"},
                "tag": "sr-a",
                "merge_job_name": "sr-a-merge",
                "arrays": ["7"],
                "merge_job_id": None,
            },
            records.SlurmArraysLaunch,
            lambda r: r.shard_jobs == {0: "7_0"} and r.slurm_names == {"sr-a", "sr-a-merge"} and r.merge_job is None,
        ),
        (  # no executor at all: Slurm, as the model always defaulted
            {"jobs": {"3": "7_3"}},
            records.SlurmArraysLaunch,
            lambda r: r.shard_jobs == {3: "7_3"},
        ),
        (  # warm workers on this machine: an empty `jobs` and the workers' pids
            {"executor": "local", "jobs": {}, "workers": {"0": "55"}, "worker_shards": [0, 1], "pid_start": {"55": 9}},
            records.WarmWorkersLaunch,
            lambda r: r.local_worker_jobs == ["55"] and r.shards_for_workers == [0, 1] and r.shard_jobs == {},
        ),
        (  # warm workers on Slurm
            {
                "executor": "slurm",
                "jobs": {},
                "workers": {"0": "9_0"},
                "worker_shards": [2],
                "tag": "sr-a",
                "merge_job_name": "sr-a-merge",
                "arrays": ["9"],
                "merge_job_id": "10",
            },
            records.WarmWorkersLaunch,
            lambda r: r.slurm_worker_jobs == ["9_0"] and r.local_worker_jobs == [] and r.merge_job == "10",
        ),
    ],
)
def test_an_old_launch_line_without_a_mode_reads_as_its_backends_record(tmp_path: Path, old, model, check) -> None:
    store.launches_path(tmp_path).write_bytes(orjson.dumps(old) + b"\n")
    (got,) = records.read_launches(tmp_path)
    assert type(got) is model and check(got)


@pytest.mark.parametrize(
    "line, said",
    [
        ({"mode": "slurm_arrays", "jobs": {"0": "7_0"}, "pid_start": {"7": 1}}, "'pid_start' is a field of local jobs"),
        ({"mode": "local_jobs", "jobs": {"0": "12"}, "tag": "sr-a"}, "'tag' is a field of Slurm job arrays"),
        ({"mode": "local_jobs", "workers": {"0": "12"}}, "'workers' is a field of warm workers"),
        ({"mode": "slurm_arrays", "executor": "slurm"}, "'executor' is a field of warm workers"),
        ({"mode": "warm_workers", "executor": "slurm", "jobs": {"0": "7_0"}}, "'jobs' is a field of local jobs"),
        (
            {"mode": "warm_workers", "executor": "local", "workers": {"0": "5"}, "tag": "a"},
            "'tag' is not a field of warm workers run with executor 'local'",
        ),
        (
            {"mode": "warm_workers", "executor": "slurm", "pid_start": {"5": 1}},
            "'pid_start' is not a field of warm workers run with executor 'slurm'",
        ),
        (
            {"executor": "slurm", "jobs": {"0": "7_0"}, "pid_start": {"7": 1}},
            "'pid_start' is a field of local jobs",
        ),  # old
        ({"mode": "warm_workers", "workers": {}}, "no 'executor'"),
        ({"mode": "cloud"}, "'mode' is \"cloud\": not one of local_jobs, slurm_arrays, warm_workers"),
        ({"executor": "cloud"}, "'executor' is \"cloud\": not one of local, slurm"),
    ],
)
def test_a_launch_record_with_another_modes_field_is_refused_naming_it(tmp_path: Path, line, said) -> None:
    store.launches_path(tmp_path).write_bytes(b'{"mode": "local_jobs"}\n' + orjson.dumps(line) + b"\n")
    with pytest.raises(BadRecord) as err:
        records.read_launches(tmp_path)
    assert f"{store.launches_path(tmp_path)}:2: invalid launch record: {said}" in str(err.value)
    with pytest.raises(BadRecord, match="a new launch record"):
        records.append_launch(tmp_path, line)


@pytest.mark.parametrize(
    "line, said",
    [
        (b'{"jobs": {"x": "1"}}', "'jobs'"),
        (b'{"tag": "a,b"}', "'tag'"),
        (b'{"executor": "local", "pid_start": {"-1": 5}}', "'pid_start'"),
        (b'{"mode": "warm_workers", "executor": "local", "pid_start": {"0": 5}}', "'pid_start'"),
        (b'{"mode": "warm_workers", "executor": "slurm", "merge_job_name": "x y"}', "'merge_job_name'"),
        (b'{"submitted_at": "now"}', "'submitted_at'"),
        (b'{"mode": "local_jobs", "max_attempts": -1}', "'max_attempts'"),
        (b"[]", "not an object"),
        (b"{", "not a launch record"),
    ],
)
def test_a_launch_record_of_the_wrong_shape_names_file_line_and_field(tmp_path: Path, line, said) -> None:
    store.launches_path(tmp_path).write_bytes(b'{"executor": "local"}\n' + line + b"\n")
    with pytest.raises(BadRecord) as err:
        records.read_launches(tmp_path)
    assert f"{store.launches_path(tmp_path)}:2" in str(err.value) and said in str(err.value)


def test_a_new_launch_record_of_the_wrong_shape_is_never_written(tmp_path: Path) -> None:
    with pytest.raises(BadRecord, match="'jobs'"):
        records.append_launch(tmp_path, {"jobs": ["7_0"]})
    with pytest.raises(ValueError, match="'pid_start' is a field of local jobs"):
        records.SlurmArraysLaunch(pid_start={"5": 1})  # type: ignore[call-arg]
    assert not store.launches_path(tmp_path).exists()


def test_worker_state_round_trips_and_refuses_a_wrong_type_on_assignment(tmp_path: Path) -> None:
    state = records.WorkerState(worker_id="w0", job_id=None, host="h", pid=12, pid_start=34, started_at=1.0, gpus=0)
    state.sealed.append(3)
    state.collecting_s["3"] = 2.5
    store.worker_dir(tmp_path, "w0").mkdir(parents=True)
    records.write_worker_state(tmp_path, state)
    assert records.read_worker_states(tmp_path) == [state]
    with pytest.raises(ValueError):
        state.current_shard = "3"  # type: ignore[assignment]
    store.worker_state_path(tmp_path, "w0").write_bytes(orjson.dumps(state.to_json() | {"pid": "12"}))
    with pytest.raises(BadRecord, match="'pid'"):
        records.read_worker_states(tmp_path)


def test_fill_request_and_shard_failure_round_trip_and_refuse_wrong_types(tmp_path: Path) -> None:
    assert records.read_fill(tmp_path) == records.FillRequest()
    records.write_fill(tmp_path, records.FillRequest(tasks=[3, 1]))
    assert orjson.loads(store.fill_path(tmp_path).read_bytes()) == {"tasks": [3, 1]}
    store.fill_path(tmp_path).write_bytes(b'{"all": "yes"}')
    with pytest.raises(BadRecord, match=f"{store.fill_path(tmp_path)}: invalid a fill request: 'all'"):
        records.read_fill(tmp_path)
    store.shard_dir(tmp_path, 0).mkdir(parents=True)
    assert records.read_failure(tmp_path, 0) is None
    records.write_failure(tmp_path, 0, records.ShardFailure(job_id="5", error="boom", attempt=2))
    assert records.read_failure(tmp_path, 0) == records.ShardFailure(job_id="5", error="boom", attempt=2)


def test_a_claim_token_is_a_file_name_part_never_a_path() -> None:
    good = {"worker_id": "w", "host": "h", "pid": 7, "claimed_at": 1.0, "token": "0a1b"}
    assert records.parse_claim(Path("c"), orjson.dumps(good)).token == "0a1b"
    for token in ("../x", "a/b", "", "AB"):
        with pytest.raises(BadRecord, match="'token'"):
            records.parse_claim(Path("c"), orjson.dumps(good | {"token": token}))


def test_the_plan_shape_names_the_field_at_fault(tmp_path: Path) -> None:
    """plan.json's shape is planner.Plan's (the one definition): store.load_plan refuses another, naming the field."""
    shard = {"index": 0, "num_rollouts": 2, "kind": "range", "start": 0, "stop": 2}
    plan = {
        "planner_version": "1",
        "input": {"path": "x", "sha256": "0", "num_lines": 1},
        "planning": {},
        "config": {},
        "num_tasks": 1,
        "num_rollouts": 2,
        "agents": {},
        "shards": [shard],
        "fingerprint": "f",
    }

    def loaded(data: dict) -> str:
        store.plan_path(tmp_path).write_bytes(orjson.dumps(data))
        with pytest.raises(PlanMismatch) as e:
            store.load_plan(tmp_path)
        return str(e.value)

    assert "content does not match its fingerprint" in loaded(plan)  # the shape is right; only the hash is not
    assert "unreadable plan ('shards' is a list: Value error, shard 0 has index 1)" in loaded(
        plan | {"shards": [shard | {"index": 1}]}
    )
    assert "unreadable plan ('num_tasks' is -1:" in loaded(plan | {"num_tasks": -1})
    assert "unreadable plan ('num_tasks' is \"1\":" in loaded(plan | {"num_tasks": "1"})  # strict: no "1" for 1
    assert "unreadable plan (no 'input')" in loaded({k: v for k, v in plan.items() if k != "input"})
    assert "unreadable plan ('shards.0.kind' is \"ring\":" in loaded(plan | {"shards": [shard | {"kind": "ring"}]})
    assert "unreadable plan ('extra' is 1:" in loaded(plan | {"extra": 1})
    entry = {
        "label": "a b",
        "agent": "a",
        "data": "d",
        "sha256": "0",
        "rows_in_file": 1,
        "num_tasks": 1,
        "num_rollouts": 2,
        "repeats": 2,
        "tasks": [[0, 1]],
    }
    assert "unreadable plan ('blend.0.label' is \"a b\":" in loaded(plan | {"blend": [entry]})
    assert str(tmp_path / "plan.json") in loaded(plan | {"num_tasks": -1})


def test_only_regular_files_are_opened_and_never_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFile, match=f"{fifo}: a FIFO"):
        store.read_regular(fifo)
    if stat.S_ISCHR(os.stat("/dev/null").st_mode):  # a sandbox's /dev/null may be a regular file
        with pytest.raises(NotRegularFile, match="a device"):
            store.open_regular_fd(Path("/dev/null"))
    with pytest.raises(IsADirectoryError):
        store.open_regular(tmp_path)
    with pytest.raises(FileNotFoundError):
        store.open_regular(tmp_path / "absent")
    (tmp_path / "f").write_bytes(b"x\n")
    assert store.read_regular(tmp_path / "f") == b"x\n"


def label_row(**fields) -> dict:
    rate = {
        "rollouts": 4,
        "hours": 0.5,
        "gpu_hours": 0.5,
        "rollouts_per_hour": 8.0,
        "rollouts_per_gpu_hour": 8.0,
        "output_tokens": 40,
        "output_tokens_per_s": 0.02,
        "basis": "output_tokens",
    }
    row = {
        "label": "math",
        "agent": "a",
        "owner": None,
        "tasks_planned": 2,
        "rollouts_planned": 4,
        "collected": 4,
        "masked": 0,
        "failed": 0,
        "skipped": 0,
        "missing": 0,
        "tasks_complete": 2,
        "tasks_partial": 0,
        "tasks_missing": 0,
        "mean_reward": 0.5,
        "pass_at_1": 0.5,
        "rate": rate,
        "profile": "by_label/math",
    }
    return row | fields


def test_labels_json_round_trips_and_a_damaged_one_names_the_file_and_the_field(tmp_path: Path) -> None:
    assert records.read_labels(tmp_path) is None  # not a blend, or not merged yet
    doc = {"run_dir": str(tmp_path), "fingerprint": "f", "labels": [label_row()], "failed_lanes": [], "rate_basis": "b"}
    path = store.labels_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(records.BlendLabels.model_validate(doc).to_bytes())
    labels = records.read_labels(tmp_path)
    assert (
        labels is not None and labels.labels[0].rate.rollouts_per_gpu_hour == 8.0 and not labels.labels[0].failed_lane
    )
    assert orjson.loads(path.read_bytes()) == doc
    for row, field in (
        (label_row(collected="4"), "'labels.0.collected'"),  # strict: no "4" for 4
        (label_row(collected=-1), "'labels.0.collected'"),
        ({k: v for k, v in label_row().items() if k != "agent"}, "no 'labels.0.agent'"),
        (label_row(rate={"rollouts": 1}), "no 'labels.0.rate.hours'"),
    ):
        path.write_bytes(orjson.dumps(doc | {"labels": [row]}))
        with pytest.raises(BadRecord, match=f"{path}: invalid a blend's labels: {re.escape(field)}"):
            records.read_labels(tmp_path)
    path.write_bytes(b"{")
    with pytest.raises(BadRecord, match=f"{path}: not a blend's labels"):
        records.read_labels(tmp_path)
