"""Offline pass@k / majority@k per agent, with NeMo Gym's names, units and estimators (pure, vectorised).

The definitions are those of Gym's `compute_pass_majority_metrics` (the helper environments such as
`math_with_judge` use in `compute_metrics`), applied to the default score `accuracy` = the rollout's `reward`
and, when an answer field is configured, the binary score `no_answer` (1 when the answer is missing):

* `pass@k/<score>`: over tasks with at least k scored rollouts; for 0/1 scores the unbiased estimator
  1 - C(n - c, k) / C(n, k) (n scored rollouts, c of them non-zero), otherwise the max of the first k scores.
* `pass@1[avg-of-k]/<score>`: the mean score of each task's first k rollouts, averaged over tasks.
* `majority@k/<score>`: among the first k rollouts with an answer, the most frequent (answer, score) pairs;
  ties are averaged; a task with no answer counts 0.
* `per_sample_aggregate`: per rollout position i, the mean score of the i-th rollouts of all tasks.
* `pass@1[avg-of-k]/<score>/std_dev_across_runs` and `.../std_err_across_runs`: sample std (and its standard
  error) of the first k entries of `per_sample_aggregate`.

Values are percentages (0-100). "First k" is by rollout index. k runs over 1, 2, 4, ... and the agent's number
of repeats (Gym computes every k up to the repeats; the powers of two are its headline values).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardrun.merge.rowtable import NO_ANSWER

ACCURACY = "accuracy"
NO_ANSWER_SCORE = "no_answer"
STAT_SUFFIXES = ("std_dev_across_runs", "std_err_across_runs", "avg_sample_std_dev")


def ks_for(repeats: int) -> list[int]:
    """1, 2, 4, ... up to `repeats`, and `repeats` itself."""
    ks, k = [], 1
    while k <= repeats:
        ks.append(k)
        k *= 2
    if repeats >= 1 and ks[-1] != repeats:
        ks.append(repeats)
    return ks


@dataclass(frozen=True)
class AgentRollouts:
    """One agent's rollouts sorted by (task, rollout): task number (0..), position within the task, scores."""

    task: np.ndarray  # task number of each row, non-decreasing
    position: np.ndarray  # 0-based position of the row among its task's rollouts
    scores: dict[str, np.ndarray]  # score name -> value per row (NaN: the row has no such score)
    answers: np.ndarray | None  # answer code per row (NO_ANSWER: none)

    @property
    def num_tasks(self) -> int:
        return int(self.task[-1]) + 1 if len(self.task) else 0


def score_table(task: np.ndarray, reward: np.ndarray, answers: np.ndarray | None) -> AgentRollouts:
    """Build the score table Gym's defaults use: accuracy = reward, and no_answer when answers are given."""
    new_task = np.r_[True, task[1:] != task[:-1]] if len(task) else np.zeros(0, bool)
    starts = np.flatnonzero(new_task)
    number = (np.cumsum(new_task) - 1).astype(np.int32)
    position = (np.arange(len(task)) - starts[number]).astype(np.int32)
    scores = {ACCURACY: reward.astype(np.float64)}
    if answers is not None:
        scores[NO_ANSWER_SCORE] = (answers == NO_ANSWER).astype(np.float64)
    return AgentRollouts(number, position, dict(sorted(scores.items())), answers)


