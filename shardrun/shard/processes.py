"""The process seam: start a command in its own process group with output to a log file, wait until it answers
over HTTP (while checking it is still alive), and stop it (SIGTERM to the group, then SIGKILL stragglers).

Every server shardrun starts (vLLM, `ng_run`, the collector) goes through here, so no process outlives its shard:
`stop` also sweeps descendants that left the group (found through /proc on Linux).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import http.client
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Mapping, Sequence

from shardrun.core.errors import NotRegularFile, ServerFailure
from shardrun.rundir import store

LOG_TAIL_LINES = 30


@dataclass
class Proc:
    """A started command: its Popen, its process group and where its output goes."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.time)
    redactor: subprocess.Popen | None = None  # copies the output to the log with secrets masked (start(redact=))
    leader_ticks: int | None = None  # the leader's start time (start_ticks): names the group for `reap_group`

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # started as a session leader: its pid is its group id

    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def group(self) -> tuple[int, int] | None:
        """(process group id, the leader's start ticks), what `reap_group` needs once the starter is gone; None when
        the leader was gone before it could be read."""
        return None if self.leader_ticks is None else (self.pgid, self.leader_ticks)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; subprocess.TimeoutExpired if it still runs after `timeout` seconds."""
        return self.popen.wait(timeout=timeout)

    def stop(self, grace: float = 10.0) -> int | None:
        return stop(self, grace=grace)

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def describe_exit(self) -> str:
        rc = self.returncode
        if rc is None:
            return f"{self.name} (pid {self.pid}) is running"
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        return f"{self.name} (pid {self.pid}) {how}; log {self.log_path}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file (reads at most 64 KiB)."""
    try:
        with store.open_regular(path) as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            data = f.read()
    except (FileNotFoundError, NotRegularFile):  # a FIFO in its place is never waited on
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def start(
    cmd: Sequence[str],
    log_path: Path,
    *,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = True,
    redact: Sequence[str] = (),
) -> Proc:
    """Start `cmd` in a new session (own process group), stdin closed, stdout+stderr appended to `log_path`.

    SIGINT/SIGTERM dispositions are reset to default in the child (a non-interactive parent shell may have
    ignored SIGINT, which children would inherit). With `die_with_parent` (Linux) the child gets SIGTERM when the
    thread that started it dies, so a SIGKILLed shard does not leave its servers running; start long-lived
    servers from the main thread.

    With `redact` (secret values, e.g. the policy API key), the output goes through a small redactor process
    that writes it to the log line by line with every one of them replaced by `***`: the command's own debug
    output (NeMo Gym prints request headers when a request fails) never puts a secret on disk. The redactor gets
    the secrets in its environment, never on its command line, and ends when the command and everything that
    inherited its output have exited.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    name = name or Path(cmd[0]).name
    parent = os.getpid() if die_with_parent else None
    secrets = [s for s in redact if s]
    with open(log_path, "ab") as log:
        log.write(f"[shardrun] {time.strftime('%Y-%m-%d %H:%M:%S')} start {name}: {_show(cmd)}\n".encode())
        log.flush()
        redactor = None
        out: int | IO[bytes] = log
        try:
            if secrets:
                read_end, out = os.pipe()
                try:
                    redactor = subprocess.Popen(
                        [sys.executable, "-c", _REDACTOR],
                        stdin=read_end,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={_REDACT_ENV: "\n".join(secrets)},
                        start_new_session=True,
                        preexec_fn=_child_setup(parent),
                    )
                finally:
                    os.close(read_end)
            popen = subprocess.Popen(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_child_setup(parent),
            )
        except OSError as e:
            if redactor is not None:
                redactor.kill()
            raise ServerFailure(f"cannot start {name} ({cmd[0]}): {e}") from None
        finally:
            if isinstance(out, int):
                os.close(out)  # the command (and its children) hold the only write ends now
    return Proc(name=name, popen=popen, log_path=log_path, redactor=redactor, leader_ticks=start_ticks(popen.pid))


_REDACT_ENV = "SHARDRUN_REDACT"
_REDACTOR = """\
import os, sys
secrets = [s.encode() for s in os.environ.pop("SHARDRUN_REDACT").split("\\n")]
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    for s in secrets:
        line = line.replace(s, b"***")
    try:
        out.write(line)
        out.flush()
    except OSError:  # a full disk loses log lines, never the command: it keeps a reader on its output
        pass
