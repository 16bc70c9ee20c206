"""Helpers for the runtime tests: the stand-in policy server as a subprocess, and small run directories.

The policy server is a fake at the one seam shardrun does not own (the model); every Gym part is real."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Iterator


from shardrun.core import config as config_mod
from shardrun.shard import processes
from tests import builders
from tests import ports

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "policy_server.py"
GYM_SITE_EXAMPLE = "resources_servers/example_single_tool_call/data/example.jsonl"
CONFIG_PATHS = builders.GYM_CONFIG_PATHS
TOOL_CALL_AGENT = builders.TOOL_CALL_AGENT
API_KEY_ENV = "SHARDRUN_TEST_POLICY_KEY"
API_KEY = "test-key-not-a-secret"

# the runtime, e2e and launch tests' runs: 1 shard x 2 repeats on the local executor, the servers the input needs
STACK = builders.Stack(
    api_key_env=API_KEY_ENV,
    gym={"num_samples_in_parallel": 4, "stall_timeout_s": 120, "ready_timeout_s": 300},
    cluster={"executor": "local", "array_parallelism": 1},
)
write_config = functools.partial(builders.write_config, stack=STACK)


class FakePolicy:
    def __init__(self, proc: processes.Proc, port: int, request_log: Path):
        self.proc, self.port, self.request_log = proc, port, request_log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def set_faults(self, faults: list[str], delay: float | None = None) -> None:
        body = {"faults": faults} | ({"delay": delay} if delay is not None else {})
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/_fault",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).read()

    def requests(self) -> list[dict]:
        if not self.request_log.exists():
            return []
        return [json.loads(line) for line in self.request_log.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        processes.stop(self.proc, grace=2)


@contextlib.contextmanager
def fake_policy(
    tmp: Path,
    *args: str,
    ports_from: range = ports.RUNTIME,
    key: str = API_KEY,
    tagged: bool = True,
    ready_timeout: float = 30,
) -> Iterator[FakePolicy]:
    """The stand-in policy server (policy_server.py, the fake at the model seam) on a free port of `ports_from`
    (each test area has its range: tests/ports.py), requiring `key` as the Bearer token, its extra command line
    `args`; `tagged` False: started without this test's process tag (TAG_ENV), so the test's leftover check
    does not count it. Stopped on leaving, also when a test froze it (SIGSTOP)."""
    port = ports.free_port(ports_from)
    log = tmp / f"policy-{port}-requests.jsonl"
    env = None if tagged else {k: v for k, v in os.environ.items() if k != TAG_ENV}
    proc = processes.start(
        [sys.executable, str(FAKE), "--port", str(port), "--api-key", key, "--request-log", str(log), *args],
        tmp / f"policy-{port}.log",
        name="fake-policy",
        env=env,
    )
    fake = FakePolicy(proc, port, log)
    try:
        processes.wait_http(f"http://127.0.0.1:{port}/health", watch=[proc], timeout=ready_timeout, what="fake policy")
        yield fake
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a test may have frozen it
        fake.stop()


def example_input(path: Path, gym_venv: Path, math_rows: int = 3, weather_rows: int = 1) -> Path:
    """Arithmetic rows from examples/arith plus weather rows from Gym's example_single_tool_call data."""
    rows = builders.arith_lines(math_rows)
    site = sorted((gym_venv / "lib").glob("python3*/site-packages"))[-1]
    for line in (site / GYM_SITE_EXAMPLE).read_text().splitlines()[:weather_rows]:
        row = json.loads(line)
        row["agent_ref"] = {"name": TOOL_CALL_AGENT}
        rows.append(json.dumps(row))
    path.write_text("".join(r + "\n" for r in rows))
    return path


def load_config(path: Path, overrides: list[str] | None = None) -> config_mod.RunConfig:
    return config_mod.load(path, overrides or [])


def keys(path: Path) -> list[tuple[int, int]]:
    return [
        (r["_ng_task_index"], r["_ng_rollout_index"])
        for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    ]


TAG_ENV = "SHARDRUN_TEST_TAG"


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment has SHARDRUN_TEST_TAG=tag: everything a
    shard started inherits it, so after teardown this must be empty."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and processes.start_ticks(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


def keys_complete(path: Path) -> list[tuple[int, int]]:
    """Identities on the complete lines of a JSONL file (a torn last line is ignored)."""
    data = path.read_bytes()
    body = data[: data.rfind(b"\n") + 1]
    return [
        (r["_ng_task_index"], r["_ng_rollout_index"])
        for r in (json.loads(line) for line in body.decode().splitlines() if line.strip())
    ]
