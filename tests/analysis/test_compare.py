"""`shardrun compare`: runs whose per-task pass counts are known by construction (sealed synthetic shards merged by
shardrun's own merge-and-profile, tests/reportkit.py), compared task by task; the statistics checked against
their plain computation; pairing by key across different inputs; several candidates; an adaptive run against a
full one (the stand-in collector of tests/rundir/test_adaptive.py); the HTML and its figures. No Gym needed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import orjson
import pytest
import yaml
from typer.testing import CliRunner

from reportkit import input_row, merge_run, planned_run, seal_shards, write_input
from shardrun import api
from shardrun.analysis import comparison
from shardrun.cli import app
from shardrun.core import config, task_rules
from shardrun.core.errors import BadInput
from shardrun.plan import planner
from shardrun.rundir import decided, store

K = 4
TASKS = 24
AGENTS = ("math", "code")


def solved_base(t: int) -> int:
    """Rollouts (of K) that solve task t in the base run: 0..K, so every bucket occurs."""
    return t % (K + 1)


def solved_cand(t: int) -> int:
    """The candidate: better on even tasks, worse on every third, the same elsewhere."""
    c = solved_base(t) + (1 if t % 2 == 0 else 0) - (2 if t % 3 == 0 else 0)
    return min(K, max(0, c))


def make_run(tmp: Path, solved, rows=None, repeats: int = K) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    rows = rows if rows is not None else [input_row(i, AGENTS[i % 2]) for i in range(TASKS)]
    run_dir, _ = planned_run(tmp, rows, num_repeats=repeats, num_shards=3)
    seal_shards(run_dir, lambda t, r: 1.0 if r < solved(t) else 0.0)
    merge_run(run_dir)
    return run_dir


def plain_bucket(c: int, n: int = K) -> str:
    return "never" if c == 0 else "always" if c == n else "sometimes"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("compare")
    return make_run(tmp / "base", solved_base), make_run(tmp / "cand", solved_cand)


def run_cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / comparison.TASKS_FILE).read_text().splitlines()]


# ---------------------------------------------------------------- per task and per group, by construction


def test_every_delta_and_bucket_is_the_plain_computation(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    res = run_cli("compare", base, cand, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    rows = read_rows(tmp_path / "out")
    assert [r["task_index_base"] for r in rows] == list(range(TASKS))
    for r in rows:
        t = r["task_index_base"]
        assert r["key"] == t == r["task_index_cand"]  # same input: paired by identity
        assert r["agent"] == AGENTS[t % 2] and r["candidate"] == str(cand)
        assert r["mean_base"] == solved_base(t) / K and r["mean_cand"] == solved_cand(t) / K
        assert r["delta"] == pytest.approx((solved_cand(t) - solved_base(t)) / K)
        assert r["bucket_base"] == plain_bucket(solved_base(t)) and r["bucket_cand"] == plain_bucket(solved_cand(t))
        assert r["rollouts_base"] == r["rollouts_cand"] == K
        assert "label" not in r  # the runs have no labels
    summary = json.loads((tmp_path / "out" / comparison.SUMMARY_FILE).read_text())
    (c,) = summary["candidates"]
    assert c["pairing"] == "identity" and c["tasks_paired"] == TASKS and c["notes"] == []
    groups = {g["group"]: g for g in c["groups"]}
    assert set(groups) == {"all", *AGENTS}
    for name, tasks in [("all", range(TASKS)), *((a, [t for t in range(TASKS) if AGENTS[t % 2] == a]) for a in AGENTS)]:
        tasks = list(tasks)
        g = groups[name]
        mb = sum(solved_base(t) for t in tasks) / K / len(tasks)
        mc = sum(solved_cand(t) for t in tasks) / K / len(tasks)
        m = g["mean_reward"]
        assert (m["tasks"], m["base"], m["cand"]) == (len(tasks), pytest.approx(mb), pytest.approx(mc))
        assert m["delta"] == pytest.approx(mc - mb)
        assert m["ci95"][0] <= m["delta"] <= m["ci95"][1]
        # binary rewards: pass@1 is the mean in percent; pass@K is the share of tasks solved at least once
        assert g["pass_at_1"]["delta"] == pytest.approx(100 * (mc - mb))
        pk = g["pass_at_k"]
        assert pk["k"] == K
        assert pk["base"] == pytest.approx(100 * sum(solved_base(t) > 0 for t in tasks) / len(tasks))
        assert pk["cand"] == pytest.approx(100 * sum(solved_cand(t) > 0 for t in tasks) / len(tasks))
        flips = {b: {c2: 0 for c2 in task_rules.BUCKETS} for b in task_rules.BUCKETS}
        for t in tasks:
            flips[plain_bucket(solved_base(t))][plain_bucket(solved_cand(t))] += 1
        assert g["flips"] == flips
        gained = sum(solved_base(t) == 0 < solved_cand(t) for t in tasks)
        lost = sum(solved_cand(t) == 0 < solved_base(t) for t in tasks)
        ever = g["mcnemar"]["ever_solved"]
        assert (ever["gained"], ever["lost"]) == (gained, lost)
        assert ever["p_value"] == pytest.approx(
            min(1.0, 2 * sum(math.comb(gained + lost, i) for i in range(min(gained, lost) + 1)) / 2 ** (gained + lost))
        )
    assert "Δ mean" in res.output and "candidate 1" in res.output


def test_the_frame_is_the_task_file(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    comparison.build(base, [cand], tmp_path / "out")
    frame = api.compare_frame(base, cand)
    assert frame.to_dict("records") == read_rows(tmp_path / "out")
    assert list(frame.columns) == list(comparison.FRAME_COLUMNS)


def test_html_is_written_with_its_figures(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    result = comparison.build(base, [cand], tmp_path / "out")
    page = result.html.read_text()
    assert len(result.figures) == 3
    for fig in result.figures:
        assert fig.parent == tmp_path / "out" and fig.read_bytes().startswith(b"\x89PNG")
        assert f"src='{fig.name}'" in page
    assert "http" not in page.replace("http-equiv", "")  # offline: nothing fetched
    embedded = comparison.build(base, [cand], tmp_path / "emb", embed=True).html.read_text()
    assert embedded.count("data:image/png;base64,") == 3


def test_the_same_seed_gives_the_same_intervals_and_another_seed_may_not(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    a = comparison.compare(base, [cand], seed=7).summary
    b = comparison.compare(base, [cand], seed=7).summary
    c = comparison.compare(base, [cand], seed=8).summary
    assert a == b
    assert a["bootstrap"]["seed"] == 7 and c["bootstrap"]["seed"] == 8


# ---------------------------------------------------------------- the statistics


def test_the_bootstrap_interval_covers_the_true_difference_in_at_least_90_of_100_repetitions() -> None:
    """Tasks drawn from a population (base pass rate uniform, the candidate 0.1 better up to 1), K = 8 binary
    rollouts each; the true difference of the mean reward is E[min(p + 0.1, 1) - p] = 0.1 - 0.1**2 / 2."""
    truth = 0.1 - 0.1**2 / 2
    covered = 0
    for rep in range(100):
        rng = np.random.default_rng(1000 + rep)
        p = rng.uniform(size=200)
        q = np.minimum(p + 0.1, 1.0)
        diffs = rng.binomial(8, q) / 8 - rng.binomial(8, p) / 8
        low, high = comparison.bootstrap_interval(diffs, resamples=1000, seed=rep)
        covered += low <= truth <= high
    assert covered >= 90, covered


def test_bootstrap_interval_edges() -> None:
    assert comparison.bootstrap_interval([]) is None
    assert comparison.bootstrap_interval([0.25]) == (0.25, 0.25)
    assert comparison.bootstrap_interval([0.5] * 10) == pytest.approx((0.5, 0.5))


def test_mcnemar_exact() -> None:
    assert comparison.mcnemar_exact(0, 0) == 1.0
    assert comparison.mcnemar_exact(0, 6) == pytest.approx(2 / 2**6)
    assert comparison.mcnemar_exact(3, 3) == 1.0
    assert comparison.mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 2**10)


def test_bucket_definition() -> None:
    assert task_rules.bucket(0.0, 0.0) == "never"
    assert task_rules.bucket(0.0, 1.0) == "sometimes"
    assert task_rules.bucket(1.0, 1.0) == "always"
    assert task_rules.bucket(0.4, 0.6, solved_threshold=0.5) == "sometimes"
    assert task_rules.bucket(None, None) is None
    assert task_rules.bucket(0.0, 1.0, complete=False) == "sometimes"  # its rollouts already disagree
    assert task_rules.bucket(1.0, 1.0, complete=False) is None  # one more rollout could fail


# ---------------------------------------------------------------- pairing by key


def test_pairing_by_key_across_different_inputs(tmp_path: Path) -> None:
    """The candidate's input holds the base's tasks in another order, less task 5, plus a new one: tasks pair by
    the hash of their responses_create_params; the two unpaired ones are counted and listed."""
    base_rows = [input_row(i, AGENTS[i % 2]) for i in range(TASKS)]
    order = [i for i in reversed(range(TASKS)) if i != 5] + [99]
    cand_rows = [input_row(i, AGENTS[i % 2]) for i in order]
    base = make_run(tmp_path / "base", solved_base, base_rows)
    cand = make_run(tmp_path / "cand", lambda t: solved_cand(order[t]), cand_rows)
    assert store.load_plan(base).input.sha256 != store.load_plan(cand).input.sha256
    for key in (None, "question"):
        res = comparison.build(base, [cand], tmp_path / f"out-{key}", key=key)
        rows = read_rows(tmp_path / f"out-{key}")
        assert len(rows) == TASKS - 1
        for r in rows:
            t = r["task_index_base"]
            assert order[r["task_index_cand"]] == t != 5
            assert r["delta"] == pytest.approx((solved_cand(t) - solved_base(t)) / K)
        if key == "question":
            assert {r["key"] for r in rows} == {f"What is {t} + {t}?" for t in range(TASKS) if t != 5}
        (c,) = res.comparison.summary["candidates"]
        assert c["pairing"] == (key or comparison.DEFAULT_KEY)
        assert [t["task_index"] for t in c["unpaired"]["only_base"]["tasks"]] == [5]
        assert [t["task_index"] for t in c["unpaired"]["only_cand"]["tasks"]] == [order.index(99)]
        assert c["unpaired"]["only_base"]["count"] == c["unpaired"]["only_cand"]["count"] == 1
        assert any("only in the base run" in n for n in c["notes"])


def test_a_key_that_is_not_unique_is_refused_naming_the_duplicates(tmp_path: Path) -> None:
    base = make_run(tmp_path / "base", solved_base)
    rows = [input_row(i, AGENTS[i % 2]) for i in range(TASKS)]
    rows[7]["question"] = rows[3]["question"]
    cand = make_run(tmp_path / "cand", solved_cand, rows + [input_row(50)])
    res = run_cli("compare", base, cand, "-o", tmp_path / "out", "--key", "question")
    assert res.exit_code == 2
    assert "not unique" in res.output and "tasks 3 (line 4), 7 (line 8)" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "out" / comparison.TASKS_FILE).exists()
    # the default key: two rows with the same responses_create_params
    rows[9]["responses_create_params"] = rows[2]["responses_create_params"]
    dup = make_run(tmp_path / "dup", solved_cand, rows + [input_row(51)])
    with pytest.raises(BadInput, match=r"not unique.*\n.*tasks 2 \(line 3\), 9 \(line 10\)"):
        comparison.compare(base, [dup])
    # a field some row lacks
    res = run_cli("compare", base, cand, "-o", tmp_path / "out", "--key", "nope")
    assert res.exit_code == 2 and "field nope: missing" in res.output


def test_keys_from_the_profile_when_the_input_is_gone(tmp_path: Path) -> None:
    """An input moved after the run: its tasks' rows come from the profile's samples, less the seed the planner
    added, so they pair with the other run's rows all the same."""
    base = make_run(tmp_path / "base", solved_base)
    order = list(reversed(range(TASKS)))
    cand = make_run(tmp_path / "cand", lambda t: solved_cand(order[t]), [input_row(i, AGENTS[i % 2]) for i in order])
    Path(store.load_plan(cand).input.path).unlink()
    c = comparison.compare(base, [cand]).summary["candidates"][0]
    assert c["tasks_paired"] == TASKS and "the profile's samples" in c["key_sources"][1]


