"""A seal the merge refutes is set aside with its reason (rundir/seal.set_aside): only the seal that was checked is
moved, the quick check then calls the shard damaged with that reason, and the shard's next seal removes the record."""

from __future__ import annotations

from pathlib import Path

import orjson
from reportkit import input_row, planned_run, seal_shards

from shardrun.rundir import records, seal, store


def test_the_checked_seal_is_set_aside_and_a_new_seal_settles_it(tmp_path: Path) -> None:
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    markers = seal_shards(run_dir, lambda t, r: 1.0)
    plan = store.load_plan(run_dir)
    first = store.done_path(run_dir, 1).read_bytes()

    # a seal written since the merge checked (the shard sealed again, another attempt's times) stays where it is
    other = markers[1].model_copy(update={"finished_at": markers[1].finished_at + 1})
    assert seal.set_aside(run_dir, 1, other, "why") is None
    assert store.done_path(run_dir, 1).read_bytes() == first and seal.check(run_dir, plan, 1).sealed

    aside = seal.set_aside(run_dir, 1, markers[1], "it counts 7 rollouts, 8 planned identities were found")
    record = records.read_set_aside_seal(run_dir, 1)
    assert aside == store.damaged_seal_path(run_dir, 1) and record is not None
    assert record.seal == orjson.loads(first) and record.reason.startswith("it counts 7")
    assert not store.done_path(run_dir, 1).exists()
    state = seal.check(run_dir, plan, 1)
    assert not state.sealed and state.damaged and "set aside" in state.reason and "shardrun resume" in state.reason
    assert "8 planned identities" in state.reason
    assert seal.set_aside(run_dir, 1, markers[1], "why") is None  # nothing left to move

    aside.write_bytes(b'{"seal": ')  # a set-aside record torn or edited: still damaged, and it says so
    state = seal.check(run_dir, plan, 1)
    assert state.damaged and str(aside) in state.reason and "set aside" in state.reason
    assert seal.check(run_dir, plan, 0).sealed  # the other shard is untouched

    seal.write_marker(run_dir, 1, markers[1])  # the shard sealed again
    assert not aside.exists() and seal.check(run_dir, plan, 1).sealed
    assert orjson.loads(store.done_path(run_dir, 1).read_bytes()) == orjson.loads(first)
