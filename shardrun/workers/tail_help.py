"""Help with the end of a run: an idle worker collects part of a shard that another worker holds.

When fewer shards are left than workers, a worker with nothing to claim asks the holder of a long shard for help;
the holder lends it some of the shard's rollouts that still wait for a slot (its collector service then never runs
them), the helper collects them into a folder of its own, and the holder appends the helper's rows to the shard's
rollouts.jsonl before it seals. Everything is in the shard's `help/` folder, one token per request:

    help/TOKEN.ask.json     {"worker": ID, "at": T}: the helper asks (written whole)
    help/TOKEN.grant.json   {"holder": ID, "rows": [[TASK, ROLLOUT], ...], "at": T}: the holder's answer (no rows: no
                            help wanted); written after the helper's share
    help/TOKEN/             the helper's share: rollouts_materialized_inputs.jsonl (the lent planned rows, written by
                            the holder), rollouts.jsonl and rollouts_failures.jsonl (Gym's, written by the helper)
    help/TOKEN.beat.json    {"at": T}: the helper is at it (renewed every cluster.claim_heartbeat_s)
    help/TOKEN.done.json    {"rc": N}: the helper has stopped; what it collected is in help/TOKEN/rollouts.jsonl
    help/TOKEN.revoked      the holder took the share back (the helper's beat lapsed): the helper stops

A share is *settled* once its helper is done, or it was revoked, or its helper's last beat (or the grant, before a
first beat) is older than cluster.claim_lease_s. The holder then folds it in: each complete row of the helper's file
whose identity is in the grant and not yet in the shard's rollouts.jsonl is appended to it (a row is never written
twice, and a row for an identity not lent is never taken); the share's files are removed. What the helper did not
finish (failed, or not reached) is pending again, and the holder runs it. A new holder (the old one died) folds the
settled shares when it starts and waits for the others, so a helper's work survives its holder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from shardrun.core.errors import ShardrunError
from shardrun.core.gym_names import MATERIALIZED, ROLLOUT_KEY, ROLLOUTS, TASK_KEY
from shardrun.rundir import records, store
from shardrun.rundir.records import HelpAsk, HelpBeat, HelpDone, HelpGrant

HELP_DIR = "help"
ASK, GRANT, BEAT, DONE, REVOKED = ".ask.json", ".grant.json", ".beat.json", ".done.json", ".revoked"
_TOKEN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,150}$")

Key = tuple[int, int]


@dataclass(frozen=True)
class Grant:
    token: str
    holder: str
    rows: frozenset[Key]
    at: float


def help_dir(run_dir: Path, index: int) -> Path:
    return store.shard_dir(run_dir, index) / HELP_DIR


def share_dir(run_dir: Path, index: int, token: str) -> Path:
    """The helper's share of the shard: the collector's input and output for it."""
    return help_dir(run_dir, index) / token


def share_log_path(run_dir: Path, index: int, token: str) -> Path:
    """The helper's collector log (kept apart from the holder's, whose failures it must not name)."""
    return store.logs_dir(run_dir, index) / f"help-{token}.log"


def _file(run_dir: Path, index: int, token: str, suffix: str) -> Path:
    if not _TOKEN.match(token):
        raise ValueError(f"not a help token: {token!r}")
    return help_dir(run_dir, index) / f"{token}{suffix}"


def _read(path: Path, model: type[records.M], what: str) -> records.M | None:
    """A record of the protocol, or None when absent or not one (a garbled file is never trusted: it lends,
    asks or says nothing)."""
    try:
        return records.read_json(path, model, what)
    except (ShardrunError, OSError):
        return None


def _write(path: Path, record: records.Record) -> None:
    store.atomic_write_json(path, record.to_json())


def _tokens(run_dir: Path, index: int, suffix: str) -> list[str]:
    try:
        names = sorted(os.listdir(help_dir(run_dir, index)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    tokens = [n[: -len(suffix)] for n in names if n.endswith(suffix)]
    return [t for t in tokens if _TOKEN.match(t)]


# ---------------------------------------------------------------- the helper's side


def ask(run_dir: Path, index: int, token: str, worker_id: str) -> bool:
    """Ask for a share; False when the shard's help folder went away meanwhile (the shard was sealed)."""
    try:
        help_dir(run_dir, index).mkdir(exist_ok=True)
        _write(_file(run_dir, index, token, ASK), HelpAsk(worker=worker_id, at=time.time()))
    except FileNotFoundError:
        return False
    return True


def withdraw(run_dir: Path, index: int, token: str) -> None:
    """The helper gives its ask up (no answer came, or the shard was sealed: then the folder its ask made after
    the seal had cleared it goes too)."""
    _file(run_dir, index, token, ASK).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        help_dir(run_dir, index).rmdir()  # only when empty


def beat(run_dir: Path, index: int, token: str) -> None:
    """The helper is at it (nothing when the share is gone: its holder took it back and sealed)."""
    with contextlib.suppress(FileNotFoundError):
        _write(_file(run_dir, index, token, BEAT), HelpBeat(at=time.time()))