# ---------------------------------------------------------------- several candidates, repeats, adaptive


def test_three_candidates_against_one_base(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    same = make_run(tmp_path / "same", solved_base)
    worse = make_run(tmp_path / "worse", lambda t: 0)
    out = tmp_path / "out"
    res = run_cli("compare", base, cand, same, worse, "-o", out)
    assert res.exit_code == 0, res.output
    rows = read_rows(out)
    assert [r["candidate"] for r in rows] == [str(c) for c in (cand, same, worse) for _ in range(TASKS)]
    summary = json.loads((out / comparison.SUMMARY_FILE).read_text())
    whole = [next(g for g in c["groups"] if g["group"] == "all") for c in summary["candidates"]]
    assert whole[1]["mean_reward"]["delta"] == 0 and whole[1]["mean_reward"]["ci95"] == [0, 0]
    assert whole[1]["mcnemar"]["ever_solved"]["p_value"] == 1.0
    assert whole[2]["mean_reward"]["cand"] == 0 and whole[2]["flips"]["always"]["never"] == TASKS // (K + 1)
    assert whole[2]["mean_reward"]["ci95"][1] < 0
    assert len(list(out.glob("compare_*_3.png"))) == 3
    assert all(f"candidate {n}" in res.output for n in (1, 2, 3))


def test_different_repeats_compare_and_say_so(two_runs, tmp_path: Path) -> None:
    base, _ = two_runs
    more = make_run(tmp_path / "more", lambda t: 2 * solved_base(t), repeats=2 * K)
    c = comparison.compare(base, [more]).summary["candidates"][0]
    assert any("different repeats per task" in n for n in c["notes"])
    whole = c["groups"][0]
    assert whole["mean_reward"]["delta"] == pytest.approx(0.0) and whole["pass_at_k"]["k"] == K


ADAPTIVE_TASKS, ADAPTIVE_K, ADAPTIVE_SHARDS = 12, 8, 8


def adaptive_reward(task: int, r: int) -> float:
    """never, always, or solved by every 2nd or 3rd rollout (stopped early once it has shown a pass and a failure)."""
    kind = task % 4
    return 0.0 if kind == 0 else 1.0 if kind == 1 else (1.0 if r % kind == 0 else 0.0)


def test_an_adaptive_run_against_a_full_one(tmp_path: Path) -> None:
    """Tasks stopped early have a known bucket (sometimes: they showed a pass and a failure) but no full mean: they
    enter the flips, not the mean differences, and the summary says how many."""
    from reportkit import collect_shard

    inp = write_input(tmp_path / "input.jsonl", [input_row(i) for i in range(ADAPTIVE_TASKS)])

    def plan(name: str, sampling: dict | None) -> Path:
        data = {"input_jsonl": str(inp), "run_dir": str(tmp_path / name), "num_repeats": ADAPTIVE_K}
        data["sharding"] = {"num_shards": ADAPTIVE_SHARDS}
        if sampling:
            data["sampling"] = sampling
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(data))
        cfg = config.load(tmp_path / f"{name}.yaml")
        store.write_plan(cfg)
        return cfg.run_dir

    def collect(run_dir: Path, index: int, skip=frozenset()) -> None:
        collect_shard(run_dir, index, adaptive_reward, skip)

    full = plan("full", None)
    adaptive = plan("adaptive", {"stop_when_decided": {"drop_solved": True, "drop_unsolved": True}, "wave": 2})
    for i in range(ADAPTIVE_SHARDS):
        collect(full, i)
        found = decided.decide_shard(adaptive, store.load_plan(adaptive), i, max_attempts=3)
        collect(adaptive, i, found.skip)
    merge_run(full)
    merge_run(adaptive)

    out = tmp_path / "out"
    res = run_cli("compare", full, adaptive, "-o", out)
    assert res.exit_code == 0, res.output
    rows = {r["task_index_base"]: r for r in read_rows(out)}
    stopped = {t for t, r in rows.items() if r["stopped_early_cand"]}
    assert stopped == {t for t in range(ADAPTIVE_TASKS) if t % 4 in (2, 3)}  # the sometimes-solved tasks
    for t, r in rows.items():
        assert r["bucket_base"] == r["bucket_cand"] == ["never", "always", "sometimes", "sometimes"][t % 4]
        if t in stopped:
            assert r["mean_cand"] is None and r["delta"] is None and r["rollouts_cand"] < ADAPTIVE_K
        else:
            assert r["delta"] == 0 and r["rollouts_cand"] == ADAPTIVE_K
    whole = json.loads((out / comparison.SUMMARY_FILE).read_text())["candidates"][0]
    g = whole["groups"][0]
    assert g["tasks_paired"] == ADAPTIVE_TASKS and g["left_out_stopped_early"] == len(stopped)
    assert g["tasks_in_means"] == ADAPTIVE_TASKS - len(stopped) == g["mean_reward"]["tasks"]
    assert g["flips"]["sometimes"]["sometimes"] == len(stopped) and g["bucket_unknown"] == 0
    assert any(f"{len(stopped)} paired task(s) stopped early" in n for n in whole["notes"])
    assert "stopped early" in res.output


