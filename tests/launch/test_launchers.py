"""The launcher interface (docs/architecture.md, "Launchers"): the backends are registered in one place, each
config selects exactly one, nothing else picks a backend by the config's fields, and `status` and `cancel` ask
every backend which of its jobs are live (each answers for its own jobs only)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import shardrun.launch
from shardrun.core.config import ClusterConfig
from shardrun.core.errors import BadInput
from shardrun.launch import backends, scheduler
from shardrun.launch.launcher import Launcher
from shardrun.shard import processes

LAUNCH = Path(shardrun.launch.__file__).resolve().parent
PACKAGE = LAUNCH.parent
BACKEND_MODULES = {"local_jobs.py", "slurm_arrays.py", "warm_workers.py"}


def launch_modules() -> list[str]:
    return [f"shardrun.launch.{m.name}" for m in pkgutil.iter_modules([str(LAUNCH)])]


def concrete_launchers() -> set[type[Launcher]]:
    for name in launch_modules():
        importlib.import_module(name)
    found, todo = set(), list(Launcher.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not getattr(cls, "__abstractmethods__", None):
            found.add(cls)
    return found


def test_every_backend_is_registered_in_the_registry_and_only_there() -> None:
    registered = {type(b) for b in backends.REGISTRY.values()}
    assert registered == concrete_launchers()
    assert len(registered) == len(backends.REGISTRY) == 3
    assert all(mode == b.mode for mode, b in backends.REGISTRY.items())
    # one module per backend, and no module but the registry makes one or asks one whether it is selected
    assert sorted(Path(sys.modules[c.__module__].__file__ or "").name for c in registered) == sorted(BACKEND_MODULES)
    names = {c.__name__ for c in registered}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                assert callee not in names, f"{path}:{node.lineno} makes a backend: register it in backends.py"
                assert callee != "selects" or path.name in BACKEND_MODULES, f"{path}:{node.lineno} picks a backend"


def test_nothing_outside_the_backends_branches_on_warm_workers() -> None:
    """`cluster.workers` set or not is what selects the warm workers: only the backends look at it (the registry
    asks them); submit, resume, status, cancel and the command line go through the registry."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == LAUNCH and path.name in BACKEND_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "workers":
                pytest.fail(f"{path}:{node.lineno} branches on .workers; ask backends.for_config instead")


@pytest.mark.parametrize(
    ("cluster", "mode"),
    [
        (ClusterConfig(), "local jobs"),
        (ClusterConfig(executor="slurm"), "Slurm job arrays"),
        (ClusterConfig(workers=2), "warm workers"),
        (ClusterConfig(executor="slurm", workers=3), "warm workers"),
    ],
)
def test_each_config_selects_exactly_one_backend(cluster: ClusterConfig, mode: str) -> None:
    assert backends.mode(cluster) == mode
    assert [m for m, b in backends.REGISTRY.items() if b.selects(cluster)] == [mode]


def test_a_config_no_backend_or_two_backends_select_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(backends.REGISTRY, "greedy", backends.REGISTRY["local jobs"])
    with pytest.raises(BadInput, match="local jobs and greedy"):
        backends.mode(ClusterConfig())


# ---------------------------------------------------------------- live and cancel, per backend


@dataclass
class Records:
    """What status.Launches carries for the backends (launcher.Launched)."""

    names: set[str] = field(default_factory=set)
    local_pids: dict[str, int | None] = field(default_factory=dict)
    local_hosts: dict[str, str] = field(default_factory=dict)
    worker_jobs: dict[str, str] = field(default_factory=dict)


def squeue(jobs: dict[str, str]):
    asked: list[frozenset[str]] = []

    def ask(names):
        asked.append(frozenset(names))
        return {
            job_id: scheduler.LiveJob(job_id, "RUNNING", "None", "2026-01-01T00:00:00", name)
            for job_id, name in jobs.items()
        }

    return ask, asked


