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
    if plan.blend:
        rows[0] = (
            "input",
            f"blend of {len(plan.blend)} entries -> {shown(plan.input.path)} (sha256 {plan.input.sha256[:12]}…)",
        )
        nickname = plan.config.get("nickname") if isinstance(plan.config, dict) else None
        if nickname:
            rows.insert(0, ("blend", shown(nickname)))
        for e in plan.blend:
            rows.append(
                (
                    f"  entry {shown(e.label)}",
                    f"agent {shown(e.agent)}: {e.num_tasks:,} of {e.rows_in_file:,} rows x {e.repeats} repeats = "
                    f"{e.num_rollouts:,}",
                )
            )
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
            **(
                {
                    "entries": [
                        {
                            "label": e.label,
                            "agent": e.agent,
                            "rows_in_file": e.rows_in_file,
                            "tasks": e.num_tasks,
                            "repeats": e.repeats,
                            "rollouts": e.num_rollouts,
                        }
                        for e in plan.blend
                    ]
                }
                if plan.blend
                else {}
            ),
            "shards": len(plan.shards),
            "rollouts_per_shard_min": lo,
            "rollouts_per_shard_max": hi,
            "array_jobs_needed": plan.array_jobs_needed(max_array_size),
            "fingerprint": plan.fingerprint,
            "input_sha256": plan.input.sha256,
            "warnings": list(plan.warnings),
        },
        option=orjson.OPT_INDENT_2,
    ).decode()