def with_labels(run_dir: Path, blocks: tuple[tuple[str, range], ...]) -> None:
    """The run's plan.json with a blend of these (label, task range) entries, its fingerprint made again."""
    plan = store.load_plan(run_dir)
    entries = tuple(
        planner.BlendEntry(
            label=label,
            agent=AGENTS[0],
            data=f"{label}.jsonl",
            sha256="0" * 64,
            rows_in_file=len(tasks),
            num_tasks=len(tasks),
            num_rollouts=len(tasks) * K,
            repeats=K,
            tasks=((tasks.start, tasks.stop),),
        )
        for label, tasks in blocks
    )
    plan = dataclasses.replace(plan, blend=entries)
    plan = dataclasses.replace(plan, fingerprint=planner.fingerprint(plan))
    store.plan_path(run_dir).write_bytes(orjson.dumps(plan.to_json()))
    assert store.load_plan(run_dir) == plan


def stray_label_folder(run_dir: Path, name: str, tasks: range) -> None:
    """A folder under merged/by_label/ that looks like a label's profile (not one of the plan's labels)."""
    d = store.by_label_dir(run_dir, name)
    d.mkdir(parents=True)
    (d / "rollouts_reward_profiling.jsonl").write_bytes(
        b"".join(orjson.dumps({"_ng_task_index": t}) + b"\n" for t in tasks)
    )