def finish(run_dir: Path, index: int, token: str, rc: int) -> None:
    """The helper has stopped (nothing when the share is gone, as for `beat`)."""
    with contextlib.suppress(FileNotFoundError):
        _write(_file(run_dir, index, token, DONE), HelpDone(rc=rc, at=time.time()))


def revoked(run_dir: Path, index: int, token: str) -> bool:
    return _file(run_dir, index, token, REVOKED).exists()


# ---------------------------------------------------------------- the holder's side


def asks(run_dir: Path, index: int) -> list[tuple[str, str]]:
    """(token, worker id) of the asks not yet answered."""
    out = []
    for token in _tokens(run_dir, index, ASK):
        a = _read(_file(run_dir, index, token, ASK), HelpAsk, "a help ask")
        if a is not None and not _file(run_dir, index, token, GRANT).exists():
            out.append((token, a.worker))
    return out


def grant(run_dir: Path, index: int, token: str, holder: str, rows: list[Key]) -> Grant:
    """Answer an ask: write the helper's share (the lent planned rows), then the grant (rows may be empty: a
    refusal)."""
    lent = set(rows)
    help_dir(run_dir, index).mkdir(exist_ok=True)  # the asking helper may have given up and removed it
    if lent:
        share = share_dir(run_dir, index, token)
        share.mkdir(parents=True, exist_ok=True)
        with store.atomic_writer(share / MATERIALIZED) as f:
            for raw in store.complete_lines(store.materialized_path(run_dir, index)):
                row = orjson.loads(raw)
                if (row[TASK_KEY], row[ROLLOUT_KEY]) in lent:
                    f.write(raw)
    now = time.time()
    _write(_file(run_dir, index, token, GRANT), HelpGrant(holder=holder, rows=[list(k) for k in sorted(lent)], at=now))
    _file(run_dir, index, token, ASK).unlink(missing_ok=True)
    return Grant(token, holder, frozenset(lent), now)


def read_grant(run_dir: Path, index: int, token: str) -> Grant | None:
    g = _read(_file(run_dir, index, token, GRANT), HelpGrant, "a help grant")
    if g is None:
        return None
    return Grant(token, g.holder, frozenset((t, r) for t, r in g.rows), g.at)


def grants(run_dir: Path, index: int) -> list[Grant]:
    """The shares lent and not folded in yet (a garbled grant is not trusted: it lends nothing)."""
    out = []
    for token in _tokens(run_dir, index, GRANT):
        g = read_grant(run_dir, index, token)
        if g is None or not g.rows:
            continue
        out.append(g)
    return out


def settled(run_dir: Path, index: int, g: Grant, lease_s: float, now: float | None = None) -> bool:
    """The share's helper is done, or it was revoked, or the helper's last sign of life is older than the lease."""
    if _file(run_dir, index, g.token, DONE).exists() or revoked(run_dir, index, g.token):
        return True
    b = _read(_file(run_dir, index, g.token, BEAT), HelpBeat, "a helper's beat")
    last = b.at if b is not None else g.at
    return (time.time() if now is None else now) - last > lease_s


def lapsed(run_dir: Path, index: int, g: Grant, lease_s: float, now: float | None = None) -> bool:
    """Settled without the helper saying it is done (it died or stopped beating): take the share back."""
    return not _file(run_dir, index, g.token, DONE).exists() and settled(run_dir, index, g, lease_s, now)


def revoke(run_dir: Path, index: int, token: str) -> None:
    store.atomic_write_bytes(_file(run_dir, index, token, REVOKED), b"")


def fold(run_dir: Path, index: int, g: Grant) -> int:
    """Append the helper's complete rows for lent identities not yet in the shard's rollouts.jsonl; returns how
    many. A torn last line (a killed helper) is left out; a row that does not parse or names an identity that was
    not lent is never taken."""
    ours = store.rollouts_path(run_dir, index)
    store.repair_torn_tail(ours)
    have: set[Key] = set()
    for raw in store.complete_lines(ours):
        with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
            row = orjson.loads(raw)
            have.add((row[TASK_KEY], row[ROLLOUT_KEY]))
    taken: list[bytes] = []
    for raw in store.complete_lines(share_dir(run_dir, index, g.token) / ROLLOUTS):
        try:
            row = orjson.loads(raw)
            key = (row[TASK_KEY], row[ROLLOUT_KEY])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            continue
        if key in g.rows and key not in have:
            have.add(key)
            taken.append(raw)
    if taken:
        with open(ours, "ab") as f:
            f.write(b"".join(taken))
            f.flush()
            os.fsync(f.fileno())
    return len(taken)


def clear(run_dir: Path, index: int, token: str) -> None:
    """Remove a folded share's files (the grant last: until it is gone, a restart folds the share again, and
    folding twice appends nothing twice)."""
    shutil.rmtree(share_dir(run_dir, index, token), ignore_errors=True)
    for suffix in (ASK, BEAT, DONE, REVOKED, GRANT):
        _file(run_dir, index, token, suffix).unlink(missing_ok=True)


def clear_all(run_dir: Path, index: int) -> None:
    """After the seal: no share is left to fold (asks unanswered included)."""
    shutil.rmtree(help_dir(run_dir, index), ignore_errors=True)
