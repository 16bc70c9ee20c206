"""Curriculum selection: per-task statistics, the rules, byte-identical output rows, refusals."""

from __future__ import annotations

import itertools
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from reportkit import input_row, merge_run, planned_run, seal_shards
from shardrun.analysis import selection
from shardrun.rundir import store
from shardrun.profile import taskstats
from shardrun.cli import app
from shardrun.core.errors import BadInput, PlanMismatch, RunDirError
from shardrun.analysis.selection import Rules
from shardrun.profile.taskstats import TaskStat


def reward(t: int, r: int) -> float:
    """4 repeats: task t % 5 == 0 never solved, 4 always solved, the others solved by t % 5 of 4 rollouts."""
    return 1.0 if r < t % 5 else 0.0


def ts(i: int, rewards: list[float], agent: str = "a") -> TaskStat:
    mean = sum(rewards) / len(rewards)
    std = (sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else 0.0
    stats = {"mean/reward": mean, "std/reward": std, "min/reward": min(rewards), "max/reward": max(rewards)}
    return TaskStat(i, agent, len(rewards), len(rewards), stats, tuple(rewards))


# ---------------------------------------------------------------- pass@k


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=8), st.integers(1, 8))
def test_pass_at_k_binary_equals_fraction_of_k_subsets_with_a_success(scores, k):
    got = taskstats.task_pass_at_k(scores, k)
    if k > len(scores):
        assert got is None
        return
    subsets = list(itertools.combinations(scores, k))
    assert got == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_continuous_is_max_of_first_k_and_agent_value_is_percent():
    assert taskstats.task_pass_at_k([0.2, 0.7, 0.4], 1) == 0.2
    assert taskstats.task_pass_at_k([0.2, 0.7, 0.4], 2) == 0.7
    tasks = [ts(0, [1.0, 0.0]), ts(1, [0.0, 0.0]), ts(2, [1.0])]
    assert taskstats.pass_at_k(tasks, 1) == pytest.approx(100 * (0.5 + 0 + 1) / 3)
    assert taskstats.pass_at_k(tasks, 2) == pytest.approx(100 * (1 + 0) / 2)  # task 2 has too few rollouts
    assert taskstats.pass_at_k_curve(tasks) == {1: pytest.approx(50.0), 2: pytest.approx(50.0)}


def test_task_stat_reads_a_gym_profile_row():
    row = {
        "_ng_task_index": 7,
        "mean/reward": 0.5,
        "std/reward": 0.7,
        "mean/output_tokens": 12.0,
        "histogram/reward": None,
        "sample": {"agent_ref": {"name": "math"}, "question": "q"},
        "num_rollouts": 2,
        "expected_num_rollouts": 3,
        "rollout_infos": [{"_ng_rollout_index": 1, "reward": 0.0}, {"_ng_rollout_index": 0, "reward": 1.0}],
    }
    t = taskstats.task_stat(row)
    assert (t.task_index, t.agent, t.num_rollouts, t.expected_num_rollouts) == (7, "math", 2, 3)
    assert t.stat("mean") == 0.5 and t.stat("mean", "output_tokens") == 12.0 and t.stat("median") is None
    assert t.rewards == (1.0, 0.0)
    with pytest.raises(BadInput, match="_ng_task_index"):
        taskstats.task_stat({"mean/reward": 1})
    with pytest.raises(BadInput, match="task 7 appears twice"):
        taskstats.task_stats([row, row])


# ---------------------------------------------------------------- rules

TASKS = [
    ts(0, [0, 0, 0, 0]),
    ts(1, [1, 0, 0, 0]),
    ts(2, [1, 1, 0, 0], "b"),
    ts(3, [1, 1, 1, 0], "b"),
    ts(4, [1, 1, 1, 1]),
    ts(5, [1, 0, 0, 0], "b"),
]


def kept(rules: Rules, tasks=TASKS) -> list[int]:
    return [t.task_index for t in selection.choose(tasks, rules).kept]