def test_runs_with_labels_compare_per_label(tmp_path: Path) -> None:
    """A blend's plan gives each task its label (its entries' task ranges): a column of the task rows and a group
    of the summary."""
    base = make_run(tmp_path / "base", solved_base)
    cand = make_run(tmp_path / "cand", solved_cand)
    half = TASKS // 2
    for run_dir in (base, cand):
        with_labels(run_dir, (("easy", range(0, half)), ("hard", range(half, TASKS))))
    result = comparison.compare(base, [cand])
    rows = result.task_rows()
    assert [r["label"] for r in rows] == ["easy" if t < half else "hard" for t in range(TASKS)]
    labels = {g["group"]: g for g in result.summary["candidates"][0]["groups"] if g["kind"] == "label"}
    assert set(labels) == {"easy", "hard"}
    easy = range(half)
    want = sum(solved_cand(t) - solved_base(t) for t in easy) / K / len(easy)
    assert labels["easy"]["tasks_paired"] == len(easy) and labels["easy"]["mean_reward"]["delta"] == pytest.approx(want)


def test_a_folder_under_by_label_is_not_taken_for_a_label(tmp_path: Path) -> None:
    """Labels come from the plan, never from folder names: a stray folder under merged/by_label/ (a label's
    profile left from another run, a copy) gives no task a label, in a blend or in a run without one."""
    base = make_run(tmp_path / "base", solved_base)
    cand = make_run(tmp_path / "cand", solved_cand)
    for run_dir in (base, cand):
        stray_label_folder(run_dir, "old_label", range(TASKS))
    plain = comparison.compare(base, [cand])
    assert all("label" not in r for r in plain.task_rows())
    assert not [g for g in plain.summary["candidates"][0]["groups"] if g["kind"] == "label"]
    for run_dir in (base, cand):
        with_labels(run_dir, (("all", range(TASKS)),))
    blended = comparison.compare(base, [cand])
    assert {r["label"] for r in blended.task_rows()} == {"all"}
    groups = [g["group"] for g in blended.summary["candidates"][0]["groups"] if g["kind"] == "label"]
    assert groups == ["all"]


