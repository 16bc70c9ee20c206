"""The launcher interface (docs/architecture.md, "Launchers"): the backends are registered in one place, each
config selects exactly one, nothing else picks a backend by the config's fields, and `status` and `cancel` ask
every backend which of its jobs are live (each answers for its own jobs only)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import shardrun.launch
from shardrun.core.config import ClusterConfig, validate
from shardrun.core.errors import BadInput
from shardrun.launch import backends, scheduler, status
from shardrun.launch.launcher import Launch, Launcher, Request, SlurmJobs
from shardrun.rundir import records
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


# ---------------------------------------------------------------- no branching on the executor or the launch mode

# where a launch's executor or mode may be compared: the backends (each knows its own) and the registry
BRANCHING_ALLOWED = BACKEND_MODULES | {"after_workers.py", "backends.py"}
MODE_VALUES = {"local", "slurm", records.LOCAL_JOBS, records.SLURM_ARRAYS, records.WARM_WORKERS}
MODE_CONSTANTS = {"LOCAL_JOBS", "SLURM_ARRAYS", "WARM_WORKERS"}
MODE_KEYS = {"executor", "mode"}
RECORD_MODELS = {m.__name__ for m in records.LAUNCH_MODELS}
CONFIG_PROPERTY = "uses_slurm"  # ClusterConfig's one comparison of the executor (core/config.py)


def names_mode(node: ast.AST) -> bool:
    """Is `node` a launch's executor or mode (`x.executor`, `rec.mode`, `d["executor"]`, `d.get("mode")`), or one of
    their values ("slurm", "local", a record's mode, records.LOCAL_JOBS ...)?"""
    if isinstance(node, ast.Attribute):
        return node.attr in MODE_KEYS | MODE_CONSTANTS
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value in MODE_KEYS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in MODE_KEYS
    if isinstance(node, ast.Constant):
        return node.value in MODE_VALUES
    return isinstance(node, ast.Name) and node.id in MODE_CONSTANTS


def mode_branches(source: str, *, config_module: bool = False) -> list[str]:
    """Where `source` branches on the executor or a launch record's mode: a comparison (==, !=, in, is ...) or a
    match on either, an isinstance test against one mode's record model, or a read of ClusterConfig.uses_slurm
    (the executor compared in disguise). `config_module`: core/config.py, whose uses_slurm property is the one
    comparison allowed outside the backends, and which may read it in its own checks."""
    tree = ast.parse(source)
    exempt: set[int] = set()
    if config_module:
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name == CONFIG_PROPERTY:
                exempt |= {id(n) for n in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Compare) and any(map(names_mode, [node.left, *node.comparators])):
            found.append(f"{node.lineno}: compares the executor or the launch mode")
        elif isinstance(node, ast.Match) and names_mode(node.subject):
            found.append(f"{node.lineno}: matches on the executor or the launch mode")
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("isinstance", "issubclass")
            and len(node.args) == 2
            and any(getattr(n, "id", getattr(n, "attr", None)) in RECORD_MODELS for n in ast.walk(node.args[1]))
        ):
            found.append(f"{node.lineno}: tests which mode's launch record it has")
        elif isinstance(node, ast.Attribute) and node.attr == CONFIG_PROPERTY and not config_module:
            found.append(f"{node.lineno}: reads cluster.{CONFIG_PROPERTY}")
    return found


