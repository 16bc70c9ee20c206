"""The Python API for notebooks: a run directory's plan, its status, the per-task reward profile as a pandas
DataFrame, and the merged rollouts (docs/api.md shows each in use).

    from shardrun import api

    plan = api.load_plan("runs/arith")                       # plan.num_tasks, plan.num_rollouts, plan.shards
    st = api.status("runs/arith")                            # st.complete, st.done / st.planned, st.shards
    df = api.profile_frame("runs/arith", fields=["question"])  # one row per task, indexed by task index
    for rollout in api.iter_rollouts("runs/arith"): ...      # dicts, in (task, rollout) order, streamed
    cmp = api.compare_frame("runs/base", "runs/new")         # one row per paired task: means, delta, buckets

This module only arranges what the stages already read: the plan is `rundir.store.load_plan`'s, the status
`launch.status.collect`'s, the profile `profile.taskstats.load_profile`'s (of
`merged/rollouts_reward_profiling.jsonl`), and the rollouts are the lines of `merged/rollouts.jsonl`: the files
`shardrun merge-and-profile` writes; `compare_frame` is `analysis.comparison`'s per-task table (what
`shardrun compare` writes to compare_tasks.jsonl). Errors are the domain errors of shardrun.core.errors (a run that is not merged
yet: RunDirError; a field no task has: BadInput).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Iterator, Sequence

import pandas as pd

from shardrun.core.errors import BadInput, RunDirError
from shardrun.launch import status as run_status
from shardrun.launch.status import RunStatus
from shardrun.plan.planner import Plan
from shardrun.profile import taskstats
from shardrun.rundir import store

INDEX = "task_index"
COUNTS = ("agent", "num_rollouts", "expected_num_rollouts")
LABEL = "label"  # a blend's runs only


def load_plan(run_dir: str | Path) -> Plan:
    """The run's plan (`plan.json`, checked against its fingerprint): `num_tasks`, `num_rollouts`, `shards` (each
    with its `index` and `num_rollouts`), `input` (the planned input's `path` and `sha256`), `fingerprint`.
    RunDirError when RUN_DIR holds no plan; PlanMismatch when plan.json was edited."""
    return store.load_plan(Path(run_dir))


def status(run_dir: str | Path) -> RunStatus:
    """What every shard is doing, as `shardrun status --json` reports it (on Slurm this asks `squeue` once).

    A frozen dataclass: `complete` (every shard sealed), `planned` and `done` rollouts (`done` counts failed ones
    too), `failed_rollouts`, `counts` (shards per state: sealed, running, pending, failed, never_started), `shards`
    (one ShardStatus each: `index`, `state`, `planned`, `rollouts`, `failed_rollouts`, `attempts`, `job_id`,
    `reason`, `log`), `gpu_hours`, `throughput_per_min`, `eta_s`, `warnings`; `dataclasses.asdict` turns it into
    plain dicts and lists."""
    return run_status.collect(Path(run_dir))


def profile_frame(run_dir: str | Path, fields: Sequence[str] = ()) -> pd.DataFrame:
    """The per-task reward profile (`merged/rollouts_reward_profiling.jsonl`) as a DataFrame, one row per profiled
    task, indexed by task index in ascending order.

    Columns: `agent`, then for a blend `label` (the task's entry in the run config, from the plan; a run without
    a blend has no `label` column), `num_rollouts`, `expected_num_rollouts`, then each of `fields` (taken from the task's planned
    input row, the profile's `sample`; None where a task's row lacks it), then every statistic of the profile,
    `mean/reward`, `std/reward`, `min/reward`, `max/reward`, `median/reward` first and the other numeric rollout
    fields after (e.g. `mean/output_tokens`). `mean/reward` is 0-1.

    RunDirError when the run is not merged yet (run `shardrun merge-and-profile RUN_DIR`); BadInput for a field
    that no task's row has or whose name is already a column."""
    run_dir = Path(run_dir)
    fields = list(dict.fromkeys([fields] if isinstance(fields, str) else fields))
    tasks = taskstats.load_profile(run_dir, fields)
    stats = taskstats.stat_columns(tasks)
    plan = store.load_plan(run_dir)
    own = [INDEX, *COUNTS] if not plan.blend else [INDEX, COUNTS[0], LABEL, *COUNTS[1:]]
    for f in fields:
        if f in (*own, *stats):
            raise BadInput(
                f"fields: {f!r} is the name of one of the profile's own columns; it cannot be an input field"
            )
        if tasks and not any(f in t.inputs for t in tasks):
            raise BadInput(f"fields: no task's input row has a field {f!r}{_hint(run_dir, f)}")
    rows: list[dict[str, Any]] = [
        {
            INDEX: t.task_index,
            "agent": t.agent,
            **({LABEL: plan.label_of(t.task_index)} if plan.blend else {}),
            "num_rollouts": t.num_rollouts,
            "expected_num_rollouts": t.expected_num_rollouts,
            **{f: t.inputs.get(f) for f in fields},
            **{c: t.stats.get(c) for c in stats},
        }
        for t in tasks
    ]
    frame = pd.DataFrame(rows, columns=[*own, *fields, *stats])
    return frame.set_index(INDEX)


def _hint(run_dir: Path, field: str) -> str:
    """' (did you mean ...?)' or ' (its fields: ...)', from the first profiled task's input row."""
    first = next(iter(store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir))), {})
    sample = first.get("sample")
    known = sorted(sample) if isinstance(sample, dict) else []
    close = difflib.get_close_matches(field, known, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (its fields: {', '.join(known)})" if known else ""


def iter_rollouts(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The merged rollouts (`merged/rollouts.jsonl`), one dict per finished rollout, in identity order (task index,
    then rollout index), each rollout once; read line by line, so memory stays bounded however large the run.

    Only a merged run has them: a shard's own `rollouts.jsonl` is in completion order and may hold a rollout twice
    (a resumed attempt), which the merge sorts out. RunDirError, raised here rather than at the first row, when the
    run is not merged yet."""
    run_dir = Path(run_dir)
    path = store.merged_rollouts_path(run_dir)
    if not path.is_file():
        raise RunDirError(f"no merged rollouts at {path}; run `shardrun merge-and-profile {run_dir}` first")
    return iter(store.iter_jsonl_objects(path))


def compare_frame(
    base: str | Path, cand: str | Path, key: str | None = None, solved_threshold: float = 1.0
) -> pd.DataFrame:
    """Two merged runs task by task, as `shardrun compare BASE CAND` writes them to compare_tasks.jsonl: one row per
    paired task, in the base's task order.

    Columns: `candidate`, `key` (the task index when the runs planned the same input, else the `key` field of the
    input rows, by default the sha256 of their `responses_create_params`), `task_index_base`, `task_index_cand`,
    `agent`, `label` (only when the runs have labels), `mean_base`, `mean_cand`, `delta` (candidate - base),
    `bucket_base`, `bucket_cand` (never / sometimes / always solved at `solved_threshold`), `rollouts_base`,
    `rollouts_cand` (the rollouts behind each mean), `planned_rollouts_base`, `planned_rollouts_cand`,
    `stopped_early_base`, `stopped_early_cand`. A task whose sampling stopped early has no full mean (None, and no
    delta); its bucket is None when its rollouts do not tell it.

    RunDirError when a run is not merged; BadInput when the key does not name one task per row."""
    from shardrun.analysis import comparison

    b, cands, pairings = comparison.read_and_pair(Path(base), [Path(cand)], key, solved_threshold)
    rows = comparison.task_rows(b, cands, pairings)
    columns = list(rows[0]) if rows else list(comparison.FRAME_COLUMNS)
    return pd.DataFrame(rows, columns=columns)
