"""Cost accounting from sealed markers and sacct: GPU-hours, rollouts per GPU-hour, tokens per second."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reportkit import input_row, planned_run, seal_shards
from shardrun.rundir import cost
from shardrun.rundir import seal
from shardrun.rundir import store


def sealed(**fields) -> seal.Seal:
    """A seal with these fields (the ones cost accounting does not read filled in)."""
    base = {"plan_fingerprint": "f", "rollouts_sha256": "0", "rollouts_bytes": 0, "num_rollouts": 0, "num_failed": 0}
    return seal.Seal.model_validate(base | fields)


def marker(i: int, start: float, wall: float, gpus: int = 8, rollouts: int = 100, **kw) -> seal.Seal:
    m = {
        "shard_index": i,
        "started_at": start,
        "finished_at": start + wall,
        "gpus": gpus,
        "gpu_hours": gpus * wall / 3600,
        "num_rollouts": rollouts,
        "num_failed": 0,
        "attempt": 1,
        "collect_s": wall - 100,
        "server_wait_s": 100.0,
        "host": "n",
        "job_id": f"77_{i}",
    }
    m.update(kw)
    return sealed(**m)


def test_shard_cost_from_a_real_marker():
    from shardrun.plan.planner import InputInfo, Plan, ShardSpec

    plan = Plan("1", InputInfo("x", "0" * 64, 1), {}, {}, 1, 40, {}, (ShardSpec(0, 40, "range", 0, 40),), (), "f")
    m = seal.make_marker(
        plan,
        0,
        num_rollouts=38,
        num_failed=2,
        rollouts_sha256="0",
        rollouts_bytes=1,
        started_at=1000.0,
        finished_at=1000.0 + 5400,
        host="h",
        job_id="12_0",
        attempt=2,
        server_wait_s=120.0,
        collect_s=5000.0,
        gpus=4,
        extra={"output_tokens": 250_000},
    )
    c = cost.shard_cost(m)
    assert (c.shard_index, c.attempt, c.gpus, c.num_rollouts, c.num_failed) == (0, 2, 4, 38, 2)
    assert c.wall_s == 5400 and c.gpu_hours == pytest.approx(6.0)
    assert c.rollouts_per_gpu_hour == pytest.approx(38 / 6)
    assert c.output_tokens_per_s == pytest.approx(250_000 / 5000)  # over collection time, not wall time


def test_missing_fields_degrade_to_none_not_to_made_up_numbers():
    c = cost.shard_cost(sealed(shard_index=3, started_at=0.0, finished_at=3600.0, gpus=0, num_rollouts=10))
    assert c.gpu_hours == 0 and c.rollouts_per_gpu_hour is None and c.output_tokens_per_s is None
    assert cost.shard_cost(sealed(shard_index=1, started_at=0, finished_at=1800, gpus=2)).gpu_hours == 1.0


def test_run_costs_sum_shards_and_span_first_start_to_last_end():
    shards = cost.shard_costs(
        [marker(1, 3600, 7200, extra={"output_tokens": 9000}), None, marker(0, 0, 3600, extra={"output_tokens": 1800})]
    )
    assert [s.shard_index for s in shards] == [0, 1]
    run = cost.run_costs(shards)
    assert run.gpu_hours == pytest.approx(8 + 16) and run.rollouts == 200 and run.wall_s == 10800
    assert run.rollouts_per_gpu_hour == pytest.approx(200 / 24)
    assert run.output_tokens_per_s == pytest.approx(10800 / 10800)
    assert dict(cost.cost_rows(run))["wall time"] == "3:00:00"
    partial = cost.run_costs(cost.shard_costs([marker(0, 0, 10, extra={"output_tokens": 5}), marker(1, 0, 10)]))
    assert "output_tokens" not in partial.tokens and partial.output_tokens_per_s is None


def test_run_costs_of_nothing():
    run = cost.run_costs([])
    assert (run.shards, run.gpu_hours, run.wall_s, run.rollouts_per_gpu_hour) == (0, 0, 0.0, None)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1e5), st.floats(0, 1e4), st.integers(0, 1000)), min_size=1, max_size=12),
    st.integers(1, 80),
)
def test_throughput_integrates_to_the_rollouts_done(spec, bins):
    shards = cost.shard_costs([marker(i, s, w, rollouts=n) for i, (s, w, n) in enumerate(spec)])
    tp = cost.throughput(shards, bins)
    width_min = [(b - a) / 60 for a, b in zip(tp.edges_s, tp.edges_s[1:])]
    total = sum(r * w for r, w in zip(tp.rollouts_per_min, width_min))
    assert total == pytest.approx(sum(n for *_, n in spec), rel=1e-6, abs=1e-6)
    assert tp.sealed[-1] == sum(n for *_, n in spec) and list(tp.sealed) == sorted(tp.sealed)


# ---------------------------------------------------------------- sacct


def test_sacct_gpu_hours_attached_by_job_id():
    shards = cost.with_sacct(
        cost.shard_costs([marker(0, 0, 3000), marker(1, 0, 5000), marker(5, 0, 1)]), {"77_0": 8.0, "77_1": 9.0}
    )
    assert [s.sacct_gpu_hours for s in shards] == [8.0, 9.0, None]
    run = cost.run_costs(shards)
    assert run.sacct_gpu_hours == pytest.approx(17.0)
    assert "GPU-hours (sacct)" in dict(cost.cost_rows(run))
    assert "GPU-hours (sacct)" not in dict(cost.cost_rows(cost.run_costs(cost.with_sacct(shards[2:], {}))))


def test_costs_from_a_sealed_run_directory(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    markers = seal_shards(run_dir, lambda t, r: 1.0, gpus=2)
    plan = store.load_plan(run_dir)
    on_disk = [seal.check(run_dir, plan, s.index).marker for s in plan.shards]
    run = cost.run_costs(cost.shard_costs(on_disk))
    assert run.shards == 3 and run.rollouts == 12
    assert run.gpu_hours == pytest.approx(sum(2 * (m.finished_at - m.started_at) / 3600 for m in markers))
    assert run.tokens["output_tokens"] == sum(m.extra["output_tokens"] for m in markers)


def test_status_shows_the_sealed_cost(tmp_path):
    from shardrun.launch import status

    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    markers = seal_shards(run_dir, lambda t, r: 1.0, gpus=2)
    st = status.collect(run_dir, query_live=lambda names: {}, query_ended=lambda ids: {})
    run = cost.run_costs(cost.shard_costs(markers))
    assert st.sealed_cost == cost.run_row(run)
    line = next(ln for ln in status.render(st).splitlines() if ln.startswith("sealed cost"))
    assert f"{run.rollouts_per_gpu_hour:,.1f} rollouts/GPU-hour" in line
    assert f"{run.output_tokens_per_s:,.1f} output tokens/s over 3 sealed shard(s)" in line
    assert cost.sealed_cost_text({}) == "-"


def test_merge_summary_shows_the_cost(tmp_path):
    from reportkit import merge_run
    from shardrun.merge import outcome

    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=3)
    markers = seal_shards(run_dir, lambda t, r: 1.0, gpus=4)
    summary = merge_run(run_dir)
    run = cost.run_costs(cost.shard_costs(markers))
    assert summary.to_json()["cost"] == cost.run_row(run)
    rows = dict(ln.split("  ", 1) for ln in outcome.render(summary).splitlines()[:14] if "  " in ln)
    assert rows["rollouts per GPU-hour"].strip() == f"{run.rollouts_per_gpu_hour:,.1f}"
    assert rows["output tokens per second"].strip() == f"{run.output_tokens_per_s:,.1f}"
    assert rows["wall time"].strip() == cost.hours(run.wall_s)