def test_each_backend_answers_for_its_own_jobs_and_squeue_is_asked_once() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        host = socket.gethostname()
        records = Records(
            names={"run-abc", "run-abc-merge"},
            local_pids={str(p.pid): processes.start_ticks(p.pid) for p in (sleeper, worker)} | {"999999999": 5},
            local_hosts={str(sleeper.pid): host, str(worker.pid): host, "999999999": host},
            worker_jobs={str(worker.pid): "local", "12_0": "slurm", "12_1": "slurm"},
        )
        ask, asked = squeue({"11_0": "run-abc", "11_1": "run-abc", "12_0": "run-abc", "13": "run-abc-merge"})
        per = {mode: set(b.live(records, ask).jobs) for mode, b in backends.REGISTRY.items()}
        assert per == {
            "local jobs": {str(sleeper.pid)},
            "Slurm job arrays": {"11_0", "11_1", "13"},
            "warm workers": {str(worker.pid), "12_0"},
        }
        asked.clear()
        both = backends.live(records, ask)
        assert set(both.jobs) == set().union(*per.values()) and len(asked) == 1
        assert {j for j, live in both.jobs.items() if live.on_slurm} == {"11_0", "11_1", "12_0", "13"}
    finally:
        for p in (sleeper, worker):
            p.kill()
            p.wait()


def test_cancel_asks_every_backend_and_stops_only_live_jobs(monkeypatch) -> None:
    cancelled: list[list[str]] = []
    monkeypatch.setattr(scheduler, "cancel", lambda ids: cancelled.append(sorted(ids)) or sorted(ids))
    # a local job as a shard runs it: it takes SIGINT itself (runtime.py installs its handler), so a SIGINT ignored by
    # whatever started the suite (a background job of a non-interactive shell) does not reach it; it says when it
    # listens, so the cancel cannot come before
    job = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True);"
            " time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        records = Records(
            names={"run-abc"},
            local_pids={str(job.pid): processes.start_ticks(job.pid), "999999999": None},
            local_hosts={str(job.pid): socket.gethostname()},
            worker_jobs={"12_0": "slurm"},
        )
        ask, _ = squeue({"11_0": "run-abc", "11_1": "run-abc", "12_0": "run-abc"})
        done = backends.cancel(records, ask)
        assert done.local_pids == [job.pid] and sorted(done.slurm_jobs) == ["11", "12"]
        assert sorted(map(tuple, cancelled)) == [("11",), ("12",)]  # each backend its own arrays
        assert job.wait(timeout=60) != 0  # SIGINT
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_cancel_refuses_to_guess_when_squeue_fails() -> None:
    def broken(names):
        raise scheduler.SlurmError("squeue: error: Unable to contact slurm controller")

    with pytest.raises(scheduler.SlurmError, match="Unable to contact"):
        backends.cancel(Records(names={"run-abc"}), broken)
    assert backends.live(Records(names={"run-abc"}), broken).warnings  # status: a warning, not a crash


def test_launch_has_no_import_cycle() -> None:
    """The rule of the import-linter contract (acyclic_siblings on shardrun.launch), checked with grimp, which
    import-linter builds on, so that the fast tier shows a cycle too; function-level imports count."""
    import grimp

    graph = grimp.build_graph("shardrun", cache_dir=None)
    modules = sorted(graph.find_children("shardrun.launch"))
    imports = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules} for m in modules}
    assert imports["shardrun.launch.status"] and imports["shardrun.launch.submission"]  # the graph is not empty

    def cycle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def walk(m: str) -> list[str] | None:
            for n in sorted(imports[m]):
                if n == start:
                    return path + [n]
                if n not in seen:
                    seen.add(n)
                    path.append(n)
                    found = walk(n)
                    if found:
                        return found
                    path.pop()
            return None

        return walk(start)

    cycles = [c for c in map(cycle_from, modules) if c]
    assert not cycles, "import cycle(s) in launch/: " + "; ".join(" -> ".join(c) for c in cycles)
