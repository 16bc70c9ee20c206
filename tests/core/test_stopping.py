"""The decision rule of adaptive sampling (core/stopping.py) and the per-task rules (core/task_rules.py).

The property: whenever `decide` says a task is decided, every completion of its open rollouts (each one completed
at a range end or inside, failed, or never run) gets that decision from the rules, and so does the task as it
stands (stopped now).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardrun.core import stopping
from shardrun.core.stopping import DROP, KEEP, Partial, decide
from shardrun.core.task_rules import TaskRules, problems

FAIL, LEFT_OUT = "fail", "left out"


def final_keep(rules: TaskRules, agent: str, values: list[float], failed: int, policy: str) -> bool:
    """What the profile and `select` make of a finished task: the metric's mean (numpy's sum over the counted
    rollouts, as the profile computes it), min and max; failed rollouts count as 0 under `zero`."""
    counted = values + ([0.0] * failed if policy == "zero" else [])
    if not counted:
        return rules.keeps(agent, None, None, None)
    arr = np.array(counted, dtype=np.float64)
    return rules.keeps(agent, float(arr.sum() / len(arr)), float(arr.min()), float(arr.max()))


def completions(m: int, options: list) -> itertools.product:
    return itertools.product(options, repeat=m)


@st.composite
def cases(draw):
    binary = draw(st.booleans())
    if binary:
        a, b = 0.0, 1.0
        value = st.sampled_from([0.0, 1.0])
    else:
        a = draw(st.sampled_from([0.0, -1.0, 0.5, -2.5, 0.25]))
        b = a + draw(st.sampled_from([1.0, 0.5, 3.0, 0.1]))
        value = st.floats(a, b, allow_nan=False)
    k = draw(st.integers(1, 10))
    n_done = draw(st.integers(0, k))
    failed = draw(st.integers(0, k - n_done))
    values = draw(st.lists(value, min_size=n_done, max_size=n_done))
    m = min(k - n_done - failed, 3)  # the completions are enumerated: keep them few
    grid = sorted({a, b, (a + b) / 2, a + (b - a) / 3})
    bound = st.one_of(st.none(), st.sampled_from(grid + [(a + b) / 4, a - 0.5, b + 0.5]), st.floats(a - 1, b + 1))
    lo, hi = draw(bound), draw(bound)
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    rules = TaskRules(
        agents=draw(st.sampled_from([(), ("a",), ("b",), ("a", "b")])),
        min_mean=lo,
        max_mean=hi,
        drop_unsolved=draw(st.booleans()),
        drop_solved=draw(st.booleans()),
        solved_threshold=draw(st.sampled_from(grid + [0.0, b + 1, a - 1])),
    )
    policy = draw(st.sampled_from(stopping.MISSING_POLICIES))
    min_repeats = draw(st.integers(0, 3))
    inside = draw(st.lists(st.floats(a, b, allow_nan=False), min_size=1, max_size=2))
    return rules, "a", values, failed, m, (a, b), policy, min_repeats, sorted(set(grid + inside))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_a_decided_task_gets_the_same_decision_from_every_completion(case):
    rules, agent, values, failed, m, metric_range, policy, min_repeats, inside = case
    verdict = decide(rules, agent, Partial.of(values, failed, m, metric_range), metric_range, policy, min_repeats)
    if m == 0:
        assert verdict == final_keep(rules, agent, values, failed, policy)
        return
    if verdict is None:
        return
    assert len(values) + failed >= min_repeats
    assert final_keep(rules, agent, values, failed, policy) == verdict  # stopped now: the same
    for ending in completions(m, inside + [FAIL, LEFT_OUT]):
        done = values + [x for x in ending if isinstance(x, float)]
        fails = failed + sum(1 for x in ending if x == FAIL)
        assert final_keep(rules, agent, done, fails, policy) == verdict, (ending, verdict)


def test_solved_unsolved_filter_decides_at_the_first_pass_and_failure():
    rules = TaskRules(drop_solved=True, drop_unsolved=True)
    assert decide(rules, "a", Partial.of((1.0, 0.0), 0, 14)) is KEEP
    assert decide(rules, "a", Partial.of((1.0, 1.0), 0, 14)) is None
    assert decide(rules, "a", Partial.of((0.0,) * 15, 0, 1)) is None  # the last one may still pass
    assert decide(rules, "a", Partial.of((1.0, 0.0), 0, 14), min_repeats=4) is None
    assert decide(rules, "a", Partial.of((1.0, 0.0, 0.0, 1.0), 0, 12), min_repeats=4) is KEEP


def test_band_decides_when_the_interval_leaves_it():
    rules = TaskRules(min_mean=0.2, max_mean=0.8)
    # 13 failures of 16: the mean is at most 3/16 < 0.2 whatever comes
    assert decide(rules, "a", Partial.of((0.0,) * 13, 0, 3)) is DROP
    assert decide(rules, "a", Partial.of((0.0,) * 12, 0, 4)) is None
    # exactly on the bound counts as inside (integers: no margin): 4 passes of 16 give at least 0.25
    assert decide(TaskRules(min_mean=0.25), "a", Partial.of((1.0,) * 4, 0, 12)) is KEEP


def test_an_agent_outside_the_rule_is_dropped_before_any_rollout():
    assert decide(TaskRules(agents=("b",)), "a", Partial.of((), 0, 16)) is DROP
    assert decide(TaskRules(agents=("b",)), "a", Partial.of((), 0, 16), min_repeats=2) is None


def test_zero_policy_counts_failures_and_widens_the_range_to_zero():
    rules = TaskRules(min_mean=0.6)
    # range [0.5, 1], 2 passes and 2 open: under omit the mean ends >= 0.75; under zero a failure is a 0 (0.5)
    assert decide(rules, "a", Partial.of((1.0, 1.0), 0, 2), (0.5, 1.0), "omit") is KEEP
    assert decide(rules, "a", Partial.of((1.0, 1.0), 0, 2), (0.5, 1.0), "zero") is None
    assert decide(rules, "a", Partial.of((1.0,), 3, 0), policy="zero") is DROP
    assert decide(rules, "a", Partial.of((1.0,), 3, 0), policy="omit") is KEEP


def test_a_value_outside_the_range_is_an_error_never_a_decision():
    with pytest.raises(ValueError, match="outside metric_range"):
        Partial.of((1.5,), 0, 3)
    with pytest.raises(ValueError, match="outside metric_range"):
        Partial.of((float("nan"),), 0, 3)
    assert stopping.out_of_range([0.0, 2.0, -1.0], (0.0, 1.0)) == [2.0, -1.0]


def test_problems_name_the_rule_as_the_caller_does():
    assert problems(TaskRules(min_mean=0.9, max_mean=0.1)) == [
        "--min-mean 0.9 is above --max-mean 0.1: no task can match"
    ]
    assert problems(TaskRules(min_mean=float("nan")), lambda f: f"sampling.stop_when_decided.{f}") == [
        "sampling.stop_when_decided.min_mean nan: must be a finite number"
    ]
