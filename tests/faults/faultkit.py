"""Shared tools of the fault suite: kill a whole process tree at once, find leftovers, compare merged outputs,
mount small file systems, run the CLI, and the stand-in policy server on this suite's ports (24000-24999).

The stand-in policy server (tests/fakes/policy_server.py) is a fake at the one seam shardrun does not own, the
model; everything else these tests run (NeMo Gym, submitit, the file system) is real.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import orjson
import pytest

from shardrun.shard import processes
from shardrun.rundir import store
from tests.fakes import harness
from tests import ports

SHARDRUN = [sys.executable, "-m", "shardrun.cli"]
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]

# what NeMo Gym itself makes up per call (uuids, clock): the only bytes of a rollout that differ between two runs
GYM_RANDOM = re.compile(rb'"(id|created_at)":("(resp|msg|rs|fc|call)_[0-9a-f]{32}"|[0-9]+\.[0-9]+)')


# the stand-in policy server on this suite's ports, started without the test's process tag, its start-up given 60 s
fake_policy = functools.partial(harness.fake_policy, ports_from=ports.FAULTS, tagged=False, ready_timeout=60)


# ---------------------------------------------------------------- processes


def _children_table() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                data = Path(f"/proc/{entry.name}/stat").read_bytes()
            except OSError:
                continue
            fields = data[data.rfind(b")") + 2 :].split()
            if fields and fields[0] not in (b"Z", b"X"):
                table.setdefault(int(fields[1]), []).append(int(entry.name))
    return table


def descendants(pid: int) -> set[int]:
    """Live descendants of `pid` (any session or group), found through /proc."""
    children = _children_table()
    found: set[int] = set()
    stack = [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found:
                found.add(c)
                stack.append(c)
    return found


def kill_tree(popen: subprocess.Popen, tag: str | None = None) -> int:
    """SIGKILL a command and everything it started, all at once, the way a node failure does: freeze the tree
    (SIGSTOP, repeated until no new process appears, so nothing forks or cleans up in between), then SIGKILL
    every frozen process. With `tag`, processes that carry the test's tag but left the tree (reparented) are
    included. Returns how many processes were killed."""
    frozen: set[int] = set()
    for _ in range(50):
        now = {popen.pid} | descendants(popen.pid)
        if tag:
            now |= set(harness.tagged_processes(tag))
        new = now - frozen
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen |= new
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=30)
    return len(frozen)


def leftovers(tag: str, *, also: Path | None = None, wait_s: float = 5.0) -> list[str]:
    """Processes still alive that carry the test's tag (or name `also` on their command line): must be none."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [f"{pid}: {cmdline(pid)}" for pid in harness.tagged_processes(tag)]
        if also is not None:
            needle = str(also).encode()
            for entry in os.scandir("/proc"):
                if entry.name.isdigit() and int(entry.name) != os.getpid():
                    with contextlib.suppress(OSError):
                        if (
                            needle in Path(f"/proc/{entry.name}/cmdline").read_bytes()
                            and processes.start_ticks(int(entry.name)) is not None
                        ):
                            found.append(f"{entry.name}: {cmdline(int(entry.name))}")
        if not found or time.monotonic() > deadline:
            return sorted(set(found))
        time.sleep(0.2)


def cmdline(pid: int, limit: int | None = 200) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:limit]
    except OSError:
        return "?"


