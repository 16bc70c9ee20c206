"""Claims on shards (shardrun/workers/claims.py): exclusive create, heartbeat, lease, take-over by exactly one worker.

The unit tests drive the lease with an injected clock. The race test runs four real processes on the real file
system (the test's tmp dir) that make 500 claim and take-over attempts each on the same three shards; a holder that
"dies" stops renewing and its claim's heartbeat is set a lease and a half into the past (what a SIGKILLed worker's
claim looks like a while later), with a lease of an hour so that no live claim can lapse while the test runs:
nothing in it depends on how fast the processes run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest

from shardrun.rundir import store
from shardrun.workers import claims


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_run(tmp_path: Path, shards: int = 1) -> Path:
    for i in range(shards):
        store.shard_dir(tmp_path, i).mkdir(parents=True)
    return tmp_path


def book(run_dir: Path, name: str, clock: Clock, lease: float = 100.0) -> claims.ClaimBook:
    return claims.ClaimBook(run_dir, claims.Holder(name, f"job-{name}"), lease, clock=clock)


def test_one_claim_per_shard_and_its_record(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a, b = book(run, "a", clock), book(run, "b", clock)
    got = a.try_claim(0)
    assert got is not None and got.took_over is None
    assert b.try_claim(0) is None
    record = json.loads(store.claim_path(run, 0).read_text())
    assert {k: record[k] for k in ("worker_id", "job_id", "pid")} == {
        "worker_id": "a",
        "job_id": "job-a",
        "pid": os.getpid(),
    }
    assert record["claimed_at"] == clock.t and record["host"]
    info = b.read(0)
    assert info is not None and info.worker_id == "a" and not b.stale(info)
    assert a.release(got) and store.claim_path(run, 0).exists() is False
    assert sorted(p.name for p in store.shard_dir(run, 0).iterdir()) == []
    assert b.try_claim(0) is not None


def test_stale_claim_is_taken_over_and_its_holder_knows(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a, b, c = book(run, "a", clock), book(run, "b", clock), book(run, "c", clock)
    held = a.try_claim(0)
    assert held is not None
    clock.t += 60
    assert a.renew(held) and a.held(held)
    clock.t += 90  # 90 s since the last heartbeat: within the lease of 100 s
    assert b.try_claim(0) is None
    clock.t += 11  # 101 s: stale
    info = b.read(0)
    assert info is not None and b.stale(info)
    taken = b.try_claim(0)
    assert taken is not None and taken.took_over is not None and taken.took_over.worker_id == "a"
    assert c.take_over(info) is None  # the same stale claim cannot be taken over twice
    assert not a.held(held) and not a.renew(held) and not a.release(held)
    assert json.loads(store.claim_path(run, 0).read_text())["worker_id"] == "b"
    assert b.held(taken)


def test_holder_counts_its_claim_lost_before_anyone_may_take_it(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a = book(run, "a", clock)
    held = a.try_claim(0)
    assert held is not None
    clock.t += 100 - a.margin_s  # not stale for others yet, but the holder no longer trusts it
    assert not a.held(held) and not a.renew(held) and not a.release(held)
    assert store.claim_path(run, 0).exists()  # left to go stale: a lapsed holder never renews or releases


def test_a_claim_renewed_after_it_was_judged_stale_is_given_back(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a, b = book(run, "a", clock), book(run, "b", clock)
    held = a.try_claim(0)
    assert held is not None
    # b reads the claim as stale at one moment (a's heartbeat is late by b's clock) ...
    stale_view = claims.ClaimInfo(**{**b.read(0).__dict__, "renewed_at": clock.t - 500})
    # ... but the file itself was renewed: b must see that on the renamed inode and put the handle back
    assert b.take_over(stale_view) is None
    assert a.held(held) and a.renew(held)
    assert claims.handle_path(run, 0, held.token).exists()


def test_an_orphaned_claim_gets_its_handle_back_and_is_taken_over(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a, b = book(run, "a", clock), book(run, "b", clock)
    held = a.try_claim(0)
    assert held is not None
    handle = claims.handle_path(run, 0, held.token)
    # a died in the middle of a release, after renaming its handle; the leftover name is swept two leases later
    handle.rename(handle.with_name(handle.name + claims.RELEASED))
    clock.t += 150
    assert b.try_claim(0) is None  # a release is under way as far as anyone can tell: not touched
    clock.t += 60
    assert b.sweep(0) == 1
    taken = b.try_claim(0)
    assert taken is not None and taken.took_over is not None
    assert sorted(p.name for p in store.shard_dir(run, 0).iterdir()) == [
        store.CLAIM,
        claims.handle_path(run, 0, taken.token).name,
    ]


def test_sweep_removes_handles_never_linked(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clock = Clock()
    a = book(run, "a", clock)
    stray = claims.handle_path(run, 0, "deadbeef")
    stray.write_text("{}")
    os.utime(stray, (clock.t - 150, clock.t - 150))
    assert a.sweep(0) == 0
    clock.t += 60
    held = a.try_claim(0)
    assert a.sweep(0) == 1 and not stray.exists()
    assert held is not None and a.held(held)


def test_a_retransmitted_link_reporting_eexist_for_its_own_success_still_claims(tmp_path: Path, monkeypatch) -> None:
    run = make_run(tmp_path)
    real_link = os.link

    def link_then_eexist(src, dst, *a, **k):
        real_link(src, dst, *a, **k)
        raise FileExistsError(17, "File exists (retransmitted reply)", str(dst))

    monkeypatch.setattr(claims.os, "link", link_then_eexist)
    got = book(run, "a", Clock()).try_claim(0)
    assert got is not None and store.claim_path(run, 0).stat().st_ino == got.ino


# ---------------------------------------------------------------- the race on the real file system

LEASE = 3600.0
SHARDS = 3
ATTEMPTS = 500
RACERS = 4


def racer(run_dir: str, seed: int, start: multiprocessing.synchronize.Barrier) -> None:
    run = Path(run_dir)
    rng = random.Random(seed)
    me = claims.ClaimBook(run, claims.Holder(f"w{seed}", None), LEASE)
    events = os.open(run / "events.log", os.O_WRONLY | os.O_APPEND)

    def event(*fields: object) -> None:
        os.write(events, (" ".join(map(str, fields)) + "\n").encode())

    start.wait()
    for _ in range(ATTEMPTS):
        i = rng.randrange(SHARDS)
        held = me.try_claim(i)
        if held is None:
            event("miss", i, seed)
            continue
        event("enter", i, held.token, held.took_over.token if held.took_over else "-")
        owner = run / f"owner-{i}"
        if owner.read_text() != "":
            event("VIOLATION-enter", i, held.token, owner.read_text())
        owner.write_text(held.token)
        for _ in range(rng.randrange(3)):
            if not (me.renew(held) and me.held(held)):
                event("VIOLATION-lost", i, held.token)
        if owner.read_text() != held.token:
            event("VIOLATION-owner", i, held.token, owner.read_text())
        owner.write_text("")
        if rng.random() < 0.3:  # die: no release, no heartbeat; a lease and a half later it is stale
            event("leave-dead", i, held.token)
            past = me.clock() - 1.5 * LEASE
            os.utime(claims.handle_path(run, i, held.token), (past, past))
        else:
            event("leave", i, held.token)
            if not me.release(held):
                event("VIOLATION-release", i, held.token)
    os.close(events)


def check_events(lines: list[str]) -> tuple[int, int]:
    """Per shard, enter and leave alternate with the same token; a stale token is taken over at most once.
    Returns (claims made, take-overs)."""
    inside: dict[int, str | None] = {}
    taken_over: set[str] = set()
    dead: set[str] = set()
    made = takeovers = 0
    for line in lines:
        kind, *rest = line.split()
        assert not kind.startswith("VIOLATION"), line
        if kind == "enter":
            i, token, previous = int(rest[0]), rest[1], rest[2]
            assert inside.get(i) is None, f"shard {i}: {token} entered while {inside[i]} was inside"
            inside[i] = token
            made += 1
            if previous != "-":
                assert previous in dead, f"{token} took over {previous}, which had not died"
                assert previous not in taken_over, f"{previous} taken over twice"
                taken_over.add(previous)
                takeovers += 1
        elif kind in ("leave", "leave-dead"):
            i, token = int(rest[0]), rest[1]
            assert inside.get(i) == token, f"shard {i}: {token} left but {inside.get(i)} was inside"
            inside[i] = None
            if kind == "leave-dead":
                dead.add(token)
    return made, takeovers


@pytest.mark.timeout(600)
def test_four_processes_never_hold_two_live_claims_on_one_shard(tmp_path: Path) -> None:
    run = make_run(tmp_path, SHARDS)
    (run / "events.log").write_text("")
    for i in range(SHARDS):
        (run / f"owner-{i}").write_text("")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(RACERS)
    procs = [ctx.Process(target=racer, args=(str(run), seed, start)) for seed in range(RACERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * RACERS
    lines = (run / "events.log").read_text().splitlines()
    assert len(lines) == RACERS * ATTEMPTS + sum(1 for line in lines if line.startswith(("leave", "VIOLATION")))
    made, takeovers = check_events(lines)
    # the dead claims still standing are taken over now, once each
    final = claims.ClaimBook(run, claims.Holder("final", None), LEASE)
    for i in range(SHARDS):
        info = final.read(i)
        if info is not None:
            got = final.try_claim(i)
            assert got is not None and got.took_over is not None and got.took_over.token == info.token
            assert final.try_claim(i) is None
            takeovers += 1
    assert made > 0 and takeovers > 0
    for i in range(SHARDS):  # nothing but the final claim's two names is left in a shard directory
        assert len(list(store.shard_dir(run, i).glob(".claim*"))) in (0, 2)
