"""Helpers for the tests against the real local Slurm: a stand-in policy server on a 23xxx port, a small run
config with executor slurm, the CLI as a subprocess, polling, and Slurm's own view (squeue, sacct)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from shardrun.shard import processes
from shardrun.rundir import store
from tests import builders
from tests.fakes import harness
from tests.ports import free_port_in

GYM_CONFIG_PATHS = [
    "resources_servers/math_with_judge/configs/math_with_judge.yaml",
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
]


def free_port(offset: int = 0) -> int:
    """A free port in 23000-23999 (the range these tests use), spread by pid."""
    return free_port_in(23000, 24000, (os.getpid() * 13 + offset * 101) % 1000)


@contextmanager
def fake_policy(tmp: Path, *args: str, offset: int = 0) -> Iterator[harness.FakePolicy]:
    """The stand-in OpenAI-compatible policy server (tests/fakes/policy_server.py) stands in for vLLM."""
    port = free_port(offset)
    log = tmp / f"policy-{port}-requests.jsonl"
    proc = processes.start(
        [
            sys.executable,
            str(harness.FAKE),
            "--port",
            str(port),
            "--api-key",
            harness.API_KEY,
            "--request-log",
            str(log),
            *args,
        ],
        tmp / f"policy-{port}.log",
        name="fake-policy",
    )
    fake = harness.FakePolicy(proc, port, log)
    try:
        processes.wait_http(f"http://127.0.0.1:{port}/health", watch=[proc], timeout=30, what="fake policy")
        yield fake
    finally:
        fake.stop()


def math_input(path: Path, rows: int) -> Path:
    return builders.arith_input(path, rows)


def write_config(
    path: Path,
    input_jsonl: Path,
    run_dir: Path,
    policy_url: str,
    *,
    repeats: int,
    shards: int,
    cluster: dict,
    gym: dict | None = None,
) -> Path:
    return builders.write_gym_config(
        path,
        input_jsonl,
        run_dir,
        policy_url,
        repeats=repeats,
        shards=shards,
        config_paths=GYM_CONFIG_PATHS,
        api_key_env=harness.API_KEY_ENV,
        gym={"num_samples_in_parallel": 2, "stall_timeout_s": 600, "ready_timeout_s": 300} | (gym or {}),
        cluster={
            "executor": "slurm",
            "partition": os.environ.get("SLURM_LOCAL_PARTITION", "debug"),
            "time_limit": "00:15:00",
            "cpus_per_task": 1,
            "mem_gb": 2,
            "job_name_prefix": "srtest",
        }
        | cluster,
    )


def shardrun(*args: str, cwd: Path, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    if check:
        assert proc.returncode == 0, (
            f"shardrun {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def status_json(run_dir: Path, cwd: Path) -> dict:
    return json.loads(shardrun("status", run_dir, "--json", cwd=cwd, timeout=60).stdout)


def wait_for(check, timeout: float, what: str, interval: float = 2.0):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def squeue(*names: str) -> list[tuple[str, str, str]]:
    """(job id, state, reason) of the live jobs carrying one of `names`."""
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--name={','.join(names)}", "--format=%i|%T|%r"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def sacct_state(job_id: str) -> str | None:
    out = subprocess.run(
        ["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State", "--jobs", job_id],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid == job_id:
            return state.split(" ")[0]
    return None


def scancel_names(*names: str) -> None:
    for name in names:
        subprocess.run(["scancel", f"--name={name}"], capture_output=True, timeout=60)


def launches(run_dir: Path) -> list[dict]:
    """The launch records as launches.jsonl holds them."""
    return [rec.to_json() for rec in store.read_launches(run_dir)]


def planned_identities(run_dir: Path, shards: int) -> list[tuple[int, int]]:
    return sorted(k for i in range(shards) for k in harness.keys(store.materialized_path(run_dir, i)))


def job_names(run_dir: Path) -> tuple[str, str]:
    rec = launches(run_dir)[-1]
    return rec["tag"], rec["merge_job_name"]


ENDED = ("FAILED", "COMPLETED", "CANCELLED")


def ended_state(job_id: str, timeout: float, what: str) -> str:
    """Wait until sacct shows the job ended; its state (FAILED, COMPLETED or CANCELLED)."""
    return wait_for(lambda: (state := sacct_state(job_id)) in ENDED and state, timeout, what)