def test_nothing_outside_the_backends_branches_on_the_executor_or_the_launch_mode() -> None:
    """What a launch's executor or mode means is the backends' to say (backends.for_config / for_record, then ask
    the backend): status, submission, resume, preflight, report and the rest never compare them."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == LAUNCH and path.name in BRANCHING_ALLOWED:
            continue
        config_module = path == PACKAGE / "core" / "config.py"
        found += [f"{path}:{where}" for where in mode_branches(path.read_text(), config_module=config_module)]
    assert not found, "ask the backend (backends.for_config / for_record) instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        'if cluster.executor == "slurm":\n    pass',
        'ok = cfg.cluster_or_default.executor != "local"',
        'ok = rec.executor in ("slurm",)',
        'ok = "slurm" == executor',
        "ok = rec.mode == records.WARM_WORKERS",
        "ok = rec.mode is WARM_WORKERS",
        'ok = data["mode"] == "local_jobs"',
        'ok = (plan.config.get("cluster") or {}).get("executor") == "slurm"',
        "ok = last_executor.get(i) == 'slurm'",
        "match rec.mode:\n    case _:\n        pass",
        "ok = isinstance(rec, records.SlurmArraysLaunch)",
        "ok = isinstance(rec, (LocalJobsLaunch, WarmWorkersLaunch))",
        "ok = cluster.uses_slurm and x",
    ],
)
def test_the_guard_catches_a_branch_on_the_executor_or_the_mode(snippet: str) -> None:
    assert mode_branches(snippet), snippet


def test_the_guard_lets_the_config_define_its_one_comparison_and_passes_plain_code() -> None:
    prop = 'class C:\n    @property\n    def uses_slurm(self):\n        return self.executor == "slurm"\n'
    assert mode_branches(prop, config_module=True) == []
    assert mode_branches(prop + '    def other(self):\n        return self.executor == "slurm"\n', config_module=True)
    assert mode_branches(prop) != []  # only core/config.py may
    assert mode_branches("ok = backends.for_record(rec).accounted_by_slurm and job in live") == []
    assert mode_branches("ok = isinstance(rec, kind) and rec.host == 'h'") == []


def test_every_launch_record_model_is_one_backends_and_maps_back_to_it() -> None:
    assert {b.record_type for b in backends.REGISTRY.values()} == set(records.LAUNCH_MODELS)
    one_each = [records.LocalJobsLaunch(), records.SlurmArraysLaunch(), records.WarmWorkersLaunch(executor="slurm")]
    assert [backends.for_record(r).mode for r in one_each] == ["local jobs", "Slurm job arrays", "warm workers"]


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


def launched(*lines: records.LaunchBase) -> status.Launches:
    """The run's launch records as status folds them for the backends (launcher.Launched)."""
    return status.fold_launches(lines)


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
        run = launched(
            records.LocalJobsLaunch(
                host=host,
                jobs={"0": str(sleeper.pid), "1": "999999999"},
                pid_start={str(sleeper.pid): processes.start_ticks(sleeper.pid), "999999999": 5},
            ),
            records.SlurmArraysLaunch(
                jobs={"2": "11_0", "3": "11_1"}, tag="run-abc", merge_job_name="run-abc-merge", merge_job_id="13"
            ),
            records.WarmWorkersLaunch(
                executor="local",
                host=host,
                workers={"0": str(worker.pid)},
                pid_start={str(worker.pid): processes.start_ticks(worker.pid)},
            ),
            records.WarmWorkersLaunch(executor="slurm", workers={"0": "12_0", "1": "12_1"}, tag="run-abc"),
        )
        ask, asked = squeue({"11_0": "run-abc", "11_1": "run-abc", "12_0": "run-abc", "13": "run-abc-merge"})
        per = {mode: set(b.live(run, ask).jobs) for mode, b in backends.REGISTRY.items()}
        assert per == {
            "local jobs": {str(sleeper.pid)},
            "Slurm job arrays": {"11_0", "11_1", "13"},
            "warm workers": {str(worker.pid), "12_0"},
        }
        asked.clear()
        both = backends.live(run, ask)
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
        run = launched(
            records.LocalJobsLaunch(
                host=socket.gethostname(),
                jobs={"0": str(job.pid), "1": "999999999"},
                pid_start={str(job.pid): processes.start_ticks(job.pid), "999999999": None},
            ),
            records.SlurmArraysLaunch(jobs={"2": "11_0", "3": "11_1"}, tag="run-abc"),
            records.WarmWorkersLaunch(executor="slurm", workers={"0": "12_0"}, tag="run-abc"),
        )
        ask, _ = squeue({"11_0": "run-abc", "11_1": "run-abc", "12_0": "run-abc"})
        done = backends.cancel(run, ask)
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

    run = launched(records.SlurmArraysLaunch(jobs={"0": "11_0"}, tag="run-abc"))
    with pytest.raises(scheduler.SlurmError, match="Unable to contact"):
        backends.cancel(run, broken)
    assert backends.live(run, broken).warnings  # status: a warning, not a crash


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


