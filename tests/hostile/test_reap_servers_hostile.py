"""Hostile round 3, the servers of a killed worker (issue 34): a worker.json is read back by the next worker on its
host, which kills what that worker, gone, left of its servers. It signals only what it can show the worker started:
a process recorded with its pid and start time, or a group whose recorded leader still runs. A stale worker.json
naming a group whose leader is gone, or a pid that now names another process, signals nothing. And what a worker's
servers started (in their group or out of it) is recorded as the worker sees it, so it is stopped after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostilekit import invoke_bounded
from reportkit import input_row, planned_run

from shardrun.rundir import records
from shardrun.rundir.records import WorkerState
from shardrun.shard import processes
from shardrun.workers import worker

HOST = socket.gethostname()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def stale_state(**servers) -> WorkerState:
    """A worker gone from this host (its pid names no process), with the servers it recorded."""
    return WorkerState(
        worker_id="ghost", job_id=None, host=HOST, pid=dead_pid(), pid_start=1, started_at=1.7e9, gpus=0, **servers
    )


def alive(pid: int, ticks: int) -> bool:
    return processes.start_ticks(pid) == ticks


@pytest.fixture()
def orphan():
    """A `sleep` in a process group whose leader is gone (the leader started it and exited): someone else's."""
    code = "import subprocess; p = subprocess.Popen(['sleep', '1000']); print(p.pid, flush=True)"
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    leader_ticks = processes.start_ticks(leader.pid)
    pid = int(leader.stdout.readline())
    leader.wait(30)
    ticks = processes.start_ticks(pid)
    assert leader_ticks is not None and ticks is not None and processes.start_ticks(leader.pid) is None
    yield leader.pid, leader_ticks, pid, ticks
    if processes.start_ticks(pid) == ticks:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def foreign():
    proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    ticks = processes.start_ticks(proc.pid)
    assert ticks is not None
    yield proc.pid, ticks
    proc.kill()
    proc.wait(30)


def test_a_group_whose_leader_is_gone_is_never_signalled(orphan):
    """The named case: a starting worker killed the unrelated process a stale worker.json's group id named."""
    leader, leader_ticks, pid, ticks = orphan
    assert worker.reap_servers(stale_state(server_groups=[[leader, leader_ticks]]), HOST) == 0
    assert processes.reap_group(leader, leader_ticks) == 0
    assert alive(pid, ticks)


def test_a_group_whose_id_names_another_leader_is_never_signalled(foreign):
    pid, ticks = foreign
    assert worker.reap_servers(stale_state(server_groups=[[pid, ticks + 1]]), HOST) == 0
    assert alive(pid, ticks)


@pytest.mark.parametrize("recorded", ["other ticks", "ticks 0", "a pair cut short"])
def test_a_recorded_pid_that_is_now_another_process_is_never_signalled(foreign, recorded):
    pid, ticks = foreign
    entry = {"other ticks": [pid, ticks + 7], "ticks 0": [pid, 0], "a pair cut short": [pid]}[recorded]
    assert worker.reap_servers(stale_state(server_processes=[entry]), HOST) == 0
    assert alive(pid, ticks)


def test_a_live_worker_or_another_hosts_servers_are_left_alone(foreign):
    pid, ticks = foreign
    me = WorkerState(
        worker_id="w",
        job_id=None,
        host=HOST,
        pid=os.getpid(),
        pid_start=processes.start_ticks(os.getpid()),
        started_at=time.time(),
        gpus=0,
        server_processes=[[pid, ticks]],
    )
    assert worker.reap_servers(me, HOST) is None
    assert worker.reap_servers(stale_state(server_processes=[[pid, ticks]]), "elsewhere") is None
    assert alive(pid, ticks)


SERVER = """
import subprocess, sys, time
subprocess.Popen(["sleep", "1000"], start_new_session=True)  # out of the server's group (Gym's may do this)
subprocess.Popen(["sleep", "1000"])  # in the server's group
time.sleep(1000)
"""

WORKER = """
import json, os, socket, sys, time
from pathlib import Path
from shardrun.rundir import records
from shardrun.rundir.records import WorkerState
from shardrun.shard import processes
from shardrun.workers import worker

run_dir = Path(sys.argv[1])
server = processes.start([sys.executable, "-c", sys.argv[2]], run_dir / "server.log", name="server")
deadline = time.monotonic() + 60
while len(processes.descendants([server.group])) < 3 and time.monotonic() < deadline:
    time.sleep(0.05)
state = WorkerState(
    worker_id="w0", job_id=None, host=socket.gethostname(), pid=os.getpid(),
    pid_start=processes.start_ticks(os.getpid()), started_at=time.time(), gpus=0,
    server_groups=[list(server.group)],
    server_processes=worker.merge_recorded([], processes.descendants([server.group])),
)
records.paths.worker_state_path(run_dir, "w0").parent.mkdir(parents=True)
records.write_worker_state(run_dir, state)
print(json.dumps(state.server_processes), flush=True)
time.sleep(1000)
"""


@pytest.mark.parametrize("reaper", ["the next worker", "shardrun cancel"])
def test_a_sigkilled_workers_recorded_servers_are_stopped_by_the_next_reaper(tmp_path: Path, reaper):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(2)], num_repeats=1, num_shards=1)
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(run_dir), SERVER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    recorded: list[tuple[int, int]] = []
    try:
        recorded = [tuple(p) for p in json.loads(proc.stdout.readline())]
        assert len(recorded) == 3, recorded  # the server and both of its children
        state = records.read_worker_state(records.paths.worker_state_path(run_dir, "w0"))
        assert state is not None and sorted(tuple(p) for p in state.server_processes) == sorted(recorded)
        assert worker.reap_servers(state, HOST) is None  # its worker still runs
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if reaper == "the next worker":
            killed = worker.reap_servers(state, HOST)
            assert killed is not None and killed >= 2  # the children at least (the kernel SIGTERMs the server)
        else:
            out = invoke_bounded("cancel", run_dir)
            assert out.exit_code == 0 and "server process(es) that workers gone from this host left" in out.output
        deadline = time.monotonic() + 10
        while any(alive(*p) for p in recorded) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(*p) for p in recorded), "a recorded server outlived its worker and the reaper"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        processes.reap_recorded(recorded)