def test_failed_rollouts_are_compared_on_the_rollouts_there_are_and_said(two_runs, tmp_path: Path) -> None:
    base, _ = two_runs
    (tmp_path / "cand").mkdir()
    cand, _ = planned_run(tmp_path / "cand", [input_row(i, AGENTS[i % 2]) for i in range(TASKS)], K, 3)
    seal_shards(cand, lambda t, r: 1.0 if r < solved_cand(t) else 0.0, failed={(4, 0), (4, 1)})
    merge_run(cand)
    result = comparison.compare(base, [cand])
    row = next(r for r in result.task_rows() if r["task_index_base"] == 4)
    rest = [1.0 if r < solved_cand(4) else 0.0 for r in (2, 3)]
    assert (row["rollouts_cand"], row["planned_rollouts_cand"]) == (2, K) and not row["stopped_early_cand"]
    assert row["mean_cand"] == sum(rest) / 2 and row["delta"] == pytest.approx(sum(rest) / 2 - solved_base(4) / K)
    assert any(
        "1 paired task(s) have fewer rollouts than planned" in n for n in result.summary["candidates"][0]["notes"]
    )


def test_runs_of_different_gym_versions_compare_and_say_so(two_runs, tmp_path: Path) -> None:
    import shutil

    base, cand = two_runs
    older = tmp_path / "older"
    shutil.copytree(cand, older)
    # the run as Gym 0.4.0 would have planned it: the release is part of the plan and of its fingerprint
    import dataclasses

    from shardrun.plan import planner

    plan = dataclasses.replace(store.load_plan(older), gym_version="0.4.0")
    plan = dataclasses.replace(plan, fingerprint=planner.fingerprint(plan))
    store.plan_path(older).write_text(json.dumps(plan.to_json()))
    c = comparison.compare(base, [older]).summary["candidates"][0]
    assert c["gym_version"] == {"base": store.load_plan(base).gym_version, "cand": "0.4.0"}
    assert any(n.startswith("different NeMo Gym versions") and "0.4.0" in n for n in c["notes"])
    assert c["groups"][0]["mean_reward"]["tasks"] == TASKS  # compared all the same


