"""A blend through the real Gym stack (the stand-in policy: tests/fakes), issue #21's "How it is shown":

- a manifest in NVIDIA's format with three entries, two sharing one agent and one with a `limit`, run by
  `shardrun submit MANIFEST run_dir=...`: each
  merged/by_label/<label>/ profile equals the Gym release's own profiler run on that label's rows alone (0.4 and
  0.7), and merged/labels.json equals counts computed here from the merged rows, each row's label taken from
  its question (not from the plan);
- one entry whose every rollout fails (the policy answers its prompts with HTTP 500): the run completes, `status`
  and `merge-and-profile` name that label as a failed lane, the other labels are profiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from shardrun.core import gym_adapter
from shardrun.rundir import store
from shardrun.shard import gym_stack
from tests import builders
from tests.e2e.test_profile_vs_gym import same
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


def blend_manifest(tmp: Path, files: dict[str, tuple[Path, list[str]]], run_dir: Path, url: str) -> list[str]:
    """The same blend as a NeMo Gym reward-profiling manifest (NVIDIA's format: docs/blends.md), each entry with
    its own Gym configs; returns the command line's config and overrides (run dir, the stand-in policy, local
    jobs)."""
    configs = {
        "sums": [harness.CONFIG_PATHS[0]],
        "diffs": [harness.CONFIG_PATHS[0]],
        "weather": [harness.CONFIG_PATHS[1]],
    }
    entries = []
    for label, (path, _) in files.items():
        agent = WEATHER_AGENT if label == "weather" else MATH_AGENT
        entry: dict[str, Any] = {"label": label, "agent": agent, "configs": configs[label], "data": str(path)}
        entries.append(entry | {"owner": "tests"} | ({"limit": 2} if label == "diffs" else {}))
    manifest = {
        "nickname": "blend_test",
        "num_shards": 2,
        "gym_env_start": {"config_paths": [harness.CONFIG_PATHS[2]]},
        "gym_eval_run": {"num_repeats": REPEATS, "num_samples_in_parallel": 4},
        "entries": entries,
    }
    path = tmp / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return [
        str(path),
        f"run_dir={run_dir}",
        f"++policy.base_url={url}",
        "++policy.model_name=fake-model",
        f"++policy.api_key_env={harness.API_KEY_ENV}",
        "++gym.stall_timeout_s=120",
        "++gym.ready_timeout_s=900",
        "++cluster.executor=local",
        "++cluster.array_parallelism=1",
    ]


def shardrun(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def run_blend(
    tmp: Path, gym_venv: Path, monkeypatch, broken: bool, manifest: bool = False
) -> tuple[Path, dict, subprocess.CompletedProcess]:
    monkeypatch.setenv(harness.TAG_ENV, uuid.uuid4().hex)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    files = entry_files(tmp, gym_venv, broken)
    run_dir = tmp / "run"
    faults = ("--fault", f"500:match={BROKEN}") if broken else ()
    with harness.fake_policy(tmp, "--correct-share", "0.5", *faults) as fake:
        if manifest:
            done = shardrun("submit", *blend_manifest(tmp, files, run_dir, fake.base_url), cwd=tmp)
        else:
            done = shardrun("submit", str(blend_config(tmp, files, run_dir, fake.base_url)), cwd=tmp)
    return run_dir, files, done


def test_each_label_profile_equals_gyms_own_profiler_on_its_rows(tmp_path: Path, gym_venv_each: Path, monkeypatch):
    release = gym_adapter.for_venv(gym_venv_each)
    run_dir, files, done = run_blend(tmp_path, gym_venv_each, monkeypatch, broken=False, manifest=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    merged_out = shardrun("merge-and-profile", str(run_dir), cwd=tmp_path)
    assert merged_out.returncode == 0, merged_out.stdout + merged_out.stderr
    assert "that lane failed" not in merged_out.stdout + merged_out.stderr
    merged = store.merged_dir(run_dir)
    label_of_question = {q: label for label, (_, qs) in files.items() for q in qs}
    planned = rows_of(merged / "rollouts_materialized_inputs.jsonl")
    rollouts = rows_of(merged / "rollouts.jsonl")
    question = {r["_ng_task_index"]: r["question"] for r in planned}
    assert set(question.values()) == set(label_of_question)  # diffs: its limit took 2 of its 4 rows
    doc = orjson.loads(store.labels_path(run_dir).read_bytes())
    assert [r["label"] for r in doc["labels"]] == ["sums", "diffs", "weather"] and doc["failed_lanes"] == []
    for entry in doc["labels"]:
        label = entry["label"]
        mine_planned = [r for r in planned if label_of_question[question[r["_ng_task_index"]]] == label]
        mine = [r for r in rollouts if label_of_question[question[r["_ng_task_index"]]] == label]
        # Gym's own profiler on this label's rows alone
        work = tmp_path / "gym" / label
        work.mkdir(parents=True)
        write_jsonl(work / "rollouts_materialized_inputs.jsonl", mine_planned)
        write_jsonl(work / "rollouts.jsonl", mine)
        cmd = release.profile_command(
            gym_venv_each, work / "rollouts_materialized_inputs.jsonl", work / "rollouts.jsonl", True
        )
        gym = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert gym.returncode == 0, gym.stdout[-2000:] + gym.stderr[-2000:]
        ours = store.by_label_dir(run_dir, label)
        want = sorted(rows_of(work / "rollouts_reward_profiling.jsonl"), key=lambda r: r["_ng_task_index"])
        same(rows_of(ours / "rollouts_reward_profiling.jsonl"), want, f"{label} profile")
        for suffix in release.profile_file_suffixes()[1:]:  # agent metrics; 0.7: and the repeat-level metrics
            name = f"rollouts{suffix}"
            same(orjson.loads((ours / name).read_bytes()), orjson.loads((work / name).read_bytes()), f"{label} {name}")
        # labels.json against counts made here
        tasks = {r["_ng_task_index"] for r in mine_planned}
        done_per_task = {t: sum(1 for r in mine if r["_ng_task_index"] == t) for t in tasks}
        assert entry["agent"] == (WEATHER_AGENT if label == "weather" else MATH_AGENT) and entry["owner"] == "tests"
        assert (entry["tasks_planned"], entry["rollouts_planned"]) == (len(tasks), len(mine_planned))
        assert entry["collected"] == len(mine) > 0
        assert entry["tasks_complete"] == sum(1 for n in done_per_task.values() if n == REPEATS)
        assert entry["tasks_partial"] == sum(1 for n in done_per_task.values() if 0 < n < REPEATS)
        assert entry["mean_reward"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine))
        assert entry["rate"]["rollouts"] == len(mine) and entry["rate"]["rollouts_per_hour"] > 0
        assert entry["rate"]["output_tokens"] == sum(r["response"]["usage"]["output_tokens"] for r in mine)
    assert [e["rollouts_planned"] for e in doc["labels"]] == [4 * REPEATS, 2 * REPEATS, 2 * REPEATS]


def test_a_lane_that_fails_every_rollout_is_named_and_the_others_profiled(tmp_path: Path, gym_venv, monkeypatch):
    run_dir, files, done = run_blend(tmp_path, gym_venv, monkeypatch, broken=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # the run completes
    status = shardrun("status", str(run_dir), "--json", cwd=tmp_path, timeout=120)
    assert status.returncode == 0, status.stderr
    lanes = {r["label"]: r for r in json.loads(status.stdout)["labels"]}
    assert lanes["lane"]["collected"] == 0 and lanes["lane"]["silent"] and lanes["lane"]["failed"] == 2 * REPEATS
    assert lanes["sums"]["collected"] == 4 * REPEATS and not lanes["sums"]["silent"]
    plan = store.load_plan(run_dir)  # every shard sealed: each seal counted its rollouts per label, status added them
    seals = [orjson.loads(store.done_path(run_dir, spec.index).read_bytes()) for spec in plan.shards]
    assert [sum(m["label_rollouts"][i] for m in seals) for i in range(len(plan.blend))] == [
        lanes[e.label]["collected"] for e in plan.blend
    ]
    text = shardrun("status", str(run_dir), cwd=tmp_path, timeout=120)
    assert "label(s) lane collected nothing" in text.stdout
    merged_out = shardrun("merge-and-profile", str(run_dir), cwd=tmp_path)
    assert merged_out.returncode == 0, merged_out.stdout + merged_out.stderr
    assert "label lane collected nothing: that lane failed" in merged_out.stdout
    doc = orjson.loads(store.labels_path(run_dir).read_bytes())
    assert doc["failed_lanes"] == ["lane"]
    by = {r["label"]: r for r in doc["labels"]}
    assert by["lane"]["failed"] == 2 * REPEATS and by["lane"]["collected"] == 0
    for label in ("sums", "diffs"):
        profile = rows_of(store.by_label_dir(run_dir, label) / "rollouts_reward_profiling.jsonl")
        assert len(profile) == by[label]["tasks_planned"] and by[label]["collected"] == by[label]["rollouts_planned"]
