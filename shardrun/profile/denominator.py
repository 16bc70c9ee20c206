"""The denominator of the aggregate metrics: what a planned rollout without a result counts as (pure).

A planned rollout has no result when it is missing (never ran, or was lost) or failed for good (recorded in the
failures sidecar). The policy says what the aggregate metrics do with it:

- `omit`: it leaves the denominator (what both supported Gym versions do by default: Gym 0.4.0 always, Gym 0.7
  unless `count_missing_rollouts_as_zero` / `count_failure_classes_as_zero`);
- `zero`: it counts as a rollout with reward 0 and no answer, at its own rollout index (Gym 0.7's
  `count_missing_rollouts_as_zero`), in pass@k, majority@k, pass@1[avg-of-k] and the agent's reward stats.

The per-task reward profile is left as each Gym version's profiler writes it (only collected rollouts), and its
rows report their coverage themselves (`num_rollouts` of `expected_num_rollouts`). Every agent's aggregate entry
reports its coverage in Gym 0.7's names: `coverage/expected` (planned), `coverage/scored` (counted),
`coverage/missing` (planned without a result) and, with `zero`, `coverage/imputed`.

A masked rollout (Gym 0.7's `mask_sample`: GymAdapter.mask_field) has a result, so it is never missing and never
imputed, and counts in `coverage/scored`; it is left out of the quality statistics, and `masked_coverage` says
how much of the agent's scored rollouts those statistics come from, as Gym 0.7 names it.
"""

from __future__ import annotations

import numpy as np

from shardrun.core.errors import BadInput

POLICIES = ("omit", "zero")
REWARD_STATS = ("mean", "max", "min", "median", "std")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise BadInput(f"--missing {policy!r}: one of {', '.join(POLICIES)}")
    return policy


def with_zeros(
    keys: np.ndarray, reward: np.ndarray, answers: np.ndarray | None, imputed: np.ndarray, no_answer: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows (sorted identity keys, rewards, answer codes) with a zero-reward, no-answer row added for each key of
    `imputed` (planned keys without a result), all in key order."""
    all_keys = np.concatenate([keys, imputed])
    order = np.argsort(all_keys, kind="stable")
    all_reward = np.concatenate([reward.astype(np.float64), np.zeros(len(imputed))])[order]
    all_answers = (
        np.concatenate([answers, np.full(len(imputed), no_answer, dtype=answers.dtype)])[order]
        if answers is not None
        else None
    )
    return all_keys[order], all_reward, all_answers


def reward_stats(reward: np.ndarray) -> dict[str, float]:
    """`{mean,max,min,median,std}/reward` over rewards counted (missing values skipped; std 0 for one value)."""
    values = reward[~np.isnan(reward)]
    if not len(values):
        return {}
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    stats = (float(values.mean()), float(values.max()), float(values.min()), float(np.median(values)), std)
    return {f"{name}/reward": v for name, v in zip(REWARD_STATS, stats)}


def coverage(expected: int, completed: int, imputed: int | None) -> dict[str, int]:
    """An agent's coverage in Gym 0.7's names (`imputed` None: the omit policy)."""
    out = {
        "coverage/expected": expected,
        "coverage/scored": completed + (imputed or 0),
        "coverage/missing": expected - completed,
    }
    if imputed is not None:
        out["coverage/imputed"] = imputed
    return out


def masked_coverage(measured_task: np.ndarray, masked_task: np.ndarray) -> dict[str, int]:
    """Gym 0.7's coverage of one agent's quality metrics when some of its rollouts are masked, from the task of
    each measured rollout and of each masked one: `coverage/measured_rollouts`, `coverage/masked_rollouts`,
    `coverage/measured_tasks` (tasks with a measured rollout) and `coverage/fully_masked_tasks` (tasks with
    rollouts, none of them measured). Empty when nothing is masked (the keys appear only then)."""
    if not len(masked_task):
        return {}
    measured = np.unique(measured_task)
    tasks = np.union1d(measured, masked_task)
    return {
        "coverage/measured_rollouts": len(measured_task),
        "coverage/masked_rollouts": len(masked_task),
        "coverage/measured_tasks": len(measured),
        "coverage/fully_masked_tasks": len(tasks) - len(measured),
    }
