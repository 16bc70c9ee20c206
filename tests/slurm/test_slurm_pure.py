"""Pure Slurm pieces: array layout, time limits, sbatch parameters (no Slurm)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.launch import slurm
from shardrun.core.config import ClusterConfig
from shardrun.core.errors import BadInput


def test_layout_splits_by_max_array_size():
    layout = slurm.array_layout(list(range(2500)), 1001, 64)
    assert [c.size for c in layout] == [1001, 1001, 498]
    assert [c.shards[0] for c in layout] == [0, 1001, 2002]
    assert sum(c.parallelism for c in layout) == 64
    # shares in proportion to the sizes (largest remainder), so the arrays finish at about the same time
    assert [c.parallelism for c in layout] == [26, 25, 13]


def test_layout_small_cases():
    assert slurm.array_layout([], 10, 2) == []
    assert slurm.array_layout([3, 5, 9], 1001, 64) == [slurm.ArrayChunk((3, 5, 9), 3)]
    assert slurm.array_layout([0, 1, 2], 2, 2) == [slurm.ArrayChunk((0, 1), 1), slurm.ArrayChunk((2,), 1)]
    # more arrays than the cap: one slot each
    assert [c.parallelism for c in slurm.array_layout(list(range(5)), 1, 2)] == [1] * 5
    with pytest.raises(BadInput):
        slurm.array_layout([1], 0, 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 1001), st.integers(1, 300))
def test_layout_properties(n, max_size, cap):
    shards = list(range(0, 2 * n, 2))
    layout = slurm.array_layout(shards, max_size, cap)
    assert [s for c in layout for s in c.shards] == shards
    assert all(1 <= c.size <= max_size for c in layout)
    assert len(layout) == -(-n // max_size)
    assert all(1 <= c.parallelism <= c.size for c in layout)
    assert sum(c.parallelism for c in layout) <= max(cap, len(layout))


def test_format_ranges_and_describe():
    assert slurm.format_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    text = slurm.describe_layout(slurm.array_layout(list(range(5)), 2, 2))
    assert "3 job array(s), 5 shard(s)" in text and "--array=0-1%1  shards 0-1" in text


@pytest.mark.parametrize(
    "value,minutes",
    [
        ("30", 30),
        ("30:30", 31),
        ("01:00:00", 60),
        ("04:00:00", 240),
        ("1-00", 1440),
        ("1-02:03", 1563),
        ("0-00:01:00", 1),
        (5, 5),
        ("1", 1),
    ],
)
def test_parse_time_limit(value, minutes):
    assert slurm.parse_time_limit(value) == minutes


@pytest.mark.parametrize("bad", ["", "abc", "1:2:3:4", "00:00:30", 0, "1-", "::"])
def test_parse_time_limit_rejects(bad):
    with pytest.raises(BadInput):
        slurm.parse_time_limit(bad)


def test_time_limit_per_partition_and_signal_delay():
    c = ClusterConfig(partition="batch", timeouts={"batch": "02:00:00"}, time_limit="04:00:00")
    assert slurm.shard_time_minutes(c) == 120
    assert slurm.shard_time_minutes(ClusterConfig(time_limit="00:10:00")) == 10
    assert slurm.shard_time_minutes(ClusterConfig()) == 240
    assert slurm.signal_delay_s(ClusterConfig(signal_delay_s=120), 1) == 30  # at most half a 1-minute limit
    assert slurm.signal_delay_s(ClusterConfig(signal_delay_s=120), 240) == 120


def test_shard_parameters():
    c = ClusterConfig(
        executor="slurm",
        account="acc",
        partition="gpu",
        qos="high",
        time_limit="01:30:00",
        gpus_per_node=8,
        cpus_per_task=32,
        mem_gb=256,
        env_vars=["HF_HOME=/x y", "WANDB_API_KEY"],
        setup=["module load cuda"],
        containers={"shardrun": "/img.sqsh"},
        mounts=["/a:/a", "/b:/b"],
        additional_parameters={"exclusive": True},
    )
    p = slurm.shard_parameters(c, job_name="sr-abc", comment="shardrun /runs/x", pass_through_env=["OPENAI_KEY"])
    assert p["time"] == 90 and p["mem"] == "256GB" and p["gpus_per_node"] == 8 and p["qos"] == "high"
    assert p["srun_args"] == ["--container-image=/img.sqsh", "--container-mounts=/a:/a,/b:/b"]
    assert p["setup"][0] == "export HF_HOME='/x y'"
    assert "WANDB_API_KEY:?" in p["setup"][1] and "OPENAI_KEY:?" in p["setup"][2]
    assert p["setup"][-1] == "module load cuda"
    assert p["additional_parameters"] == {"requeue": True, "export": "ALL", "exclusive": True}
    assert "gpus_per_node" not in slurm.shard_parameters(ClusterConfig(), job_name="j", comment="c")


def test_secret_values_are_refused():
    with pytest.raises(BadInput, match="looks like a secret"):
        slurm.env_setup_lines(["HF_TOKEN=hf_abc"])
    with pytest.raises(BadInput, match="container image"):
        slurm.container_srun_args(ClusterConfig(mounts=["/a:/a"]))


def test_merge_parameters():
    c = ClusterConfig(partition="gpu", merge_partition="cpu", env_vars=["A=1", "SECRET_PASS_THROUGH"])
    p = slurm.merge_parameters(c, job_name="sr-abc-merge", comment="c", after=["11", "12"])
    assert p["partition"] == "cpu" and p["time"] == 60 and p["mem"] == "16GB" and p["cpus_per_task"] == 4
    assert p["additional_parameters"]["dependency"] == "afterany:11:12"
    assert p["additional_parameters"]["kill-on-invalid-dep"] == "yes"
    assert p["setup"] == ["export A=1"]


def test_job_tag_is_per_run_dir_and_plan(tmp_path):
    a = slurm.job_tag("sr", tmp_path / "a", "f" * 64)
    assert a == slurm.job_tag("sr", tmp_path / "a", "f" * 64)
    assert a != slurm.job_tag("sr", tmp_path / "b", "f" * 64) != slurm.job_tag("sr", tmp_path / "a", "e" * 64)
    assert a.startswith("sr-") and len(a) == 13
    assert slurm.merge_job_name(a) == a + "-merge"


def test_missing_pass_through():
    assert slurm.missing_pass_through(["A=1", "B", "C"], ["KEY"], {"C": "x"}) == ["B", "KEY"]
    assert slurm.missing_pass_through(["A=1"], [], {}) == []
