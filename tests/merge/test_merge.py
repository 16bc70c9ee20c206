"""merge-and-profile on shard directories written by tests/builders.py, checked against a plain recomputation."""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from shardrun import cli
from shardrun.merge import row_copier, shard_merge, shard_reader
from shardrun.profile import writers
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import store
from shardrun.core.errors import IncompleteRun, RunDirError
from tests.builders import Run, ShardWrite, input_rows, make_run, rollout_row, seal_shard, write_shard

IDS = ("_ng_task_index", "_ng_rollout_index")
KEY = lambda r: (r["_ng_task_index"], r["_ng_rollout_index"])  # noqa: E731


# ---------------------------------------------------------------- an independent, straightforward profile


def usage_of(row: dict[str, Any]) -> dict[str, Any]:
    """response.usage; anything but an object counts as none (Gym would crash on it)."""
    usage = (row.get("response") or {}).get("usage")
    return usage if isinstance(usage, dict) else {}


def numeric_fields(row: dict[str, Any]) -> dict[str, float]:
    usage = usage_of(row)
    merged = {**row, **usage}
    return {k: float(v) for k, v in merged.items() if isinstance(v, (int, float)) and k not in IDS}


def describe(rows: list[dict[str, Any]], fields: list[str]) -> dict[str, float]:
    nums = [numeric_fields(r) for r in rows]
    out: dict[str, float] = {}
    std: dict[str, float] = {}
    for f in fields:
        vals = [n[f] for n in nums if f in n]
        if vals:
            out[f"mean/{f}"] = statistics.fmean(vals)
            out[f"max/{f}"] = max(vals)
            out[f"min/{f}"] = min(vals)
            out[f"median/{f}"] = statistics.median(vals)
            if len(vals) > 1:
                std[f"std/{f}"] = statistics.stdev(vals)
    if not std:  # every std undefined: 0 for the fields every row has
        std = {f"std/{f}": 0.0 for f in fields if all(f in n for n in nums)}
    out.update(std)
    return out


def info(row: dict[str, Any]) -> dict[str, Any]:
    t, r = KEY(row)
    d: dict[str, Any] = {"rollout_id": f"{t}:{r}", "_ng_task_index": t, "_ng_rollout_index": r}
    if "reward" in row:
        d["reward"] = row["reward"]
    usage = usage_of(row)
    for k, v in list(usage.items()) + [(k, v) for k, v in row.items() if k not in IDS + ("reward", "response")]:
        if isinstance(v, (int, float)):
            d[k] = int(v) if isinstance(v, bool) else v
    return d


def reference_profile(materialized: list[dict], rollouts: list[dict]) -> tuple[list[dict], list[dict]]:
    fields: list[str] = []
    for r in sorted(rollouts, key=KEY):
        fields += [f for f in numeric_fields(r) if f not in fields]
    by_task: dict[int, list[dict]] = defaultdict(list)
    for r in sorted(rollouts, key=KEY):
        by_task[r["_ng_task_index"]].append(r)
    planned = defaultdict(list)
    for m in materialized:
        planned[m["_ng_task_index"]].append(m)
    agent_of = {m["_ng_task_index"]: m["agent_ref"]["name"] for m in materialized}
    rows = []
    for t in sorted(by_task):
        done = by_task[t]
        first = min(r["_ng_rollout_index"] for r in done)
        sample = next(m for m in planned[t] if m["_ng_rollout_index"] == first)
        row = {
            "_ng_task_index": t,
            **describe(done, fields),
            "sample": {k: v for k, v in sample.items() if k not in IDS},
            "num_rollouts": len(done),
            "expected_num_rollouts": len(planned[t]),
            "missing_num_rollouts": len(planned[t]) - len(done),
            "reward_profile_completion_pct": 100.0 * len(done) / len(planned[t]),
            "rollout_infos": [info(r) for r in done],
        }
        rows.append(row)
    agents = []
    for a in sorted({agent_of[t] for t in by_task}):
        mine = [r for t in sorted(by_task) if agent_of[t] == a for r in by_task[t]]
        agents.append({**describe(mine, fields), "agent_ref": {"name": a}})
    return rows, agents


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(set(got) ^ set(want)))
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    else:
        assert got == want and type(got) is type(want), (where, got, want)


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


