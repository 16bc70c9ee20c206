"""`shardrun rescore` on a real Slurm (the local single-node cluster of the session fixture): the re-score's shards
run as a job array with the merge job after them, each re-verifying its source shard with NeMo Gym 0.7's own
`gym eval reverify`; every shard seals, the merge job merges the re-score, and its rewards equal those of the same
re-score run as local jobs. The source is collected locally (real Gym, the stand-in policy
tests/fakes/policy_server.py; no policy is asked in a re-score)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardrun.core import gym_adapter
from shardrun.rundir import seal, store
from slurm_helpers import ended_state, fake_policy, launches, math_input, shardrun, write_config
from tests.fakes import harness

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1200)]
SHARDS = 2


def shard_rewards(run_dir: Path) -> dict[tuple[int, int], float]:
    out = {}
    for i in range(SHARDS):
        for r in store.iter_jsonl_objects(store.rollouts_path(run_dir, i)):
            out[(r["_ng_task_index"], r["_ng_rollout_index"])] = r["reward"]
    return out


def test_a_rescore_on_slurm_seals_merges_and_equals_the_local_rescore(
    tmp_path: Path, slurm_cluster, gym_venv: Path, monkeypatch
) -> None:
    if gym_adapter.for_venv(gym_venv).version.startswith("0.4"):
        pytest.skip("gym eval reverify is nemo-gym 0.7's")
    from shardrun.shard import gym_stack

    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    source = tmp_path / "run"
    with fake_policy(tmp_path, "--correct-share", "0.5") as fake:
        inp = math_input(tmp_path / "input.jsonl", 4)
        cfg = write_config(tmp_path / "run.yaml", inp, source, fake.base_url, repeats=2, shards=SHARDS)
        shardrun("submit", cfg, "cluster.executor=local", cwd=tmp_path, timeout=900)
    before = shard_rewards(source)
    assert len(before) == 8

    local = tmp_path / "local"
    shardrun("rescore", source, "-o", local, "--force", cwd=tmp_path, timeout=900)
    on_slurm = tmp_path / "slurm"
    out = shardrun("rescore", source, "cluster.executor=slurm", "-o", on_slurm, "--force", cwd=tmp_path).stdout
    rec = launches(on_slurm)[0]
    assert f"merge job: {rec['merge_job_id']}" in out, out
    assert ended_state(rec["merge_job_id"], 900, "the re-score's merge job") == "COMPLETED"

    plan = store.load_plan(on_slurm)
    assert plan.config["cluster"]["executor"] == "slurm" and plan.config["rescore"]["force"] is True
    assert all(seal.check(on_slurm, plan, i, deep=True).sealed for i in range(SHARDS))
    assert sorted(rec["jobs"]) == [str(i) for i in range(SHARDS)]  # one array task per shard
    assert shard_rewards(on_slurm) == shard_rewards(local) == before  # the same scoring: every reward as it was
    merged = [json.loads(line) for line in store.merged_rollouts_path(on_slurm).read_text().splitlines() if line]
    assert {(r["_ng_task_index"], r["_ng_rollout_index"]): r["reward"] for r in merged} == before