def test_the_default_key_ignores_what_the_planner_writes_into_a_row() -> None:
    """The seed in metadata.extra_body and the run's responses_create_params overrides are not the task's identity;
    the prompt and the rest of the request are."""
    original = {"responses_create_params": {"input": [{"role": "user", "content": "2+2?"}], "temperature": 1.0}}
    planned = {
        "responses_create_params": {
            "input": [{"role": "user", "content": "2+2?"}],
            "temperature": 0.2,
            "metadata": {"extra_body": '{"seed": 7}'},
        },
        "_ng_task_index": 3,
    }
    key = lambda row, strip=(): comparison.key_value(row, None, "row", strip)  # noqa: E731
    assert key(original, {"temperature"}) == key(planned, {"temperature"})
    assert key(original) != key(planned)  # without the override known, the temperature differs
    other = {"responses_create_params": {"input": [{"role": "user", "content": "2+3?"}], "temperature": 1.0}}
    assert key(other, {"temperature"}) != key(original, {"temperature"})
    kept = {"responses_create_params": {"input": [], "metadata": {"extra_body": '{"seed": 1, "top_k": 5}'}}}
    assert comparison.task_params(kept["responses_create_params"]) == {
        "input": [],
        "metadata": {"extra_body": {"top_k": 5}},
    }


def test_refusals_are_domain_errors(two_runs, tmp_path: Path) -> None:
    base, cand = two_runs
    inside = run_cli("compare", base, cand, "-o", base / "merged" / "cmp")
    assert inside.exit_code == 2 and "Traceback" not in inside.output
    assert not (base / "merged" / "cmp").exists()
    unmerged, _ = planned_run(tmp_path, [input_row(i) for i in range(3)])
    res = run_cli("compare", base, unmerged, "-o", tmp_path / "out")
    assert res.exit_code == 2 and "merge-and-profile" in res.output
    res = run_cli("compare", base, cand, "-o", tmp_path / "out", "--resamples", "0")
    assert res.exit_code == 2 and "--resamples" in res.output
