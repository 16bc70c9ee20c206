"""The `.done` marker that seals a shard, and the rules that decide whether a marker is valid for a plan.

A marker is valid only for the plan it was written under (same fingerprint), for its own shard, with the
planned number of identities accounted for, and for the exact rollouts file it describes (size always; sha256
when `deep`). Anything else is reported and ignored: the shard counts as unsealed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shardrun.rundir import store
from shardrun.plan.planner import Plan

MARKER_VERSION = 1


def make_marker(
    plan: Plan,
    shard_index: int,
    *,
    num_rollouts: int,
    num_failed: int,
    rollouts_sha256: str,
    rollouts_bytes: int,
    started_at: float,
    finished_at: float,
    host: str,
    job_id: str | None,
    attempt: int,
    server_wait_s: float,
    collect_s: float,
    gpus: int,
    extra: dict[str, Any] | None = None,
    gym_version: str | None = None,
) -> dict[str, Any]:
    """The marker's content (pure). Times are Unix seconds; `extra` holds optional accounting such as tokens."""
    marker = {
        "marker_version": MARKER_VERSION,
        "plan_fingerprint": plan.fingerprint,
        "shard_index": shard_index,
        "planned_rollouts": plan.shards[shard_index].num_rollouts,
        "num_rollouts": num_rollouts,
        "num_failed": num_failed,
        "rollouts_sha256": rollouts_sha256,
        "rollouts_bytes": rollouts_bytes,
        "started_at": started_at,
        "finished_at": finished_at,
        "host": host,
        "job_id": job_id,
        "attempt": attempt,
        "server_wait_s": server_wait_s,
        "collect_s": collect_s,
        "gpus": gpus,
        "gpu_hours": gpus * (finished_at - started_at) / 3600.0,
    }
    if gym_version is not None:
        marker["gym_version"] = gym_version  # the nemo-gym release the shard ran with
    if extra:
        marker["extra"] = extra
    return marker


def write_marker(run_dir: Path, shard_index: int, marker: dict[str, Any]) -> None:
    store.atomic_write_json(store.done_path(run_dir, shard_index), marker)


@dataclass(frozen=True)
class SealState:
    sealed: bool
    reason: str  # "" when sealed; why not otherwise ("no marker" for a shard never sealed)
    marker: dict[str, Any] | None = None


def check(run_dir: Path, plan: Plan, shard_index: int, deep: bool = False) -> SealState:
    """Is shard `shard_index` sealed under `plan`? `deep` also re-hashes the rollouts file."""
    path = store.done_path(run_dir, shard_index)
    try:
        marker = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return SealState(False, "no marker")
    except orjson.JSONDecodeError:
        return SealState(False, f"{path}: unreadable marker (ignored)")
    if not isinstance(marker, dict):
        return SealState(False, f"{path}: marker is not an object (ignored)")
    if marker.get("plan_fingerprint") != plan.fingerprint:
        return SealState(
            False,
            f"{path}: marker belongs to another plan (fingerprint "
            f"{str(marker.get('plan_fingerprint'))[:12]}…, this plan {plan.fingerprint[:12]}…); "
            f"ignored",
            marker,
        )
    if marker.get("shard_index") != shard_index:
        return SealState(
            False, f"{path}: marker is for shard {marker.get('shard_index')}, copied here? ignored", marker
        )
    planned = plan.shards[shard_index].num_rollouts
    accounted = (marker.get("num_rollouts") or 0) + (marker.get("num_failed") or 0)
    if accounted != planned:
        return SealState(
            False, f"{path}: marker accounts for {accounted} of {planned} planned rollouts; ignored", marker
        )
    rollouts = store.rollouts_path(run_dir, shard_index)
    try:
        size = rollouts.stat().st_size
    except FileNotFoundError:
        return SealState(False, f"{path}: sealed but {rollouts.name} is missing; ignored", marker)
    if size != marker.get("rollouts_bytes"):
        return SealState(
            False,
            f"{path}: {rollouts.name} changed after sealing ({size} bytes, sealed "
            f"{marker.get('rollouts_bytes')}); ignored",
            marker,
        )
    if deep and store.sha256_file(rollouts) != marker.get("rollouts_sha256"):
        return SealState(
            False, f"{path}: {rollouts.name} content changed after sealing (sha256 differs); ignored", marker
        )
    return SealState(True, "", marker)