def _per_task(values: np.ndarray, task: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(task, weights=values, minlength=n)


def pass_at_k(r: AgentRollouts, score: np.ndarray, k: int) -> float | None:
    """Mean over tasks with >= k scored rollouts of the unbiased estimator (0/1 tasks) or max of first k."""
    values = task_pass_at_k(r, score, k)
    return None if values is None else 100.0 * float(values.sum()) / len(values)


def task_pass_at_k(r: AgentRollouts, score: np.ndarray, k: int) -> np.ndarray | None:
    """Each task's pass@k (0-1), in task order, for the tasks with >= k scored rollouts (None if none has):
    the unbiased estimator 1 - C(n - c, k) / C(n, k) for a task whose scores are all 0 or 1, else the max of its
    first k scores."""
    n_tasks = r.num_tasks
    present = ~np.isnan(score)
    n = _per_task(present, r.task, n_tasks).astype(np.int64)
    nonbinary = _per_task(present & (score != 0) & (score != 1), r.task, n_tasks) > 0
    incorrect = _per_task(present & (score == 0), r.task, n_tasks).astype(np.int64)
    rank = _rank_among(present, r.task)
    first_k = present & (rank < k)
    best = np.full(n_tasks, -np.inf)
    np.maximum.at(best, r.task[first_k], score[first_k])
    counted = n >= k
    if not counted.any():
        return None
    return np.where(nonbinary, best, _unbiased(n, incorrect, k))[counted]


def _rank_among(mask: np.ndarray, task: np.ndarray) -> np.ndarray:
    """For each row, how many earlier rows of its task have `mask` set."""
    before = np.cumsum(mask) - mask
    starts = np.flatnonzero(np.r_[True, task[1:] != task[:-1]]) if len(task) else np.zeros(0, np.int64)
    number = np.cumsum(np.r_[False, task[1:] != task[:-1]]) if len(task) else np.zeros(0, np.int64)
    return before - before[starts][number] if len(task) else before


def _unbiased(n: np.ndarray, incorrect: np.ndarray, k: int) -> np.ndarray:
    """1 - C(incorrect, k) / C(n, k), exactly as Python's integer maths gives it, per distinct (n, incorrect)."""
    out = np.ones(len(n))
    pairs, inverse = np.unique(np.stack([n, incorrect]), axis=1, return_inverse=True)
    table = np.array([1.0 if c < k or k > t else 1.0 - math.comb(c, k) / math.comb(t, k) for t, c in pairs.T.tolist()])
    if len(n):
        out = table[inverse.reshape(-1)]
    return out


def avg_of_k(r: AgentRollouts, score: np.ndarray, k: int) -> float | None:
    """pass@1[avg-of-k]: mean over tasks of the mean score of its first k rollouts (tasks with one scored)."""
    n_tasks = r.num_tasks
    take = (r.position < k) & ~np.isnan(score)
    count = _per_task(take, r.task, n_tasks)
    total = _per_task(np.where(take, score, 0.0), r.task, n_tasks)
    has = count > 0
    if not has.any():
        return None
    return 100.0 * float((total[has] / count[has]).sum()) / int(has.sum())


def majority_at_k(r: AgentRollouts, score: np.ndarray, k: int) -> float | None:
    """majority@k: per task the mean score of the most frequent (answer, score) pairs among its first k."""
    n_tasks = r.num_tasks
    if n_tasks == 0 or r.answers is None:
        return None
    valid = (r.position < k) & (r.answers != NO_ANSWER) & ~np.isnan(score)
    t, a, s = r.task[valid], r.answers[valid], score[valid]
    values = np.zeros(n_tasks)
    if len(t):
        order = np.lexsort((s, a, t))
        t, a, s = t[order], a[order], s[order]
        new = np.r_[True, (t[1:] != t[:-1]) | (a[1:] != a[:-1]) | (s[1:] != s[:-1])]
        first = np.flatnonzero(new)
        count = np.diff(np.r_[first, len(t)])
        pair_task, pair_score = t[first], s[first]
        top = np.zeros(n_tasks, np.int64)
        np.maximum.at(top, pair_task, count)
        tied = count == top[pair_task]
        tied_n = np.bincount(pair_task[tied], minlength=n_tasks)
        tied_sum = np.bincount(pair_task[tied], weights=pair_score[tied], minlength=n_tasks)
        has = tied_n > 0
        values[has] = tied_sum[has] / tied_n[has]
    return 100.0 * float(values.sum()) / n_tasks


def per_sample_aggregate(r: AgentRollouts, score: np.ndarray) -> list[float]:
    """Per rollout position i: 100 x mean score of the tasks' i-th rollouts (positions with none left out)."""
    present = ~np.isnan(score)
    width = int(r.position.max()) + 1 if len(r.position) else 0
    count = np.bincount(r.position[present], minlength=width)
    total = np.bincount(r.position[present], weights=score[present], minlength=width)
    return [100.0 * float(total[i]) / int(count[i]) for i in range(width) if count[i] > 0]


def agent_pass_metrics(r: AgentRollouts, repeats: int) -> dict[str, Any]:
    """Gym's compute_pass_majority_metrics keys for one agent, for k in ks_for(repeats)."""
    metrics: dict[str, Any] = {}
    seen = int(r.position.max()) + 1 if len(r.position) else 0
    ks = [k for k in ks_for(repeats) if k <= seen]  # as Gym, no k beyond the most rollouts a task has
    for k in ks:
        for name, score in r.scores.items():
            for key, value in (
                (f"pass@{k}/{name}", pass_at_k(r, score, k)),
                (f"pass@1[avg-of-{k}]/{name}", avg_of_k(r, score, k)),
                (f"majority@{k}/{name}", majority_at_k(r, score, k)),
            ):
                if value is not None:
                    metrics[key] = value
    per_sample = {name: per_sample_aggregate(r, score) for name, score in r.scores.items()}
    metrics["per_sample_aggregate"] = {name: v for name, v in per_sample.items() if v}
    for k in ks[1:]:
        for name in r.scores:
            runs = per_sample.get(name, [])[:k]
            if len(runs) >= 2:
                mean = sum(runs) / len(runs)
                std = math.sqrt(sum((x - mean) ** 2 for x in runs) / (len(runs) - 1))
                metrics[f"pass@1[avg-of-{k}]/{name}/std_dev_across_runs"] = std
                metrics[f"pass@1[avg-of-{k}]/{name}/std_err_across_runs"] = std / math.sqrt(len(runs))
    return metrics


def highest_k(metrics: dict[str, Any], pattern: str, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The entries of `pattern` (with {k}) at the highest k, stats suffixes and `exclude` score names left out."""
    regex = re.compile("^" + re.escape(pattern).replace(r"\{k\}", r"(\d+)") + "/(.+)$")
    found = [
        (int(m.group(1)), key)
        for key in metrics
        if (m := regex.match(key)) and not m.group(2).endswith(STAT_SUFFIXES) and m.group(2) not in exclude
    ]
    top = max((k for k, _ in found), default=None)
    return {key: metrics[key] for k, key in found if k == top}


def key_metrics(agent_metrics: dict[str, Any]) -> dict[str, Any]:
    """Headline metrics: every mean/*, then the highest-k pass@1[avg-of-k], pass@k and majority@k."""
    out = {k: v for k, v in agent_metrics.items() if k.startswith("mean/")}
    out.update(highest_k(agent_metrics, "pass@1[avg-of-{k}]"))
    out.update(highest_k(agent_metrics, "pass@{k}", exclude=(NO_ANSWER_SCORE,)))
    out.update(highest_k(agent_metrics, "majority@{k}", exclude=(NO_ANSWER_SCORE,)))
    return out
