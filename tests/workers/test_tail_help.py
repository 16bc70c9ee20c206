"""The end-of-run help protocol's files (workers/tail_help.py): an ask, a grant that writes the helper's share, the
share settling (done, revoked, or silent past the lease), and folding the helper's rows into the shard: only lent
identities, never twice, never a torn or garbled line."""

from __future__ import annotations

from pathlib import Path

import orjson

from shardrun.core.gym_names import MATERIALIZED, ROLLOUTS
from shardrun.rundir import store
from shardrun.workers import tail_help


def shard(tmp_path: Path, rows: int = 6) -> Path:
    run_dir = tmp_path / "run"
    store.shard_dir(run_dir, 0).mkdir(parents=True)
    with open(store.materialized_path(run_dir, 0), "wb") as f:
        for r in range(rows):
            f.write(orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": r, "question": f"q{r}"}) + b"\n")
    store.rollouts_path(run_dir, 0).touch()
    return run_dir


def row(r: int, reward: float = 1.0) -> bytes:
    return orjson.dumps({"_ng_task_index": 0, "_ng_rollout_index": r, "reward": reward}) + b"\n"


def test_an_ask_is_answered_with_the_share_written_before_the_grant(tmp_path: Path) -> None:
    run_dir = shard(tmp_path)
    tail_help.ask(run_dir, 0, "w2-ab", "w2")
    assert tail_help.asks(run_dir, 0) == [("w2-ab", "w2")]
    g = tail_help.grant(run_dir, 0, "w2-ab", "w1", [(0, 5), (0, 4)])
    assert tail_help.asks(run_dir, 0) == []  # answered
    assert tail_help.read_grant(run_dir, 0, "w2-ab") == g and g.rows == {(0, 4), (0, 5)}
    share = tail_help.share_dir(run_dir, 0, "w2-ab") / MATERIALIZED
    assert [orjson.loads(x)["_ng_rollout_index"] for x in share.read_bytes().splitlines()] == [4, 5]  # input order
    assert tail_help.grants(run_dir, 0) == [g]
    tail_help.ask(run_dir, 0, "w3-cd", "w3")
    refusal = tail_help.grant(run_dir, 0, "w3-cd", "w1", [])
    assert refusal.rows == frozenset() and tail_help.grants(run_dir, 0) == [g]  # a refusal lends nothing


def test_a_share_settles_when_done_revoked_or_silent_past_the_lease(tmp_path: Path) -> None:
    run_dir = shard(tmp_path)
    g = tail_help.grant(run_dir, 0, "w2-ab", "w1", [(0, 5)])
    assert not tail_help.settled(run_dir, 0, g, lease_s=60, now=g.at + 30)
    assert tail_help.lapsed(run_dir, 0, g, lease_s=60, now=g.at + 61)  # no beat since the grant
    tail_help.beat(run_dir, 0, "w2-ab")
    beat_at = orjson.loads((tail_help.help_dir(run_dir, 0) / "w2-ab.beat.json").read_bytes())["at"]
    assert not tail_help.settled(run_dir, 0, g, lease_s=60, now=beat_at + 59)
    assert tail_help.lapsed(run_dir, 0, g, lease_s=60, now=beat_at + 61)
    tail_help.finish(run_dir, 0, "w2-ab", 0)
    assert tail_help.settled(run_dir, 0, g, lease_s=60, now=beat_at + 1)
    assert not tail_help.lapsed(run_dir, 0, g, lease_s=60, now=beat_at + 999)  # done: nothing to take back
    h = tail_help.grant(run_dir, 0, "w3-cd", "w1", [(0, 4)])
    assert not tail_help.revoked(run_dir, 0, "w3-cd")
    tail_help.revoke(run_dir, 0, "w3-cd")
    assert tail_help.revoked(run_dir, 0, "w3-cd") and tail_help.settled(run_dir, 0, h, lease_s=60, now=h.at)


def test_folding_takes_each_lent_identity_once_and_nothing_else(tmp_path: Path) -> None:
    run_dir = shard(tmp_path)
    ours = store.rollouts_path(run_dir, 0)
    ours.write_bytes(row(0) + row(1) + row(3))  # the holder's own rows (3 it ran itself after taking it back)
    g = tail_help.grant(run_dir, 0, "w2-ab", "w1", [(0, 3), (0, 4), (0, 5)])
    helper = tail_help.share_dir(run_dir, 0, "w2-ab") / ROLLOUTS
    helper.write_bytes(
        row(2, 0.5)  # not lent: never taken
        + b"{not json\n"
        + row(3, 0.0)  # already in the shard: not twice
        + row(4)
        + row(4)  # twice in the helper's file: once
        + row(5)[:-5]  # torn: a killed helper's last line
    )
    assert tail_help.fold(run_dir, 0, g) == 1
    assert ours.read_bytes() == row(0) + row(1) + row(3) + row(4)
    assert tail_help.fold(run_dir, 0, g) == 0  # folding again (a restart between fold and clear) adds nothing
    tail_help.clear(run_dir, 0, "w2-ab")
    assert tail_help.grants(run_dir, 0) == [] and not tail_help.share_dir(run_dir, 0, "w2-ab").exists()


def test_a_garbled_grant_or_a_strange_token_lends_nothing(tmp_path: Path) -> None:
    run_dir = shard(tmp_path)
    help_dir = tail_help.help_dir(run_dir, 0)
    help_dir.mkdir()
    (help_dir / "w2-ab.grant.json").write_bytes(b'{"holder": "w1", "rows": [[0, "5"]]}')
    (help_dir / "..grant.json").write_bytes(b'{"holder": "w1", "rows": [[0, 5]]}')
    (help_dir / "w4.ask.json").write_bytes(b"[1, 2]")
    assert tail_help.grants(run_dir, 0) == [] and tail_help.asks(run_dir, 0) == []


def test_an_ask_after_the_seal_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = shard(tmp_path)
    assert tail_help.ask(run_dir, 0, "w2-ab", "w2")
    tail_help.clear_all(run_dir, 0)  # the holder sealed meanwhile
    tail_help.withdraw(run_dir, 0, "w2-ab")
    assert not tail_help.help_dir(run_dir, 0).exists()
    assert tail_help.ask(run_dir, 0, "w2-cd", "w2")  # asked again after the seal: its folder is made, and
    tail_help.withdraw(run_dir, 0, "w2-cd")  # withdrawn (the helper sees the seal), it goes
    assert not tail_help.help_dir(run_dir, 0).exists()
    assert not tail_help.ask(tmp_path / "gone", 0, "w2-ef", "w2")  # no shard folder at all: no ask
    tail_help.beat(tmp_path / "gone", 0, "w2-ef")  # a share taken back and cleared: beats and the end are moot
    tail_help.finish(tmp_path / "gone", 0, "w2-ef", 0)
