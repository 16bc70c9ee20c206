"""End to end on the local executor: real `ng_run`, real `ng_collect_rollouts`, real `ng_reward_profile`; the
policy model is the stand-in server (tests/fakes/policy_server.py: the one seam we do not own).

`shardrun submit` runs a 2-shard plan; its merged rollouts (identities, seeds, rewards, usage) and reward profile
must equal one unsharded `ng_collect_rollouts +num_repeats=k +num_repeats_add_seed=true` run over the same input
followed by `ng_reward_profile`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardrun.core import gym_adapter
from shardrun.shard import gym_stack
from shardrun.shard import runtime
from shardrun.rundir import store
from tests.fakes import harness
from tests.e2e.test_profile_vs_gym import same

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
REPEATS = 3


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def seed_of(row: dict) -> int:
    return json.loads(row["responses_create_params"]["metadata"]["extra_body"])["seed"]


def essentials(rollouts: list[dict]) -> dict[tuple[int, int], tuple]:
    """identity -> (seed, reward, agent, usage, answer): what must not depend on sharding."""
    out = {}
    for r in rollouts:
        key = (r["_ng_task_index"], r["_ng_rollout_index"])
        assert key not in out, f"identity {key} twice"
        usage = r["response"]["usage"]
        out[key] = (
            seed_of(r),
            r["reward"],
            r["agent_ref"]["name"],
            usage["input_tokens"],
            usage["output_tokens"],
            r.get("extracted_answer"),
        )
    return out


def run_cmd(*cmd: str, cwd: Path, env: dict, timeout: float = 300) -> None:
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def unsharded_reference(tmp: Path, cfg_path: Path, input_jsonl: Path, gym_venv: Path, repeats: int = REPEATS) -> Path:
    """One plain Gym run over the input (own stack), then the release's own profiler. Returns its output dir."""
    release = gym_adapter.for_venv(gym_venv)
    cfg = harness.load_config(cfg_path)
    out = tmp / "reference" / "out"
    out.mkdir(parents=True)
    for attempt in (1, 2):
        stack, _ = gym_stack.start_ready(
            tmp / "reference", 0, cfg.gym, [cfg.policy.base_url], harness.API_KEY, cfg.policy.model_name
        )
        try:
            env = gym_stack.stack_env(dict(os.environ), gym_venv, stack.ray_tmp, True)
            proc = subprocess.run(
                [
                    *release.collect_command(gym_venv),
                    f"+head_server.host={gym_stack.HEAD_HOST}",
                    f"+head_server.port={stack.port}",
                    f"+input_jsonl_fpath={input_jsonl}",
                    f"+output_jsonl_fpath={out / 'rollouts.jsonl'}",
                    f"+num_repeats={repeats}",
                    "+num_repeats_add_seed=true",
                    "+num_samples_in_parallel=4",
                    "+disable_aggregation=true",
                ],
                cwd=out,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            # the reference's own stack can lose a server's port to a test running beside it (Gym picks its
            # servers' ports at random; another stack answered on it, then ng_run exited): started once more
            lost = not stack.proc.alive() and stack.transient_failure() is not None
        finally:
            stack.stop()
        if proc.returncode == 0 or not lost or attempt == 2:
            break
    assert proc.returncode == 0, f"the reference collection failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_cmd(
        *release.profile_command(gym_venv, out / "rollouts_materialized_inputs.jsonl", out / "rollouts.jsonl", False),
        cwd=out,
        env=dict(os.environ),
    )
    return out


def profile_rows(path: Path) -> list[dict]:
    return sorted(rows(path), key=lambda r: r["_ng_task_index"])