def cli(*args: str, timeout: float = 300, prefix: list[str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        (prefix or []) + SHARDRUN + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw
    )


def start_cli(*args: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start a shardrun command in its own session (so the test can kill its whole tree)."""
    with open(log, "ab") as f:
        return subprocess.Popen(
            SHARDRUN + [str(a) for a in args],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )


def wait_for(
    check: Callable[[], object], timeout: float, what: str, interval: float = 0.05, proc: subprocess.Popen | None = None
) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


# ---------------------------------------------------------------- outputs

MERGED_FILES = (
    "rollouts.jsonl",
    "rollouts_materialized_inputs.jsonl",
    "rollouts_failures.jsonl",
    "rollouts_reward_profiling.jsonl",
    "rollouts_agent_metrics.json",
    "rollouts_aggregate_metrics.json",
)


def without_gym_randomness(data: bytes) -> bytes:
    """Rollout bytes with the values NeMo Gym makes up per call (response/message uuids, created_at) blanked."""
    return GYM_RANDOM.sub(rb'"\1":"*"', data)


GYM_SERVER_PORT = re.compile(rb"(https?://(?:127\.0\.0\.1|localhost)):\d+")
REPEAT_LEVEL = "rollouts_repeat_level_metrics.json"  # written for runs on Gym 0.7


def without_server_ports(data: bytes) -> bytes:
    """Failure rows with the ports of Gym's servers blanked: Gym 0.7's sidecar names the failed /run's URL, and
    every start of its servers picks new ports."""
    return GYM_SERVER_PORT.sub(rb"\1:*", data)


def merged_outputs(run_dir: Path, *, gym: bool = False) -> dict[str, bytes]:
    """The merged files that must be byte-identical to an uninterrupted run (merge_summary.json has timings)."""
    out = {}
    extra = (REPEAT_LEVEL,) if (store.merged_dir(run_dir) / REPEAT_LEVEL).exists() else ()
    for name in MERGED_FILES + extra:
        data = (store.merged_dir(run_dir) / name).read_bytes()
        if gym and name == "rollouts.jsonl":
            data = without_gym_randomness(data)
        elif gym and name == "rollouts_failures.jsonl":
            data = without_server_ports(data)
        out[name] = data
    out["merge_summary (without timings)"] = summary_essentials(run_dir)
    return out


TIMING_KEYS = {"timings", "run_dir", "outputs", "seal", "marker", "cost", "gpu_hours", "wall_s", "fingerprint"}
"""Keys of merge_summary.json that differ between two runs of the same rollouts: timings and paths (the plan's
fingerprint covers the input's path, and the compared runs plan it from their own directories)."""


def summary_essentials(run_dir: Path) -> bytes:
    """merge_summary.json without timings, paths and seals (they hold start/end times)."""
    return essentials_of(store.merged_summary_path(run_dir).read_bytes())


def essentials_of(summary: bytes) -> bytes:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in TIMING_KEYS}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return orjson.dumps(strip(orjson.loads(summary)), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)


def identities(path: Path) -> list[tuple[int, int]]:
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in store.iter_jsonl_objects(path)]


def assert_exactly_once(run_dir: Path, planned: list[tuple[int, int]], failed: set[tuple[int, int]] = frozenset()):
    """Every planned identity once in the merged output (rollouts, or the failures for `failed`), none invented."""
    rolled = identities(store.merged_rollouts_path(run_dir))
    assert len(rolled) == len(set(rolled)), "an identity appears twice in merged/rollouts.jsonl"
    assert set(rolled) | set(failed) == set(planned) and not set(rolled) & set(failed)
    assert len(rolled) + len(failed) == len(planned)
    return len(planned)


def tree_bytes(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not skip(p)}


def sealed_and_merged(tmp: Path, tasks: int, shards: int):
    """A synthetic run sealed by `shardrun resume` and merged, never faulted: a fault test's reference."""
    from tests.faults import synthetic

    run = synthetic.make(tmp, tasks=tasks, shards=shards, seal=False)
    assert cli("resume", run.run_dir).returncode == 0
    assert cli("merge-and-profile", run.run_dir).returncode == 0
    return run


# ---------------------------------------------------------------- file systems


def mount_tmpfs(path: Path, options: str, mounted: list[Path]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needed to simulate the fault): {res.stderr.decode().strip()}")
    mounted.append(path)
    return path


def fill(directory: Path) -> Path:
    """Fill the file system holding `directory` to the last byte (ENOSPC for the next write)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 64 << 10, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    return filler


def need_setpriv() -> None:
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop the capability that lets root ignore file modes")


def seeded(seed: int) -> random.Random:
    return random.Random(seed)


def counts_line(name: str, **counts: object) -> None:
    """One line per test in the suite's output; docs/reliability.md quotes these counts."""
    print(f"\n[fault-counts] {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


# ---------------------------------------------------------------- a CLI command in a forked process


class Forked:
    """A shardrun command running in a child forked from this (already imported) test process: the same code path
    as the `shardrun` executable without paying the interpreter start-up for every one of many kills."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


def fork_cli(*args: object, log: Path) -> Forked:
    """Run `shardrun ARGS` in a forked child, in its own session, output appended to `log`. The modules the
    commands use are imported here first, once, so that no child spends its time importing."""
    import importlib

    for module in (
        "shardrun.cli",
        "shardrun.profile.merge_and_profile",
        "shardrun.launch.resume",
        "shardrun.launch.submission",
        "shardrun.launch.status",
    ):
        importlib.import_module(module)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            from shardrun.cli import app

            try:
                app([str(a) for a in args], prog_name="shardrun")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return Forked(pid)


# ---------------------------------------------------------------- placing a kill by what a process has done


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, D, T, t, Z, ...), None when it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def freeze(pid: int, timeout: float = 60) -> bool:
    """SIGSTOP `pid` and wait until the kernel shows it stopped, so its files hold all it wrote and nothing more
    comes; False if it has exited."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while (state := process_state(pid)) not in ("T", "t"):
        if state in (None, "Z", "X"):
            return False
        if time.monotonic() > deadline:
            pytest.fail(f"pid {pid} did not stop within {timeout:.0f} s of SIGSTOP (state {state})")
        time.sleep(0.0002)
    return True


def step_until(pid: int, reached, slice_s: float = 0.002, limit: int = 200_000) -> bool:
    """With `pid` frozen: until `reached()` holds on the frozen state, let it run one short slice (SIGCONT, sleep,
    freeze). Returns True with the process frozen where `reached()` held; False if it exited first."""
    for _ in range(limit):
        if reached():
            return True
        os.kill(pid, signal.SIGCONT)
        time.sleep(slice_s)
        if not freeze(pid):
            return False
    pytest.fail(f"pid {pid} did not get there in {limit} slices")
