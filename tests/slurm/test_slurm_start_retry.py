"""A Gym stack start that loses its head server's port to a race is started again on Slurm too (issue 20, item 10):
per-shard job arrays and warm workers on Slurm, the head port taken before Gym's head server binds it
(tests/faults/head_port.py, deterministic). Shard-level retries are off (cluster.max_attempts=1, no auto-resume,
a warm worker may not restart its servers), so only the start's own retry can seal the shards; the merge job (for
the workers, the job after them) then completes. Real Slurm, real NeMo Gym, the stand-in policy server."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardrun.shard import gym_stack
from slurm_helpers import ended_state, fake_policy, launches, math_input, shardrun, write_config
from tests.fakes import harness
from tests.faults.head_port import port_taken_venv
from tests.shard.test_start_retry import SHARDS, check_the_race_was_lost_and_recovered

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.mark.parametrize(
    "cluster",
    [
        pytest.param({"array_parallelism": 2}, id="slurm-arrays"),
        pytest.param({"workers": 1, "max_server_restarts": 0, "auto_resume_rounds": 0}, id="warm-workers-slurm"),
    ],
)
def test_a_lost_head_port_is_started_again_on_slurm(
    tmp_path: Path, slurm_cluster, gym_venv: Path, monkeypatch, cluster: dict
) -> None:
    taken = port_taken_venv(gym_venv, tmp_path)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(taken.venv))
    run_dir = tmp_path / "run"
    with fake_policy(tmp_path) as fake:
        cfg = write_config(
            tmp_path / "run.yaml",
            math_input(tmp_path / "input.jsonl", SHARDS),
            run_dir,
            fake.base_url,
            repeats=2,
            shards=SHARDS,
            cluster={"max_attempts": 1} | cluster,
        )
        shardrun("submit", cfg, cwd=tmp_path)
        merge_job = launches(run_dir)[0]["merge_job_id"]
        assert ended_state(merge_job, 900, "the merge job") == "COMPLETED"
    check_the_race_was_lost_and_recovered(run_dir, taken)
