"""Identity accounting for one shard: which planned rollouts are done, failed for good, or still to run.

An identity is `(_ng_task_index, _ng_rollout_index)`. The planned identities are the rows of the shard's
materialized file; done = present in rollouts.jsonl; failed = gated in the failures sidecar exactly the way NeMo
Gym 0.4.0's resume gates them (`_ng_failure_terminal`, or at least `max_attempts` rows for the identity), so a
resumed collector and this ledger always agree on what is left. shardrun's own retry ledger
(rollout_attempts.jsonl) counts failed attempts of identities whose failure the collector cannot record itself
(a /run error aborts Gym's collector); at `max_attempts` the identity is written to the sidecar as terminal, with
its reason and no reward.

`tally` and `quarantine_row` are pure; `load` reads the files (complete lines only).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from shardrun.rundir import store
from shardrun.core.errors import ShardFailed
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY

Key = tuple[int, int]
FAILURE_CLASS_KEY = "_ng_failure_class"
TERMINAL_KEY = "_ng_failure_terminal"
QUARANTINE_CLASS = "shardrun_max_attempts"
USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")


def key_of(row: dict[str, Any]) -> Key:
    return row[TASK_KEY], row[ROLLOUT_KEY]


@dataclass
class Ledger:
    planned: dict[Key, Any]  # identity -> agent_ref (as the planned row has it; None when absent)
    done: set[Key]
    failed: set[Key]
    attempts: Counter
    duplicates: int = 0
    unplanned: list[Key] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    reasons: dict[Key, str] = field(default_factory=dict)
    sidecar_rows: int = 0  # failure rows in rollouts_failures.jsonl (agents may write one per failed attempt)

    @property
    def pending(self) -> list[Key]:
        return [k for k in self.planned if k not in self.done and k not in self.failed]

    @property
    def complete(self) -> bool:
        return not self.pending

    @property
    def num_failed(self) -> int:
        return sum(1 for k in self.failed if k not in self.done)

    def due_for_quarantine(self, max_attempts: int) -> list[Key]:
        """Identities that used up their attempts in shardrun's ledger but are not yet failed in the sidecar."""
        return [k for k in self.pending if self.attempts[k] >= max_attempts]


def tally(
    planned_rows: Iterable[dict],
    rollout_rows: Iterable[dict],
    failure_rows: Iterable[dict],
    attempt_rows: Iterable[dict],
    max_attempts: int,
) -> Ledger:
    planned: dict[Key, Any] = {}
    for r in planned_rows:
        planned[key_of(r)] = r.get(AGENT_KEY)
    done: set[Key] = set()
    duplicates = 0
    unplanned = []
    usage: Counter[str] = Counter()
    for r in rollout_rows:
        k = key_of(r)
        if k in done:
            duplicates += 1
            continue
        done.add(k)
        if k not in planned:
            unplanned.append(k)
        for name, value in ((r.get("response") or {}).get("usage") or {}).items():
            if name in USAGE_KEYS and isinstance(value, int):
                usage[name] += value
    side_attempts: Counter = Counter()
    terminal: set[Key] = set()
    reasons = {}
    for r in failure_rows:
        if TASK_KEY not in r or ROLLOUT_KEY not in r:
            continue
        k = key_of(r)
        side_attempts[k] += 1
        if r.get(TERMINAL_KEY):
            terminal.add(k)
        if r.get("reason"):
            reasons[k] = str(r["reason"])
    failed = terminal | {k for k, n in side_attempts.items() if n >= max_attempts}
    attempts: Counter = Counter()
    for r in attempt_rows:
        if TASK_KEY in r and ROLLOUT_KEY in r:
            attempts[key_of(r)] += 1
    return Ledger(
        planned=planned,
        done=done,
        failed=failed,
        attempts=attempts,
        duplicates=duplicates,
        unplanned=unplanned,
        usage=dict(usage),
        reasons=reasons,
        sidecar_rows=sum(side_attempts.values()),
    )


def load(run_dir: Path, index: int, max_attempts: int) -> Ledger:
    """Read the shard's files into a Ledger. ShardFailed if rollouts.jsonl holds identities the plan lacks."""
    ledger = tally(
        store.iter_jsonl_objects(store.materialized_path(run_dir, index)),
        store.iter_jsonl_objects(store.rollouts_path(run_dir, index)),
        store.iter_jsonl_objects(store.failures_path(run_dir, index)),
        store.iter_jsonl_objects(store.rollout_attempts_path(run_dir, index)),
        max_attempts,
    )
    if ledger.unplanned:
        shown = ", ".join(f"{t}:{r}" for t, r in ledger.unplanned[:5])
        raise ShardFailed(
            f"{store.rollouts_path(run_dir, index)} holds {len(ledger.unplanned)} rollout(s) that "
            f"this shard's plan does not contain ({shown}); it was written under another plan or "
            f"copied here. Move it away and run the shard again"
        )
    return ledger


def attempt_row(key: Key, reason: str, attempt_of_shard: int) -> dict[str, Any]:
    return {
        TASK_KEY: key[0],
        ROLLOUT_KEY: key[1],
        "reason": reason,
        "shard_attempt": attempt_of_shard,
        "at": time.time(),
    }


def quarantine_row(key: Key, agent_ref: Any, reason: str, attempts: int) -> dict[str, Any]:
    """The sidecar row that records an identity as failed for good (Gym's resume skips terminal rows)."""
    row = {
        TASK_KEY: key[0],
        ROLLOUT_KEY: key[1],
        FAILURE_CLASS_KEY: QUARANTINE_CLASS,
        TERMINAL_KEY: True,
        "reason": reason,
        "attempts": attempts,
    }
    if agent_ref is not None:
        row[AGENT_KEY] = agent_ref
    return row


def record_attempts(run_dir: Path, index: int, failures: dict[Key, str], shard_attempt: int) -> None:
    store.append_jsonl(
        store.rollout_attempts_path(run_dir, index),
        [attempt_row(k, reason, shard_attempt) for k, reason in failures.items()],
    )


def quarantine(run_dir: Path, index: int, ledger: Ledger, max_attempts: int, last_reasons: dict[Key, str]) -> list[Key]:
    """Write every identity that used up its attempts to the failures sidecar as terminal; returns them."""
    due = ledger.due_for_quarantine(max_attempts)
    rows = [quarantine_row(k, ledger.planned.get(k), last_reasons.get(k, "failed"), ledger.attempts[k]) for k in due]
    store.append_jsonl(store.failures_path(run_dir, index), rows)
    return due


def last_reasons(run_dir: Path, index: int) -> dict[Key, str]:
    out = {}
    for r in store.iter_jsonl_objects(store.rollout_attempts_path(run_dir, index)):
        if TASK_KEY in r and ROLLOUT_KEY in r:
            out[key_of(r)] = str(r.get("reason", "failed"))
    return out