# ---------------------------------------------------------------- the reference pass@k


def reference_pass_at_k(tasks: list[list[float]], k: int) -> float | None:
    values = []
    for vals in tasks:
        if len(vals) < k:
            continue
        if all(v in (0, 1) for v in vals):
            wrong = sum(1 for v in vals if v == 0)
            values.append(1.0 if wrong < k else 1 - math.comb(wrong, k) / math.comb(len(vals), k))
        else:
            values.append(max(vals[:k]))
    return 100 * sum(values) / len(values) if values else None


# ---------------------------------------------------------------- scenarios

SCENARIOS = {  # workers: shards read in this process (1) or a pool of processes
    "contiguous-int": dict(rows=dict(n_tasks=9), num_repeats=4, num_shards=3, slicing="contiguous", workers=1),
    "roundrobin-dict-sparse-shuffled": dict(
        rows=dict(n_tasks=11, agents=("math", "tool"), explicit_index=True, shuffle_seed=5),
        num_repeats={"math": 4, "_default": 2},
        num_shards=4,
        slicing="round_robin",
        workers=2,
    ),
    "contiguous-split-tasks": dict(
        rows=dict(n_tasks=7, agents=("a", "b", "c")),
        num_repeats={"a": 3, "b": 5, "_default": 1},
        num_shards=5,
        slicing="contiguous",
        workers=3,
    ),  # 3: shards read by a pool of three processes
}


