"""The `.done` marker that seals a shard, and the rules that decide whether a marker is valid for a plan.

A marker is valid only for the plan it was written under (same fingerprint), for its own shard, with the
planned number of identities accounted for, and for the exact rollouts file it describes (size always; sha256
when `deep`). Anything else is reported and ignored: the shard counts as unsealed.
"""

from __future__ import annotations

import math
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
    worker: dict[str, Any] | None = None,
    skipped_decided_tasks: list[int] | None = None,
    num_skipped_decided: int = 0,
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
    if (
        num_skipped_decided
    ):  # adaptive sampling: rows never run because their task was decided (not failed, not missing)
        marker["num_skipped_decided"] = num_skipped_decided
        marker["skipped_decided_tasks"] = sorted(skipped_decided_tasks or ())
    if worker:
        marker["worker"] = worker  # the warm worker that sealed it: {id, servers_warm, ...} (docs/workers.md)
    if extra:
        marker["extra"] = extra
    return marker


def write_marker(run_dir: Path, shard_index: int, marker: dict[str, Any]) -> None:
    store.atomic_write_json(store.done_path(run_dir, shard_index), marker)


_COUNT = "a whole number >= 0"
_NUMBER = "a finite number"
_TEXT = "a string"
REQUIRED_FIELDS = {
    "plan_fingerprint": _TEXT,
    "shard_index": _COUNT,
    "num_rollouts": _COUNT,
    "num_failed": _COUNT,
    "rollouts_sha256": _TEXT,
    "rollouts_bytes": _COUNT,
}
OPTIONAL_FIELDS = {
    "marker_version": _COUNT,
    "planned_rollouts": _COUNT,
    "started_at": _NUMBER,
    "finished_at": _NUMBER,
    "server_wait_s": _NUMBER,
    "collect_s": _NUMBER,
    "gpu_hours": _NUMBER,
    "gpus": _COUNT,
    "attempt": _COUNT,
    "host": _TEXT,
    "job_id": _TEXT,
    "extra": "an object",
    "gym_version": _TEXT,
    "worker": "an object",
    "num_skipped_decided": _COUNT,
    "skipped_decided_tasks": "a list",
}
"""The marker's fields and what each must be: a marker with a field of another type is invalid (ignored and
reported), so no reader of a marker ever meets "16" where it counts rollouts. `host` and `job_id` may be null."""


def _is(value: Any, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _COUNT:
        return number and isinstance(value, int) and value >= 0
    if kind == _NUMBER:
        return number and math.isfinite(value)
    if kind == _TEXT:
        return isinstance(value, str)
    if kind == "a list":
        return isinstance(value, list)
    return isinstance(value, dict)


def wrong_field(marker: dict[str, Any]) -> str | None:
    """What is wrong with the marker's fields, in words; None when every field has its type."""
    for name, kind in REQUIRED_FIELDS.items():
        if name not in marker:
            return f"no {name!r}"
        if not _is(marker[name], kind):
            return f"{name!r} is {_shown(marker[name])}, not {kind}"
    for name, kind in OPTIONAL_FIELDS.items():
        value = marker.get(name)
        if value is not None and not _is(value, kind):
            return f"{name!r} is {_shown(value)}, not {kind}"
    return None


def _shown(value: Any) -> str:
    """The value as the marker has it (strings and numbers, cut short), or its kind (lists, objects)."""
    if isinstance(value, bool) or value is None:
        return orjson.dumps(value).decode()
    if isinstance(value, (str, int, float)):
        text = orjson.dumps(value).decode() if isinstance(value, str) else repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return "a list" if isinstance(value, list) else "an object"


@dataclass(frozen=True)
class SealState:
    sealed: bool
    reason: str  # "" when sealed; why not otherwise ("no marker" for a shard never sealed)
    marker: dict[str, Any] | None = None


def check(run_dir: Path, plan: Plan, shard_index: int, deep: bool = False) -> SealState:
    """Is shard `shard_index` sealed under `plan`? `deep` also re-hashes the rollouts file. RunDirError when the
    shard directory or a file in it is a symlink (nothing is read through it)."""
    store.refuse_links(run_dir, (shard_index,))
    path = store.done_path(run_dir, shard_index)
    try:
        marker = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return SealState(False, "no marker")
    except orjson.JSONDecodeError:
        return SealState(False, f"{path}: unreadable marker (ignored)")
    except IsADirectoryError:
        return SealState(False, f"{path}: a directory, not a marker (ignored)")
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
    wrong = wrong_field(marker)
    if wrong:
        return SealState(False, f"{path}: invalid marker, {wrong}; ignored")
    planned = plan.shards[shard_index].num_rollouts
    accounted = marker["num_rollouts"] + marker["num_failed"] + marker.get("num_skipped_decided", 0)
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
