"""A blend's labels after the merge: which rows are whose, each label's counts, and its measured rate (pure, but for
the paths; docs/blends.md, "Per-label outputs").

    merged/by_label/<label>/rollouts_reward_profiling.jsonl   Gym's profiler's files on that label's rows only
    merged/by_label/<label>/rollouts_agent_metrics.json
    merged/by_label/<label>/rollouts_aggregate_metrics.json   shardrun's aggregate metrics of those rows
    merged/by_label/<label>/rollouts_repeat_level_metrics.json  (a Gym 0.7 run only)
    merged/labels.json                                        per label: planned, collected, failed, skipped,
                                                              tasks, mean reward, pass@1, rate; the failed lanes

A label's rows are the rows of the task indices the plan gives it (Plan.blend, keyed on `_ng_task_index`, never on
the agent: labels may share one). Its profile is made by the same writers as the run's, from the merged table cut
down to its tasks (MergedTable.subset), so it is what Gym's profiler gives on that label's rows alone.

A label's rate comes from the run's own timings, the sealed shards' markers (rundir/cost.py). Rollouts carry no
time of their own, so each shard's time and GPU-hours are shared out among the labels it holds: in proportion to
their output tokens in that shard when every rollout of the shard reports its output tokens (generation is what
the GPUs spend their time on), in proportion to their rollouts otherwise. `rate.basis` says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from shardrun.merge.merged_table import MergedTable
from shardrun.plan.planner import BlendEntry, Plan
from shardrun.rundir import cost
from shardrun.rundir.records import BlendLabels, LabelRate, LabelResult, Seal

TOKENS = "output_tokens"


def task_ranks(plan: Plan, table: MergedTable) -> list[np.ndarray]:
    """Per blend entry (config order), the positions in `table.tasks` of its tasks."""
    codes = plan.label_codes(table.tasks)
    return [np.flatnonzero(codes == i) for i in range(len(plan.blend))]


def label_plan(plan: Plan, entry: BlendEntry) -> Plan:
    """The plan as the label's rows alone would have it: one agent, the label's tasks and rollouts (what the
    aggregate metrics' coverage counts as planned)."""
    from dataclasses import replace

    agents = {entry.agent: {"tasks": entry.num_tasks, "rollouts": entry.num_rollouts, "repeats": entry.repeats}}
    return replace(plan, agents=agents, num_tasks=entry.num_tasks, num_rollouts=entry.num_rollouts)


@dataclass
class ShardShare:
    """What one label collected in each shard: rollouts and output tokens (NaN when a rollout has none)."""

    rollouts: np.ndarray  # per shard index
    tokens: np.ndarray  # per shard index: the label's output tokens there


def shard_share(table: MergedTable, num_shards: int) -> ShardShare:
    """Rollouts and output tokens per shard of a (label's) table whose rows still know their shard."""
    shard = table.r_shard.astype(np.int64)
    tokens = table.column(TOKENS)
    return ShardShare(
        np.bincount(shard, minlength=num_shards),
        np.bincount(shard, weights=np.where(np.isnan(tokens), np.nan, tokens), minlength=num_shards),
    )


def label_rate(mine: ShardShare, whole: ShardShare, markers: Sequence[Seal | None]) -> LabelRate:
    """The label's share of the sealed shards' time and GPU-hours, and its rates over them (module docstring)."""
    hours = gpu_hours = 0.0
    tokens = 0.0
    bases: set[str] = set()
    for marker in markers:
        if marker is None:
            continue
        i = marker.shard_index
        if i >= len(whole.rollouts) or not whole.rollouts[i] or not mine.rollouts[i]:
            continue
        c = cost.shard_cost(marker)
        seconds = c.collect_s if c.collect_s else c.wall_s
        by_tokens = bool(math.isfinite(whole.tokens[i]) and whole.tokens[i] > 0 and math.isfinite(mine.tokens[i]))
        share = float(mine.tokens[i] / whole.tokens[i] if by_tokens else mine.rollouts[i] / whole.rollouts[i])
        bases.add(TOKENS if by_tokens else "rollouts")
        hours += share * seconds / 3600.0
        gpu_hours += share * c.gpu_hours
        if math.isfinite(mine.tokens[i]):
            tokens += float(mine.tokens[i])
    if not math.isfinite(tokens) or not 0 <= tokens <= cost.MAX_TOKENS:  # rows' counts past any sane total
        tokens = 0.0
    rollouts = int(sum(int(mine.rollouts[m.shard_index]) for m in markers if m is not None))
    return LabelRate(
        rollouts=rollouts,
        hours=hours,
        gpu_hours=gpu_hours,
        rollouts_per_hour=rollouts / hours if hours > 0 else None,
        rollouts_per_gpu_hour=rollouts / gpu_hours if gpu_hours > 0 else None,
        output_tokens=int(tokens),
        output_tokens_per_s=tokens / (hours * 3600.0) if hours > 0 else None,
        basis="+".join(sorted(bases)) if bases else None,
    )


def labels_document(run_dir: Path, plan: Plan, results: Sequence[LabelResult]) -> BlendLabels:
    """merged/labels.json (records.BlendLabels): the labels in config order and the failed lanes."""
    return BlendLabels(
        run_dir=str(run_dir),
        fingerprint=plan.fingerprint,
        labels=list(results),
        failed_lanes=[r.label for r in results if r.failed_lane],
        rate_basis="each sealed shard's collection time and GPU-hours shared among its labels by their output "
        "tokens there (by their rollouts where a rollout lacks output tokens); rollouts_per_hour is per "
        "hour of one shard's allocation",
    )
