"""Small helpers for planner tests: in-memory inputs and configs (no files needed for pure planning)."""

from __future__ import annotations

from typing import Any

import orjson

from shardrun.core import config
from shardrun.plan import planner


def row(i: int, agent: str | None = "agent_a", **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "responses_create_params": {"input": [{"role": "user", "content": f"question {i}"}]},
        "question": f"q{i}",
        "expected_answer": str(i),
    }
    if agent:
        r["agent_ref"] = {"name": agent}
    r.update(extra)
    return r


def lines_of(rows: list[Any]) -> list[tuple[int, bytes]]:
    return [(n, r if isinstance(r, bytes) else orjson.dumps(r)) for n, r in enumerate(rows, 1)]


def cfg(**kw: Any) -> config.RunConfig:
    base = {"input_jsonl": "in.jsonl", "run_dir": "run"}
    base.update(kw)
    return config.validate(base)


def plan_rows(rows: list[Any], **kw: Any) -> tuple[planner.Plan, list[tuple[int, dict]]]:
    """Plan in memory; return the plan and (shard, materialized row) for every planned rollout."""
    c = cfg(**kw)
    summary = planner.scan(lines_of(rows), c, "in.jsonl")
    plan = planner.make_plan(c, planner.InputInfo("in.jsonl", "0" * 64, summary.num_lines), summary)
    out = [
        (s, orjson.loads(line))
        for s, chunk in planner.materialize(plan, c, lines_of(rows), "in.jsonl")
        for line in chunk.splitlines()
    ]
    return plan, out