def test_sharded_submit_equals_one_unsharded_gym_run(tmp_path: Path, gym_venv_each: Path, monkeypatch) -> None:
    """On every supported Gym version (gym_venv_each): the sharded run and its merged profile equal one unsharded
    run of that version and that version's own profiler, file for file."""
    gym_venv = gym_venv_each
    release = gym_adapter.for_venv(gym_venv)
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl = harness.example_input(tmp_path / "input.jsonl", gym_venv, math_rows=4, weather_rows=1)
    run_dir = tmp_path / "run"
    with harness.fake_policy(tmp_path, "--correct-share", "0.5") as fake:
        cfg_path = harness.write_config(
            tmp_path / "run.yaml", input_jsonl, run_dir, fake.base_url, repeats=REPEATS, shards=2
        )
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path)],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        sharded_s = time.monotonic() - t0
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"run directory: {run_dir}" in done.stdout
        assert "shard 00000: sealed" in done.stdout and "shard 00001: sealed" in done.stdout
        assert all(r["auth_ok"] for r in fake.requests())
        n_requests = len(fake.requests())

        reference = unsharded_reference(tmp_path, cfg_path, input_jsonl, gym_venv)

        # a second submit launches nothing; a foreign marker is reported, ignored, and the shard re-sealed from
        # its files without starting any server
        again = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert again.returncode == 0 and "every shard is sealed" in again.stdout, again.stdout + again.stderr
        shutil.copy(store.done_path(run_dir, 0), store.done_path(run_dir, 1))
        again = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert "marker is for shard 0" in again.stderr and "shard 00001: sealed" in again.stdout
        assert "sealing without starting servers" in store.shard_log_path(run_dir, 1).read_text()
        assert runtime.run_shard(run_dir, 0).state == "already_sealed"
        reference_requests = len(fake.requests()) - n_requests

    # identities, seeds, rewards, usage: the concatenated shards equal the unsharded run
    shard_rollouts = [r for i in (0, 1) for r in rows(store.rollouts_path(run_dir, i))]
    ref_rollouts = rows(reference / "rollouts.jsonl")
    assert len(shard_rollouts) == len(ref_rollouts) == 5 * REPEATS
    assert essentials(shard_rollouts) == essentials(ref_rollouts)
    assert {seed_of(r) for r in shard_rollouts} == set(range(REPEATS))
    assert len({r["reward"] for r in shard_rollouts}) > 1, "rewards should vary"
    assert n_requests == reference_requests  # same number of model calls: nothing ran twice
    planned = b"".join(store.materialized_path(run_dir, i).read_bytes() for i in (0, 1))
    assert planned == (reference / "rollouts_materialized_inputs.jsonl").read_bytes()

    # the merged profile equals ng_reward_profile of the unsharded run
    from shardrun.profile import merge_and_profile

    merge_and_profile.merge_and_profile(run_dir)
    merged = store.merged_dir(run_dir)
    assert profile_rows(merged / "rollouts_reward_profiling.jsonl") == profile_rows(
        reference / "rollouts_reward_profiling.jsonl"
    )
    for suffix in release.profile_file_suffixes()[1:]:  # agent metrics; with 0.7 also the repeat-level metrics
        name = f"rollouts{suffix}"
        same(json.loads((merged / name).read_text()), json.loads((reference / name).read_text()), name)
    profile_files = {p.name for p in merged.glob("rollouts_*_metrics.json")} - {"rollouts_aggregate_metrics.json"}
    assert profile_files == {p.name for p in reference.glob("rollouts_*_metrics.json")}  # no file more, none less
    assert store.load_plan(run_dir).gym_version == release.version

    # nothing left running, no key on disk, env.yaml deleted
    assert harness.tagged_processes(tag) == []
    for i in (0, 1):
        assert not store.env_yaml_path(run_dir, i).exists()
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert harness.API_KEY.encode() not in path.read_bytes(), f"API key written to {path}"
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in (0, 1)]
    assert [m["gym_version"] for m in markers] == [release.version] * 2
    assert markers[0]["server_wait_s"] > 0 and markers[0]["collect_s"] > 0 and markers[0]["extra"]["output_tokens"] > 0
    assert (
        markers[1]["server_wait_s"] == 0
        and markers[1]["num_rollouts"] + markers[1]["num_failed"] == markers[1]["planned_rollouts"]
    )  # re-sealed from its files, no servers
    print(f"sharded submit (2 shards, sequential): {sharded_s:.1f} s")
