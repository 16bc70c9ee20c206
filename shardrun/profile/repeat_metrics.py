"""NeMo Gym 0.7's repeat-level metrics (pure: arrays in, rows out).

Gym 0.7's reward profiler adds two things to 0.4's profile, both computed from the same numeric frame (one row per
measured rollout: its agent, task, rollout index and numeric fields):

- `*_repeat_level_metrics.json`: for every agent with more than one rollout index, one row per rollout index
  ("repeat"), in agent-name then rollout order: `agent_ref`, `_ng_rollout_index`, `sample_count` (tasks with
  that repeat), `missing_count` (the agent's tasks without it), then for every numeric field in name order
  `mean/ median/ std/ sem/ min/ max/ p25/ p75/` and, with more than one value, `ci_low_95/ ci_high_95/` (a
  Student-t interval around the mean). Missing values are skipped; std is the sample std (0 for one value);
  quantiles interpolate linearly; every stat is a float.
- across-repeat statistics appended to each such agent's row of `*_agent_metrics.json`: every repeat-level
  `mean/<field>` is one observation per repeat, and its `mean_across_repeats/`, `median_`, `std_`, `min_`, `max_`,
  `se_` and (more than one repeat) `ci_low_95_`/`ci_high_95_across_repeats/` follow, fields in the order they
  first appear in the repeat rows. Only point estimates count as observations (Gym's `is_primary_metric`).

An interval whose standard error is 0 collapses to (mean, mean), as Gym's does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.merge.merged_table import MergedTable

REPEAT_STATS = ("mean", "median", "std", "sem", "min", "max", "p25", "p75")
ACROSS_MARKER = "_across_repeats/"
CONFIDENCE = 0.95
# Gym 0.7's metrics_config: what is not a point estimate (and so never aggregated across repeats)
_EXCLUDED_PREFIXES = tuple(
    f"{s}/" for s in ("max", "min", "median", "std", "sem", "se", "p25", "p75", "ci_low_95", "ci_high_95", "histogram")
)
_EXCLUDED_SUFFIXES = (
    "/max",
    "/min",
    "/median",
    "/p5",
    "/p25",
    "/p75",
    "/p95",
    "/ci_low_95",
    "/ci_high_95",
    "/ci_lower",
    "/ci_upper",
    "_ci_lower",
    "_ci_upper",
    "_ci95_lower",
    "_ci95_upper",
    "/_ng_attempt_index",
    "/std_dev_across_runs",
    "/std_err_across_runs",
    "/avg_sample_std_dev",
)
_EXCLUDED_NAMES = frozenset(
    (TASK_KEY, ROLLOUT_KEY, "_ng_attempt_index", "sample_count", "missing_count", "num_repeats", "token_usage_version")
)


@dataclass(frozen=True)
class RolloutFrame:
    """The numeric frame of the measured rollouts: per row its agent (a code into `agent_names`), task and rollout
    index; `column(name)` gives a numeric field's values over all rows (NaN where a rollout has none), asked once
    per field, so a caller can gather one field at a time."""

    agent_names: Sequence[str]
    agent: np.ndarray
    task: np.ndarray
    rollout: np.ndarray
    names: Sequence[str]
    column: Callable[[str], np.ndarray]


def is_primary_metric(name: str) -> bool:
    """Gym 0.7's rule for a metric that is a point estimate (aggregated across repeats, compared across runs)."""
    return (
        name not in _EXCLUDED_NAMES
        and not name.startswith(_EXCLUDED_PREFIXES)
        and not name.endswith(_EXCLUDED_SUFFIXES)
        and ACROSS_MARKER not in name
    )


def t_interval(mean: float, se: float, n: int) -> tuple[float, float] | None:
    """The 95% Student-t interval around `mean` with standard error `se` from `n` values (None for n <= 1)."""
    if n <= 1:
        return None
    if se == 0:
        return mean, mean
    from scipy import stats

    low, high = stats.t.interval(CONFIDENCE, df=n - 1, loc=mean, scale=se)
    return float(low), float(high)


