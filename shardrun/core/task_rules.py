"""The per-task rules of a curriculum: which tasks a selection keeps, judged by each task's own rollouts alone.

One definition, used where sampling stops (`sampling.stop_when_decided` in the config, the shard stage) and where
tasks are selected (`shardrun select`, whose `Rules` add the rules that look beyond one task). A task is kept
when every rule set here keeps it (they commute: each only looks at the task itself):

- it has a mean of the metric (at least one rollout counted);
- `agents`: its agent is one of them (none given: any agent);
- `min_mean` / `max_mean`: its mean of the metric is at least / at most the bound;
- `drop_unsolved`: some rollout solved it (its max of the metric reaches `solved_threshold`);
- `drop_solved`: not every rollout solved it (its min of the metric is below `solved_threshold`).

The same two rules sort tasks into difficulty buckets (`bucket`): *never* solved (what `drop_unsolved` drops),
*always* solved (what `drop_solved` drops) and *sometimes* solved (what both together keep).

Pure: numbers in, booleans out.
"""

from __future__ import annotations

import math
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

FLAGS = {
    "metric": "--metric",
    "agents": "--agent",
    "min_mean": "--min-mean",
    "max_mean": "--max-mean",
    "drop_unsolved": "--drop-unsolved",
    "drop_solved": "--drop-solved",
    "solved_threshold": "--solved-threshold",
}
"""The `shardrun select` flag of each rule (the config uses the field names themselves)."""


class TaskRules(BaseModel):
    """The rules that decide a task by its own rollouts (the names and meanings of `shardrun select`'s flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str = Field("reward", description="The rollout field the rules read (the profile's mean/<metric>, ...).")
    agents: tuple[str, ...] = Field((), description="Keep only tasks of these agents (empty: every agent).")
    min_mean: float | None = Field(None, description="Keep tasks whose mean of the metric is at least this.")
    max_mean: float | None = Field(None, description="Keep tasks whose mean of the metric is at most this.")
    drop_unsolved: bool = Field(False, description="Drop tasks no rollout solved (max of the metric < threshold).")
    drop_solved: bool = Field(False, description="Drop tasks every rollout solved (min of the metric >= threshold).")
    solved_threshold: float = Field(1.0, description="A rollout solves its task when the metric reaches this.")

    # ------------------------------------------------------------ each rule, on one task's statistics

    def allows_agent(self, agent: str) -> bool:
        return not self.agents or agent in self.agents

    def above_min_mean(self, mean: float) -> bool:
        return self.min_mean is None or mean >= self.min_mean

    def below_max_mean(self, mean: float) -> bool:
        return self.max_mean is None or mean <= self.max_mean

    def solved_by_some(self, maximum: float) -> bool:
        """`drop_unsolved` keeps the task (whether or not it is set)."""
        return maximum >= self.solved_threshold

    def unsolved_by_some(self, minimum: float) -> bool:
        """`drop_solved` keeps the task (whether or not it is set)."""
        return minimum < self.solved_threshold

    def keeps(self, agent: str, mean: float | None, minimum: float | None, maximum: float | None) -> bool:
        """Does every rule keep a task with these statistics of the metric (None: the task has no rollout counted)?"""
        if mean is None or minimum is None or maximum is None or not self.allows_agent(agent):
            return False
        return (
            self.above_min_mean(mean)
            and self.below_max_mean(mean)
            and (not self.drop_unsolved or self.solved_by_some(maximum))
            and (not self.drop_solved or self.unsolved_by_some(minimum))
        )

    def task_rules(self) -> "TaskRules":
        """Just the per-task rules (a subclass with more rules hands back these)."""
        return TaskRules(**{name: getattr(self, name) for name in TaskRules.model_fields})


def problems(rules: TaskRules, name: Callable[[str], str] = lambda field: FLAGS[field]) -> list[str]:
    """What makes the rules impossible to meet whatever the rollouts hold: a bound that is not a finite number, a
    minimum above the maximum. `name` says how the caller names a rule (a flag, a config key)."""
    found = []
    for field in ("min_mean", "max_mean", "solved_threshold"):
        value = getattr(rules, field)
        if value is not None and not math.isfinite(value):
            found.append(f"{name(field)} {value}: must be a finite number")
    lo, hi = rules.min_mean, rules.max_mean
    if lo is not None and hi is not None and lo > hi:
        found.append(f"{name('min_mean')} {lo} is above {name('max_mean')} {hi}: no task can match")
    return found


# ---------------------------------------------------------------- difficulty buckets

NEVER, SOMETIMES, ALWAYS = "never", "sometimes", "always"
BUCKETS = (NEVER, SOMETIMES, ALWAYS)
"""A task's difficulty bucket, by its rollouts of the metric against `solved_threshold` (the solved notion of the
rules above): `never` solved (no rollout reaches it: `drop_unsolved` drops it), `always` solved (every rollout
does: `drop_solved` drops it), `sometimes` solved otherwise (both keep it)."""


def bucket(
    minimum: float | None, maximum: float | None, solved_threshold: float = 1.0, complete: bool = True
) -> str | None:
    """The bucket of a task whose counted rollouts' metric ranges over [minimum, maximum] (None: no rollout counted,
    no bucket). `complete=False` (a task whose sampling stopped early) knows its bucket only when its rollouts
    already disagree (`sometimes`); rollouts all on one side of the threshold could still be joined by one on the
    other, so its bucket is unknown (None)."""
    if minimum is None or maximum is None:
        return None
    rules = TaskRules(solved_threshold=solved_threshold)
    solved_by_some, unsolved_by_some = rules.solved_by_some(maximum), rules.unsolved_by_some(minimum)
    if solved_by_some and unsolved_by_some:
        return SOMETIMES
    if not complete:
        return None
    return ALWAYS if solved_by_some else NEVER
