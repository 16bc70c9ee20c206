"""Adaptive sampling on the real local Slurm (the session's single-node cluster): one array task per shard, run in
shard order (`array_parallelism: 1`), each deciding from the rollouts its predecessors left in the run directory.

The stand-in policy (tests/fakes/policy_server.py, the model being the one seam we do not own) knows each task's
pass rate: never, always, sometimes. The full run of the same plan is collected on the local executor; the adaptive
run on Slurm must select the same bytes, hold only the full run's rollouts, and account for every skipped row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardrun.rundir import store
from slurm_helpers import fake_policy, shardrun, status_json, wait_for, write_config
from tests.fakes import harness
from tests.test_adaptive_gym import FLAGS, REPEATS, RULES, SHARES, write_input
from tests.test_e2e_local import essentials, rows

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture
def env(slurm_cluster, gym_venv, monkeypatch):
    from shardrun.shard import gym_stack

    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return slurm_cluster


def test_adaptive_array_on_slurm_selects_what_the_full_run_selects(tmp_path: Path, env) -> None:
    inp = write_input(tmp_path / "input.jsonl")
    (tmp_path / "shares.json").write_text(json.dumps({f"What is {i + 2} + 3?": s for i, s in enumerate(SHARES)}))
    with fake_policy(tmp_path, "--shares", str(tmp_path / "shares.json")) as fake:
        full_cfg = harness.write_config(tmp_path / "full.yaml", inp, tmp_path / "full", fake.base_url, repeats=REPEATS)
        shardrun("submit", full_cfg, cwd=tmp_path, timeout=900)
        shardrun("merge-and-profile", tmp_path / "full", cwd=tmp_path)
        run_dir = tmp_path / "adaptive"
        cfg = write_config(
            tmp_path / "adaptive.yaml",
            inp,
            run_dir,
            fake.base_url,
            repeats=REPEATS,
            shards=2,  # shard 0: every task's first wave; shard 1: the second
            cluster={"array_parallelism": 1},
            gym={"num_samples_in_parallel": 4},
        )
        data = yaml.safe_load(cfg.read_text())
        data["sampling"] = {"stop_when_decided": RULES}
        cfg.write_text(yaml.safe_dump(data))
        shardrun("submit", cfg, "--no-merge-job", cwd=tmp_path)
        wait_for(lambda: status_json(run_dir, tmp_path)["complete"], 1200, "both array tasks sealed", interval=5)
    shardrun("merge-and-profile", run_dir, cwd=tmp_path)
    shardrun("select", tmp_path / "full", "-o", tmp_path / "full.jsonl", *FLAGS, cwd=tmp_path)
    shardrun("select", run_dir, "-o", tmp_path / "adaptive.jsonl", *FLAGS, cwd=tmp_path)
    assert (tmp_path / "adaptive.jsonl").read_bytes() == (tmp_path / "full.jsonl").read_bytes()
    got = essentials(rows(store.merged_rollouts_path(run_dir)))
    want = essentials(rows(store.merged_rollouts_path(tmp_path / "full")))
    assert got and set(got) < set(want) and all(got[k] == want[k] for k in got)
    status = status_json(run_dir, tmp_path)
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in range(2)]
    assert markers[1].get("num_skipped_decided", 0) > 0
    assert status["skipped_decided"] == sum(m.get("num_skipped_decided", 0) for m in markers)
    assert status["skipped_decided"] == status["planned"] - len(got)
