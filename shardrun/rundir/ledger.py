"""Identity accounting for one shard: which planned rollouts are done, failed for good, or still to run.

An identity is `(_ng_task_index, _ng_rollout_index)`. The planned identities are the rows of the shard's
materialized file; done = present in rollouts.jsonl; failed = gated in the failures sidecar exactly the way NeMo
Gym 0.4.0's resume gates them (`_ng_failure_terminal`, or at least `max_attempts` rows for the identity), so a
resumed collector and this ledger always agree on what is left. shardrun's own retry ledger
(rollout_attempts.jsonl) counts failed attempts of identities whose failure the collector cannot record itself
(a /run error aborts Gym's collector); at `max_attempts` the identity is written to the sidecar as terminal, with
its reason and no reward.

The one definition of a *failed rollout* (used by the ledger, `shardrun status` and the merge) lives here:
`failed_for_good`, `failure_reason` and `failed_rollouts`.

`tally`, `quarantine_row` and the failed-rollout rules are pure; `load` reads the files (complete lines only).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import orjson

from shardrun.core import failure_classes, gym_errors
from shardrun.core.terminal import shown
import numpy as np

from shardrun.plan.planner import Plan
from shardrun.rundir import env_manifest, records, store
from shardrun.core.config import DEFAULT_UNRELIABLE_FAILURE_RATE, GymConfig
from shardrun.core.errors import BadRecord, ShardFailed, ShardrunError
from shardrun.core.gym_names import AGENT_KEY, ROLLOUT_KEY, TASK_KEY

Key = tuple[int, int]
FAILURE_CLASS_KEY = "_ng_failure_class"
TERMINAL_KEY = "_ng_failure_terminal"
QUARANTINE_CLASS = "shardrun_max_attempts"
USAGE_KEYS = ("input_tokens", "output_tokens", "total_tokens")
# where a failure row says why, first found wins: shardrun's own reason (its terminal rows also carry the Gym-side
# class QUARANTINE_CLASS, which says only that the attempts ran out; what failed is failure_classes'), then Gym's
# failure class, then the error text
REASON_KEYS = ("reason", FAILURE_CLASS_KEY, "error", "failure")
NO_REASON = "unknown"


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
    skipped: set[Key] = field(default_factory=set)  # skipped because decided (adaptive sampling): never run
    lent: set[Key] = field(default_factory=set)  # lent to a helping worker (workers/tail_help.py): not run here

    @property
    def pending(self) -> list[Key]:
        return [
            k
            for k in self.planned
            if k not in self.done and k not in self.failed and k not in self.skipped and k not in self.lent
        ]

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
    failed = {k for k, n in side_attempts.items() if gave_up(k in terminal, n, max_attempts)}
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


def quarantine_row(
    key: Key,
    agent_ref: Any,
    reason: str,
    attempts: int,
    roles: failure_classes.ServerRoles = failure_classes.DEFAULT_ROLES,
) -> dict[str, Any]:
    """The sidecar row that records an identity as failed for good (Gym's resume skips terminal rows), with what
    failed (`failure_class`, from its reason and the run's server roles)."""
    row = {
        TASK_KEY: key[0],
        ROLLOUT_KEY: key[1],
        FAILURE_CLASS_KEY: QUARANTINE_CLASS,
        TERMINAL_KEY: True,
        "reason": reason,
        "attempts": attempts,
        failure_classes.CLASS_KEY: failure_classes.classify_reason(reason, roles),
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
    roles = env_manifest.server_roles(run_dir) if due else failure_classes.DEFAULT_ROLES
    rows = [
        quarantine_row(k, ledger.planned.get(k), last_reasons.get(k, "failed"), ledger.attempts[k], roles) for k in due
    ]
    store.append_jsonl(store.failures_path(run_dir, index), rows)
    return due


def last_reasons(run_dir: Path, index: int) -> dict[Key, str]:
    out = {}
    for r in store.iter_jsonl_objects(store.rollout_attempts_path(run_dir, index)):
        if TASK_KEY in r and ROLLOUT_KEY in r:
            out[key_of(r)] = str(r.get("reason", "failed"))
    return out


# ---------------------------------------------------------------- failed rollouts (the one definition)


@dataclass(frozen=True)
class FailedRollout:
    """A planned identity recorded as failed for good, with its shard, reason, number of attempts and failure class
    (core/failure_classes.py: what failed, from the row's structured fields, else its reason)."""

    task: int
    rollout: int
    shard: int
    reason: str
    attempts: int
    failure_class: str = failure_classes.OTHER


def launched_max_attempts(run_dir: Path) -> int:
    """gym.max_rollout_attempts of the run's latest launch (the config's default when none is readable)."""
    try:
        settings = store.read_launch_settings(run_dir)
    except ShardrunError:
        settings = None
    if settings is not None and settings.gym is not None:
        return settings.gym.max_rollout_attempts
    return int(GymConfig.model_fields["max_rollout_attempts"].default)


def gave_up(terminal: bool, rows: int, max_attempts: int) -> bool:
    """NeMo Gym 0.4.0's resume gate: a terminal failure row, or at least `max_attempts` failure rows."""
    return terminal or rows >= max_attempts


def failure_reason(row: Mapping[str, Any]) -> str:
    """Why a failure row says its rollout failed: shardrun's own reason, else what Gym 0.7 recorded of the failed
    /run (its HTTP status and innermost error), else the first of REASON_KEYS that is set (JSON for non-strings)."""
    gym_reason = None if row.get("reason") else gym_errors.sidecar_reason(row)
    if gym_reason:
        return gym_reason
    for key in REASON_KEYS:
        value = row.get(key)
        if value not in (None, ""):
            return value if isinstance(value, str) else orjson.dumps(value).decode()
    return NO_REASON


def failed_for_good(rows: Sequence[Mapping[str, Any]], max_attempts: int, *, sealed: bool = False) -> bool:
    """Has a planned identity without a rollout failed for good, by its failure rows (file order)?

    Yes when the rows pass Gym's resume gate (`gave_up`), or when its shard is sealed: the runtime seals a shard
    only once every identity is done or has failed for good under the settings it ran with, so there any failure
    row of an identity without a rollout is final. The caller checks "without a rollout"; a reader that does not
    read the rollouts (status) passes sealed=False, where the gate alone decides (a gated identity is never run
    again, so it never gets a rollout)."""
    return sealed or gave_up(any(r.get(TERMINAL_KEY) for r in rows), len(rows), max_attempts)


def failed_rollout(
    task: int,
    rollout: int,
    shard: int,
    rows: Sequence[Mapping[str, Any]],
    roles: failure_classes.ServerRoles = failure_classes.DEFAULT_ROLES,
) -> FailedRollout:
    """The failed rollout an identity's failure rows (file order) describe: the reason and class of its last
    terminal row (else of its last row), and the attempts a terminal row counts (else one per row). BadRecord for
    a row whose recorded class is not one (the sidecar was edited or damaged)."""
    terminal = [r for r in rows if r.get(TERMINAL_KEY)]
    last = (terminal or rows)[-1]
    counted = terminal[-1].get("attempts") if terminal else None
    attempts = counted if type(counted) is int and counted > 0 else len(rows)
    reason = failure_reason(last)
    try:
        klass = failure_classes.classify(last, reason, roles)
    except ValueError as e:
        raise BadRecord(
            f"shard {shard:05d}: the failure row of rollout {task}:{rollout}: {e}; the sidecar was edited or damaged"
        ) from None
    return FailedRollout(task, rollout, shard, reason, attempts, klass)


def failed_rollouts(
    shard: int,
    rows: Mapping[Key, Sequence[Mapping[str, Any]]],
    max_attempts: int,
    *,
    sealed: bool = False,
    done: Callable[[Key], bool] | None = None,
    roles: failure_classes.ServerRoles = failure_classes.DEFAULT_ROLES,
) -> list[FailedRollout]:
    """The failed rollouts of one shard, by identity, from its failure rows grouped by identity (file order
    within each). `done` says which identities have a rollout (None: not known, see failed_for_good); `roles`
    names the run's policy and judges (failure_classes.ServerRoles; rundir.env_manifest.server_roles)."""
    return [
        failed_rollout(t, r, shard, got, roles)
        for (t, r), got in sorted(rows.items())
        if (done is None or not done((t, r))) and failed_for_good(got, max_attempts, sealed=sealed and done is not None)
    ]


# ---------------------------------------------------------------- failures per label and class


def launched_unreliable_rate(run_dir: Path) -> float:
    """report.unreliable_failure_rate of the run's latest launch (the config's default when none is readable)."""
    try:
        settings = store.read_launch_settings(run_dir)
    except ShardrunError:
        settings = None
    return settings.report.unreliable_failure_rate if settings is not None else DEFAULT_UNRELIABLE_FAILURE_RATE


def is_unreliable(failed: int, planned: int, threshold: float) -> bool:
    """A group whose failed share of its planned rollouts is above `threshold` (report.unreliable_failure_rate)."""
    return planned > 0 and failed / planned > threshold


def failure_tally(failed: Sequence[FailedRollout], plan: Plan, threshold: float) -> records.FailureTally:
    """The failed rollouts by class, per label of a blend (the plan's task ranges) or for the whole run (one group,
    "run"), each group named unreliable when its failed share is above `threshold`."""
    classes = Counter(f.failure_class for f in failed)
    if plan.blend:
        codes = plan.label_codes(np.fromiter((f.task for f in failed), np.int64, len(failed)))
        per: list[Counter[str]] = [Counter() for _ in plan.blend]
        for f, code in zip(failed, codes.tolist()):
            per[code][f.failure_class] += 1
        named = [(e.label, e.num_rollouts, c) for e, c in zip(plan.blend, per)]
    else:
        named = [("run", plan.num_rollouts, classes)]
    groups = [
        records.GroupFailures(
            name=name,
            planned=planned,
            failed=sum(c.values()),
            by_class=_in_order(c),
            rate=sum(c.values()) / planned if planned else None,
            unreliable=is_unreliable(sum(c.values()), planned, threshold),
        )
        for name, planned, c in named
    ]
    return records.FailureTally(
        fingerprint=plan.fingerprint,
        group="label" if plan.blend else "run",
        unreliable_failure_rate=threshold,
        by_class=_in_order(classes),
        groups=groups,
    )


def _in_order(counts: Mapping[str, int]) -> dict[str, int]:
    return {k: counts[k] for k in failure_classes.CLASSES if counts.get(k)}


def class_text(by_class: Mapping[str, int]) -> str:
    """ "judge 3, policy 1" (the classes in CLASSES order; "" when none)."""
    return ", ".join(f"{k} {by_class[k]:,}" for k in failure_classes.CLASSES if by_class.get(k))


def unreliable_lines(tally: records.FailureTally | None) -> list[str]:
    """Each label (or the run) whose failures are above the threshold, named unreliable rather than hard."""
    if tally is None:
        return []
    return [
        f"warning: {'label ' + shown(g.name) if tally.group == 'label' else 'the run'} is unreliable, not hard: "
        f"{g.failed:,} of its {g.planned:,} planned rollouts failed ({100 * (g.rate or 0):.1f}%: "
        f"{class_text(g.by_class)}), above report.unreliable_failure_rate {100 * tally.unreliable_failure_rate:g}%"
        for g in tally.unreliable
    ]
