"""`select` in the vocabulary of training data (#14): NVIDIA's per-prompt fields (`pass_rate`, `pass_rate_total`,
`pass_rate_passed`) and rows ordered by difficulty."""

from __future__ import annotations

import orjson
import pytest
from typer.testing import CliRunner

from shardrun.analysis import selection
from shardrun.analysis.selection import Rules
from shardrun.cli import app
from shardrun.core.errors import BadInput
from tests.analysis.test_select import reward, run, ts  # noqa: F401  (run is the fixture: a merged run of 10 tasks)


def test_nvidia_fields_count_passed_rollouts_at_the_threshold() -> None:
    assert selection.nvidia_fields(ts(0, [1.0, 0.0, 1.0, 0.0])) == {
        "pass_rate": 0.5,
        "pass_rate_total": 4,
        "pass_rate_passed": 2,
    }
    assert selection.nvidia_fields(ts(1, [0.4, 0.6, 0.9]), solved_threshold=0.5)["pass_rate_passed"] == 2
    assert selection.nvidia_fields(ts(2, [0.0]))["pass_rate"] == 0.0


def test_select_writes_nvidia_fields_and_keeps_every_input_byte(run, tmp_path):  # noqa: F811
    run_dir, cfg, profile, by_index = run
    out = tmp_path / "blend.jsonl"
    res = selection.select_run(run_dir, out, Rules(), stats_format="nvidia")
    lines = out.read_bytes().splitlines(keepends=True)
    assert res.rows_written == len(lines) == 10
    for line in lines:
        row = orjson.loads(line)
        i = next(k for k, v in by_index.items() if line.startswith(v.rstrip(b"}\n")))
        passed = sum(reward(i, r) == 1.0 for r in range(4))
        assert (row["pass_rate"], row["pass_rate_total"], row["pass_rate_passed"]) == (passed / 4, 4, passed)
        assert "shardrun_stats" not in row and line.startswith(by_index[i].rstrip(b"}\n"))


def test_select_orders_rows_hardest_first(run, tmp_path):  # noqa: F811
    run_dir, cfg, profile, by_index = run
    out = tmp_path / "hard-first.jsonl"
    selection.select_run(run_dir, out, Rules(), stats_key="s", order="difficulty")
    got = [orjson.loads(line)["s"] for line in out.read_bytes().splitlines()]
    keys = [(g["mean/reward"], -g["std/reward"], g["task_index"]) for g in got]
    assert keys == sorted(keys) and len(got) == 10
    assert got[0]["mean/reward"] == 0.0 and got[-1]["mean/reward"] == 1.0


def test_select_refuses_rows_that_already_have_the_fields_and_unknown_choices(run, tmp_path):  # noqa: F811
    run_dir, _, _, _ = run
    with pytest.raises(BadInput, match="--stats-format 'hf'"):
        selection.select_run(run_dir, tmp_path / "x.jsonl", Rules(), stats_format="hf")
    with pytest.raises(BadInput, match="--order 'random'"):
        selection.select_run(run_dir, tmp_path / "x.jsonl", Rules(), order="random")
    rows = selection.subset_lines([b'{"a": 1, "pass_rate": 0.3}\n'], {0: ts(0, [1.0])}, None, "in.jsonl", 1.0)
    with pytest.raises(BadInput, match="in.jsonl:1: the row already has pass_rate"):
        list(rows)


def test_cli_select_nvidia_fields_by_difficulty(run, tmp_path):  # noqa: F811
    run_dir, _, _, _ = run
    out = tmp_path / "c.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "select",
            str(run_dir),
            "-o",
            str(out),
            "--stats-format",
            "nvidia",
            "--order",
            "difficulty",
            "--top-k-hardest",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    rates = [orjson.loads(line)["pass_rate"] for line in out.read_bytes().splitlines()]
    assert len(rates) == 3 and rates == sorted(rates)
