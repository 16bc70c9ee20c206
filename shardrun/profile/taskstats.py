"""Per-task statistics as read from Gym's reward-profile rows, and pass@k over them (pure: data in, data out).

A profile row (`<rollouts stem>_reward_profiling.jsonl`, one per task) carries `_ng_task_index`, the stats
`{mean,max,min,median,std}/<field>` for `reward` and every other numeric rollout field, `sample` (the task's
materialized input row, so `sample.agent_ref.name` is its agent), `num_rollouts`, `expected_num_rollouts` and
`rollout_infos` (one dict per completed rollout, with its `reward`). A TaskStat keeps, in `inputs`, the fields of
`sample` its reader asks for (e.g. `question`).

pass@k is `aggregate.pass_at_k` (Gym's `compute_pass_majority_metrics` definition, written once) over the
rewards of the profile rows; its 95% interval is the bootstrap over tasks of profile/intervals.py. A task's
difficulty bucket (never / sometimes / always solved) is core/task_rules.py's `bucket` over its rollout rewards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import orjson

from shardrun.core.errors import BadInput, RunDirError
from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY
from shardrun.core import task_rules
from shardrun.profile import aggregate, intervals
from shardrun.rundir import store

STAT_NAMES = ("mean", "max", "min", "median", "std")
UNKNOWN_AGENT = "(no agent_ref)"


@dataclass(frozen=True)
class RolloutNumbers:
    """One completed rollout of a task as its profile row's `rollout_infos` entry has it: its index, its reward and
    its output length (`response.usage.output_tokens`); None where the entry has no such number."""

    rollout_index: int
    reward: float | None
    output_tokens: float | None


@dataclass(frozen=True)
class TaskStat:
    """One task's profile: identity, agent, completion and every `<stat>/<field>` number."""

    task_index: int
    agent: str
    num_rollouts: int
    expected_num_rollouts: int
    stats: Mapping[str, float] = field(default_factory=dict)
    rewards: tuple[float, ...] = ()  # per completed rollout, in rollout-index order
    inputs: Mapping[str, Any] = field(default_factory=dict)  # the asked-for fields of its planned row (`sample`)
    rollouts: tuple[RolloutNumbers, ...] = ()  # every rollout_infos entry, in rollout-index order

    def stat(self, name: str, metric: str = "reward") -> float | None:
        return self.stats.get(f"{name}/{metric}")