def build(tmp_path: Path, scenario: str) -> tuple[Run, list[ShardWrite]]:
    s = SCENARIOS[scenario]
    run = make_run(
        tmp_path,
        input_rows(**s["rows"]),
        num_repeats=s["num_repeats"],
        num_shards=s["num_shards"],
        slicing=s["slicing"],
    )
    last = run.num_shards - 1
    writes = [
        write_shard(
            run,
            i,
            duplicates=2 if i == 0 else 0,
            torn=i == 1,
            foreign=1 if i == last else 0,
            failed=1 if i == last else 0,
            missing=1 if i == 2 else 0,
            seed=i,
        )
        for i in range(run.num_shards)
    ]
    return run, writes


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_merged_files_and_profile_equal_plain_computation(tmp_path: Path, scenario: str) -> None:
    run, writes = build(tmp_path, scenario)
    summary = merge_and_profile(run.run_dir, answer_field="extracted_answer", workers=SCENARIOS[scenario]["workers"])
    merged = store.merged_dir(run.run_dir)

    planned = sorted((m for i in range(run.num_shards) for m in run.materialized(i)), key=KEY)
    assert read_jsonl(merged / "rollouts_materialized_inputs.jsonl") == planned
    planned_lines = {
        KEY(orjson.loads(x)): x
        for i in range(run.num_shards)
        for x in store.materialized_path(run.run_dir, i).read_bytes().splitlines()
    }
    assert (merged / "rollouts_materialized_inputs.jsonl").read_bytes() == b"".join(
        planned_lines[k] + b"\n" for k in sorted(planned_lines)
    )

    first_written: dict[tuple[int, int], dict] = {}
    for w in writes:
        for r in w.rows:
            if KEY(r) not in w.foreign:
                first_written.setdefault(KEY(r), r)
    rollouts = read_jsonl(merged / "rollouts.jsonl")
    assert [KEY(r) for r in rollouts] == sorted(first_written)
    assert rollouts == [first_written[k] for k in sorted(first_written)]  # first copy kept, bytes as written
    assert all(r["reward"] != -1.0 for r in rollouts)
    lost = {k for w in writes for k in w.missing + w.failed}
    assert set(first_written) == {KEY(m) for m in planned} - lost

    want_rows, want_agents = reference_profile(planned, rollouts)
    assert_same(read_jsonl(merged / "rollouts_reward_profiling.jsonl"), want_rows, "profile")
    assert_same(orjson.loads((merged / "rollouts_agent_metrics.json").read_bytes()), want_agents, "agents")

    assert summary.duplicates == 2
    assert summary.rejected["not planned for its shard"] == 1 and sum(summary.rejected.values()) == 1
    assert summary.torn_lines == 1
    assert summary.failure_rows == 2 and summary.failed_total == 1
    assert [(f.task, f.rollout, f.attempts) for f in summary.failed] == [(*writes[-1].failed[0], 2)]
    failures = read_jsonl(merged / "rollouts_failures.jsonl")
    assert [KEY(f) for f in failures] == [writes[-1].failed[0]] * 2
    assert summary.rollouts == len(first_written) and summary.expected_rollouts == len(planned)
    partial_tasks = {t for t, _ in lost}
    assert summary.tasks_partial + summary.tasks_missing == len(partial_tasks)
    assert summary.tasks_complete == summary.tasks - len(partial_tasks)
    assert summary.gpu_hours == pytest.approx(0.5 * run.num_shards)
    assert summary.warnings == []


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_aggregate_metrics_equal_plain_pass_at_k(tmp_path: Path, scenario: str) -> None:
    run, _ = build(tmp_path, scenario)
    merge_and_profile(run.run_dir, answer_field="extracted_answer")
    data = store.merged_aggregate_metrics_path(run.run_dir).read_bytes()
    entries = orjson.loads(data)
    heads = orjson.dumps(
        [{k: v for k, v in e.items() if k != "group_level_metrics"} for e in entries], option=orjson.OPT_INDENT_2
    )
    assert data.startswith(heads.split(b'"key_metrics"')[0])  # entries laid out as Gym's (indented) file
    group_lines = [x for x in data.splitlines() if x.startswith(b"      {")]
    assert len(group_lines) == sum(len(e["group_level_metrics"]) for e in entries)  # one row per line
    rollouts = read_jsonl(store.merged_rollouts_path(run.run_dir))
    profile_rows = read_jsonl(store.merged_reward_profiling_path(run.run_dir))
    agent_of = {r["_ng_task_index"]: r["sample"]["agent_ref"]["name"] for r in profile_rows}
    assert [e["agent_ref"]["name"] for e in entries] == sorted(set(agent_of.values()))
    for e in entries:
        name = e["agent_ref"]["name"]
        tasks: dict[int, list[float]] = defaultdict(list)
        for r in rollouts:
            if agent_of[r["_ng_task_index"]] == name:
                tasks[r["_ng_task_index"]].append(float(r["reward"]))
        repeats = run.plan.agents[name]["repeats"]
        m = e["agent_metrics"]
        for k in (1, 2, 4, repeats):
            want = reference_pass_at_k(list(tasks.values()), k) if k <= repeats else None
            if want is None:
                assert f"pass@{k}/accuracy" not in m
            else:
                assert m[f"pass@{k}/accuracy"] == pytest.approx(want)
                firsts = [sum(v[:k]) / len(v[:k]) for v in tasks.values()]
                assert m[f"pass@1[avg-of-{k}]/accuracy"] == pytest.approx(100 * sum(firsts) / len(firsts))
        assert m["mean/reward"] == pytest.approx(statistics.fmean(x for v in tasks.values() for x in v))
        assert e["key_metrics"]["mean/reward"] == m["mean/reward"]
        assert any(k.startswith("majority@") for k in e["key_metrics"])
        groups = e["group_level_metrics"]
        assert [g["_ng_task_index"] for g in groups] == sorted(tasks)
        assert all(g["sample"] == {"agent_ref": {"name": "agent"}} for g in groups)
        assert all(g["expected_num_rollouts"] == g["num_rollouts"] == len(tasks[g["_ng_task_index"]]) for g in groups)
        prof = {r["_ng_task_index"]: r for r in profile_rows}
        for g in groups:
            p = prof[g["_ng_task_index"]]
            assert {k: v for k, v in g.items() if "/" in k} == {k: v for k, v in p.items() if "/" in k}
            assert g["rollout_infos"] == p["rollout_infos"]


