"""`shardrun report`: every figure is a valid, non-blank PNG referenced by a self-contained HTML page, and the
headline numbers are the ones the rollouts imply."""

from __future__ import annotations

import base64
import io
import math
import os
import re

import pytest
from PIL import Image
from typer.testing import CliRunner

from reportkit import input_row, planned_run, seal_shards, tokens_of, write_merged
from shardrun import report, store, taskstats
from shardrun.cli import app

REPEATS = 4


def reward(t: int, r: int) -> float:
    return 1.0 if r < t % 5 else 0.0


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a" if i < 6 else "agent_b") for i in range(10)]
    run_dir, cfg = planned_run(tmp_path, rows, num_repeats=REPEATS, num_shards=4)
    seal_shards(run_dir, reward, attempts={1: 2, 3: 3})
    write_merged(run_dir, failures=2)
    return run_dir


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 0, path
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 100 and img.height > 100
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 2, f"{path} is blank"


def test_report_writes_every_figure_and_a_self_contained_page(run):
    result = report.build_report(run)
    assert result.html == store.report_path(run)
    assert [p.name for p in result.figures] == [store.report_figure_path(run, n).name for n, _ in report.FIGURES]
    page = result.html.read_text()
    for p in result.figures:
        assert p.parent == result.html.parent
        assert_png(p)
        assert f"src='{p.name}'" in page
    assert not re.search(r"(https?:)?//|<script|<link|@import", page), "the page must open offline"
    assert set(re.findall(r"src='([^']+)'", page)) == {p.name for p in result.figures}
    umask = os.umask(0)
    os.umask(umask)
    assert {(p.stat().st_mode & 0o777) for p in (result.html, *result.figures)} == {0o666 & ~umask}


def test_headline_numbers_match_the_rollouts(run):
    page = report.build_report(run).html.read_text()
    for agent, tasks in (("agent_a", range(6)), ("agent_b", range(6, 10))):
        rewards = [[reward(t, r) for r in range(REPEATS)] for t in tasks]
        mean = sum(map(sum, rewards)) / (len(rewards) * REPEATS)
        p1 = 100 * mean
        pk = 100 * sum(any(rs) for rs in rewards) / len(rewards)
        assert f"<td>{agent}</td><td>{len(rewards)}</td><td>{len(rewards) * REPEATS} / " \
               f"{len(rewards) * REPEATS}</td><td>{mean:.3f}</td><td>{p1:.1f}%</td><td>{pk:.1f}% (k=4)</td>" in page
    assert "10 profiled of 10 planned" in page and "40 completed of 40 planned" in page
    assert "2 rows in the failures file" in page and "4 sealed of 4" in page
    gpu_hours = sum(2 * (1800 + 60 * i) / 3600 for i in range(4))
    assert f"<td>GPU-hours (markers)</td><td>{gpu_hours:,.2f}</td>" in page
    assert "<td>mean/reward</td>" in page  # Gym's key metrics, from the aggregate-metrics file


def test_figure_data_is_what_the_profile_says(run):
    tasks = taskstats.load_profile(run)
    fd = report.figure_data(tasks)
    assert sorted(fd["means"]["agent_a"]) == sorted(sum(reward(t, r) for r in range(4)) / 4 for t in range(6))
    assert fd["token_field"] == "output_tokens"
    tok = dict((t, m) for t, m in zip(range(6, 10), fd["tokens"]["agent_b"]))
    assert tok[6][0] == pytest.approx(sum(tokens_of(6, r) for r in range(4)) / 4)
    assert fd["curves"]["agent_a"][4] == pytest.approx(100.0 * 4 / 6)  # tasks 0 and 5 are never solved
    assert fd["curves"]["agent_b"][4] == pytest.approx(100.0)
    assert fd["curves"]["agent_a"][1] == pytest.approx(100.0 * sum(t % 5 for t in range(6)) / 24)
    assert all(not math.isnan(s) for _, s in fd["mean_std"]["agent_a"])


def test_embedded_report_inlines_the_same_pngs(run):
    result = report.build_report(run, embed=True)
    uris = re.findall(r"src='data:image/png;base64,([^']+)'", result.html.read_text())
    assert [base64.b64decode(u) for u in uris] == [p.read_bytes() for p in result.figures]