def test_each_rule_keeps_what_it_says():
    assert kept(Rules()) == [0, 1, 2, 3, 4, 5]
    assert kept(Rules(agents=("b",))) == [2, 3, 5]
    assert kept(Rules(min_mean=0.25)) == [1, 2, 3, 4, 5]
    assert kept(Rules(max_mean=0.5)) == [0, 1, 2, 5]
    assert kept(Rules(min_std=0.55)) == [2]  # std 0.577; the 1-of-4 and 3-of-4 tasks have 0.5
    assert kept(Rules(min_std=0.5)) == [1, 2, 3, 5]
    assert kept(Rules(drop_unsolved=True)) == [1, 2, 3, 4, 5]
    assert kept(Rules(drop_solved=True)) == [0, 1, 2, 3, 5]
    assert kept(Rules(drop_unsolved=True, drop_solved=True)) == [1, 2, 3, 5]
    graded = [ts(0, [0.6, 0.8]), ts(1, [0.2, 0.9]), ts(2, [0.1, 0.3])]
    assert kept(Rules(drop_solved=True, solved_threshold=0.5), graded) == [1, 2]
    assert kept(Rules(drop_unsolved=True, solved_threshold=0.5), graded) == [0, 1]
    assert kept(Rules(drop_solved=True), graded) == [0, 1, 2]


def test_top_k_hardest_takes_lowest_means_ties_by_higher_std_then_index_and_keeps_task_order():
    assert kept(Rules(top_k_hardest=1)) == [0]
    assert kept(Rules(top_k_hardest=3)) == [0, 1, 5]
    assert kept(Rules(drop_unsolved=True, top_k_hardest=2)) == [1, 5]
    tie = [ts(0, [0.5, 0.5]), ts(1, [1.0, 0.0])]  # same mean, task 1 has the larger std
    assert kept(Rules(top_k_hardest=1), tie) == [1]


def test_steps_count_what_each_rule_saw_and_kept():
    sel = selection.choose(
        TASKS, Rules(agents=("b",), drop_unsolved=True, max_mean=0.6, top_k_hardest=1), planned_tasks=9
    )
    assert [(s.before, s.kept) for s in sel.steps] == [(9, 6), (6, 3), (3, 2), (2, 2), (2, 1)]
    assert [s.rule.split()[0] for s in sel.steps] == [
        "profiled",
        "--agent",
        "--max-mean",
        "--drop-unsolved",
        "--top-k-hardest",
    ]


@pytest.mark.parametrize(
    "rules, message",
    [
        (Rules(min_mean=0.8, max_mean=0.2), "above --max-mean"),
        (Rules(agents=("bb",)), "did you mean 'b'"),
        (Rules(top_k_hardest=0), "at least 1"),
        (Rules(metric="acc"), "known metrics: reward"),
    ],
)
def test_contradictory_or_unknown_rules_are_refused(rules, message):
    with pytest.raises(BadInput, match=message):
        selection.choose(TASKS, rules)


# ---------------------------------------------------------------- rows

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5),  # what orjson reads as int
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=4), st.booleans())
def test_attach_keeps_every_original_byte_and_adds_only_the_key(row, spaced):
    row.pop("shardrun_stats", None)
    raw = json.dumps(row, indent=None if not spaced else 1).replace("\n", " ").encode()
    out = selection.attach(raw, "shardrun_stats", {"mean/reward": 0.5})
    assert orjson.loads(out) == {**row, "shardrun_stats": {"mean/reward": 0.5}}
    assert out.startswith(raw.rstrip()[:-1])


def test_subset_lines_uses_the_planners_task_index_and_keeps_bytes_and_terminators():
    lines = [b'{"a": 1}\n', b"   \n", b'{"b":2,  "_ng_task_index": 10}\r\n', b'{"c": 3}\n', b'{"d":4}']
    chosen = {0: ts(0, [1]), 10: ts(10, [0]), 3: ts(3, [1])}
    out = list(selection.subset_lines(lines, chosen, None))
    assert out == [(0, b'{"a": 1}\n'), (10, b'{"b":2,  "_ng_task_index": 10}\r\n'), (3, b'{"d":4}\n')]
    with_stats = dict(selection.subset_lines(lines, chosen, "st"))
    assert with_stats[10].startswith(b'{"b":2,  "_ng_task_index": 10,"st":{') and with_stats[10].endswith(b"}\r\n")
    assert orjson.loads(with_stats[10])["st"]["mean/reward"] == 0.0
    with pytest.raises(BadInput, match="already has a field 'a'"):
        list(selection.subset_lines(lines, chosen, "a"))


