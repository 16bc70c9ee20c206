"""When a task's sampling may stop: its rollouts so far already decide what the per-task rules do with it (pure).

A task has k planned rollouts. Some are *counted* (completed, with their metric; under the `zero` policy a rollout
failed for good also counts, as 0), some failed for good and left out (the `omit` policy), and m are still open.
Each open rollout can end in one of three ways: it completes with a metric in `metric_range` [a, b], it fails
(counted as 0 under `zero`, left out under `omit`), or it is never run (skipped because decided: always left out).
The final statistics of the metric are therefore bounded:

    mean in [(S + m*c) / (N + m), (S + m*d) / (N + m)]     (c = a, d = b; under `zero` c = min(a, 0), d = max(b, 0))

where N counted values sum to S (with N = n, no failures and the range [0, 1] this is the issue's
[(s + (k-n)*r_min)/k, (s + (k-n)*r_max)/k]), and both ends are reached (every open rollout at c, or at d). The
task is *decided* when no final outcome can change what the rules do with it: either no outcome is dropped (every
one is kept) or none is kept. `decide` over-approximates both sets of outcomes, so it may miss a decision (it
costs a few rollouts) but never claims one that a completion could break:

- an outcome that drops the task exists when the mean can fall below `min_mean` or rise above `max_mean`, when
  every open rollout can be left out and the task then has no counted rollout, no solved one (`drop_unsolved`),
  or only solved ones (`drop_solved`), or when its agent is not one of `agents`;
- an outcome that keeps it can exist only when the mean interval meets [min_mean, max_mean] and each solved rule
  can still be met by itself.

Because every open rollout may also be left out, the outcome in which sampling stops now is one of the completions
too: the statistics of a stopped task (from fewer rollouts) get the same decision as the full run's. Comparisons
at a bound are exact when the values are integers (sums of small integers are exact in floating point, so the
profile's mean and the bound are the same rounded quotient); otherwise a margin of a few parts in 10^9 keeps
rounding on the safe side.

A failed rollout is an infrastructure failure (a judge, a sandbox, the policy: core/failure_classes.py), never a
score, so no early decision rests on one: while the task has open rollouts, each failed one is taken as still open
(its final value anywhere an open rollout's can be: left out, or under `zero` a 0 inside [c, d]), which only
widens the outcomes, and `min_repeats` counts completed rollouts only. A task whose every rollout so far failed
is therefore never settled early by what failed.

The decision is monotone: more rollouts only narrow the interval and only remove outcomes, so a decided task stays
decided, the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from shardrun.core.task_rules import TaskRules

KEEP, DROP = True, False
MISSING_POLICIES = ("omit", "zero")
"""How a rollout that failed for good counts: left out of the task's statistics, or as a 0."""


@dataclass(frozen=True)
class Partial:
    """What is known of one task's rollouts: the metrics of the completed ones (their number, sum, lowest and
    highest), how many failed for good, how many are still open (neither completed nor failed: not run yet,
    running, or skipped). `exact`: the sum is exact (integer values), so no margin is needed at a bound."""

    count: int
    total: float
    low: float
    high: float
    failed: int
    open: int
    exact: bool = False

    @classmethod
    def of(
        cls, values: Sequence[float], failed: int, open: int, metric_range: tuple[float, float] = (0.0, 1.0)
    ) -> "Partial":
        """From the completed rollouts' values; ValueError for a value outside `metric_range` (or not a number):
        nobody may decide a task from data the range does not bound."""
        bad = out_of_range(values, metric_range)
        if bad:
            raise ValueError(f"metric value(s) {bad[:3]} outside metric_range {list(metric_range)}")
        exact = all(float(x).is_integer() and abs(x) <= 2**32 for x in (*values, *metric_range))
        low, high = (min(values), max(values)) if values else (math.inf, -math.inf)
        return cls(len(values), math.fsum(values), low, high, failed, open, exact)


def out_of_range(values: Sequence[float], metric_range: tuple[float, float]) -> list[float]:
    """The values the decision cannot use: not a finite number, or outside [a, b]."""
    a, b = metric_range
    return [v for v in values if not (isinstance(v, (int, float)) and math.isfinite(v) and a <= v <= b)]


