"""Which rows of a shard count, and as which planned identity (pure, vectorised).

A shard's plan is the set of (task, rollout) identities in its materialized inputs. A rollout row is accepted
when its identity is planned for its shard. If the collector renumbered rollouts inside the shard (Gym restarts
`_ng_rollout_index` at 0 per task when it materializes repeats itself), row (t, j) means the j-th planned
rollout of task t in that shard: the shard is read that way when that explains more of its rows than the
global numbering does. Among accepted rows the first one of each identity (file order) is kept; the others are
duplicates (a resumed shard that wrote a rollout twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardrun.core.errors import PlanMismatch


@dataclass(frozen=True)
class ShardPlanIndex:
    """A shard's planned identities sorted by (task, rollout), for lookups."""

    tasks: np.ndarray  # unique planned task indices, ascending
    starts: np.ndarray  # where each task's rollouts begin in `rollouts`
    counts: np.ndarray  # how many rollouts of each task the shard holds
    rollouts: np.ndarray  # planned rollout indices, sorted within task
    stride: int  # > every planned rollout index

    def keys(self, task_code: np.ndarray, rollout: np.ndarray) -> np.ndarray:
        return task_code * self.stride + rollout


def plan_index(task: np.ndarray, rollout: np.ndarray, where: str) -> ShardPlanIndex:
    order = np.lexsort((rollout, task))
    t, r = task[order], rollout[order]
    dup = (t[1:] == t[:-1]) & (r[1:] == r[:-1])
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise PlanMismatch(f"{where}: identity ({t[i]}, {r[i]}) is planned twice; the run directory is damaged")
    tasks, starts, counts = np.unique(t, return_index=True, return_counts=True)
    stride = int(r.max()) + 1 if len(r) else 1
    return ShardPlanIndex(tasks, starts, counts, r, stride)


def _task_codes(index: ShardPlanIndex, task: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    code = np.searchsorted(index.tasks, task)
    found = code < len(index.tasks)
    found[found] = index.tasks[code[found]] == task[found]
    return np.where(found, code, 0), found


def match_global(index: ShardPlanIndex, task: np.ndarray, rollout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(accepted mask, planned rollout index) reading row identities as global identities."""
    code, ok = _task_codes(index, task)
    ok &= rollout < index.stride
    planned = index.keys(np.arange(len(index.tasks)).repeat(index.counts), index.rollouts)
    want = index.keys(code, np.where(ok, rollout, 0))
    pos = np.minimum(np.searchsorted(planned, want), max(len(planned) - 1, 0))
    ok &= planned[pos] == want if len(planned) else False
    return ok, rollout


def match_local(index: ShardPlanIndex, task: np.ndarray, rollout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(accepted mask, planned rollout index) reading row (t, j) as the j-th planned rollout of t in the shard."""
    code, ok = _task_codes(index, task)
    ok &= rollout < index.counts[code] if len(index.tasks) else False
    mapped = np.where(ok, index.rollouts[np.where(ok, index.starts[code] + rollout, 0)], -1)
    return ok, mapped


@dataclass(frozen=True)
class Resolution:
    keep: np.ndarray  # row numbers (file order) of the rows that count, one per identity
    rollout: np.ndarray  # their planned rollout index
    renumbered: bool
    duplicates: int
    foreign: int  # rows whose identity is not planned for this shard


def resolve(index: ShardPlanIndex, task: np.ndarray, rollout: np.ndarray) -> Resolution:
    g_ok, g_r = match_global(index, task, rollout)
    l_ok, l_r = match_local(index, task, rollout)
    renumbered = int(l_ok.sum()) > int(g_ok.sum())
    ok, mapped = (l_ok, l_r) if renumbered else (g_ok, g_r)
    accepted = np.flatnonzero(ok)
    code, _ = _task_codes(index, task[accepted])
    _, first = np.unique(index.keys(code, mapped[accepted]), return_index=True)
    keep = np.sort(accepted[first])
    return Resolution(keep, mapped[keep], renumbered, len(accepted) - len(keep), len(task) - len(accepted))


def map_identities(
    index: ShardPlanIndex, task: np.ndarray, rollout: np.ndarray, renumbered: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(accepted mask, planned rollout) for other rows of the shard (its failure sidecar), same numbering."""
    return (match_local if renumbered else match_global)(index, task, rollout)
