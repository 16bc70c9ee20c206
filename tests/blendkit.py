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
from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY
from tests.builders import Run, make_run, rollout_row, seal_shard


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


# ---------------------------------------------------------------- three labels, two sharing agent "a"

LABELS = (("alpha", "a", 4), ("beta", "a", 3), ("gamma", "b", 2))
REPEATS = {"a": 3, "b": 2}


def label_of(task: int) -> str:
    return "alpha" if task < 4 else "beta" if task < 7 else "gamma"


def write_lane_shards(run: Run, failing: str | None = None, skip: tuple[int, int] | None = None) -> dict[str, Any]:
    """Every planned rollout collected (rollout_row), except those of the `failing` label (failure sidecar only)
    and one `skip` identity (missing); sealed. Returns the rows written and the failed identities."""
    written: list[dict[str, Any]] = []
    failed: list[tuple[int, int]] = []
    for i in range(run.num_shards):
        rows, fails = [], []
        for m in run.materialized(i):
            ident = (m[TASK_KEY], m[ROLLOUT_KEY])
            if label_of(ident[0]) == failing:
                fails.append(ident)
            elif ident != skip:
                rows.append(rollout_row(m))
        store.rollouts_path(run.run_dir, i).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        lines = [
            {TASK_KEY: t, ROLLOUT_KEY: r, "agent_ref": {"name": "b"}, "_ng_failure_class": "http_500", "error": "x"}
            for _ in range(3)
            for t, r in fails
        ]
        store.failures_path(run.run_dir, i).write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        seal_shard(run, i, num_failed=len(fails) + (skip is not None and skip in run.identities(i)), hours=0.25)
        written += rows
        failed += fails
    return {"rows": written, "failed": failed}
