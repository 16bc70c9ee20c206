"""Helpers for the report/select/cost tests: a planned run directory (input written with spaces after separators,
so byte-identical copies are distinguishable from re-serialized rows), sealed shards with Gym-shaped rollouts
(tests/builders.py rows with a reward the test chooses) and controlled accounting (times, attempts, job ids,
tokens), merged by shardrun's own merge-and-profile.

Rewards are a pure function of (task, rollout) so tests know every expected statistic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import orjson

import builders
from shardrun.core import config
from shardrun.rundir import seal
from shardrun.rundir import store

Reward = Callable[[int, int], float]


def input_row(i: int, agent: str = "agent_a", **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
        "question": f"What is {i} + {i}?",
        "expected_answer": str(2 * i),
        "agent_ref": {"name": agent},
        **extra,
    }


def write_input(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (dumped with a space after separators, so they differ from orjson's bytes) or raw bytes."""
    import json

    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return path


def planned_run(
    tmp: Path, rows: list[Any], num_repeats: Any = 4, num_shards: int = 3, cluster: dict | None = None
) -> tuple[Path, config.RunConfig]:
    inp = write_input(tmp / "input.jsonl", rows)
    cfg_path = builders.write_config(
        tmp / "run.yaml", inp, tmp / "run", repeats=num_repeats, shards=num_shards, cluster=cluster or None
    )
    cfg = config.load(cfg_path)
    store.write_plan(cfg)
    return cfg.run_dir, cfg


def rollout(row: dict[str, Any], reward: float, output_tokens: int) -> dict[str, Any]:
    """A verify response as the collector writes it (builders.rollout_row), with this reward and token count."""
    out = builders.rollout_row(row)
    out.update(reward=reward, library_reward=reward, is_correct=reward >= 1.0)
    out["response"]["usage"].update(input_tokens=10, output_tokens=output_tokens, total_tokens=10 + output_tokens)
    return out


def tokens_of(task: int, r: int) -> int:
    return 20 + 3 * task + r


def seal_shards(
    run_dir: Path,
    reward: Reward,
    *,
    failed: set[tuple[int, int]] = frozenset(),
    t0: float = 1_700_000_000.0,
    gpus: int = 2,
    attempts: dict[int, int] | None = None,
    unsealed: set[int] = frozenset(),
    job_prefix: str | None = None,
) -> list[seal.Seal]:
    """Write every shard's rollouts.jsonl and seal it; returns the markers. `failed` identities go to the shard's
    failure sidecar instead (recorded as failed after their retries, as the runtime does)."""
    plan = store.load_plan(run_dir)
    markers = []
    for s in plan.shards:
        rows = list(store.iter_jsonl_objects(store.materialized_path(run_dir, s.index)))
        out = [
            rollout(
                r,
                reward(r["_ng_task_index"], r["_ng_rollout_index"]),
                tokens_of(r["_ng_task_index"], r["_ng_rollout_index"]),
            )
            for r in rows
            if (r["_ng_task_index"], r["_ng_rollout_index"]) not in failed
        ]
        data = b"".join(orjson.dumps(o) + b"\n" for o in out)
        store.rollouts_path(run_dir, s.index).write_bytes(data)
        store.failures_path(run_dir, s.index).write_bytes(
            b"".join(
                orjson.dumps(
                    {
                        **{k: r[k] for k in ("_ng_task_index", "_ng_rollout_index", "agent_ref")},
                        "_ng_failure_class": "http_500",
                        "error": "model returned 500",
                    }
                )
                + b"\n"
                for r in rows
                if (r["_ng_task_index"], r["_ng_rollout_index"]) in failed
            )
        )
        if s.index in unsealed:
            continue
        start = t0 + 600 * s.index
        marker = builders.seal_shard(
            run_dir,
            s.index,
            plan=plan,
            num_rollouts=len(out),
            num_failed=len(rows) - len(out),
            started_at=start,
            finished_at=start + 1800 + 60 * s.index,
            host=f"node{s.index}",
            job_id=f"{job_prefix}_{s.index}" if job_prefix else None,
            attempt=(attempts or {}).get(s.index, 1),
            server_wait_s=30.0,
            collect_s=1700.0 + 60 * s.index,
            gpus=gpus,
            extra={
                "output_tokens": sum(o["response"]["usage"]["output_tokens"] for o in out),
                "input_tokens": 10 * len(out),
                "total_tokens": sum(o["response"]["usage"]["total_tokens"] for o in out),
            },
        )
        markers.append(marker)
    return markers


# ---------------------------------------------------------------- merged outputs, by the real merge


def merge_run(run_dir: Path, allow_partial: bool = False):
    """merged/ written by shardrun's own merge-and-profile (Gym's formats)."""
    from shardrun.profile import merge_and_profile

    return merge_and_profile.merge_and_profile(run_dir, allow_partial)


def collect_shard(run_dir: Path, index: int, reward: Callable[[int, int], float], skip: Any = frozenset()) -> dict:
    """What a shard job does, with the collector replaced by `reward(task, rollout)`: collect the rows of shard
    `index` not in `skip` ((task, rollout) pairs an adaptive run skipped), then seal; returns the seal as on disk."""
    plan = store.load_plan(run_dir)
    rows = list(store.iter_jsonl_objects(store.materialized_path(run_dir, index)))
    out = [
        rollout(r, reward(r["_ng_task_index"], r["_ng_rollout_index"]), 10)
        for r in rows
        if (r["_ng_task_index"], r["_ng_rollout_index"]) not in skip
    ]
    data = b"".join(orjson.dumps(o) + b"\n" for o in out)
    store.rollouts_path(run_dir, index).write_bytes(data)
    marker = builders.seal_shard(
        run_dir,
        index,
        plan=plan,
        num_rollouts=len(out),
        num_failed=0,
        started_at=0.0,
        finished_at=1.0,
        host="h",
        server_wait_s=0.0,
        collect_s=1.0,
        skipped_decided_tasks=sorted({t for t, _ in skip}),
        num_skipped_decided=len(skip),
    )
    return marker.to_json()  # as the seal holds it on disk
