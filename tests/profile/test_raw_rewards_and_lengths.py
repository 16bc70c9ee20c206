"""The opt-in per-rollout field of the profile (`merge-and-profile --raw-rewards-and-lengths`, NeMo Gym pull request
2771's `raw_rewards_and_lengths`), and `select`'s length bounds.

A small run is planned by the planner and written in Gym's formats (tests/builders.py, no servers); some rollouts
have no `response.usage`. The expected entries are recomputed from the rollout rows the builder wrote, not read back
from the profile; the default profile must stay the bytes it was (Gym's own, which tests/e2e/test_profile_vs_gym.py
compares with Gym's profiler)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

import builders
from shardrun.analysis import selection
from shardrun.analysis.selection import Rules
from shardrun.cli import app
from shardrun.core.errors import BadInput
from shardrun.profile import taskstats
from shardrun.rundir import store
from tests.machine_env import without_machine_gym_venv

TASKS = 8
REPEATS = 3


def no_usage(t: int, r: int) -> bool:
    return (t + r) % 5 == 0


def make_row(materialized: dict) -> dict:
    row = builders.rollout_row(materialized)
    if no_usage(row["_ng_task_index"], row["_ng_rollout_index"]):
        del row["response"]["usage"]
    return row


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[builders.Run, dict[tuple[int, int], dict]]:
    """A run of 8 tasks x 3 rollouts over 2 shards, sealed, not merged; the rollout rows by identity."""
    with without_machine_gym_venv():
        run = builders.make_run(
            tmp_path_factory.mktemp("raw"), builders.input_rows(TASKS), num_repeats=REPEATS, num_shards=2
        )
        rows = {}
        for i in range(run.num_shards):
            for row in builders.write_shard(run, i, make_row=make_row).rows:
                rows[(row["_ng_task_index"], row["_ng_rollout_index"])] = row
    return run, rows


def merge(run_dir: Path, *flags: str) -> bytes:
    res = CliRunner().invoke(app, ["merge-and-profile", str(run_dir), *flags], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return store.merged_reward_profiling_path(run_dir).read_bytes()


def expected_entry(row: dict) -> dict:
    entry = {"_ng_rollout_index": row["_ng_rollout_index"], "reward": row["reward"]}
    usage = row["response"].get("usage")
    if usage is not None:
        entry.update({k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")})
    return entry


def test_opt_in_rows_carry_each_rollouts_reward_and_lengths_and_the_default_is_unchanged(written):
    run, rows = written
    default = merge(run.run_dir)
    assert b"raw_rewards_and_lengths" not in default
    opted = merge(run.run_dir, "--raw-rewards-and-lengths")
    lines = opted.splitlines()
    assert len(lines) == TASKS
    for line, plain in zip(lines, default.splitlines()):
        profile_row = orjson.loads(line)
        t = profile_row["_ng_task_index"]
        got = profile_row["raw_rewards_and_lengths"]
        assert got == [expected_entry(rows[(t, r)]) for r in range(REPEATS)]  # ordered by rollout index
        assert list(profile_row)[-2:] == ["rollout_infos", "raw_rewards_and_lengths"]
        # everything else is the default row, byte for byte
        field = b',"raw_rewards_and_lengths":' + orjson.dumps(got)
        assert line.replace(field, b"") == plain
    assert any(no_usage(t, r) for t in range(TASKS) for r in range(REPEATS))  # the run has rollouts without usage
    # the aggregate metrics' group rows never carry it
    assert b"raw_rewards_and_lengths" not in store.merged_aggregate_metrics_path(run.run_dir).read_bytes()
    # and a merge without the flag writes Gym's profile again, the same bytes as before
    assert merge(run.run_dir) == default


def test_the_profile_reader_gives_each_rollouts_reward_and_output_length_in_rollout_order(written):
    run, rows = written
    merge(run.run_dir)
    for t in taskstats.load_profile(run.run_dir):
        assert [r.rollout_index for r in t.rollouts] == list(range(REPEATS))
        for r in t.rollouts:
            row = rows[(t.task_index, r.rollout_index)]
            assert r.reward == row["reward"]
            usage = row["response"].get("usage")
            assert r.output_tokens == (None if usage is None else usage["output_tokens"])


def mean_length(rows: dict, t: int) -> float | None:
    """Gym's mean/output_tokens of a task: the mean over the rollouts whose usage has it."""
    got = [rows[(t, r)]["response"]["usage"]["output_tokens"] for r in range(REPEATS) if not no_usage(t, r)]
    return sum(got) / len(got) if got else None


def test_select_keeps_the_tasks_whose_mean_output_length_is_within_the_bounds(written, tmp_path):
    run, rows = written
    merge(run.run_dir)
    lengths = {t: mean_length(rows, t) for t in range(TASKS)}
    known = sorted(v for v in lengths.values() if v is not None)
    lo, hi = known[1], known[-2]
    out = tmp_path / "mid.jsonl"
    res = CliRunner().invoke(
        app,
        ["select", str(run.run_dir), "-o", str(out), "--min-mean-length", str(lo), "--max-mean-length", str(hi)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    want = sorted(t for t, v in lengths.items() if v is not None and lo <= v <= hi)
    got = selection.select_run(run.run_dir, tmp_path / "again.jsonl", Rules(min_mean_length=lo, max_mean_length=hi))
    assert [t.task_index for t in got.selection.kept] == want
    assert len(out.read_bytes().splitlines()) == len(want) > 0
    assert [s.rule for s in got.selection.steps][1:] == [f"--min-mean-length {lo:g}", f"--max-mean-length {hi:g}"]


def test_length_bounds_are_checked_and_a_profile_without_output_tokens_is_refused(written, tmp_path):
    run, _ = written
    merge(run.run_dir)
    with pytest.raises(BadInput, match="--min-mean-length 9 is above --max-mean-length 3"):
        selection.select_run(run.run_dir, tmp_path / "x.jsonl", Rules(min_mean_length=9, max_mean_length=3))
    with pytest.raises(BadInput, match="--max-mean-length -1"):
        selection.select_run(run.run_dir, tmp_path / "x.jsonl", Rules(max_mean_length=-1))
    bare = [taskstats.TaskStat(0, "a", 1, 1, {"mean/reward": 1.0}, (1.0,))]
    with pytest.raises(BadInput, match="no task has a mean/output_tokens"):
        selection.choose(bare, Rules(min_mean_length=1))
    assert not (tmp_path / "x.jsonl").exists()
