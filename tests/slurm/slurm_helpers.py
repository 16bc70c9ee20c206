"""Helpers for the tests against the real local Slurm: a stand-in policy server on a 23xxx port, a small run
config with executor slurm, the CLI as a subprocess, polling, and Slurm's own view (squeue, sacct)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardrun.rundir import store
from tests import builders
from tests.fakes import harness
from tests import ports

GYM_CONFIG_PATHS = builders.MATH_CONFIG_PATHS


# the stand-in policy server (tests/fakes/policy_server.py) stands in for vLLM, on this area's ports
fake_policy = functools.partial(harness.fake_policy, ports_from=ports.SLURM)


def math_input(path: Path, rows: int) -> Path:
    return builders.arith_input(path, rows)


# jobs on the local Slurm: one CPU and 2 GB each, 15 minutes; the quickest real stack, a generous stall timeout
STACK = builders.Stack(
    api_key_env=harness.API_KEY_ENV,
    config_paths=GYM_CONFIG_PATHS,
    gym={"num_samples_in_parallel": 2, "stall_timeout_s": 600, "ready_timeout_s": 300},
    cluster={
        "executor": "slurm",
        "partition": os.environ.get("SLURM_LOCAL_PARTITION", "debug"),
        "time_limit": "00:15:00",
        "cpus_per_task": 1,
        "mem_gb": 2,
        "job_name_prefix": "srtest",
    },
)
write_config = functools.partial(builders.write_config, stack=STACK)


def shardrun(
    *args: str, cwd: Path, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The CLI as a subprocess, in this process's environment or `env` (another cluster's SLURM_CONF)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
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
