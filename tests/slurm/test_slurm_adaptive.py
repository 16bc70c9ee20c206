"""Adaptive sampling on the real local Slurm (the session's single-node cluster), both launch modes:

- one array task per shard, run in shard order (`array_parallelism: 1`), each deciding from the rollouts its
  predecessors left in the run directory;
- two warm workers as one job array, one of them SIGKILLed in the middle of a first-wave shard: the other takes the
  shard over after the lease, and the later shards still decide from what is on disk.

The stand-in policy (tests/fakes/policy_server.py, the model being the one seam we do not own) knows each task's
pass rate: never, always, sometimes. The full run of the same plan is collected once on the local executor; every
adaptive run on Slurm must select the same bytes, hold only the full run's rollouts, and account for every skipped
row.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import yaml

from shardrun.rundir import store
from shardrun.shard import gym_stack
from slurm_helpers import fake_policy, scancel_names, launches, shardrun, status_json, wait_for, write_config
from tests.fakes import harness
from tests.e2e.test_adaptive_gym import FLAGS, REPEATS, RULES, full_run
from tests.e2e.test_e2e_local import essentials, rows

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="session")  # once, however xdist interleaves this module's tests with others
def full(tmp_path_factory: pytest.TempPathFactory, gym_venv: Path) -> Path:
    """The input, the per-task pass rates and the full run of the plan (local executor), selected."""
    tmp = tmp_path_factory.mktemp("adaptive-full")
    with full_run(tmp, gym_venv):
        pass
    return tmp


@pytest.fixture
def env(slurm_cluster, gym_venv, monkeypatch):
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return slurm_cluster


def adaptive_config(
    tmp_path: Path, full: Path, url: str, shards: int, cluster: dict, collector: dict | None = None
) -> Path:
    cfg = write_config(
        tmp_path / "adaptive.yaml",
        full / "input.jsonl",
        tmp_path / "adaptive",
        url,
        repeats=REPEATS,
        shards=shards,
        cluster=cluster,
        gym={"num_samples_in_parallel": 4},
        **({"collector": collector} if collector else {}),
    )
    data = yaml.safe_load(cfg.read_text())
    data["sampling"] = {"stop_when_decided": RULES}
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def check_against_full(tmp_path: Path, full: Path, run_dir: Path, shards: int) -> list[dict]:
    """Merge, then: select's bytes equal the full run's, every collected rollout is the full run's, and the skipped
    count is planned minus collected, in the markers and in status. Returns the markers."""
    shardrun("merge-and-profile", run_dir, cwd=tmp_path)
    shardrun("select", run_dir, "-o", tmp_path / "adaptive.jsonl", *FLAGS, cwd=tmp_path)
    assert (tmp_path / "adaptive.jsonl").read_bytes() == (full / "full.jsonl").read_bytes()
    got = essentials(rows(store.merged_rollouts_path(run_dir)))
    want = essentials(rows(store.merged_rollouts_path(full / "full")))
    assert got and set(got) < set(want) and all(got[k] == want[k] for k in got)
    status = status_json(run_dir, tmp_path)
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in range(shards)]
    assert status["skipped_decided"] == sum(m.get("num_skipped_decided", 0) for m in markers) > 0
    assert status["skipped_decided"] == status["planned"] - len(got)
    return markers


def test_adaptive_array_on_slurm_selects_what_the_full_run_selects(tmp_path: Path, full: Path, env) -> None:
    with fake_policy(tmp_path, "--shares", str(full / "shares.json")) as fake:
        # shard 0: every task's first wave; shard 1: the second, started after shard 0 sealed
        cfg = adaptive_config(tmp_path, full, fake.base_url, 2, {"array_parallelism": 1})
        run_dir = tmp_path / "adaptive"
        shardrun("submit", cfg, "--no-merge-job", cwd=tmp_path)
        wait_for(lambda: status_json(run_dir, tmp_path)["complete"], 1200, "both array tasks sealed", interval=5)
    markers = check_against_full(tmp_path, full, run_dir, 2)
    assert markers[1].get("num_skipped_decided", 0) > 0


def test_adaptive_warm_workers_on_slurm_one_killed_mid_shard(tmp_path: Path, full: Path, env) -> None:
    """Two warm workers (one job array) over 4 shards. Shard 0 holds rollouts 0 and 1 of tasks 0-2; task 2's rollout
    1 hangs in the model, and the worker holding shard 0 is SIGKILLed there with every other rollout of it on disk,
    as a node failure would. The other worker takes shard 0 over after the lease and resumes it; the model answers
    each rollout once and the selection equals the full run's."""
    question = f"What is {2 + 2} + 3?"  # task 2 (sometimes solved)
    with fake_policy(
        tmp_path, "--shares", str(full / "shares.json"), "--fault", f"hang:match={question},seed=1"
    ) as fake:
        # one shard at a time: the killed worker holds only shard 0, so the model answers each rollout once
        cluster = {"workers": 2, "claim_heartbeat_s": 1, "claim_lease_s": 10, "max_attempts": 3}
        cfg = adaptive_config(tmp_path, full, fake.base_url, 4, cluster, {"pipeline_shards": 1})
        run_dir = tmp_path / "adaptive"
        shardrun("submit", cfg, "--no-merge-job", cwd=tmp_path)
        rec = launches(run_dir)[0]
        try:
            assert rec["mode"] == "warm_workers" and "jobs" not in rec and len(rec["workers"]) == 2
            wait_for(lambda: [r for r in fake.requests() if r["fault"] == "hang"], 600, "the hanging request")
            claim = json.loads(store.claim_path(run_dir, 0).read_text())
            wait_for(
                lambda: len(harness.keys_complete(store.rollouts_path(run_dir, 0))) == 5,
                300,
                "shard 0's other rollouts to land",
            )
            os.kill(claim["pid"], signal.SIGKILL)
            fake.set_faults([])
            wait_for(lambda: status_json(run_dir, tmp_path)["complete"], 1200, "every shard sealed", interval=5)
        finally:
            scancel_names(rec["tag"], rec["merge_job_name"])
        answered = [(r["prompt"], r["seed"]) for r in fake.requests() if r["fault"] is None]
    assert len(answered) == len(set(answered))  # the model answered each rollout once
    markers = check_against_full(tmp_path, full, run_dir, 4)
    assert all(m.get("worker") for m in markers)
    assert markers[0]["worker"]["id"] != claim["worker_id"]