# ---------------------------------------------------------------- the command on a run directory


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a" if i % 2 == 0 else "agent_b") for i in range(10)]
    rows[3] = input_row(3, "agent_b", _ng_task_index=42)  # explicit task index
    rows.insert(5, b"\n")  # a blank line does not count as a task
    run_dir, cfg = planned_run(tmp_path, rows, num_repeats=4, num_shards=3)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    profile = list(store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir)))
    lines = [ln for ln in cfg.input_jsonl.read_bytes().splitlines(keepends=True) if ln.strip()]
    index = [42 if b'"_ng_task_index": 42' in ln else n for n, ln in enumerate(lines)]
    return run_dir, cfg, profile, dict(zip(index, lines))


def test_select_writes_the_original_rows_byte_identical(run, tmp_path):
    run_dir, cfg, profile, by_index = run
    out = tmp_path / "sub" / "curriculum.jsonl"
    res = selection.select_run(run_dir, out, Rules(drop_unsolved=True, drop_solved=True))
    expect = sorted(i for i in by_index if reward(i, 0) == 1.0 and reward(i, 3) == 0.0)  # mixed tasks
    assert [t.task_index for t in res.selection.kept] == expect
    assert out.read_bytes() == b"".join(ln for i, ln in by_index.items() if i in expect)
    assert res.rows_written == len(expect)


def test_select_attaches_stats_under_the_key(run, tmp_path):
    run_dir, cfg, profile, by_index = run
    out = tmp_path / "c.jsonl"
    selection.select_run(run_dir, out, Rules(agents=("agent_b",), top_k_hardest=2), stats_key="difficulty")
    rows = [orjson.loads(ln) for ln in out.read_bytes().splitlines()]
    prof = {p["_ng_task_index"]: p for p in profile}
    b_tasks = sorted(
        (p["mean/reward"], -p["std/reward"], i)
        for i, p in prof.items()
        if p["sample"]["agent_ref"]["name"] == "agent_b"
    )
    assert sorted(r["difficulty"]["task_index"] for r in rows) == sorted(i for _, _, i in b_tasks[:2])
    for r in rows:
        i = r["difficulty"]["task_index"]
        assert r["difficulty"]["mean/reward"] == prof[i]["mean/reward"]
        assert r["difficulty"]["std/reward"] == prof[i]["std/reward"]
        assert r["difficulty"]["num_rollouts"] == 4
        assert out.read_bytes().count(by_index[i].rstrip(b"}\n")) == 1  # original bytes kept in place


def test_select_refuses_a_changed_input_and_writes_nothing(run, tmp_path):
    run_dir, cfg, _, _ = run
    cfg.input_jsonl.write_bytes(cfg.input_jsonl.read_bytes().replace(b"What is 1 + 1", b"What is 1 + 2"))
    out = tmp_path / "c.jsonl"
    with pytest.raises(PlanMismatch, match="input changed since it was planned"):
        selection.select_run(run_dir, out, Rules())
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


def test_select_needs_the_profile_and_the_input(run, tmp_path):
    run_dir, cfg, _, _ = run
    moved = tmp_path / "moved.jsonl"
    cfg.input_jsonl.rename(moved)
    with pytest.raises(BadInput, match="pass --input"):
        selection.select_run(run_dir, tmp_path / "c.jsonl", Rules())
    assert selection.select_run(run_dir, tmp_path / "c.jsonl", Rules(), input_path=moved).rows_written == 10
    store.merged_reward_profiling_path(run_dir).unlink()
    with pytest.raises(RunDirError, match="merge-and-profile"):
        selection.select_run(run_dir, tmp_path / "c.jsonl", Rules())


def test_cli_select_prints_each_rule_and_writes_the_file(run, tmp_path):
    run_dir, _, _, by_index = run
    out = tmp_path / "c.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "select",
            str(run_dir),
            "--output",
            str(out),
            "--min-mean",
            "0.2",
            "--max-mean",
            "0.8",
            "--agent",
            "agent_a",
            "--min-std",
            "0.1",
        ],
    )
    assert res.exit_code == 0, res.output
    expect = [i for i in by_index if i % 2 == 0 and i != 42 and reward(i, 0) == 1.0 and reward(i, 3) == 0.0]
    assert out.read_bytes() == b"".join(by_index[i] for i in expect)
    for rule in ("profiled", "--agent agent_a", "--min-mean 0.2", "--max-mean 0.8", "--min-std 0.1"):
        assert rule in res.output
    assert f"{len(expect)} rows -> {out}" in res.output
    bad = CliRunner().invoke(app, ["select", str(run_dir), "-o", str(out), "--agent", "agent_c"])
    assert bad.exit_code == 2 and "no task in the profile belongs to it" in bad.output