def _spread(values: np.ndarray) -> tuple[float, float]:
    """(sample std, standard error) of values without NaN; std 0 for a single value."""
    n = len(values)
    std = float(np.std(values, ddof=1)) if n > 1 else 0.0
    return std, std / math.sqrt(n)


def repeat_level_metrics(frame: RolloutFrame) -> list[dict[str, Any]]:
    """Gym 0.7's `*_repeat_level_metrics.json` rows for `frame` (empty when no agent has two rollout indices)."""
    agent, task, rollout = (np.asarray(a, dtype=np.int64) for a in (frame.agent, frame.task, frame.rollout))
    groups: list[np.ndarray] = []
    out: list[dict[str, Any]] = []
    for code in sorted(set(agent.tolist()), key=lambda a: frame.agent_names[a]):
        mine = np.flatnonzero(agent == code)
        by_repeat = np.argsort(rollout[mine], kind="stable")
        repeats, starts = np.unique(rollout[mine][by_repeat], return_index=True)
        if len(repeats) < 2:
            continue
        total_tasks = len(np.unique(task[mine]))
        for r, rows in zip(repeats.tolist(), np.split(mine[by_repeat], starts[1:])):
            present = len(np.unique(task[rows]))
            groups.append(rows)
            out.append(
                {
                    AGENT_KEY: {"name": frame.agent_names[code]},
                    ROLLOUT_KEY: int(r),
                    "sample_count": present,
                    "missing_count": total_tasks - present,
                }
            )
    if not out:
        return out
    for name in sorted(frame.names):
        column = np.asarray(frame.column(name), dtype=np.float64)
        for entry, rows in zip(out, groups):
            values = column[rows]
            values = values[~np.isnan(values)]
            if len(values) == 0:
                continue
            mean = float(np.mean(values))
            std, sem = _spread(values)
            p25, median, p75 = (float(q) for q in np.quantile(values, (0.25, 0.5, 0.75)))
            stats = (mean, median, std, sem, float(values.min()), float(values.max()), p25, p75)
            entry.update({f"{s}/{name}": v for s, v in zip(REPEAT_STATS, stats)})
            ci = t_interval(mean, sem, len(values))
            if ci:
                entry[f"ci_low_95/{name}"], entry[f"ci_high_95/{name}"] = ci
    return out


def across_repeats(repeat_rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{agent name: the across-repeat statistics Gym 0.7 appends to that agent's `*_agent_metrics.json` row}."""
    order: dict[str, None] = {}
    for row in repeat_rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and is_primary_metric(key):
                order.setdefault(key, None)
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for row in repeat_rows:
        by_agent.setdefault(row[AGENT_KEY]["name"], []).append(row)
    out: dict[str, dict[str, float]] = {}
    for agent in sorted(by_agent):
        entry: dict[str, float] = {}
        for key in order:
            values = np.array([r[key] for r in by_agent[agent] if key in r], dtype=np.float64)
            values = values[~np.isnan(values)]
            if len(values) == 0:
                continue
            mean = float(np.mean(values))
            std, se = _spread(values)
            for stat, value in (
                ("mean", mean),
                ("median", float(np.median(values))),
                ("std", std),
                ("min", float(values.min())),
                ("max", float(values.max())),
                ("se", se),
            ):
                entry[f"{stat}{ACROSS_MARKER}{key}"] = value
            ci = t_interval(mean, se, len(values))
            if ci:
                entry[f"ci_low_95{ACROSS_MARKER}{key}"], entry[f"ci_high_95{ACROSS_MARKER}{key}"] = ci
        out[agent] = entry
    return out


def table_frame(table: MergedTable, agent_of_task: np.ndarray) -> RolloutFrame:
    """The frame of a merged table's kept rollouts (`agent_of_task`: the agent code of each of its tasks)."""
    task_rank = table.r_key // table.stride
    return RolloutFrame(
        agent_names=table.agents,
        agent=agent_of_task[task_rank],
        task=table.task_of_key(table.r_key),
        rollout=table.rollout_of_key(table.r_key),
        names=list(table.columns),
        column=table.column,
    )
