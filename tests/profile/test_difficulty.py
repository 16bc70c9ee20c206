"""The difficulty buckets (core/task_rules.py `bucket`) and the 95% intervals of pass@k (profile/intervals.py), each
against a plain computation on hypothesis-generated profiles: buckets by counting, pass@k by the combinatorial
formula, the bootstrap interval against the exact bootstrap distribution (every resample enumerated)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.analysis import selection
from shardrun.core import task_rules
from shardrun.profile import intervals, taskstats
from shardrun.profile.taskstats import TaskStat

REWARDS = st.sampled_from([0.0, 1.0, 1.0, 0.0, 0.5])  # mostly 0/1; a 0.5 makes a task non-binary


def task(index: int, agent: str, rewards: list[float]) -> TaskStat:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    stats = {"mean/reward": mean, "min/reward": min(rewards), "max/reward": max(rewards), "std/reward": std}
    return TaskStat(index, agent, len(rewards), len(rewards), stats, tuple(rewards))


@st.composite
def profiles(draw, max_tasks: int = 30, max_rollouts: int = 6) -> list[TaskStat]:
    n = draw(st.integers(1, max_tasks))
    return [
        task(i, draw(st.sampled_from(["a", "b"])), draw(st.lists(REWARDS, min_size=1, max_size=max_rollouts)))
        for i in range(n)
    ]


def plain_bucket(rewards: tuple[float, ...]) -> str:
    solved = sum(r >= 1.0 for r in rewards)
    return "never" if solved == 0 else "always" if solved == len(rewards) else "sometimes"


def plain_pass_at_k(rewards: tuple[float, ...], k: int) -> float:
    """Binary rewards: the chance that k of the task's rollouts drawn without replacement hold a success (every
    subset enumerated); otherwise the best of the first k rewards (Gym's rule for non-binary scores)."""
    if any(r not in (0.0, 1.0) for r in rewards):
        return max(rewards[:k])
    subsets = list(itertools.combinations(rewards, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_bucket_is_the_three_ways_a_task_can_go():
    # by the lowest and the highest reward of the task's rollouts, against the solved threshold
    assert task_rules.bucket(0.0, 0.99) == "never" and task_rules.bucket(0.0, 1.0) == "sometimes"
    assert task_rules.bucket(1.0, 1.5) == "always" and task_rules.bucket(0.5, 0.7, solved_threshold=0.6) == "sometimes"
    assert task_rules.bucket(None, None) is None


@settings(max_examples=200, deadline=None)
@given(profiles())
def test_buckets_match_counting_and_what_select_drops(tasks):
    plain = {a: dict.fromkeys(task_rules.BUCKETS, 0) for a in "ab"}
    for t in tasks:
        plain[t.agent][plain_bucket(t.rewards)] += 1
        assert taskstats.task_bucket(t) == plain_bucket(t.rewards)
    for s in taskstats.agent_summaries(tasks):
        assert dict(s.buckets) == plain[s.agent]
    # the buckets are select's rules: --drop-solved --drop-unsolved keeps exactly the sometimes-solved tasks,
    # --drop-unsolved alone drops exactly the never-solved ones
    both = selection.choose(tasks, selection.Rules(drop_solved=True, drop_unsolved=True)).kept
    assert [t.task_index for t in both] == [t.task_index for t in tasks if plain_bucket(t.rewards) == "sometimes"]
    unsolved = selection.choose(tasks, selection.Rules(drop_unsolved=True)).kept
    assert [t.task_index for t in unsolved] == [t.task_index for t in tasks if plain_bucket(t.rewards) != "never"]


@settings(max_examples=200, deadline=None)
@given(profiles())
def test_pass_at_k_values_and_intervals_match_the_plain_computation(tasks):
    for k in range(1, taskstats.max_k(tasks) + 1):
        counted = [t for t in tasks if len(t.rewards) >= k]
        want = [plain_pass_at_k(t.rewards, k) for t in counted]
        got = taskstats.pass_at_k_values(tasks, k)
        assert got.tolist() == pytest.approx(want)
        point = taskstats.pass_at_k(tasks, k)
        assert point == pytest.approx(100 * sum(want) / len(want))
        ci = taskstats.pass_at_k_interval(tasks, k)
        assert ci is not None
        # the interval holds the estimate and stays within the per-task values; it is seeded: the same every time
        eps = 1e-9
        assert 100 * min(want) - eps <= ci.low <= point + eps and point - eps <= ci.high <= 100 * max(want) + eps
        assert taskstats.pass_at_k_interval(tasks, k) == ci
    for s in taskstats.agent_summaries(tasks):
        mine = [t for t in tasks if t.agent == s.agent]
        assert s.pass_at_1_ci == taskstats.pass_at_k_interval(mine, 1)
        assert s.pass_at_k_ci == taskstats.pass_at_k_interval(mine, s.k)


def exact_bootstrap(values: list[float]) -> dict[Fraction, Fraction]:
    """The exact distribution of the mean of n values drawn from `values` with replacement: all n^n draws."""
    n = len(values)
    exact = [Fraction(v) for v in values]
    dist: dict[Fraction, Fraction] = {}
    for draw in itertools.product(range(n), repeat=n):
        m = sum(exact[i] for i in draw) / n
        dist[m] = dist.get(m, Fraction(0)) + Fraction(1, n**n)
    return dist


TOL = 0.02  # of probability mass; the Monte-Carlo CDF of 2,000 resamples is off by about 0.0035 (sd) at 2.5%


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.0, 0.0]), min_size=1, max_size=5))
def test_bootstrap_interval_is_the_exact_bootstraps_percentiles(values):
    """Each end is a mean some resample has, at the 2.5th / 97.5th percentile of the exact bootstrap distribution
    (to within the Monte-Carlo error of 2,000 resamples)."""
    dist = exact_bootstrap(values)
    ci = intervals.bootstrap_mean(values)
    assert ci is not None
    for end, q in ((ci.low, 0.025), (ci.high, 0.975)):
        at = min(dist, key=lambda m: abs(float(m) - end))
        assert abs(float(at) - end) < 1e-9, "each end is a possible resample mean"
        below = float(sum(p for m, p in dist.items() if m < at))
        upto = below + float(dist[at])
        assert below <= q + TOL and upto >= q - TOL, (values, end, below, upto)


def test_bootstrap_edges():
    assert intervals.bootstrap_mean([]) is None
    assert intervals.bootstrap_mean([0.3, 0.3, 0.3]) == intervals.Interval(0.3, 0.3)
    big = np.r_[np.zeros(900_000), np.ones(100_000)]  # a million tasks: drawn per distinct value, so quick
    ci = intervals.bootstrap_mean(big)
    assert ci is not None and ci.low < 0.1 < ci.high and ci.high - ci.low < 0.002