# ---------------------------------------------------------------- each backend builds its own launch record


def request_for(tmp_path: Path, **cluster) -> Request:
    cfg = validate({"input_jsonl": str(tmp_path / "in.jsonl"), "run_dir": str(tmp_path / "run"), "cluster": cluster})
    return Request(cfg, tmp_path / "run", [0, 1, 2])


COMMON = {"submitted_at": 1.5, "host": "h", "max_attempts": 3, "gpus_per_shard": 1, "done_at_submit": 0}


def test_local_jobs_record_the_pids_and_their_start_times(tmp_path: Path) -> None:
    me = os.getpid()
    launch = Launch(jobs={0: str(me), 1: str(me), 2: "999999999"})
    rec = backends.REGISTRY["local jobs"].record(request_for(tmp_path), launch, COMMON)
    assert isinstance(rec, records.LocalJobsLaunch) and rec.submitted_at == 1.5
    assert rec.shard_jobs == {0: str(me), 1: str(me), 2: "999999999"}
    assert rec.local_pids == {str(me): processes.start_ticks(me), "999999999": None}
    records.append_launch(tmp_path, rec)
    assert records.read_launches(tmp_path) == [rec]


def test_slurm_arrays_record_the_array_tasks_names_and_merge_job(tmp_path: Path) -> None:
    launch = Launch(jobs={0: "7_0", 1: "7_1", 2: "8_0"}, slurm=SlurmJobs("sr-a", "sr-a-merge", ["7", "8"]))
    launch.merge_job_id = "9"
    rec = backends.REGISTRY["Slurm job arrays"].record(request_for(tmp_path, executor="slurm"), launch, COMMON)
    assert isinstance(rec, records.SlurmArraysLaunch)
    assert rec.to_json() == COMMON | {
        "mode": "slurm_arrays",
        "jobs": {"0": "7_0", "1": "7_1", "2": "8_0"},
        "tag": "sr-a",
        "merge_job_name": "sr-a-merge",
        "arrays": ["7", "8"],
        "merge_job_id": "9",
    }
    assert backends.for_record(rec).accounted_by_slurm and rec.slurm_names == {"sr-a", "sr-a-merge"}


@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_warm_workers_record_where_they_run(tmp_path: Path, executor: str) -> None:
    me = os.getpid()
    if executor == "local":
        launch = Launch(jobs={}, workers={0: str(me)})
    else:
        launch = Launch(jobs={}, workers={0: "9_0", 1: "9_1"}, slurm=SlurmJobs("sr-a", "sr-a-merge", ["9"]))
    rec = backends.REGISTRY["warm workers"].record(request_for(tmp_path, executor=executor, workers=2), launch, COMMON)
    assert isinstance(rec, records.WarmWorkersLaunch) and rec.executor == executor
    assert rec.shards_for_workers == [0, 1, 2] and rec.shard_jobs == {}
    if executor == "local":
        assert rec.local_worker_jobs == [str(me)] and rec.local_pids == {str(me): processes.start_ticks(me)}
        assert rec.slurm_names == set() and rec.tag is None
    else:
        assert rec.slurm_worker_jobs == ["9_0", "9_1"] and rec.local_pids == {}
        assert rec.arrays == ["9"] and rec.slurm_names == {"sr-a", "sr-a-merge"}
    assert not backends.for_record(rec).accounted_by_slurm
    records.append_launch(tmp_path, rec)
    assert records.read_launches(tmp_path) == [rec]


@pytest.mark.parametrize(
    ("cluster", "on_slurm"),
    [({}, False), ({"executor": "slurm"}, True), ({"workers": 2}, False), ({"executor": "slurm", "workers": 2}, True)],
)
def test_the_backend_says_whether_its_jobs_run_on_slurm(tmp_path: Path, cluster: dict, on_slurm: bool) -> None:
    cfg = request_for(tmp_path, **cluster).cfg
    assert backends.for_config(cfg).runs_on_slurm(cfg.cluster_or_default) is on_slurm
