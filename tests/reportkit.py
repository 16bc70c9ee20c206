"""Helpers for the report/select/cost tests: a planned run directory, sealed shards with Gym-shaped rollouts,
and merged profile files in Gym's formats (gym-formats.md §2.6), written here until merge.py can write them.

Rewards are a pure function of (task, rollout) so tests know every expected statistic.
"""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path
from typing import Any, Callable

import orjson
import yaml

from shardrun import config, seal, store

Reward = Callable[[int, int], float]


def input_row(i: int, agent: str = "agent_a", **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
            "question": f"What is {i} + {i}?", "expected_answer": str(2 * i), "agent_ref": {"name": agent}, **extra}


def write_input(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (dumped with a space after separators, so they differ from orjson's bytes) or raw bytes."""
    import json

    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return path


def planned_run(tmp: Path, rows: list[Any], num_repeats: Any = 4, num_shards: int = 3,
                cluster: dict | None = None) -> tuple[Path, config.RunConfig]:
    inp = write_input(tmp / "input.jsonl", rows)
    data = {"input_jsonl": str(inp), "run_dir": str(tmp / "run"), "num_repeats": num_repeats,
            "sharding": {"num_shards": num_shards}}
    if cluster:
        data["cluster"] = cluster
    cfg_path = tmp / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = config.load(cfg_path)
    store.write_plan(cfg)
    return cfg.run_dir, cfg


def rollout(row: dict[str, Any], reward: float, output_tokens: int) -> dict[str, Any]:
    """A verify response as the collector writes it (trimmed to what profiling reads)."""
    return {"responses_create_params": row["responses_create_params"],
            "response": {"id": "r", "output": [], "usage": {"input_tokens": 10, "output_tokens": output_tokens,
                                                            "total_tokens": 10 + output_tokens,
                                                            "output_tokens_details": {"reasoning_tokens": 0}}},
            "reward": reward, "expected_answer": row.get("expected_answer"), "library_reward": reward >= 0.5,
            "_ng_task_index": row["_ng_task_index"], "_ng_rollout_index": row["_ng_rollout_index"],
            "agent_ref": row["agent_ref"]}


def tokens_of(task: int, r: int) -> int:
    return 20 + 3 * task + r


def seal_shards(run_dir: Path, reward: Reward, *, skip: set[tuple[int, int]] = frozenset(),
                t0: float = 1_700_000_000.0, gpus: int = 2, attempts: dict[int, int] | None = None,
                unsealed: set[int] = frozenset(), job_prefix: str | None = None) -> list[dict]:
    """Write every shard's rollouts.jsonl (minus `skip` identities) and seal it; returns the markers."""
    plan = store.load_plan(run_dir)
    markers = []
    for s in plan.shards:
        rows = list(store.iter_jsonl_objects(store.materialized_path(run_dir, s.index)))
        out = [rollout(r, reward(r["_ng_task_index"], r["_ng_rollout_index"]),
                       tokens_of(r["_ng_task_index"], r["_ng_rollout_index"]))
               for r in rows if (r["_ng_task_index"], r["_ng_rollout_index"]) not in skip]
        data = b"".join(orjson.dumps(o) + b"\n" for o in out)
        store.rollouts_path(run_dir, s.index).write_bytes(data)
        if s.index in unsealed:
            continue
        start = t0 + 600 * s.index
        marker = seal.make_marker(
            plan, s.index, num_rollouts=len(out), num_failed=len(rows) - len(out),
            rollouts_sha256=hashlib.sha256(data).hexdigest(), rollouts_bytes=len(data), started_at=start,
            finished_at=start + 1800 + 60 * s.index, host=f"node{s.index}",
            job_id=f"{job_prefix}_{s.index}" if job_prefix else None, attempt=(attempts or {}).get(s.index, 1),
            server_wait_s=30.0, collect_s=1700.0 + 60 * s.index, gpus=gpus,
            extra={"output_tokens": sum(o["response"]["usage"]["output_tokens"] for o in out),
                   "input_tokens": 10 * len(out), "total_tokens": sum(o["response"]["usage"]["total_tokens"]
                                                                      for o in out)})
        seal.write_marker(run_dir, s.index, marker)
        markers.append(marker)
    return markers


# ---------------------------------------------------------------- Gym-format merged files

def _numeric(result: dict[str, Any]) -> dict[str, float]:
    flat = result | (result["response"].get("usage") or {})
    out = {}
    for k, v in flat.items():
        if k in ("_ng_task_index", "_ng_rollout_index"):
            continue
        if isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, (int, float)):
            out[k] = v
    return out


def _describe(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "max": max(values), "min": min(values),
            "median": statistics.median(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def _info(task: int, res: dict[str, Any]) -> dict[str, Any]:
    """A rollout_infos entry: identity, reward, numeric usage, then the other numeric top-level fields."""
    info = {"rollout_id": f"{task}:{res['_ng_rollout_index']}", "_ng_task_index": task,
            "_ng_rollout_index": res["_ng_rollout_index"], "reward": res["reward"]}
    for k, v in [*res["response"]["usage"].items(), *res.items()]:
        if k not in ("_ng_task_index", "_ng_rollout_index", "reward", "response") and isinstance(v, (int, float)):
            info[k] = int(v) if isinstance(v, bool) else v
    return info


def profile_rows(materialized: list[dict], results: list[dict]) -> list[dict[str, Any]]:
    """Gym's `_reward_profiling.jsonl` rows for these rows and results (§2.6), computed independently."""
    by_key = {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in results}
    tasks: dict[int, list[tuple[dict, dict]]] = {}
    expected: dict[int, int] = {}
    for row in sorted(materialized, key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"])):
        t = row["_ng_task_index"]
        expected[t] = expected.get(t, 0) + 1
        res = by_key.get((t, row["_ng_rollout_index"]))
        if res is not None:
            tasks.setdefault(t, []).append((row, res))
    out = []
    for t in sorted(tasks):
        pairs = tasks[t]
        nums = [_numeric(res) for _, res in pairs]
        prof: dict[str, Any] = {"_ng_task_index": t}
        for f in sorted({k for n in nums for k in n}):
            for stat, v in _describe([n[f] for n in nums if f in n]).items():
                prof[f"{stat}/{f}"] = v
        sample = dict(pairs[0][0])
        sample.pop("_ng_task_index"), sample.pop("_ng_rollout_index")
        infos = [_info(t, res) for _, res in pairs]
        prof.update(sample=sample, num_rollouts=len(pairs), expected_num_rollouts=expected[t],
                    missing_num_rollouts=expected[t] - len(pairs),
                    reward_profile_completion_pct=100.0 * len(pairs) / expected[t], rollout_infos=infos)
        out.append(prof)
    return out


def write_merged(run_dir: Path, failures: int = 0) -> list[dict[str, Any]]:
    """Write merged/ profile, aggregate-metrics and failures files from the shard files; returns profile rows."""
    plan = store.load_plan(run_dir)
    mat = [r for s in plan.shards for r in store.iter_jsonl_objects(store.materialized_path(run_dir, s.index))]
    res = [r for s in plan.shards for r in store.iter_jsonl_objects(store.rollouts_path(run_dir, s.index))]
    rows = profile_rows(mat, res)
    store.merged_dir(run_dir).mkdir(exist_ok=True)
    store.merged_reward_profiling_path(run_dir).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    agents = sorted({r["sample"]["agent_ref"]["name"] for r in rows})
    store.merged_aggregate_metrics_path(run_dir).write_bytes(orjson.dumps(
        [{"agent_ref": {"name": a}, "agent_metrics": {}, "key_metrics": {"mean/reward": 0.5}, "group_level_metrics": []}
         for a in agents]))
    store.merged_failures_path(run_dir).write_bytes(b"".join(
        orjson.dumps({"_ng_task_index": i, "_ng_rollout_index": 0, "_ng_failure_class": "x"}) + b"\n"
        for i in range(failures)))
    return rows
