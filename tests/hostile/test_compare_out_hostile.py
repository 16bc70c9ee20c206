"""Hostile round 3, `compare` (issue 34): a task whose mean reward is 1e308 (the merge accepts it) is compared
without an overflow; every output of one compare is written to a folder of its own and moved into -o together, so
two compares into one -o never mix their files, a failed one leaves -o as it was, and a reused -o keeps no figure of
an earlier compare; `-o ""` is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hostilekit import invoke_bounded, refused
from reportkit import input_row, merge_run, planned_run, seal_shards

from shardrun.analysis import comparison

TASKS = 6


def make_run(tmp: Path, reward) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir, _ = planned_run(tmp, [input_row(i, "a") for i in range(TASKS)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    base = make_run(tmp / "base", lambda t, r: float(r < t % 3))
    cand = make_run(tmp / "cand", lambda t, r: float(r <= t % 3))
    huge = make_run(tmp / "huge", lambda t, r: (1e308 if t == 0 else -1e308 if t == 1 else 1.0) if r == 0 else 0.0)
    return base, cand, huge


def outputs(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()}


@pytest.mark.parametrize("order", ["huge as candidate", "huge as base"])
def test_a_huge_mean_reward_is_compared_without_an_overflow(runs, tmp_path, order):
    base, _, huge = runs
    a, b = (base, huge) if order == "huge as candidate" else (huge, base)
    out = tmp_path / "out"
    res = invoke_bounded("compare", a, b, "-o", out, "--resamples", "50")
    assert "Traceback" not in res.output and not isinstance(res.exception, (OverflowError, ValueError)), res.output
    assert res.exit_code == 2 and ("task 0" in res.output or "task 1" in res.output), res.output
    assert not out.exists()  # refused before anything is written
    assert "mean reward of 5e+307" in res.output and str(huge) in res.output


def test_an_empty_output_folder_is_refused(runs, tmp_path, monkeypatch):
    base, cand, _ = runs
    monkeypatch.chdir(tmp_path)
    refused(invoke_bounded("compare", base, cand, "-o", ""), "-o")
    assert not list(tmp_path.iterdir())


def test_a_reused_folder_keeps_no_figure_of_an_earlier_compare(runs, tmp_path):
    base, cand, huge = runs
    out = tmp_path / "out"
    assert invoke_bounded("compare", base, cand, huge, "-o", out, "--resamples", "50").exit_code in (0, 2)
    assert invoke_bounded("compare", base, cand, "-o", out, "--resamples", "50").exit_code == 0
    assert not [n for n in outputs(out) if n.endswith("_2.png")], outputs(out)
    (out / "mine.txt").write_text("a user's own file")
    assert invoke_bounded("compare", base, cand, "-o", out, "--resamples", "50").exit_code == 0
    assert (out / "mine.txt").read_text() == "a user's own file"


COMPARE = "import sys; from shardrun.cli import main; sys.argv[0] = 'shardrun'; main()"


def test_two_compares_into_one_folder_do_not_mix(runs, tmp_path):
    """Both write; what -o holds at the end is one compare's files, all of them (its base and candidate in each)."""
    base, cand, _ = runs
    out = tmp_path / "out"
    args = ["compare", "-o", str(out), "--resamples", "2000"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPARE, *args, str(a), str(b)],
            stdout=subprocess.PIPE,
            text=True,
            stderr=subprocess.STDOUT,
        )
        for a, b in ((base, cand), (cand, base))
    ]
    results = [(p.wait(120), p.stdout.read()) for p in procs]
    assert all("Traceback" not in text for _, text in results), results
    assert any(code == 0 for code, _ in results), results
    summary = json.loads((out / comparison.SUMMARY_FILE).read_text())
    rows = [json.loads(x) for x in (out / comparison.TASKS_FILE).read_text().splitlines()]
    html = (out / comparison.HTML_FILE).read_text()
    first = str(base) in str(summary["base"])
    assert first == (str(base) in html.split(str(cand))[0] if str(cand) in html else True)
    deltas = {r["delta"] for r in rows if r.get("delta") is not None}
    assert any(deltas) and all((d >= 0) if first else (d <= 0) for d in deltas), (first, sorted(deltas))
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
