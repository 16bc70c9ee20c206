"""Profile maths against a straightforward per-group computation (statistics module, plain loops)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.merge import merged_table
from shardrun.profile import reward_profile
from shardrun.profile.reward_profile import COUNT, MAX, MEAN, MEDIAN, MIN, STD, Layout


def reference(values: list[float]) -> tuple[float, ...]:
    """count, mean, max, min, median, std (ddof 1) of the non-NaN values; NaN where undefined."""
    v = [x for x in values if not math.isnan(x)]
    nan = float("nan")
    if not v:
        return 0, nan, nan, nan, nan, nan
    return (
        len(v),
        statistics.fmean(v),
        max(v),
        min(v),
        statistics.median(v),
        statistics.stdev(v) if len(v) > 1 else nan,
    )


def assert_close(got: float, want: float, scale: float = 1.0) -> None:
    """Equal up to rounding: relative 1e-12, or 1e-12 of `scale` (the sum of the inputs' sizes, which bounds a
    sum's rounding error: a mean near 0 of values near 1e6 is off by more than 1e-12 of itself)."""
    if math.isnan(want):
        assert math.isnan(got), (got, want)
    else:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12 * max(1.0, scale))


def magnitude(values: list[float]) -> float:
    return sum(abs(x) for x in values if not math.isnan(x))


groups_strategy = st.lists(
    st.lists(
        st.one_of(st.just(float("nan")), st.integers(-5, 5).map(float), st.floats(-1e6, 1e6, allow_nan=False)),
        min_size=1,
        max_size=40,
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(groups_strategy)
def test_segment_stats_equal_reference(groups: list[list[float]]) -> None:
    values = np.array([x for g in groups for x in g])
    sizes = np.array([len(g) for g in groups])
    starts = np.cumsum(np.r_[0, sizes[:-1]])
    got = reward_profile.segment_stats(values, starts, sizes)
    for j, g in enumerate(groups):
        for stat, want in zip((COUNT, MEAN, MAX, MIN, MEDIAN, STD), reference(g)):
            assert_close(float(got[stat, j]), float(want), magnitude(g))


def test_one_huge_segment_and_many_small_ones() -> None:
    rng = np.random.default_rng(0)
    sizes = np.array([1, 3, 5000, 2, 17, 1])
    values = rng.normal(size=sizes.sum())
    values[rng.random(sizes.sum()) < 0.1] = np.nan
    starts = np.cumsum(np.r_[0, sizes[:-1]])
    got = reward_profile.segment_stats(values, starts, sizes)
    for j, (s, n) in enumerate(zip(starts, sizes)):
        for stat, want in zip((COUNT, MEAN, MAX, MIN, MEDIAN, STD), reference(values[s : s + n].tolist())):
            assert_close(float(got[stat, j]), float(want))


def test_single_rollout_std_is_zero_only_for_present_columns() -> None:
    # segment 0: one row, column b missing -> std a = 0, std b undefined
    # segment 1: two rows, column b present once -> std b stays undefined (not every std is undefined)
    # segment 2: two rows, each column present once -> every std undefined, but no column is complete -> NaN
    a = np.array([1.0, 2.0, 4.0, 7.0, np.nan])
    b = np.array([np.nan, 5.0, np.nan, np.nan, 3.0])
    starts, sizes = np.array([0, 1, 3]), np.array([1, 2, 2])
    stats = reward_profile.group_stats([a, b], starts, sizes)
    assert stats[STD, 0, 0] == 0.0 and math.isnan(stats[STD, 1, 0])
    assert stats[STD, 0, 1] == pytest.approx(statistics.stdev([2.0, 4.0])) and math.isnan(stats[STD, 1, 1])
    assert math.isnan(stats[STD, 0, 2]) and math.isnan(stats[STD, 1, 2])


def test_stat_items_order_nan_dropping_and_integer_rule() -> None:
    a = np.array([1.0, 3.0])
    b = np.array([np.nan, np.nan])
    stats = reward_profile.group_stats([a, b], np.array([0]), np.array([2]))
    layout = Layout(("a", "b"), (0, 1), all_int=False)
    items = reward_profile.stat_items(layout, stats, 0)
    assert list(items) == ["mean/a", "max/a", "min/a", "median/a", "std/a"]
    assert items["max/a"] == 3.0 and isinstance(items["max/a"], float)
    ints = reward_profile.stat_items(Layout(("a", "b"), (0,), all_int=True), stats, 0)
    assert ints["max/a"] == 3 and isinstance(ints["max/a"], int) and isinstance(ints["mean/a"], float)
    assert isinstance(ints["median/a"], float)


def test_stat_items_follow_layout_order() -> None:
    cols = [np.array([1.0]), np.array([2.0]), np.array([3.0])]
    stats = reward_profile.group_stats(cols, np.array([0]), np.array([1]))
    items = reward_profile.stat_items(Layout(("x", "y", "z"), (2, 0, 1), all_int=False), stats, 0)
    assert list(items)[:3] == ["mean/z", "mean/x", "mean/y"]


def test_segments_and_buckets() -> None:
    starts, sizes = merged_table.segments(np.array([4, 4, 7, 9, 9, 9]))
    assert starts.tolist() == [0, 2, 3] and sizes.tolist() == [2, 1, 3]
    buckets = reward_profile.size_buckets(np.array([1, 16, 2, 3, 1000, 4]))
    widths = [sorted(np.array([1, 16, 2, 3, 1000, 4])[b].tolist()) for b in buckets]
    assert all(w[-1] <= 2 * max(w[0], 1) for w in widths)
    assert sorted(i for b in buckets for i in b.tolist()) == list(range(6))


def test_task_profile_row_shape() -> None:
    row = reward_profile.task_profile_row(7, {"mean/reward": 0.5}, {"q": 1}, 3, 4, [{"rollout_id": "7:0"}])
    assert list(row) == [
        "_ng_task_index",
        "mean/reward",
        "sample",
        "num_rollouts",
        "expected_num_rollouts",
        "missing_num_rollouts",
        "reward_profile_completion_pct",
        "rollout_infos",
    ]
    assert row["missing_num_rollouts"] == 1 and row["reward_profile_completion_pct"] == 75.0
    assert reward_profile.sample_of({"a": 1, "_ng_task_index": 7, "_ng_rollout_index": 0, "b": 2}) == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "items, n, expected",
    [({"mean/reward": 0.5, "max/x": 3}, 3, 4), ({}, 0, 0), ({"std/é": float("1e-7"), "min/r": True}, 7, 3)],
)
def test_task_profile_row_json_is_the_rows_orjson_bytes(items: dict, n: int, expected: int) -> None:
    infos = [{"rollout_id": "7:0", "_ng_task_index": 7, "reward": 1.0}]
    sample = {"q": "ü", "agent_ref": {"name": "a"}}
    want = orjson.dumps(reward_profile.task_profile_row(7, items, sample, n, expected, infos))
    got = reward_profile.task_profile_row_json(
        7, orjson.dumps(items), orjson.dumps(sample), n, expected, orjson.dumps(infos)
    )
    assert got == want