os._exit(0)
"""


def _child_setup(parent: int | None) -> Callable[[], None]:
    libc = _libc() if parent is not None else None

    def setup() -> None:  # runs in the child between fork and exec
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # Slurm sends the checkpoint signal (USR2, submitit's) to every process of the job step; its default
        # action kills. Children ignore it: the shard job handles it and stops them in order (launch.py).
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return setup


_PR_SET_PDEATHSIG = 1


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now, chosen by the kernel from its ephemeral range (outside Gym's
    10001-20000 range for its own servers); two shards on one node get different ports unless one closes first."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _show(cmd: Sequence[str]) -> str:
    return " ".join(str(c) for c in cmd)


# ---------------------------------------------------------------- readiness


def http_get(url: str, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> tuple[int, bytes] | None:
    """GET `url`: (status, body), or None when nothing answers HTTP (refused, reset, timeout, or a process that
    speaks another protocol on the port, such as one of Ray's that took it)."""
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read() if e.fp else b""
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None


def ok_status(status: int, _body: bytes) -> bool:
    return 200 <= status < 300


def wait_until(
    check: Callable[[], bool], *, watch: Sequence[Proc] = (), timeout: float, what: str, interval: float = 0.5
) -> float:
    """Poll `check` until it returns True; seconds waited. ServerFailure if a watched process exits or on timeout."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        for p in watch:
            if not p.alive():
                raise ServerFailure(
                    f"{what}: {p.describe_exit()} before it was ready\n--- last lines of {p.log_path} ---\n{p.tail()}"
                )
        if check():
            return time.monotonic() - t0
        if time.monotonic() >= deadline:
            logs = "".join(f"\n--- last lines of {p.log_path} ---\n{p.tail()}" for p in watch)
            raise ServerFailure(f"{what}: not ready after {timeout:.0f} s{logs}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def wait_http(
    url: str,
    *,
    watch: Sequence[Proc] = (),
    timeout: float,
    what: str | None = None,
    accept: Callable[[int, bytes], bool] = ok_status,
    headers: Mapping[str, str] | None = None,
    interval: float = 0.5,
) -> float:
    """Wait until GET `url` gets a response that `accept(status, body)` likes; seconds waited."""

    def check() -> bool:
        got = http_get(url, timeout=min(5.0, max(0.5, interval * 4)), headers=headers)
        return got is not None and accept(*got)

    return wait_until(check, watch=watch, timeout=timeout, what=what or f"waiting for {url}", interval=interval)


# ---------------------------------------------------------------- stopping


def stop(proc: Proc, grace: float = 10.0, sig: int = signal.SIGTERM, straggler_grace: float = 2.0) -> int | None:
    """SIGTERM the process group and wait up to `grace` s for the leader; then SIGTERM what is left of the group
    and of the leader's descendants (some leave the group), wait up to `straggler_grace` s, and SIGKILL the rest.
    Returns the leader's exit code. Safe to call twice."""
    family = _family(proc.pgid, proc.pid)
    _signal_group(proc.pgid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=grace)
    family |= _family(proc.pgid, proc.pid)
    _signal_each(family, sig)
    _wait_gone(family, min(straggler_grace, grace))
    kill_tree(proc, extra=family)
    if proc.redactor is not None:  # it ends at end of input, once the last writer is gone
        try:
            proc.redactor.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.redactor.kill()
            proc.redactor.wait()
    return proc.popen.poll()


def _signal_each(family: set[tuple[int, int]], sig: int) -> None:
    for pid, starttime in family:
        if _start_time(pid) == starttime:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def kill_tree(proc: Proc, extra: set[tuple[int, int]] | None = None) -> None:
    """SIGKILL the process group and every known descendant at once (what a node failure looks like)."""
    targets = _family(proc.pgid, proc.pid) | (extra or set())
    _signal_group(proc.pgid, signal.SIGKILL)
    for pid, starttime in targets:
        if _start_time(pid) == starttime:  # still the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=5)
    _wait_gone(targets, 5.0)


def reap_group(pgid: int, leader_ticks: int) -> int:
    """SIGKILL a process group whose leader shardrun started and recorded: only while that leader still lives with
    `leader_ticks` as its start time (then the group is the one it started, and its members started after it). A
    leader that is gone, or a live process of another start time under that id, proves nothing: the group is left
    alone (its members are reaped by their own records: `reap_recorded`). Returns how many processes were killed."""
    if start_ticks(pgid) != leader_ticks:
        return 0
    targets = set()
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if entry.name.isascii() and entry.name.isdigit() and int(entry.name) != os.getpid():
                f = _stat(int(entry.name))
                # a member started after the leader; anything older that shows this group id is not ours
                if f and int(f[2]) == pgid and int(f[19]) >= leader_ticks:
                    targets.add((int(entry.name), int(f[19])))
    return _kill_all(targets)


def reap_recorded(procs: Iterable[Sequence[int]]) -> int:
    """SIGKILL each recorded (pid, start ticks) that still runs with that start time: a process shardrun started
    (or saw its server start) and recorded; a pid that is gone or now names another process is left alone. Returns
    how many processes were killed."""
    targets = {
        (int(p[0]), int(p[1]))
        for p in procs
        if len(p) == 2 and p[0] > 0 and p[0] != os.getpid() and start_ticks(int(p[0])) == int(p[1])
    }
    return _kill_all(targets)


def _kill_all(targets: set[tuple[int, int]]) -> int:
    for pid, ticks in targets:
        if start_ticks(pid) == ticks:  # read again just before the signal: the pid may have been reused since
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    _wait_gone(targets, 5.0)
    return len(targets)


def descendants(roots: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """(pid, start ticks) of the `roots` (pid, start ticks) that still run with that start time, and of every live
    process descended from them (by /proc's parent pids): what a worker records of its servers, so that whoever
    reaps them after it can show it started each one."""
    table: dict[int, tuple[int, int]] = {}  # pid -> (ppid, start ticks)
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if entry.name.isascii() and entry.name.isdigit():
                f = _stat(int(entry.name))
                if f:
                    table[int(entry.name)] = (int(f[1]), int(f[19]))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, int] = {}
    todo = [int(r[0]) for r in roots if len(r) == 2 and table.get(int(r[0]), (0, None))[1] == int(r[1])]
    while todo:
        pid = todo.pop()
        if pid in out or pid == os.getpid():
            continue
        out[pid] = table[pid][1]
        todo.extend(c for c in children.get(pid, ()) if table[c][1] >= out[pid])  # a child starts after its parent
    return sorted(out.items())


@contextlib.contextmanager
def running(cmd: Sequence[str], log_path: Path, *, grace: float = 10.0, **kwargs) -> Iterator[Proc]:
    """`start` ... `stop`, whatever happens in between."""
    proc = start(cmd, log_path, **kwargs)
    try:
        yield proc
    finally:
        stop(proc, grace=grace)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_gone(family: set[tuple[int, int]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_start_time(pid) == st for pid, st in family) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---------------------------------------------------------------- /proc (Linux); empty elsewhere


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, ...]; None if gone or a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return [f.decode() for f in fields]


def start_ticks(pid: int) -> int | None:
    """A live process's start time (clock ticks since boot, /proc/PID/stat field 22); None if gone or a zombie.
    (pid, start_ticks) names one process even when pids are reused."""
    f = _stat(pid)
    return int(f[19]) if f else None


_start_time = start_ticks


def _family(pgid: int, root: int) -> set[tuple[int, int]]:
    """(pid, start time) of live processes in group `pgid` or descended from `root`."""
    table: dict[int, list[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if entry.name.isascii() and entry.name.isdigit():
                f = _stat(int(entry.name))
                if f:
                    table[int(entry.name)] = f
    children: dict[int, list[int]] = {}
    for pid, f in table.items():
        children.setdefault(int(f[1]), []).append(pid)
    found = {pid for pid, f in table.items() if int(f[2]) == pgid}
    stack = [root, *found]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.discard(os.getpid())
    return {(pid, int(table[pid][19])) for pid in found if pid in table}
