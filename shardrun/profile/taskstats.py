"""Per-task statistics as read from Gym's reward-profile rows, and pass@k over them (pure: data in, data out).

A profile row (`<rollouts stem>_reward_profiling.jsonl`, one per task) carries `_ng_task_index`, the stats
`{mean,max,min,median,std}/<field>` for `reward` and every other numeric rollout field, `sample` (the task's
materialized input row, so `sample.agent_ref.name` is its agent), `num_rollouts`, `expected_num_rollouts` and
`rollout_infos` (one dict per completed rollout, with its `reward`).

pass@k follows Gym's `compute_pass_majority_metrics` definition: for 0/1 scores the unbiased estimator
1 - C(n - c, k) / C(n, k); for continuous scores the max over the first k rollouts; tasks with fewer than k
scored rollouts are left out; the agent's value is the mean over tasks, in percent (0-100).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from shardrun.rundir import store
from shardrun.core.errors import BadInput, RunDirError

TASK_KEY = "_ng_task_index"
ROLLOUT_KEY = "_ng_rollout_index"
STAT_NAMES = ("mean", "max", "min", "median", "std")
UNKNOWN_AGENT = "(no agent_ref)"


@dataclass(frozen=True)
class TaskStat:
    """One task's profile: identity, agent, completion and every `<stat>/<field>` number."""

    task_index: int
    agent: str
    num_rollouts: int
    expected_num_rollouts: int
    stats: Mapping[str, float] = field(default_factory=dict)
    rewards: tuple[float, ...] = ()  # per completed rollout, in rollout-index order

    def stat(self, name: str, metric: str = "reward") -> float | None:
        return self.stats.get(f"{name}/{metric}")


def _agent_of(row: Mapping[str, Any]) -> str:
    sample = row.get("sample")
    ref = sample.get("agent_ref") if isinstance(sample, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) and name else UNKNOWN_AGENT


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rewards_of(row: Mapping[str, Any]) -> tuple[float, ...]:
    infos = row.get("rollout_infos") or []
    ordered = sorted((i for i in infos if isinstance(i, Mapping)), key=lambda i: i.get(ROLLOUT_KEY, 0))
    return tuple(float(i["reward"]) for i in ordered if _is_number(i.get("reward")))


def task_stat(row: Mapping[str, Any], where: str = "profile row") -> TaskStat:
    """One profile row -> TaskStat. BadInput if the row has no integer task index."""
    index = row.get(TASK_KEY)
    if isinstance(index, bool) or not isinstance(index, int):
        raise BadInput(f"{where}: field {TASK_KEY}: missing or not an integer ({index!r}); is this a Gym "
                       f"reward-profile file?")
    stats = {k: float(v) for k, v in row.items()
             if "/" in k and k.split("/", 1)[0] in STAT_NAMES and _is_number(v)}
    n = row.get("num_rollouts")
    n = n if isinstance(n, int) else len(row.get("rollout_infos") or [])
    expected = row.get("expected_num_rollouts")
    return TaskStat(index, _agent_of(row), n, expected if isinstance(expected, int) else n, stats, _rewards_of(row))


def task_stats(rows: Iterable[Mapping[str, Any]], source: str = "profile") -> list[TaskStat]:
    """All profile rows -> TaskStats sorted by task index; a repeated task index is an error."""
    out: dict[int, TaskStat] = {}
    for n, row in enumerate(rows, 1):
        t = task_stat(row, f"{source}:{n}")
        if t.task_index in out:
            raise BadInput(f"{source}:{n}: task {t.task_index} appears twice in the profile")
        out[t.task_index] = t
    return [out[i] for i in sorted(out)]


def agents(tasks: Iterable[TaskStat]) -> list[str]:
    return sorted({t.agent for t in tasks})


def metrics(tasks: Iterable[TaskStat]) -> list[str]:
    """The fields that have a mean in at least one task (e.g. reward, output_tokens, library_reward)."""
    return sorted({k.split("/", 1)[1] for t in tasks for k in t.stats if k.startswith("mean/")})


def require_metric(tasks: Sequence[TaskStat], metric: str) -> None:
    if tasks and not any(t.stat("mean", metric) is not None for t in tasks):
        raise BadInput(f"no task has a mean/{metric} in the profile; known metrics: {', '.join(metrics(tasks))}")


# ---------------------------------------------------------------- pass@k

def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def task_pass_at_k(scores: Sequence[float], k: int) -> float | None:
    """pass@k of one task (0-1), or None when it has fewer than k scored rollouts."""
    n = len(scores)
    if k < 1 or k > n:
        return None
    if is_binary(scores):
        wrong = sum(1 for s in scores if not s)
        return 1.0 if wrong < k else 1.0 - math.comb(wrong, k) / math.comb(n, k)
    return max(scores[:k])


def pass_at_k(tasks: Iterable[TaskStat], k: int) -> float | None:
    """Mean pass@k over the tasks that have at least k scored rollouts, in percent; None if none has."""
    values = [v for t in tasks if (v := task_pass_at_k(t.rewards, k)) is not None]
    return 100.0 * sum(values) / len(values) if values else None


def max_k(tasks: Iterable[TaskStat]) -> int:
    return max((len(t.rewards) for t in tasks), default=0)


def pass_at_k_curve(tasks: Sequence[TaskStat]) -> dict[int, float]:
    """{k: pass@k percent} for k = 1 .. the most rollouts any task has."""
    curve = {k: pass_at_k(tasks, k) for k in range(1, max_k(tasks) + 1)}
    return {k: v for k, v in curve.items() if v is not None}


# ---------------------------------------------------------------- per agent

@dataclass(frozen=True)
class AgentSummary:
    agent: str
    tasks: int
    rollouts: int
    expected_rollouts: int
    mean_reward: float | None  # over rollouts (each task's mean weighted by its rollouts), like Gym's agent mean
    pass_at_1: float | None  # percent
    k: int
    pass_at_k: float | None  # percent, at the agent's largest k


def by_agent(tasks: Iterable[TaskStat]) -> dict[str, list[TaskStat]]:
    groups: dict[str, list[TaskStat]] = {}
    for t in tasks:
        groups.setdefault(t.agent, []).append(t)
    return dict(sorted(groups.items()))


def rollout_weighted_mean(tasks: Iterable[TaskStat], metric: str = "reward") -> float | None:
    pairs = [(m, t.num_rollouts) for t in tasks if (m := t.stat("mean", metric)) is not None and t.num_rollouts]
    total = sum(n for _, n in pairs)
    return sum(m * n for m, n in pairs) / total if total else None


def agent_summary(agent: str, tasks: Sequence[TaskStat]) -> AgentSummary:
    k = max_k(tasks)
    return AgentSummary(agent, len(tasks), sum(t.num_rollouts for t in tasks),
                        sum(t.expected_num_rollouts for t in tasks), rollout_weighted_mean(tasks),
                        pass_at_k(tasks, 1), k, pass_at_k(tasks, k) if k else None)


def agent_summaries(tasks: Iterable[TaskStat]) -> list[AgentSummary]:
    return [agent_summary(a, ts) for a, ts in by_agent(tasks).items()]


# ---------------------------------------------------------------- reading (the one edge)

def load_profile(run_dir: Path) -> list[TaskStat]:
    """RUN_DIR's merged reward profile as TaskStats; RunDirError when it was not merged yet."""
    path = store.merged_reward_profiling_path(run_dir)
    if not path.is_file():
        raise RunDirError(f"no reward profile at {path}; run `shardrun merge-and-profile {run_dir}` first")
    return task_stats(store.iter_jsonl_objects(path), str(path))
