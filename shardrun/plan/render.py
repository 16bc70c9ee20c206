"""Text renderings of a plan for the terminal (pure)."""

from __future__ import annotations

import orjson

from shardrun.plan.planner import Plan
from shardrun.core.terminal import shown


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def plan_rows(plan: Plan, max_array_size: int) -> list[tuple[str, str]]:
    lo, hi = plan.shard_sizes
    rows = [
        ("input", f"{shown(plan.input.path)} (sha256 {plan.input.sha256[:12]}…)"),
        ("tasks", f"{plan.num_tasks:,}"),
        ("rollouts", f"{plan.num_rollouts:,}"),
    ]
    for agent, s in plan.agents.items():
        rows.append((f"  agent {shown(agent)}", f"{s['tasks']:,} tasks x {s['repeats']} repeats = {s['rollouts']:,}"))
    rows += [
        ("shards", f"{len(plan.shards):,} ({plan.planning['sharding']['slicing']})"),
        ("rollouts per shard", f"min {lo:,} / max {hi:,}"),
        ("array jobs needed", f"{plan.array_jobs_needed(max_array_size)} (MaxArraySize {max_array_size})"),
        ("seed", f"seed_offset {plan.planning['seed_offset']} + rollout index"),
        ("fingerprint", plan.fingerprint),
    ]
    return rows


def plan_table(plan: Plan, max_array_size: int) -> str:
    return table(plan_rows(plan, max_array_size))


def plan_json(plan: Plan, max_array_size: int) -> str:
    lo, hi = plan.shard_sizes
    return orjson.dumps(
        {
            "tasks": plan.num_tasks,
            "rollouts": plan.num_rollouts,
            "agents": plan.agents,
            "shards": len(plan.shards),
            "rollouts_per_shard_min": lo,
            "rollouts_per_shard_max": hi,
            "array_jobs_needed": plan.array_jobs_needed(max_array_size),
            "fingerprint": plan.fingerprint,
            "input_sha256": plan.input.sha256,
        },
        option=orjson.OPT_INDENT_2,
    ).decode()
