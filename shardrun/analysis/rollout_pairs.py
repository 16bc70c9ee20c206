"""`compare`'s pairing rollout by rollout (docs/rescore.md): two runs that hold the same rollouts (the same plan of
rollouts: input bytes, planning settings, shard table; a run and its re-score, `shardrun rescore`) are paired
identity by identity (`_ng_task_index`, `_ng_rollout_index`) from their merged rollouts: how many changed reward,
per agent and label, with examples (task, rollout, old and new reward).

A rollout scored in only one run (failed in the other) is counted as such, never as changed. `pair` and `summary`
are pure; `read_rewards` reads a merged run's rollouts, checking what it trusts (identity, reward)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from shardrun.core.errors import BadInput
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY
from shardrun.plan import planner
from shardrun.plan.planner import Plan
from shardrun.rundir import store

Key = tuple[int, int]
EXAMPLES = 10  # changed rollouts listed (the first by identity); all are counted
ALL = "all"


def read_rewards(run_dir: Path) -> dict[Key, tuple[str, float]]:
    """identity -> (agent, reward) of every rollout in the run's merged rollouts; BadInput for a row that does not
    carry an integer identity and a finite number as its reward."""
    path = store.merged_rollouts_path(run_dir)
    if not path.exists():
        raise BadInput(f"{run_dir}: no merged rollouts ({path.name}); run `shardrun merge-and-profile {run_dir}`")
    out: dict[Key, tuple[str, float]] = {}
    for n, row in enumerate(store.iter_jsonl_objects(path), 1):
        task, rollout, reward = row.get(TASK_KEY), row.get(ROLLOUT_KEY), row.get("reward")
        if not (type(task) is int and type(rollout) is int):
            raise BadInput(f"{path}: line {n}: no integer {TASK_KEY} and {ROLLOUT_KEY}")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise BadInput(f"{path}: line {n}: reward {reward!r} is not a finite number")
        agent = row.get(AGENT_KEY)
        name = agent.get("name") if isinstance(agent, dict) else None
        out[(task, rollout)] = (str(name) if name is not None else "", float(reward))
    return out


def same_rollouts(base: Plan, cand: Plan) -> bool:
    """Do the two runs hold the same rollout identities (so they pair rollout by rollout)?"""
    return planner.same_rollouts(base, cand)


def pair(
    base: Mapping[Key, tuple[str, float]],
    cand: Mapping[Key, tuple[str, float]],
    labels: Mapping[int, str] | None = None,
    examples: int = EXAMPLES,
) -> dict[str, Any]:
    """compare.json's `rollouts` entry for one candidate (pure): counts overall and per agent and label, and the
    first `examples` changed rollouts by identity."""
    labels = labels or {}
    paired = sorted(base.keys() & cand.keys())
    counts: dict[tuple[str, str], Counter] = {}
    changed: list[dict[str, Any]] = []
    for key in paired:
        agent, old = base[key]
        new = cand[key][1]
        groups = [(ALL, ALL), ("agent", agent)] + ([("label", labels[key[0]])] if key[0] in labels else [])
        moved = new != old
        for g in groups:
            c = counts.setdefault(g, Counter())
            c["paired"] += 1
            if moved:
                c["changed"] += 1
                c["up" if new > old else "down"] += 1
        if moved and len(changed) < examples:
            changed.append(
                {
                    "task_index": key[0],
                    "rollout_index": key[1],
                    "agent": agent,
                    **({"label": labels[key[0]]} if key[0] in labels else {}),
                    "reward_base": old,
                    "reward_cand": new,
                }
            )
    whole = counts.get((ALL, ALL), Counter())
    return {
        "paired": len(paired),
        "changed": whole["changed"],
        "up": whole["up"],
        "down": whole["down"],
        "only_base": len(base.keys() - cand.keys()),
        "only_cand": len(cand.keys() - base.keys()),
        "groups": [
            {
                "kind": kind,
                "group": name,
                "paired": c["paired"],
                "changed": c["changed"],
                "up": c["up"],
                "down": c["down"],
            }
            for (kind, name), c in sorted(counts.items(), key=lambda kv: (kv[0][0] != ALL, kv[0]))
        ],
        "examples": changed,
    }


def text(entry: Mapping[str, Any]) -> list[str]:
    """The rollout-by-rollout pairing for the terminal (pure)."""
    lines = [
        f"  rollouts: {entry['paired']:,} paired, {entry['changed']:,} changed reward "
        f"(+{entry['up']:,}/-{entry['down']:,})"
        + (f", scored only in base {entry['only_base']:,}" if entry["only_base"] else "")
        + (f", only in candidate {entry['only_cand']:,}" if entry["only_cand"] else "")
    ]
    for g in entry["groups"]:
        if g["kind"] != ALL:
            lines.append(f"    {g['kind']} {g['group']}: {g['changed']:,} of {g['paired']:,} changed")
    for e in entry["examples"]:
        lines.append(
            f"    task {e['task_index']} rollout {e['rollout_index']} ({e['agent']}): "
            f"{e['reward_base']:g} -> {e['reward_cand']:g}"
        )
    return lines
