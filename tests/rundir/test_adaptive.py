"""Adaptive sampling without the Gym stack: the decision from the run directory (rundir/decided.py), the seal that
records skipped rows, and the merge and `select` on the result, with shards collected in index order by a stand-in
for the collector (each rollout's reward a pure function of its identity, so a full run and an adaptive run of the
same plan can be compared row for row). The real collector is tested in test_adaptive_gym.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import orjson
import pytest
import yaml

import reportkit
from reportkit import input_row, merge_run, rollout, write_input
from shardrun.analysis import selection
from shardrun.core import config
from shardrun.core.errors import BadInput
from shardrun.rundir import decided, seal, store

TASKS = 12
K = 8
SHARDS = 8  # 96 rollouts: a wave (2 repeats of 12 tasks) fills two shards
RULES = {"drop_solved": True, "drop_unsolved": True}


def pass_rate(task: int) -> float:
    """never, always, sometimes (1/2, 1/4, 3/4)."""
    return [0.0, 1.0, 0.5, 0.25, 0.75, 0.5][task % 6]


def reward(task: int, r: int) -> float:
    h = int(hashlib.sha256(f"{task}|{r}".encode()).hexdigest()[:8], 16) / 2**32
    return 1.0 if h < pass_rate(task) else 0.0


def plan_run(tmp: Path, name: str, sampling: dict | None) -> Path:
    inp = tmp / "input.jsonl"
    if not inp.exists():
        write_input(inp, [input_row(i) for i in range(TASKS)])
    data = {"input_jsonl": str(inp), "run_dir": str(tmp / name), "num_repeats": K, "sharding": {"num_shards": SHARDS}}
    if sampling is not None:
        data["sampling"] = sampling
    cfg_path = tmp / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    cfg = config.load(cfg_path)
    store.write_plan(cfg)
    return cfg.run_dir


def collect_shard(run_dir: Path, index: int, skip: set[tuple[int, int]] = frozenset()) -> dict:
    """What a shard job does, with the collector replaced by `reward` (reportkit.collect_shard)."""
    return reportkit.collect_shard(run_dir, index, reward, skip)


def select_bytes(run_dir: Path, out: Path, **rules) -> bytes:
    selection.select_run(run_dir, out, selection.Rules(**rules))
    return out.read_bytes()


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    full = plan_run(tmp_path, "full", None)
    adaptive = plan_run(tmp_path, "adaptive", {"stop_when_decided": RULES, "wave": 2})
    for i in range(SHARDS):
        collect_shard(full, i)
    markers = []
    plan = store.load_plan(adaptive)
    for i in range(SHARDS):  # in index order, as the array runs them: wave by wave
        found = decided.decide_shard(adaptive, plan, i, max_attempts=3)
        assert not found.errors
        markers.append(collect_shard(adaptive, i, found.skip))
    merge_run(full)
    merge_run(adaptive)
    return full, adaptive, markers


def test_adaptive_run_selects_exactly_what_the_full_run_selects(runs, tmp_path: Path) -> None:
    full, adaptive, markers = runs
    assert select_bytes(adaptive, tmp_path / "a.jsonl", **RULES) == select_bytes(full, tmp_path / "f.jsonl", **RULES)
    # the savings are real, and every skipped row is accounted for in the seals
    planned = TASKS * K
    collected = sum(m["num_rollouts"] for m in markers)
    assert sum(m.get("num_skipped_decided", 0) for m in markers) == planned - collected > 0
    assert all(seal.check(adaptive, store.load_plan(adaptive), i, deep=True).sealed for i in range(SHARDS))


def test_every_collected_rollout_is_the_full_runs_rollout_with_that_identity(runs) -> None:
    full, adaptive, _ = runs

    def by_identity(run_dir: Path) -> dict:
        rows = store.iter_jsonl_objects(store.merged_rollouts_path(run_dir))
        return {(r["_ng_task_index"], r["_ng_rollout_index"]): r for r in rows}

    got, want = by_identity(adaptive), by_identity(full)
    assert got and set(got) < set(want)
    for key, row in got.items():
        assert row == want[key]


def test_stopped_tasks_stay_decided_the_same_way(runs) -> None:
    """Monotone: with all the data in, every task a shard skipped is still decided, the way the full run's data
    decides it, and its skipped rows are still the ones to skip."""
    _, adaptive, markers = runs
    plan = store.load_plan(adaptive)
    rules = plan.sampling.stop_when_decided
    for i, marker in enumerate(markers):
        later = decided.decide_shard(adaptive, plan, i, max_attempts=3)
        for task in marker.get("skipped_decided_tasks", []):
            full = [reward(task, r) for r in range(K)]
            assert later.verdicts[task] == rules.keeps("agent_a", sum(full) / K, min(full), max(full))
        assert marker.get("num_skipped_decided", 0) == len(later.skip)
        assert sorted({t for t, _ in later.skip}) == marker.get("skipped_decided_tasks", [])


def test_never_and_always_solved_tasks_are_never_stopped_early(runs) -> None:
    """With the solved/unsolved filter the last rollout can still flip a task that has only passes or only
    failures, so those tasks get all k rollouts; a task seen passing and failing stops."""
    _, adaptive, markers = runs
    stopped = {t for m in markers for t in m.get("skipped_decided_tasks", [])}
    assert not stopped & {t for t in range(TASKS) if pass_rate(t) in (0.0, 1.0)}
    assert stopped


def test_a_rollout_outside_the_metric_range_keeps_its_task_undecided(tmp_path: Path) -> None:
    run_dir = plan_run(tmp_path, "range", {"stop_when_decided": RULES, "wave": 2})
    plan = store.load_plan(run_dir)
    rows = list(store.iter_jsonl_objects(store.materialized_path(run_dir, 0)))
    out = [rollout(r, 1.0 if r["_ng_rollout_index"] == 0 else 0.0, 10) for r in rows]
    out[0]["reward"] = 2.5  # task 0, rollout 0: outside [0, 1]
    store.rollouts_path(run_dir, 0).write_bytes(b"".join(orjson.dumps(o) + b"\n" for o in out))
    found = decided.decide_shard(run_dir, plan, 2, max_attempts=3)
    assert [(e.task, e.rollout, e.value) for e in found.errors] == [(0, 0, 2.5)]
    assert 0 not in found.verdicts
    assert 1 in found.verdicts  # task 1 passed once and failed once: decided (kept)


def test_a_seal_counts_skipped_rows_as_accounted_for(runs) -> None:
    _, adaptive, markers = runs
    plan = store.load_plan(adaptive)
    index = next(i for i, m in enumerate(markers) if m.get("num_skipped_decided"))
    marker = json.loads(store.done_path(adaptive, index).read_text())
    marker["num_skipped_decided"] -= 1
    store.done_path(adaptive, index).write_text(json.dumps(marker))
    state = seal.check(adaptive, plan, index)
    assert not state.sealed and "accounts for" in state.reason


def test_select_with_other_rules_checks_each_stopped_task(runs, tmp_path: Path) -> None:
    _, adaptive, markers = runs
    stopped = sorted({t for m in markers for t in m.get("skipped_decided_tasks", [])})
    # a band the partial rollouts cannot settle for every stopped task: refused, naming them, nothing written
    with pytest.raises(BadInput, match="not decided by these rules") as e:
        selection.select_run(adaptive, tmp_path / "band.jsonl", selection.Rules(min_mean=0.5))
    named = [int(t) for t in str(e.value).split(": ", 1)[1].split(".")[0].split(", ")]
    assert named and set(named) <= set(stopped)
    assert not (tmp_path / "band.jsonl").exists()
    kept = selection.select_run(adaptive, tmp_path / "keep.jsonl", selection.Rules(min_mean=0.5), undecided="keep")
    dropped = selection.select_run(adaptive, tmp_path / "drop.jsonl", selection.Rules(min_mean=0.5), undecided="drop")
    keep_ids = {t.task_index for t in kept.selection.kept}
    drop_ids = {t.task_index for t in dropped.selection.kept}
    assert set(named) <= keep_ids and not set(named) & drop_ids and drop_ids <= keep_ids
    # rules the partial data does decide: a wider band than any stopped task can leave
    selection.select_run(adaptive, tmp_path / "wide.jsonl", selection.Rules(min_mean=0.0, max_mean=1.0))
    with pytest.raises(BadInput, match="--undecided"):
        selection.select_run(adaptive, tmp_path / "x.jsonl", selection.Rules(**RULES), undecided="maybe")


def test_status_counts_skipped_rollouts_and_the_gpu_hours_saved(runs) -> None:
    from shardrun.launch import status

    _, adaptive, markers = runs
    st = status.collect(adaptive)
    skipped = sum(m.get("num_skipped_decided", 0) for m in markers)
    data = json.loads(status.render_json(st))
    assert data["skipped_decided"] == skipped and data["planned"] == TASKS * K
    assert data["done"] + data["skipped_decided"] == data["planned"]
    assert data["saved_gpu_hours"] == pytest.approx(skipped * SHARDS * (1 / 3600) / data["done"])
    assert f"{skipped:,} rollouts" in status.render(st)


def test_fill_collects_the_skipped_rollouts(runs) -> None:
    """resume --fill: the shards that skipped rows are unsealed, their next start skips nothing, and the run then
    holds exactly what the full run holds."""
    full, adaptive, markers = runs
    plan = store.load_plan(adaptive)
    stopped = sorted({t for m in markers for t in m.get("skipped_decided_tasks", [])})
    # a rule first: only the shards holding skipped rows of those tasks reopen, and only those tasks are filled
    some = stopped[:1]
    would = decided.request_fill(adaptive, plan, some, dry_run=True)
    assert not store.fill_path(adaptive).exists() and all(store.done_path(adaptive, i).exists() for i in would)
    reopened = decided.request_fill(adaptive, plan, some)
    assert reopened == would
    assert reopened == [i for i, m in enumerate(markers) if set(m.get("skipped_decided_tasks", [])) & set(some)]
    for i in reopened:
        found = decided.decide_shard(adaptive, plan, i, max_attempts=3)
        assert not {t for t, _ in found.skip} & set(some)
        collect_shard(adaptive, i, found.skip)
    # then everything
    reopened = decided.request_fill(adaptive, plan, None)
    assert json.loads(store.fill_path(adaptive).read_text()) == {"all": True}
    for i in reopened:
        assert not decided.decide_shard(adaptive, plan, i, max_attempts=3).skip
        collect_shard(adaptive, i)
    merge_run(adaptive)
    assert store.merged_rollouts_path(adaptive).read_bytes() == store.merged_rollouts_path(full).read_bytes()


def test_report_shows_the_skipped_rollouts_and_the_gpu_hours_saved(runs) -> None:
    from shardrun.analysis import report

    _, adaptive, markers = runs
    skipped = sum(m.get("num_skipped_decided", 0) for m in markers)
    rows = dict(report.headline_rows(report.gather(adaptive, use_sacct=False)))
    assert rows["skipped (decided)"].startswith(f"{skipped:,} rollouts never run because their task was decided")
    assert "GPU-hours saved" in rows["skipped (decided)"]
    assert rows["failures"].endswith("0 planned rollouts without a result")


def test_a_shard_killed_mid_way_resumes_and_decides_afresh(tmp_path: Path) -> None:
    """A shard killed after part of its rows: its next start keeps what it collected, decides from at least what
    the first start saw (rows it had skipped stay skipped), and the run still selects what the full run selects."""
    full = plan_run(tmp_path, "full", None)
    adaptive = plan_run(tmp_path, "adaptive", {"stop_when_decided": RULES, "wave": 2})
    for i in range(SHARDS):
        collect_shard(full, i)
    plan = store.load_plan(adaptive)
    for i in range(SHARDS):
        first = decided.decide_shard(adaptive, plan, i, max_attempts=3)
        if i == 3:  # killed mid-way: half of the rows it meant to collect are on disk, no seal
            rows = list(store.iter_jsonl_objects(store.materialized_path(adaptive, i)))
            todo = [r for r in rows if (r["_ng_task_index"], r["_ng_rollout_index"]) not in first.skip]
            half = todo[: len(todo) // 2]
            store.rollouts_path(adaptive, i).write_bytes(
                b"".join(
                    orjson.dumps(rollout(r, reward(r["_ng_task_index"], r["_ng_rollout_index"]), 10)) + b"\n"
                    for r in half
                )
            )
            again = decided.decide_shard(adaptive, plan, i, max_attempts=3)
            assert first.skip <= again.skip and set(first.verdicts) <= set(again.verdicts)
            done = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in half}
            assert not again.skip & done  # what it collected stays; only open rows are skipped
            first = again
        collect_shard(adaptive, i, first.skip)
    assert all(seal.check(adaptive, plan, i, deep=True).sealed for i in range(SHARDS))
    merge_run(full)
    merge_run(adaptive)
    assert select_bytes(adaptive, tmp_path / "a.jsonl", **RULES) == select_bytes(full, tmp_path / "f.jsonl", **RULES)


def test_profile_rows_report_coverage_and_stopped_tasks(runs) -> None:
    full, adaptive, markers = runs
    stopped = {t for m in markers for t in m.get("skipped_decided_tasks", [])}
    rows = list(store.iter_jsonl_objects(store.merged_reward_profiling_path(adaptive)))
    for row in rows:
        t = row["_ng_task_index"]
        assert row["expected_num_rollouts"] == K
        if t in stopped:
            assert row["stopped_decided"] is True and row["num_rollouts"] < K
            assert row["reward_profile_completion_pct"] == 100.0 * row["num_rollouts"] / K
        else:
            assert "stopped_decided" not in row and row["num_rollouts"] == K
    assert not any("stopped_decided" in r for r in store.iter_jsonl_objects(store.merged_reward_profiling_path(full)))


def test_zero_policy_never_counts_skipped_rollouts(runs) -> None:
    """merge-and-profile --missing zero counts planned rollouts without a result as 0 in the aggregate metrics; the
    rows skipped because their task was decided were never run and are not among them."""
    from shardrun.profile.merge_and_profile import merge_and_profile

    _, adaptive, _ = runs
    merge_and_profile(adaptive, missing="zero")
    text = store.merged_aggregate_metrics_path(adaptive).read_text()
    imputed = [int(v) for v in __import__("re").findall(r'"coverage/imputed":\s*(\d+)', text)]
    assert imputed and all(v == 0 for v in imputed)


def test_a_warm_workers_reader_reads_only_what_was_appended_and_decides_as_a_fresh_one(tmp_path: Path) -> None:
    """One RunRollouts kept across shard starts (what a warm worker does) reads each byte once, starts over when a
    file is replaced or rewritten in place, and decides exactly what a fresh read of the run directory decides."""
    adaptive = plan_run(tmp_path, "adaptive", {"stop_when_decided": RULES, "wave": 2})
    plan = store.load_plan(adaptive)
    known = decided.RunRollouts(adaptive, plan, "reward")
    for i in range(SHARDS):
        fresh = decided.decide_shard(adaptive, plan, i, max_attempts=3)
        before = known.bytes_read
        kept = decided.decide_shard(adaptive, plan, i, max_attempts=3, known=known)
        assert (kept.skip, kept.verdicts) == (fresh.skip, fresh.verdicts)
        on_disk = sum(store.rollouts_path(adaptive, s).stat().st_size for s in range(i))
        assert known.bytes_read - before == on_disk - before  # only the shards written since the last start
        collect_shard(adaptive, i, fresh.skip)

    # a shard's file rewritten in place with other rows (same inode, same size or more): read again from nothing
    path = store.rollouts_path(adaptive, 0)
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    flipped = [{**r, "reward": 1.0 - r["reward"]} for r in rows]
    with open(path, "r+b") as f:
        f.write(b"".join(orjson.dumps(r) + b"\n" for r in flipped))
    fresh = decided.decide_shard(adaptive, plan, SHARDS - 1, max_attempts=3)
    kept = decided.decide_shard(adaptive, plan, SHARDS - 1, max_attempts=3, known=known)
    assert (kept.skip, kept.verdicts) == (fresh.skip, fresh.verdicts)
    assert known.values[rows[0]["_ng_task_index"]][rows[0]["_ng_rollout_index"]] == flipped[0]["reward"]  # re-read