def _agent_of(row: Mapping[str, Any]) -> str:
    sample = row.get("sample")
    ref = sample.get("agent_ref") if isinstance(sample, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) and name else UNKNOWN_AGENT


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ordered_infos(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    infos = row.get("rollout_infos")
    infos = infos if isinstance(infos, list) else []
    return sorted((i for i in infos if isinstance(i, Mapping)), key=lambda i: _index_of(i.get(ROLLOUT_KEY)))


def _index_of(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _rewards_of(infos: Sequence[Mapping[str, Any]]) -> tuple[float, ...]:
    return tuple(float(i["reward"]) for i in infos if _is_number(i.get("reward")))


def _number_or_none(value: Any) -> float | None:
    return float(value) if _is_number(value) else None


def _rollouts_of(infos: Sequence[Mapping[str, Any]]) -> tuple[RolloutNumbers, ...]:
    return tuple(
        RolloutNumbers(
            _index_of(i.get(ROLLOUT_KEY)), _number_or_none(i.get("reward")), _number_or_none(i.get("output_tokens"))
        )
        for i in infos
    )


def task_stat(row: Mapping[str, Any], where: str = "profile row", fields: Sequence[str] = ()) -> TaskStat:
    """One profile row -> TaskStat, with the `fields` its `sample` has in `inputs`. BadInput if the row has no
    integer task index."""
    index = row.get(TASK_KEY)
    if isinstance(index, bool) or not isinstance(index, int):
        raise BadInput(
            f"{where}: field {TASK_KEY}: missing or not an integer ({index!r}); is this a Gym reward-profile file?"
        )
    stats = {k: float(v) for k, v in row.items() if "/" in k and k.split("/", 1)[0] in STAT_NAMES and _is_number(v)}
    n = row.get("num_rollouts")
    n = n if isinstance(n, int) else len(row.get("rollout_infos") or [])
    expected = row.get("expected_num_rollouts")
    sample = row.get("sample")
    inputs = {f: sample[f] for f in fields if f in sample} if fields and isinstance(sample, Mapping) else {}
    expected = expected if isinstance(expected, int) else n
    infos = _ordered_infos(row)
    return TaskStat(index, _agent_of(row), n, expected, stats, _rewards_of(infos), inputs, _rollouts_of(infos))


def task_stats(
    rows: Iterable[Mapping[str, Any]], source: str = "profile", fields: Sequence[str] = ()
) -> list[TaskStat]:
    """All profile rows -> TaskStats sorted by task index; a repeated task index is an error."""
    out: dict[int, TaskStat] = {}
    for n, row in enumerate(rows, 1):
        t = task_stat(row, f"{source}:{n}", fields)
        if t.task_index in out:
            raise BadInput(f"{source}:{n}: task {t.task_index} appears twice in the profile")
        out[t.task_index] = t
    return [out[i] for i in sorted(out)]


def agents(tasks: Iterable[TaskStat]) -> list[str]:
    return sorted({t.agent for t in tasks})


def metrics(tasks: Iterable[TaskStat]) -> list[str]:
    """The fields that have a mean in at least one task (e.g. reward, output_tokens, library_reward)."""
    return sorted({k.split("/", 1)[1] for t in tasks for k in t.stats if k.startswith("mean/")})


def stat_columns(tasks: Iterable[TaskStat]) -> list[str]:
    """`<stat>/<field>` in a reading order: reward first, then the other fields by name; mean, std, min, max, median
    (the profile's columns in `api.profile_frame` and in an export)."""
    tasks = list(tasks)
    names = sorted(metrics(tasks), key=lambda m: (m != "reward", m))
    present = {k for t in tasks for k in t.stats}
    return [f"{s}/{m}" for m in names for s in ("mean", "std", "min", "max", "median") if f"{s}/{m}" in present]


def require_metric(tasks: Sequence[TaskStat], metric: str) -> None:
    if tasks and not any(t.stat("mean", metric) is not None for t in tasks):
        raise BadInput(f"no task has a mean/{metric} in the profile; known metrics: {', '.join(metrics(tasks))}")


# ---------------------------------------------------------------- pass@k


def task_pass_at_k(scores: Sequence[float], k: int) -> float | None:
    """pass@k of one task (0-1), or None when it has fewer than k scored rollouts (`aggregate.pass_at_k`'s rule)."""
    value = pass_at_k([scores], k)
    return None if value is None else value / 100.0


def pass_at_k(tasks: Iterable[TaskStat] | Iterable[Sequence[float]], k: int) -> float | None:
    """Mean pass@k over the tasks that have at least k scored rollouts, in percent; None if none has.

    The rule and the estimator are `aggregate.pass_at_k`'s, the one definition of pass@k, applied to the rewards
    the profile rows carry (`rollout_infos`)."""
    table = _score_table(tasks)
    return aggregate.pass_at_k(table, table.scores[aggregate.ACCURACY], k)


def pass_at_k_values(tasks: Iterable[TaskStat] | Iterable[Sequence[float]], k: int) -> np.ndarray:
    """Each task's pass@k (0-1), for the tasks with at least k scored rollouts, in task order: what `pass_at_k`
    averages (empty if no task has k)."""
    table = _score_table(tasks)
    values = aggregate.task_pass_at_k(table, table.scores[aggregate.ACCURACY], k)
    return np.zeros(0) if values is None else values


def pass_at_k_interval(tasks: Sequence[TaskStat], k: int) -> intervals.Interval | None:
    """The 95% interval of `pass_at_k` (in percent), bootstrapped over the tasks (profile/intervals.py)."""
    found = intervals.bootstrap_mean(pass_at_k_values(tasks, k))
    return None if found is None else intervals.Interval(100.0 * found.low, 100.0 * found.high)


def _score_table(tasks: Iterable[TaskStat] | Iterable[Sequence[float]]) -> aggregate.AgentRollouts:
    per_task = [t.rewards if isinstance(t, TaskStat) else t for t in tasks]
    task = np.repeat(np.arange(len(per_task), dtype=np.int64), [len(r) for r in per_task])
    reward = np.fromiter((x for r in per_task for x in r), dtype=np.float64, count=len(task))
    return aggregate.score_table(task, reward, None)


def max_k(tasks: Iterable[TaskStat]) -> int:
    return max((len(t.rewards) for t in tasks), default=0)


def pass_at_k_curve(tasks: Sequence[TaskStat]) -> dict[int, float]:
    """{k: pass@k percent} for k = 1 .. the most rollouts any task has."""
    curve = {k: pass_at_k(tasks, k) for k in range(1, max_k(tasks) + 1)}
    return {k: v for k, v in curve.items() if v is not None}


def pass_at_k_band(tasks: Sequence[TaskStat]) -> dict[int, intervals.Interval]:
    """{k: the 95% interval of pass@k, in percent} for the k of `pass_at_k_curve`."""
    band = {k: pass_at_k_interval(tasks, k) for k in range(1, max_k(tasks) + 1)}
    return {k: v for k, v in band.items() if v is not None}


# ---------------------------------------------------------------- difficulty buckets


def task_bucket(t: TaskStat, solved_threshold: float = 1.0) -> str | None:
    """never / sometimes / always solved (core/task_rules.py `bucket`), by the task's rollout rewards; None for a
    task without any."""
    return task_rules.bucket(min(t.rewards), max(t.rewards), solved_threshold) if t.rewards else None


def bucket_counts(tasks: Iterable[TaskStat], solved_threshold: float = 1.0) -> dict[str, int]:
    """How many tasks fall in each bucket (every bucket present, in task_rules.BUCKETS order)."""
    counts = dict.fromkeys(task_rules.BUCKETS, 0)
    for t in tasks:
        b = task_bucket(t, solved_threshold)
        if b is not None:
            counts[b] += 1
    return counts


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
    pass_at_1_ci: intervals.Interval | None = None  # percent, 95% (profile/intervals.py)
    pass_at_k_ci: intervals.Interval | None = None
    buckets: Mapping[str, int] = field(default_factory=dict)  # never / sometimes / always solved: task counts


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
    return AgentSummary(
        agent,
        len(tasks),
        sum(t.num_rollouts for t in tasks),
        sum(t.expected_num_rollouts for t in tasks),
        rollout_weighted_mean(tasks),
        pass_at_k(tasks, 1),
        k,
        pass_at_k(tasks, k) if k else None,
        pass_at_k_interval(tasks, 1),
        pass_at_k_interval(tasks, k) if k else None,
        bucket_counts(tasks),
    )


def agent_summaries(tasks: Iterable[TaskStat]) -> list[AgentSummary]:
    return [agent_summary(a, ts) for a, ts in by_agent(tasks).items()]


# ---------------------------------------------------------------- reading (the one edge)


def load_profile(run_dir: Path, fields: Sequence[str] = ()) -> list[TaskStat]:
    """RUN_DIR's merged reward profile as TaskStats (with `fields` of each task's planned row in `inputs`);
    RunDirError when it was not merged yet."""
    path = store.merged_reward_profiling_path(run_dir)
    if not path.is_file():
        raise RunDirError(f"no reward profile at {path}; run `shardrun merge-and-profile {run_dir}` first")
    return task_stats(profile_rows(path), str(path), fields)


def profile_rows(path: Path) -> Iterable[dict[str, Any]]:
    """The profile's rows; BadInput naming the file and the line for one that is not a JSON object (the file was
    edited or damaged: merge-and-profile writes it again)."""
    for n, raw in enumerate(store.complete_lines(path), 1):
        try:
            row = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            row = e
        if not isinstance(row, dict):
            raise BadInput(
                f"{path}:{n}: not a JSON object ({row if isinstance(row, Exception) else type(row).__name__}); the "
                f"profile was edited or damaged: run `shardrun merge-and-profile` again"
            )
        yield row
