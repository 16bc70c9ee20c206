"""One definition of a failed rollout (rundir.ledger): the rule, the reason precedence, and `shardrun status` and
the merge agreeing on the same run directory."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shardrun.launch import status
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import ledger, store
from tests.builders import input_rows, make_run, write_shard

T, R = "_ng_task_index", "_ng_rollout_index"


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"reason": "timeout", ledger.FAILURE_CLASS_KEY: ledger.QUARANTINE_CLASS, "error": "e"}, "timeout"),
        ({ledger.FAILURE_CLASS_KEY: "http_500", "error": "attempt 1"}, "http_500"),
        ({"reason": "", "error": "boom"}, "boom"),
        ({"failure": {"code": 7}}, '{"code":7}'),
        ({"reason": None}, ledger.NO_REASON),
    ],
)
def test_the_reason_is_the_first_key_set_in_one_order(row: dict, reason: str) -> None:
    assert ledger.failure_reason(row) == reason


def test_the_rule_is_gyms_resume_gate_or_a_sealed_shard() -> None:
    one = [{"error": "x"}]
    assert not ledger.failed_for_good(one, 3)
    assert ledger.failed_for_good(one * 3, 3)
    assert ledger.failed_for_good([{ledger.TERMINAL_KEY: True}], 3)
    assert ledger.failed_for_good(one, 3, sealed=True)
    rows = {(1, 0): one, (2, 0): one * 3, (3, 1): one * 5}
    assert [(f.task, f.rollout) for f in ledger.failed_rollouts(0, rows, 3)] == [(2, 0), (3, 1)]
    assert [(f.task, f.rollout) for f in ledger.failed_rollouts(0, rows, 3, done={(3, 1)}.__contains__)] == [(2, 0)]
    # ledger.tally (what a shard's runtime gates on) uses the same rule
    planned = [{T: t, R: r} for t, r in rows]
    failures = [{T: t, R: r, **x} for (t, r), got in rows.items() for x in got]
    assert ledger.tally(planned, [], failures, [], 3).failed == {(2, 0), (3, 1)}


def test_attempts_and_reason_of_a_terminal_row_win() -> None:
    rows = [{"error": "first"}, ledger.quarantine_row((4, 1), None, "timeout", 7), {"error": "late"}]
    f = ledger.failed_rollout(4, 1, 2, rows)
    assert (f.task, f.rollout, f.shard, f.reason, f.attempts) == (4, 1, 2, "timeout", 7)


def sidecar_rows(key: tuple[int, int], rows: list[dict]) -> bytes:
    return b"".join(orjson.dumps({T: key[0], R: key[1], **r}) + b"\n" for r in rows)


@pytest.mark.parametrize("sealed", [True, False])
def test_status_and_the_merge_name_the_same_failed_rollouts(tmp_path: Path, sealed: bool) -> None:
    """Per shard: one identity quarantined by shardrun (terminal, its reason beside the class), one failed by Gym
    max_attempts times, one that failed once and then succeeded (not failed), and, where the shard is not sealed,
    one that failed once and is still to be retried (not failed)."""
    run = make_run(tmp_path, input_rows(6), num_repeats=3, num_shards=2)
    expected = []
    for i in range(2):
        w = write_shard(run, i, failed=3 if not sealed else 2, seal_it=sealed, seed=i)
        quarantined, gym_failed = w.failed[0], w.failed[1]
        succeeded = next((t, r) for t, r in run.identities(i) if (t, r) not in w.failed)
        data = sidecar_rows(succeeded, [{ledger.FAILURE_CLASS_KEY: "http_500", "error": "once"}])
        data += sidecar_rows(quarantined, [ledger.quarantine_row(quarantined, None, "timeout", 3)])
        data += sidecar_rows(gym_failed, [{ledger.FAILURE_CLASS_KEY: "http_500", "error": f"a{n}"} for n in range(3)])
        if not sealed:
            data += sidecar_rows(w.failed[2], [{"error": "retry me"}])
        store.failures_path(run.run_dir, i).write_bytes(data)
        expected += [(*quarantined, i, "timeout", 3), (*gym_failed, i, "http_500", 3)]
    from_status = [
        (f.task, f.rollout, f.shard, f.reason, f.attempts) for f in status.failed_rollouts(run.run_dir, run.plan)
    ]
    summary = merge_and_profile(run.run_dir, allow_partial=not sealed)
    from_merge = [(f.task, f.rollout, f.shard, f.reason, f.attempts) for f in summary.failed]
    assert sorted(from_status) == from_merge == sorted(expected)
    assert summary.failed_total == len(expected)