# ---------------------------------------------------------------- sealing


def test_unsealed_shards_are_refused_with_resume_hint(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(6), num_repeats=2, num_shards=3)
    write_shard(run, 0)
    write_shard(run, 1, seal_it=False)
    with pytest.raises(IncompleteRun, match="shardrun resume") as err:
        merge_and_profile(run.run_dir)
    assert "shard 00001: no marker" in str(err.value) and "shard 00002" in str(err.value)
    assert not any(store.merged_dir(run.run_dir).glob("rollouts*"))
    result = CliRunner().invoke(cli.app, ["merge-and-profile", str(run.run_dir)])
    assert result.exit_code == IncompleteRun.exit_code and "shardrun resume" in result.output


def test_allow_partial_merges_unsealed_shards_and_reports_completion(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(6), num_repeats=4, num_shards=3)
    write_shard(run, 0)
    w1 = write_shard(run, 1, missing=3, torn=True, seal_it=False)
    summary = merge_and_profile(run.run_dir, allow_partial=True)
    assert [s.sealed for s in summary.shards] == [True, False, False]
    assert summary.shards[1].reason == "no marker" and summary.shards[1].torn_bytes > 0
    merged = store.merged_dir(run.run_dir)
    planned = sorted((m for i in range(3) for m in run.materialized(i)), key=KEY)
    assert len(read_jsonl(merged / "rollouts_materialized_inputs.jsonl")) == len(planned) == 24
    rollouts = read_jsonl(merged / "rollouts.jsonl")
    assert len(rollouts) == 8 + 8 - 3
    want_rows, _ = reference_profile(planned, rollouts)
    got = read_jsonl(merged / "rollouts_reward_profiling.jsonl")
    assert_same(got, want_rows)
    assert summary.tasks_missing == 2  # the third shard wrote nothing
    assert summary.tasks_complete + summary.tasks_partial == 4
    assert {r["reward_profile_completion_pct"] for r in got} <= {25.0, 50.0, 75.0, 100.0}
    assert summary.tasks_partial == len({t for t, _ in w1.missing})
    assert not list(merged.glob(".tmp-*"))
    assert (
        "unsealed shards merged as partial"
        in CliRunner().invoke(cli.app, ["merge-and-profile", str(run.run_dir), "--allow-partial"]).output
    )