def test_partial_run_without_tokens_still_renders_every_figure(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, lambda t, r: 0.25 * t, unsealed={1})
    rows = write_merged(run_dir)
    import orjson  # drop every token field, as a server that reports no usage would

    stripped = [{k: v for k, v in r.items() if "tokens" not in k} for r in rows]
    store.merged_reward_profiling_path(run_dir).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in stripped))
    result = report.build_report(run_dir)
    for p in result.figures:
        assert_png(p)
    page = result.html.read_text()
    assert "1 shard(s) are not sealed" in page and "1 sealed of 2" in page


def test_slurm_run_adds_sacct_gpu_hours(tmp_path, monkeypatch):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2,
                             cluster={"executor": "slurm", "gpus_per_node": 2})
    seal_shards(run_dir, reward, job_prefix="500")
    write_merged(run_dir)
    fake = tmp_path / "bin" / "sacct"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '500_0|7200|cpu=8,gres/gpu=2,node=1|COMPLETED'\n"
                    "echo '500_1|3600|cpu=8,gres/gpu=2,node=1|COMPLETED'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert "<td>GPU-hours (sacct)</td><td>6.00</td>" in report.build_report(run_dir).html.read_text()
    assert "GPU-hours (sacct)" not in report.build_report(run_dir, use_sacct=False).html.read_text()


def test_without_matplotlib_the_error_says_how_to_install_it(run, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "shardrun.figures", None)  # as if matplotlib were not installed
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 1 and "pip install 'shardrun[report]'" in res.output


def test_cli_report(run, tmp_path):
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert str(store.report_path(run)) in res.output and "agent agent_b" in res.output
    store.merged_reward_profiling_path(run).unlink()
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 2 and "merge-and-profile" in res.output


# ---------------------------------------------------------------- against NeMo Gym itself

@pytest.mark.gym
def test_profile_shapes_and_pass_at_k_equal_gyms(tmp_path, gym_venv):
    """Gym's RewardProfiler on the same rollouts writes the profile our helpers write, and Gym's pass@k equals ours."""
    import subprocess
    from pathlib import Path

    import orjson

    from reportkit import profile_rows

    rows = [input_row(i, "agent_a" if i % 3 else "agent_b") for i in range(12)]
    run_dir, _ = planned_run(tmp_path, rows, num_repeats=5, num_shards=3)
    skip = {(1, 4), (2, 0), (7, 3)}  # a partial run: Gym profiles the tasks' finished rollouts
    seal_shards(run_dir, lambda t, r: [1.0, 0.0, 0.5][(t + r) % 3] if t % 4 == 0 else reward(t, r), skip=skip)
    plan = store.load_plan(run_dir)
    mat = [r for s in plan.shards for r in store.iter_jsonl_objects(store.materialized_path(run_dir, s.index))]
    res = [r for s in plan.shards for r in store.iter_jsonl_objects(store.rollouts_path(run_dir, s.index))]
    done = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in res}
    mat_done = [r for r in mat if (r["_ng_task_index"], r["_ng_rollout_index"]) in done]
    (tmp_path / "m.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in mat_done))
    (tmp_path / "r.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in res))
    script = Path(__file__).parent / "gym_scripts" / "profile_and_pass_at_k.py"
    subprocess.run([str(gym_venv / "bin" / "python"), str(script), str(tmp_path / "m.jsonl"),
                    str(tmp_path / "r.jsonl"), str(tmp_path)], check=True, capture_output=True, timeout=300)

    gym_rows = list(store.iter_jsonl_objects(tmp_path / "rollouts_reward_profiling.jsonl"))
    ours = profile_rows(mat_done, res)
    assert [r["_ng_task_index"] for r in gym_rows] == [r["_ng_task_index"] for r in ours]
    for g, o in zip(gym_rows, ours):
        assert set(g) == set(o), set(g) ^ set(o)
        for k, v in g.items():
            assert o[k] == (pytest.approx(v) if isinstance(v, float) else v), k

    gym_tasks = taskstats.task_stats(gym_rows)
    gym_pass = orjson.loads((tmp_path / "pass_at_k.json").read_bytes())
    for agent, tasks in taskstats.by_agent(gym_tasks).items():
        for k in range(1, 6):
            key = f"pass@{k}/accuracy"
            assert taskstats.pass_at_k(tasks, k) == pytest.approx(gym_pass[agent].get(key)), (agent, k)
