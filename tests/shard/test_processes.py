"""The process seam against real child processes (shell commands and a small HTTP server)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from shardrun.shard import processes
from shardrun.core.errors import ServerFailure

PY = sys.executable


def _alive(pid: int) -> bool:
    return processes._start_time(pid) is not None


def test_start_writes_output_to_log_in_own_group(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "echo.log"
    p = processes.start(["sh", "-c", "echo hello; echo oops >&2"], log)
    assert p.popen.wait(10) == 0
    assert os.getpgid(os.getpid()) != p.pgid
    text = log.read_text()
    assert "hello" in text and "oops" in text and "[shardrun]" in text
    assert "exited with code 0" in p.describe_exit()


def test_child_gets_default_sigint_even_if_parent_ignores_it(tmp_path: Path) -> None:
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        p = processes.start(["sleep", "30"], tmp_path / "s.log")
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        status = Path(f"/proc/{p.pid}/status").read_text()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        assert not ignored & (1 << (signal.SIGINT - 1))
    finally:
        processes.stop(p, grace=2)


def test_start_missing_binary_is_server_failure(tmp_path: Path) -> None:
    with pytest.raises(ServerFailure, match="cannot start"):
        processes.start([str(tmp_path / "nope")], tmp_path / "x.log")


def test_wait_http_ready_and_stop(tmp_path: Path) -> None:
    port = 21000 + os.getpid() % 500
    p = processes.start(
        [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "http.log", cwd=tmp_path
    )
    try:
        waited = processes.wait_http(f"http://127.0.0.1:{port}/", watch=[p], timeout=20, what="http.server")
        assert waited < 20
        assert processes.http_get(f"http://127.0.0.1:{port}/")[0] == 200
    finally:
        rc = processes.stop(p, grace=5)
    assert rc is not None and not _alive(p.pid)
    assert processes.http_get(f"http://127.0.0.1:{port}/", timeout=1) is None


def test_wait_http_reports_death_with_log_tail(tmp_path: Path) -> None:
    p = processes.start(["sh", "-c", "echo fatal: no model; exit 7"], tmp_path / "d.log")
    with pytest.raises(ServerFailure) as e:
        processes.wait_http("http://127.0.0.1:9/", watch=[p], timeout=20, what="model server")
    assert "exited with code 7" in str(e.value) and "fatal: no model" in str(e.value)


def test_wait_http_times_out(tmp_path: Path) -> None:
    p = processes.start(["sleep", "30"], tmp_path / "t.log")
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerFailure, match="not ready after"):
            processes.wait_http("http://127.0.0.1:9/", watch=[p], timeout=1.0, interval=0.2, what="x")
        assert time.monotonic() - t0 < 5
    finally:
        processes.stop(p, grace=2)


def test_stop_kills_sigterm_ignoring_stragglers_and_escaped_descendants(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = f"""
import os, signal, subprocess, sys, time
a = subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
open({str(pidfile)!r}, "w").write(f"{{a.pid}} {{b.pid}}")
time.sleep(60)
"""
    p = processes.start([PY, "-c", script], tmp_path / "tree.log")
    processes.wait_until(
        lambda: pidfile.exists() and len(pidfile.read_text().split()) == 2, watch=[p], timeout=20, what="tree"
    )
    a, b = map(int, pidfile.read_text().split())
    assert os.getpgid(b) != p.pgid  # b left the group: only the descendant sweep finds it
    t0 = time.monotonic()
    processes.stop(p, grace=1)
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert not _alive(p.pid) and not _alive(a) and not _alive(b)


def test_running_context_stops_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with processes.running(["sleep", "30"], tmp_path / "r.log", grace=1) as p:
            pid = p.pid
            raise RuntimeError("boom")
    assert not _alive(pid)


def test_log_tail_limits_lines(tmp_path: Path) -> None:
    f = tmp_path / "l.log"
    f.write_text("".join(f"line {i}\n" for i in range(100)))
    assert processes.log_tail(f, 3).splitlines() == ["line 97", "line 98", "line 99"]
    assert processes.log_tail(tmp_path / "missing") == ""


def test_child_dies_with_its_parent(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent.parent)!r})
from shardrun.shard import processes
p = processes.start(["sleep", "60"], {str(tmp_path / 'c.log')!r})
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(60)
"""
    parent = processes.start([PY, "-c", script], tmp_path / "parent.log", die_with_parent=False)
    processes.wait_until(
        lambda: pidfile.exists() and pidfile.read_text() != "", watch=[parent], timeout=20, what="parent"
    )
    child = int(pidfile.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.popen.wait(5)
    processes.wait_until(lambda: not _alive(child), timeout=10, what="child to die with its parent")


def test_a_group_left_behind_by_its_dead_leader_is_reaped_by_its_recorded_members(tmp_path: Path) -> None:
    """What a SIGKILLed worker leaves: its server leader is gone, the servers it started stay in its group. The group
    id alone proves nothing once its leader is gone (it is not signalled); the members recorded with their start
    times while the leader lived (descendants) are."""
    pidfile = tmp_path / "members"
    leader = processes.start(
        ["sh", "-c", f"sleep 300 & a=$!; sleep 300 & echo $a $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait"],
        tmp_path / "leader.log",
    )
    group = leader.group
    assert group is not None and group[0] == leader.pid
    processes.wait_until(pidfile.exists, watch=[leader], timeout=20, what="the group's members")
    members = [int(p) for p in pidfile.read_text().split()]
    recorded = processes.descendants([group])
    assert sorted(p for p, _ in recorded) == sorted([leader.pid, *members])
    os.kill(leader.pid, signal.SIGKILL)
    leader.popen.wait(5)
    assert all(_alive(p) for p in members)  # the leader's death does not take its group with it

    assert processes.reap_group(group[0], group[1] + 1_000_000) == 0  # started after these: not their group
    assert processes.reap_group(*group) == 0  # its leader is gone: the id could name anyone's group now
    assert all(_alive(p) for p in members)
    assert processes.reap_recorded([(p, t + 1) for p, t in recorded]) == 0  # not the recorded start times
    assert all(_alive(p) for p in members)
    assert processes.reap_recorded(recorded) == 2
    assert not any(_alive(p) for p in members)
    assert processes.reap_recorded(recorded) == 0  # nothing left


def test_a_group_with_its_recorded_leader_alive_is_reaped(tmp_path: Path) -> None:
    proc = processes.start(["sh", "-c", "sleep 300 & sleep 300 & wait"], tmp_path / "s.log")
    try:
        assert proc.group is not None
        processes.wait_until(lambda: len(processes.descendants([proc.group])) == 3, timeout=20, what="children")
        assert processes.reap_group(*proc.group) == 3
    finally:
        processes.stop(proc, grace=2)


def test_a_live_leader_with_another_start_time_is_another_group(tmp_path: Path) -> None:
    proc = processes.start(["sleep", "300"], tmp_path / "s.log")
    try:
        assert proc.group is not None
        assert processes.reap_group(proc.pid, proc.group[1] - 1) == 0  # the id was reused: leave it alone
        assert _alive(proc.pid)
    finally:
        processes.stop(proc, grace=2)


def test_free_port_is_bindable() -> None:
    import socket

    port = processes.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_http_get_counts_a_port_that_speaks_another_protocol_as_not_answering() -> None:
    """A port taken by a process that does not speak HTTP (one of Ray's took the Gym head server's port once):
    binary bytes back instead of a status line are 'nothing answers HTTP here', never an exception."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer_in_binary() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"\x00\x00\x18\x04\x00\x00\x00\x00\x00\x00\x04\x00@\x00\x00\xfe\r\n\r\n")

    t = threading.Thread(target=answer_in_binary, daemon=True)
    t.start()
    try:
        assert processes.http_get(f"http://127.0.0.1:{server.getsockname()[1]}/server_instances", timeout=10) is None
    finally:
        t.join(timeout=10)
        server.close()
