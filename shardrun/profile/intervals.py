"""95% intervals for a mean over tasks (pass@1, pass@k, mean reward): the percentile bootstrap over tasks.

Each resample draws as many tasks as were profiled, with replacement, and takes the mean of their values; the
interval is the 2.5th and 97.5th percentile of RESAMPLES such means (the inverted empirical CDF, so each end is
a mean some resample had). The generator is numpy's PCG64 seeded with SEED: the same profile always gives the
same interval.

Drawing tasks with replacement is drawing, for each distinct per-task value, how many of the n draws land on it:
a multinomial over the distinct values with their shares. That is what is sampled here, so the cost is RESAMPLES x
(distinct values), not RESAMPLES x tasks: a per-task pass@k takes at most a few dozen distinct values (one per
success count), however many tasks the profile has.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
METHOD = (
    f"percentile bootstrap over tasks: {RESAMPLES:,} resamples of the agent's tasks drawn with replacement, seed {SEED}"
)


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


def bootstrap_mean(
    values: Sequence[float] | np.ndarray, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL
) -> Interval | None:
    """The `level` percentile-bootstrap interval of the mean of `values` (one per task); None when there are none."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return None
    distinct, counts = np.unique(arr, return_counts=True)
    if distinct.size == 1:
        return Interval(float(distinct[0]), float(distinct[0]))
    draws = np.random.default_rng(seed).multinomial(arr.size, counts / arr.size, size=resamples)
    means = draws @ distinct / arr.size
    tail = (1.0 - level) / 2
    low, high = np.clip(np.quantile(means, [tail, 1.0 - tail], method="inverted_cdf"), distinct[0], distinct[-1])
    return Interval(float(low), float(high))