def test_rollouts_changed_after_sealing_count_as_unsealed(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    write_shard(run, 0)
    write_shard(run, 1)
    path = store.rollouts_path(run.run_dir, 1)
    data = bytearray(path.read_bytes())
    data[data.index(b'"reward":') + 9] ^= 1  # same size, other content: only the hash can tell
    path.write_bytes(bytes(data))
    with pytest.raises(IncompleteRun, match="sha256 differs"):
        merge_and_profile(run.run_dir)
    summary = merge_and_profile(run.run_dir, allow_partial=True)
    assert not summary.shards[1].sealed and "sha256" in summary.shards[1].reason
    with open(path, "ab") as f:  # appended after sealing: the size no longer matches
        f.write(b"\n")
    with pytest.raises(IncompleteRun, match="changed after sealing"):
        merge_and_profile(run.run_dir)


def test_a_shard_sealing_during_the_merge_is_seen_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    """Shard 1 is sealed while the merge reads shard 0; shard 0 is rewritten between its check and its read."""
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    write_shard(run, 0)
    write_shard(run, 1, seal_it=False, missing=1)
    real_scan = shard_reader.scan_rollouts

    def racing_scan(path: Path, **kw: Any):
        if path.parent.name == "00000":
            seal_shard(run, 1, num_failed=1)  # shard 1 gets sealed now, after the merge checked it
        return real_scan(path, **kw)

    monkeypatch.setattr(shard_reader, "scan_rollouts", racing_scan)
    summary = merge_and_profile(run.run_dir, allow_partial=True)
    assert [s.sealed for s in summary.shards] == [True, False]  # as checked: never half
    assert summary.shards[1].marker is None and summary.rollouts == 7

    def rewriting_scan(path: Path, **kw: Any):
        if path.parent.name == "00000" and kw.get("snapshot") is None:
            rows = read_jsonl(path)
            rows[0]["reward"] = 0.5 if rows[0]["reward"] != 0.5 else 0.25
            data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
            path.write_bytes(data[: path.stat().st_size].ljust(path.stat().st_size, b" "))
        return real_scan(path, **kw)

    monkeypatch.setattr(shard_reader, "scan_rollouts", rewriting_scan)
    with pytest.raises(IncompleteRun, match="sha256 differs"):
        merge_and_profile(run.run_dir)


# ---------------------------------------------------------------- identity


def test_renumbered_shard_is_mapped_back_to_planned_identities(tmp_path: Path) -> None:
    rows = input_rows(5)
    plain = make_run(tmp_path, rows, num_repeats=4, num_shards=3, name="plain")
    renum = make_run(tmp_path, rows, num_repeats=4, num_shards=3, name="renum")
    assert renum.identities(1)[0][1] > 0  # shard 1 starts mid-task: local and global numbering differ
    for i in range(3):
        write_shard(plain, i, failed=1 if i == 1 else 0)
        write_shard(renum, i, renumber=i == 1, failed=1 if i == 1 else 0)
    a = merge_and_profile(plain.run_dir)
    b = merge_and_profile(renum.run_dir)
    assert b.shards[1].renumbered and not a.shards[1].renumbered
    for name in ("rollouts.jsonl", "rollouts_reward_profiling.jsonl", "rollouts_failures.jsonl"):
        assert read_jsonl(store.merged_dir(plain.run_dir) / name) == read_jsonl(store.merged_dir(renum.run_dir) / name)


def test_rows_without_identity_or_unreadable_are_rejected(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(3), num_repeats=2, num_shards=1)
    planned = run.materialized(0)
    lines = [orjson.dumps(rollout_row(m)) for m in planned]
    lines.insert(2, b'{"reward": 1.0}')
    lines.insert(3, b'{"_ng_task_index": 0, "_ng_rollout_index": "1"}')
    lines.insert(1, b"not json at all")
    lines.insert(1, b"")
    store.rollouts_path(run.run_dir, 0).write_bytes(b"\n".join(lines) + b"\n")
    seal_shard(run, 0)
    s = merge_and_profile(run.run_dir)
    assert s.rejected == {"not planned for its shard": 0, "no identity": 2, "unreadable line": 1}
    assert s.rollouts == 6 and s.tasks_complete == 3


# ---------------------------------------------------------------- re-running and being killed


def merged_bytes(run_dir: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(store.merged_dir(run_dir).iterdir())
        if p.name not in (".merge.lock", "merge_summary.json")
    }


def test_rerun_gives_identical_bytes(tmp_path: Path) -> None:
    run, _ = build(tmp_path, "roundrobin-dict-sparse-shuffled")
    merge_and_profile(run.run_dir, answer_field="extracted_answer")
    first = merged_bytes(run.run_dir)
    (store.merged_dir(run.run_dir) / f"{store.MERGE_TMP_PREFIX}rollouts.jsonl.killed").write_bytes(b"half a file")
    merge_and_profile(run.run_dir, answer_field="extracted_answer")
    assert merged_bytes(run.run_dir) == first and len(first) == 7  # failures_by_class.json too


def test_a_failing_merge_leaves_the_previous_outputs(tmp_path: Path, monkeypatch) -> None:
    run, _ = build(tmp_path, "contiguous-int")
    merge_and_profile(run.run_dir)
    before = merged_bytes(run.run_dir)
    write_shard(run, 0, seed=99)  # new content, so a completed merge would change the outputs

    def boom(*a: Any, **k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(writers, "write_profile", boom)
    with pytest.raises(KeyboardInterrupt):
        merge_and_profile(run.run_dir)
    assert merged_bytes(run.run_dir) == before
    assert not list(store.merged_dir(run.run_dir).glob(".tmp-*"))


def test_a_failing_row_copy_fails_the_merge_and_leaves_the_previous_outputs(tmp_path: Path, monkeypatch) -> None:
    """An error while copying rows (here: a disk that fills up) is the merge's error, nothing replaced."""
    run, _ = build(tmp_path, "contiguous-int")
    merge_and_profile(run.run_dir)
    before = merged_bytes(run.run_dir)
    write_shard(run, 0, seed=99)

    def full(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(row_copier, "copy_rows", full)
    with pytest.raises(RunDirError, match="(?i)no space left on (the )?device"):  # store.os_error's wording
        merge_and_profile(run.run_dir)
    assert merged_bytes(run.run_dir) == before
    assert not list(store.merged_dir(run.run_dir).glob(".tmp-*"))


@pytest.mark.slow
def test_sigkill_at_any_point_then_rerun_gives_the_clean_result(tmp_path: Path) -> None:
    run, _ = build(tmp_path, "roundrobin-dict-sparse-shuffled")
    merge_and_profile(run.run_dir)
    clean = merged_bytes(run.run_dir)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent.parent.parent)!r}); "
        f"from shardrun.profile.merge_and_profile import merge_and_profile; merge_and_profile({str(run.run_dir)!r})"
    )
    for attempt, delay in enumerate((0.05, 0.15, 0.3, 0.45, 0.6, 0.8)):
        for p in store.merged_dir(run.run_dir).iterdir():
            p.unlink() if attempt % 2 else None  # every other kill starts from an empty merged/
        proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        leftovers = merged_bytes(run.run_dir)
        for name, data in leftovers.items():  # whatever is there is complete (old or new), never half
            assert name.startswith(".tmp-") or data == clean[name]
        merge_and_profile(run.run_dir)
        assert merged_bytes(run.run_dir) == clean


