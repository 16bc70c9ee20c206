"""sacct against the real local Slurm (slurmdbd): states and GPU-hours of array tasks, as the report and status
use them."""

from __future__ import annotations

import subprocess
import time

import pytest

from shardrun.launch import scheduler
from shardrun.rundir import cost, records

pytestmark = pytest.mark.slurm


def test_query_sacct_reads_real_array_tasks(slurm_cluster):
    out = subprocess.run(
        ["sbatch", "--parsable", "--array=0-1", "--job-name=shardrun-cost-test", "--time=2", "--wrap", "sleep 2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    array = out.strip().split(";")[0]
    ids = [f"{array}_0", f"{array}_1"]
    deadline = time.time() + 120
    jobs: dict[str, scheduler.SacctJob] = {}
    while time.time() < deadline:
        jobs = scheduler.query_sacct(ids)
        if jobs and len(jobs) == 2 and all(j.state == "COMPLETED" for j in jobs.values()):
            break
        time.sleep(1)
    assert jobs and set(jobs) == set(ids) and all(j.state == "COMPLETED" for j in jobs.values()), jobs
    for j in jobs.values():
        assert 2 <= j.elapsed_s < 60
        assert j.gpus == 0 and j.gpu_hours == 0.0  # the local cluster has no GPUs (AllocTRES without gres/gpu)
    assert set(scheduler.query_sacct([array])) == set(ids)  # an array id answers for its tasks
    gpu_hours = {job_id: job.gpu_hours for job_id, job in jobs.items()}
    shards = cost.with_sacct(
        cost.shard_costs(
            [records.Seal.model_construct(shard_index=0, job_id=ids[0], gpus=0, num_rollouts=0, num_failed=0)]
        ),
        gpu_hours,
    )
    assert shards[0].sacct_gpu_hours == 0.0 and cost.run_costs(shards).sacct_gpu_hours == 0.0
