"""A planned blend for tests of the per-label outputs: an input whose rows come in blocks, one block per label, planned
as one run and then given the blend's entries in plan.json (Plan.blend, with the fingerprint recomputed), as the
planner would from a config's `entries`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import orjson

from shardrun.plan import planner
from shardrun.rundir import store
from tests.builders import Run, make_run


def blend_rows(labels: Sequence[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """Input rows of (label, agent, tasks) blocks, in that order; each row says its label in `label_hint`."""
    rows = []
    for label, agent, n in labels:
        for i in range(n):
            q = f"{label}: what is {i} + {i}?"
            rows.append(
                {
                    "responses_create_params": {"input": [{"role": "user", "content": q}]},
                    "question": q,
                    "expected_answer": str(2 * i),
                    "agent_ref": {"name": agent},
                    "label_hint": label,
                }
            )
    return rows


def with_blend(run: Run, labels: Sequence[tuple[str, str, int]], owners: dict[str, str] | None = None) -> Run:
    """The run's plan with a blend of these (label, agent, tasks) blocks (task indices in input order), written
    to plan.json."""
    plan = run.plan
    entries, start = [], 0
    for label, agent, n in labels:
        repeats = plan.agents[agent]["repeats"]
        entries.append(
            planner.BlendEntry(
                label=label,
                agent=agent,
                data=f"{label}.jsonl",
                sha256="0" * 64,
                rows_in_file=n,
                num_tasks=n,
                num_rollouts=n * repeats,
                repeats=repeats,
                tasks=((start, start + n),),
                owner=(owners or {}).get(label),
            )
        )
        start += n
    plan = dataclasses.replace(plan, blend=tuple(entries))
    plan = dataclasses.replace(plan, fingerprint=planner.fingerprint(plan))
    store.plan_path(run.run_dir).write_bytes(orjson.dumps(plan.to_json(), option=orjson.OPT_INDENT_2))
    assert store.load_plan(run.run_dir) == plan
    return dataclasses.replace(run, plan=plan)


def make_blend_run(
    tmp: Path,
    labels: Sequence[tuple[str, str, int]],
    *,
    num_repeats: int | dict[str, int] = 2,
    num_shards: int = 3,
    slicing: str = "round_robin",
    owners: dict[str, str] | None = None,
) -> Run:
    run = make_run(tmp, blend_rows(labels), num_repeats=num_repeats, num_shards=num_shards, slicing=slicing)
    return with_blend(run, labels, owners)
