"""A blend through the real Gym stack (the stand-in policy: tests/fakes), issue #21's "How it is shown": one entry
whose every rollout fails (the policy answers its prompts with HTTP 500): the run completes, `status` and
`merge-and-profile` name that label as a failed lane, the other labels are profiled."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from shardrun.profile import blend_labels
from shardrun.shard import gym_stack
from tests import builders
from tests.fakes import harness

# two real Gym shards, one after the other, on a loaded machine (one took 12 minutes here)
pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1800)]
REPEATS = 2
MATH_AGENT = "math_with_judge_simple_agent"
WEATHER_AGENT = "example_single_tool_call_simple_agent"
BROKEN = "BROKEN-LANE"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def entry_files(tmp: Path, gym_venv: Path, broken: bool = False) -> dict[str, tuple[Path, list[str]]]:
    """Per label: its data file and the questions of its rows. sums and diffs share the math agent (diffs has a
    limit of 2 of its 4 rows); weather runs the tool-calling agent, or (broken) a math lane the policy fails."""
    arith = [json.loads(x) for x in builders.arith_lines(8)]
    files: dict[str, tuple[Path, list[str]]] = {}
    files["sums"] = (write_jsonl(tmp / "sums.jsonl", arith[:4]), [r["question"] for r in arith[:4]])
    diffs = [{k: v for k, v in r.items() if k != "agent_ref"} for r in arith[4:8]]  # the entry's agent is added
    files["diffs"] = (write_jsonl(tmp / "diffs.jsonl", diffs), [r["question"] for r in diffs[:2]])
    if broken:
        rows = [dict(r) for r in arith[:2]]
        for r in rows:
            r["question"] = f"{BROKEN} {r['question']}"
            r["responses_create_params"] = dict(r["responses_create_params"])
            r["responses_create_params"]["input"] = [{"role": "user", "content": f"{BROKEN} {r['question']}"}]
        files["lane"] = (write_jsonl(tmp / "lane.jsonl", rows), [r["question"] for r in rows])
    else:
        site = sorted((gym_venv / "lib").glob("python3*/site-packages"))[-1]
        lines = (site / harness.GYM_SITE_EXAMPLE).read_text().splitlines()[:2]
        rows = [json.loads(x) | {"question": f"weather {i}"} for i, x in enumerate(lines)]
        files["weather"] = (write_jsonl(tmp / "weather.jsonl", rows), [r["question"] for r in rows])
    return files


def blend_config(tmp: Path, files: dict[str, tuple[Path, list[str]]], run_dir: Path, url: str) -> Path:
    agents = {"sums": MATH_AGENT, "diffs": MATH_AGENT, "weather": WEATHER_AGENT, "lane": MATH_AGENT}
    entries = []
    for label, (path, _) in files.items():
        entry: dict[str, Any] = {"label": label, "data": str(path), "agent": agents[label], "owner": "tests"}
        if label == "diffs":
            entry["limit"] = 2
        entries.append(entry)
    data = {
        "entries": entries,
        "run_dir": str(run_dir),
        "num_repeats": REPEATS,
        "sharding": {"num_shards": 2},
        "gym": {
            "config_paths": harness.CONFIG_PATHS,
            "num_samples_in_parallel": 4,
            "stall_timeout_s": 120,
            "ready_timeout_s": 900,
            "max_rollout_attempts": 2,
        },
        "policy": {"base_url": url, "model_name": "fake-model", "api_key_env": harness.API_KEY_ENV},
        "cluster": {"executor": "local", "array_parallelism": 1},
    }
    path = tmp / "blend.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def shardrun(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def run_blend(tmp: Path, gym_venv: Path, monkeypatch, broken: bool) -> tuple[Path, dict, subprocess.CompletedProcess]:
    monkeypatch.setenv(harness.TAG_ENV, uuid.uuid4().hex)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    files = entry_files(tmp, gym_venv, broken)
    run_dir = tmp / "run"
    faults = ("--fault", f"500:match={BROKEN}") if broken else ()
    with harness.fake_policy(tmp, "--correct-share", "0.5", *faults) as fake:
        done = shardrun("submit", str(blend_config(tmp, files, run_dir, fake.base_url)), cwd=tmp)
    return run_dir, files, done


def test_a_lane_that_fails_every_rollout_is_named_and_the_others_profiled(tmp_path: Path, gym_venv, monkeypatch):
    run_dir, files, done = run_blend(tmp_path, gym_venv, monkeypatch, broken=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the run completes
    status = shardrun("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    lanes = {r["label"]: r for r in json.loads(status.stdout)["labels"]}
    assert lanes["lane"]["collected"] == 0 and lanes["lane"]["silent"] and lanes["lane"]["failed"] == 2 * REPEATS
    assert lanes["sums"]["collected"] == 4 * REPEATS and not lanes["sums"]["silent"]
    text = shardrun("status", str(run_dir), cwd=tmp_path, timeout=120)
    assert "label(s) lane collected nothing" in text.stdout
    merged_out = shardrun("merge-and-profile", str(run_dir), cwd=tmp_path)
    assert merged_out.returncode == 0, merged_out.stdout + merged_out.stderr
    assert "label lane collected nothing: that lane failed" in merged_out.stdout
    doc = orjson.loads(blend_labels.labels_path(run_dir).read_bytes())
    assert doc["failed_lanes"] == ["lane"]
    by = {r["label"]: r for r in doc["labels"]}
    assert by["lane"]["failed"] == 2 * REPEATS and by["lane"]["collected"] == 0
    for label in ("sums", "diffs"):
        profile = rows_of(blend_labels.by_label_dir(run_dir, label) / "rollouts_reward_profiling.jsonl")
        assert len(profile) == by[label]["tasks_planned"] and by[label]["collected"] == by[label]["rollouts_planned"]