def decide(
    rules: TaskRules,
    agent: str,
    task: Partial,
    metric_range: tuple[float, float] = (0.0, 1.0),
    policy: str = "omit",
    min_repeats: int = 0,
) -> bool | None:
    """KEEP or DROP when every completion of the open rollouts gets that decision from `rules`; None when not
    decided (or fewer than `min_repeats` rollouts completed or failed)."""
    if policy not in MISSING_POLICIES:
        raise ValueError(f"unknown missing-rollout policy {policy!r} (known: {', '.join(MISSING_POLICIES)})")
    if task.open == 0:  # nothing left to stop: the statistics are final
        return _keeps(rules, agent, _Counted.of(task, policy))
    if task.count < min_repeats:  # failed rollouts are no evidence
        return None
    counted = _Counted.of(task, "omit")  # failed ones are taken as open below, never counted
    open_ = task.open + task.failed
    if not rules.allows_agent(agent):
        return DROP
    drop_possible = _drop_possible(rules, counted, open_, metric_range, policy)
    keep_possible = _keep_possible(rules, counted, open_, metric_range, policy)
    if not drop_possible:
        return KEEP
    if not keep_possible:
        return DROP
    return None


@dataclass(frozen=True)
class _Counted:
    """The values the final statistics count: the completed ones, and under `zero` a 0 per failed rollout."""

    n: int
    total: float
    low: float
    high: float
    exact: bool

    @classmethod
    def of(cls, task: Partial, policy: str) -> "_Counted":
        if policy == "zero" and task.failed:
            return cls(task.count + task.failed, task.total, min(task.low, 0.0), max(task.high, 0.0), task.exact)
        return cls(task.count, task.total, task.low, task.high, task.exact)

    @property
    def mean(self) -> float:
        return self.total / self.n


def _keeps(rules: TaskRules, agent: str, counted: _Counted) -> bool:
    if not counted.n:
        return rules.keeps(agent, None, None, None)
    return rules.keeps(agent, counted.mean, counted.low, counted.high)


def _ends(counted: _Counted, m: int, metric_range: tuple[float, float], policy: str) -> tuple[float, float]:
    """The lowest and the highest final mean (m > 0), stopping now included."""
    a, b = metric_range
    c, d = (min(a, 0.0), max(b, 0.0)) if policy == "zero" else (a, b)
    low, high = (counted.total + m * c) / (counted.n + m), (counted.total + m * d) / (counted.n + m)
    if counted.n:
        low, high = min(low, counted.mean), max(high, counted.mean)
    return low, high


def _margin(counted: _Counted, metric_range: tuple[float, float], bound: float) -> float:
    """0 when the values and the range's ends are integers (their sums are exact, so the profile's mean and ours
    are the same rounded quotient, whatever the bound); else a margin far above the rounding of a sum of floats."""
    if counted.exact:
        return 0.0
    scale = max(1.0, abs(bound), abs(counted.total), *(abs(x) for x in metric_range))
    return 1e-9 * scale


def _drop_possible(rules: TaskRules, counted: _Counted, m: int, metric_range: tuple[float, float], policy: str) -> bool:
    """Can some completion drop the task? (Exact up to the margin, which only says yes more often.)"""
    if not counted.n:  # every open rollout left out: no counted rollout, no mean
        return True
    th = rules.solved_threshold
    if rules.drop_unsolved and counted.high < th:  # open rollouts left out: still unsolved
        return True
    if rules.drop_solved and counted.low >= th:  # open rollouts left out: still solved by all
        return True
    lowest, highest = _ends(counted, m, metric_range, policy)
    if rules.min_mean is not None and lowest < rules.min_mean + _margin(counted, metric_range, rules.min_mean):
        return True
    if rules.max_mean is not None and highest > rules.max_mean - _margin(counted, metric_range, rules.max_mean):
        return True
    return False


def _keep_possible(rules: TaskRules, counted: _Counted, m: int, metric_range: tuple[float, float], policy: str) -> bool:
    """Can some completion keep the task? (An over-approximation: each condition on its own.)"""
    a, b = metric_range
    th = rules.solved_threshold
    zero_possible = policy == "zero"
    low, high = _ends(counted, m, metric_range, policy)
    if rules.min_mean is not None and high < rules.min_mean - _margin(counted, metric_range, rules.min_mean):
        return False
    if rules.max_mean is not None and low > rules.max_mean + _margin(counted, metric_range, rules.max_mean):
        return False
    if rules.drop_unsolved and not (counted.high >= th or b >= th or (zero_possible and 0.0 >= th)):
        return False
    if rules.drop_solved and not (counted.low < th or a < th or (zero_possible and 0.0 < th)):
        return False
    return True