def corner_row(m: dict[str, Any]) -> dict[str, Any]:
    row = rollout_row(m)
    t, r = m["_ng_task_index"], m["_ng_rollout_index"]
    variant = (t + r) % 5
    if variant == 0:
        row["input_tokens"] = 999  # shadowed by response.usage in the stats, not in rollout_infos
    elif variant == 1:
        row["reward"] = None
    elif variant == 2:
        row["reward"] = bool(r % 2)
    elif variant == 3:
        row["big"] = 2**60 + 1 + r  # beyond float precision: rollout_infos keep the exact integer
    else:
        row["response"] = {"usage": "not a dict"}
    return row


def test_corner_case_rows_equal_plain_computation(tmp_path: Path) -> None:
    run = make_run(
        tmp_path,
        input_rows(8, agents=("a", "b")),
        num_repeats={"a": 3, "_default": 1},
        num_shards=2,
        slicing="round_robin",
    )
    for i in range(2):
        write_shard(run, i, make_row=corner_row, seed=i)
    merge_and_profile(run.run_dir)
    merged = store.merged_dir(run.run_dir)
    planned = read_jsonl(merged / "rollouts_materialized_inputs.jsonl")
    rollouts = read_jsonl(merged / "rollouts.jsonl")
    want_rows, want_agents = reference_profile(planned, rollouts)
    got_rows = read_jsonl(merged / "rollouts_reward_profiling.jsonl")
    assert_same(got_rows, want_rows)
    assert_same(orjson.loads((merged / "rollouts_agent_metrics.json").read_bytes()), want_agents)
    bigs = [i["big"] for row in got_rows for i in row["rollout_infos"] if "big" in i]
    assert bigs and all(b > 2**60 and isinstance(b, int) for b in bigs)
    assert any(i["reward"] is None for row in got_rows for i in row["rollout_infos"])
    assert any(i["reward"] is True for row in got_rows for i in row["rollout_infos"])


