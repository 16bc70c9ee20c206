"""Helpers for the runtime tests: the stand-in policy server as a subprocess, and small run directories.

The policy server is a fake at the one seam shardrun does not own (the model); every Gym part is real."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


from shardrun.core import config as config_mod
from shardrun.shard import processes
from tests import builders
from tests.ports import free_port_in

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "policy_server.py"
GYM_SITE_EXAMPLE = "resources_servers/example_single_tool_call/data/example.jsonl"
CONFIG_PATHS = [
    "resources_servers/math_with_judge/configs/math_with_judge.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
]
TOOL_CALL_AGENT = "example_single_tool_call_simple_agent"
API_KEY_ENV = "SHARDRUN_TEST_POLICY_KEY"
API_KEY = "test-key-not-a-secret"


def test_port(offset: int) -> int:
    """A free port in 21000-21999 (the range these tests may use), spread by pid so parallel sessions differ."""
    return free_port_in(21000, 22000, (os.getpid() * 7 + offset * 97) % 1000)


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


@contextmanager
def fake_policy(tmp: Path, *args: str, offset: int = 0) -> Iterator[FakePolicy]:
    port = test_port(offset)
    log = tmp / f"policy-{port}-requests.jsonl"
    proc = processes.start(
        [sys.executable, str(FAKE), "--port", str(port), "--api-key", API_KEY, "--request-log", str(log), *args],
        tmp / f"policy-{port}.log",
        name="fake-policy",
    )
    fake = FakePolicy(proc, port, log)
    try:
        processes.wait_http(f"http://127.0.0.1:{port}/health", watch=[proc], timeout=30, what="fake policy")
        yield fake
    finally:
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


def write_config(
    path: Path,
    input_jsonl: Path,
    run_dir: Path,
    policy_url: str,
    *,
    repeats: int = 2,
    shards: int = 1,
    gym: dict | None = None,
    cluster: dict | None = None,
    config_paths: list[str] | None = None,
) -> Path:
    """The Gym servers are `config_paths`, else those the input's rows need: the tool-call environment only where a
    row names its agent (its three idle servers cost a Gym 0.7 stack start about 12 s on 2 cores)."""
    return builders.write_gym_config(
        path,
        input_jsonl,
        run_dir,
        policy_url,
        repeats=repeats,
        shards=shards,
        config_paths=config_paths or config_paths_for(input_jsonl),
        api_key_env=API_KEY_ENV,
        gym={"num_samples_in_parallel": 4, "stall_timeout_s": 120, "ready_timeout_s": 300} | (gym or {}),
        cluster={"executor": "local", "array_parallelism": 1} | (cluster or {}),
    )


def config_paths_for(input_jsonl: Path) -> list[str]:
    rows = (json.loads(line) for line in input_jsonl.read_text().splitlines() if line.strip())
    if any(row.get("agent_ref", {}).get("name") == TOOL_CALL_AGENT for row in rows):
        return CONFIG_PATHS
    return [path for path in CONFIG_PATHS if "example_single_tool_call" not in path]


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