def test_cli_prints_the_summary_and_json(tmp_path: Path) -> None:
    run, _ = build(tmp_path, "roundrobin-dict-sparse-shuffled")
    result = CliRunner().invoke(cli.app, ["merge-and-profile", str(run.run_dir), "--answer-field", "extracted_answer"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in (
        r"duplicates dropped +2\n",
        r"rows rejected +1; 1 not planned for its shard",
        r"torn last lines +1",
        r"GPU-hours \(markers\) +2\.00",
        r"agent math \(4 repeats\): mean reward 0\.\d{4}",
        r"agent tool \(2 repeats\)",
        r"k +pass@k +pass@1\[avg-of-k\] +majority@k",
        r"failed rollouts \(task:rollout, shard, class, reason\):",
        "http_500",
        "rollouts_reward_profiling.jsonl",
    ):
        assert re.search(text, out), text
    as_json = CliRunner().invoke(cli.app, ["merge-and-profile", str(run.run_dir), "--json"])
    data = orjson.loads(as_json.output)
    assert data["duplicates"] == 2 and data["gpu_hours"] == pytest.approx(2.0)
    assert [a["name"] for a in data["agents"]] == ["math", "tool"]
    assert data["shards"][0]["marker"]["gpus"] == 1
    saved = orjson.loads(store.merged_summary_path(run.run_dir).read_bytes())
    assert saved["rollouts"] == data["rollouts"] and saved["timings"]["total_s"] > 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_copy_rows_gives_the_rows_in_order_whatever_the_window(tmp_path_factory, data) -> None:
    """Rows in any order, some rewritten, whatever the window, span, gap and range sizes: units at least a range
    long go file to file (copy_file_range), the others through the window's buffer; the bytes are the same."""
    tmp = tmp_path_factory.mktemp("copy")
    files = []
    rows = []  # (file, offset, bytes)
    for f in range(data.draw(st.integers(1, 4))):
        lines = data.draw(
            st.lists(
                st.binary(min_size=0, max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\n"), min_size=1, max_size=30
            )
        )
        path = tmp / f"f{f}"
        path.write_bytes(b"".join(lines))
        files.append(path)
        off = 0
        for line in lines:
            rows.append((f, off, line))
            off += len(line)
    order = data.draw(st.one_of(st.just(list(range(len(rows)))), st.permutations(range(len(rows)))))
    flagged = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    sizes = {
        name: data.draw(st.integers(1, 200)) for name in ("WINDOW_BYTES", "SPAN_BYTES", "GAP_BYTES", "PIECE_BYTES")
    }
    sizes["RANGE_BYTES"] = data.draw(st.integers(1, 400))
    old = {name: getattr(row_copier, name) for name in sizes}
    for name, value in sizes.items():
        setattr(row_copier, name, value)
    try:
        source = np.array([rows[i][0] for i in order], np.int32)
        offset = np.array([rows[i][1] for i in order], np.int64)
        length = np.array([len(rows[i][2]) for i in order], np.int32)
        breaks = np.array([flagged[i] for i in order])
        out_path = tmp / "out"
        with open(out_path, "wb") as out, row_copier.ByteSources(files) as src:
            out.write(b"head:")
            n = row_copier.copy_rows(out, src, source, offset, length, lambda pos, b: b"<" + b + b">", breaks)
            out.write(b":tail")
    finally:
        for name, value in old.items():
            setattr(row_copier, name, value)
    want = b"".join(b"<" + rows[i][2] + b">" if flagged[i] else rows[i][2] for i in order)
    assert out_path.read_bytes() == b"head:" + want + b":tail" and n == len(want)


def test_a_marker_disagreeing_with_its_file_is_not_trusted(tmp_path: Path) -> None:
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    write_shard(run, 0)
    write_shard(run, 1, missing=2, seal_it=False)
    seal_shard(run, 1, num_failed=0)  # claims all 4 rollouts; the file holds 2
    with pytest.raises(IncompleteRun, match="damaged seal .*it counts 4 rollouts, rollouts.jsonl has 2 rows"):
        merge_and_profile(run.run_dir)
    summary = merge_and_profile(run.run_dir, allow_partial=True)
    assert [s.sealed for s in summary.shards] == [True, False] and "damaged seal" in summary.shards[1].reason
    assert summary.rollouts == 6 and summary.tasks_partial + summary.tasks_missing >= 1


def test_a_marker_counting_fewer_rollouts_than_its_file_holds_is_not_trusted_by_the_merge(tmp_path: Path) -> None:
    """The file has every row (status cannot tell without reading them), but the seal counts 2 of the 4 as failed:
    the merge, which reads every row, finds 4 planned identities and does not trust it."""
    run = make_run(tmp_path, input_rows(4), num_repeats=2, num_shards=2)
    write_shard(run, 0)
    write_shard(run, 1, seal_it=False)
    seal_shard(run, 1, num_failed=2)
    with pytest.raises(IncompleteRun, match="damaged seal .*it counts 2 rollouts, 4 planned identities were found"):
        merge_and_profile(run.run_dir)


@pytest.mark.parametrize("slicing", ["contiguous", "round_robin"])
def test_rows_come_out_in_identity_order_whatever_the_slicing(tmp_path: Path, slicing: str) -> None:
    """Contiguous shards hold their identities in order; round-robin ones interleave: the merged rows are sorted
    either way, each planned row and each kept rollout once, as its shard wrote it."""
    run = make_run(tmp_path, input_rows(12), num_repeats=3, num_shards=3, slicing=slicing)
    for i in range(3):
        write_shard(run, i, duplicates=1, seed=i)
    merge_and_profile(run.run_dir)
    rollouts = read_jsonl(store.merged_rollouts_path(run.run_dir))
    assert [KEY(r) for r in rollouts] == sorted((t, r) for t in range(12) for r in range(3))
    planned = store.merged_materialized_path(run.run_dir).read_bytes().splitlines()
    assert sorted(planned) == sorted(
        x for i in range(3) for x in store.materialized_path(run.run_dir, i).read_bytes().splitlines()
    )
    assert [KEY(orjson.loads(x)) for x in planned] == [KEY(r) for r in rollouts]


def test_the_measured_table_leaves_out_masked_rollouts_their_planned_rows_and_their_columns(tmp_path: Path) -> None:
    """MergedTable.measured (Gym 0.7's select_measured): masked rollouts (a truthy mask_sample) and their planned
    rows leave; columns only they had leave too; the flag is never a column. Without a mask field: the table."""
    run = make_run(tmp_path, input_rows(3), num_repeats=2, num_shards=1)

    def row(m: dict[str, Any]) -> dict[str, Any]:
        if m["_ng_task_index"] == 0 or m["_ng_rollout_index"] == 1:
            return rollout_row(m) | {"mask_sample": True, "only_masked": 1}
        return rollout_row(m) | {"mask_sample": False}

    write_shard(run, 0, make_row=row)
    states = shard_merge.check_seals(run.run_dir, run.plan, False)

    def merged(mask_field: str | None) -> Any:
        with open(tmp_path / "r", "wb") as r, open(tmp_path / "m", "wb") as m, open(tmp_path / "f", "wb") as f:
            files = shard_merge.RowFiles(r, m, f)
            return shard_merge.merge_shards(
                run.run_dir,
                run.plan,
                states,
                files,
                allow_partial=False,
                answer_field=None,
                workers=1,
                mask_field=mask_field,
            )[0]

    table = merged("mask_sample")
    assert table.r_masked.tolist() == [True, True, False, True, False, True]
    assert "only_masked" in table.columns and "mask_sample" not in table.columns
    measured = table.measured()
    assert measured.r_key.tolist() == table.r_key[[2, 4]].tolist() and measured.p_key.tolist() == [2, 4]
    assert "only_masked" not in measured.columns and measured.column("reward").shape == (2,)
    assert measured.planned_per_task().tolist() == [0, 1, 1] and measured.agent_of_task().tolist() == [-1, 0, 0]
    plain = merged(None)
    assert not plain.r_masked.any() and plain.measured() is plain and "mask_sample" in plain.columns
