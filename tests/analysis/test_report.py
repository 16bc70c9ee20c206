"""`shardrun report`: every figure is a valid, non-blank PNG referenced by a self-contained HTML page, and the
headline numbers are the ones the rollouts imply."""

from __future__ import annotations

import base64
import itertools
import math
import os
import re

import orjson

import pytest

from shardrun.rundir.records import LaunchRecord, Seal
from PIL import Image
from typer.testing import CliRunner

from reportkit import input_row, merge_run, planned_run, seal_shards, tokens_of
from shardrun.rundir import cost
from shardrun.analysis import report
from shardrun.rundir import store
from shardrun.profile import taskstats
from shardrun.cli import app

REPEATS = 4


def reward(t: int, r: int) -> float:
    return 1.0 if r < t % 5 else 0.0


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a" if i < 6 else "agent_b") for i in range(10)]
    run_dir, cfg = planned_run(tmp_path, rows, num_repeats=REPEATS, num_shards=4)
    seal_shards(run_dir, reward, attempts={1: 2, 3: 3}, failed={(3, 1), (8, 0)})
    merge_run(run_dir)
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


FAILED = {(3, 1), (8, 0)}


def brute_pass_at_k(scores: list[float], k: int) -> float:
    subsets = list(itertools.combinations(scores, k))
    return sum(any(x) for x in subsets) / len(subsets)


def test_headline_numbers_match_the_rollouts(run):
    page = report.build_report(run).html.read_text()
    agg = {
        a["agent_ref"]["name"]: a["agent_metrics"]
        for a in orjson.loads(store.merged_aggregate_metrics_path(run).read_bytes())
    }
    for agent, tasks in (("agent_a", range(6)), ("agent_b", range(6, 10))):
        rewards = [[reward(t, r) for r in range(REPEATS) if (t, r) not in FAILED] for t in tasks]
        n = sum(map(len, rewards))
        mean = sum(map(sum, rewards)) / n
        p1 = 100 * sum(sum(rs) / len(rs) for rs in rewards) / len(rewards)
        full = [rs for rs in rewards if len(rs) == REPEATS]  # pass@4 only over tasks with 4 finished rollouts
        pk = 100 * sum(brute_pass_at_k(rs, REPEATS) for rs in full) / len(full)
        assert (
            f"<td>{agent}</td><td>{len(rewards)}</td><td>{n} / {len(rewards) * REPEATS}</td><td>{mean:.3f}</td>"
            f"<td>{p1:.1f}%</td><td>{pk:.1f}% (k=4)</td>" in page
        )
        assert agg[agent]["pass@1/accuracy"] == pytest.approx(p1)  # the merge's aggregate metrics agree
        assert agg[agent]["pass@4/accuracy"] == pytest.approx(pk)
    assert "10 profiled of 10 planned" in page and "38 completed of 40 planned" in page
    assert "2 rows in the failures file; 2 planned rollouts without a result" in page and "4 sealed of 4" in page
    gpu_hours = sum(2 * (1800 + 60 * i) / 3600 for i in range(4))
    assert f"<td>GPU-hours (markers)</td><td>{gpu_hours:,.2f}</td>" in page
    assert "<td>agent_a</td><td>pass@4/accuracy</td>" in page  # Gym's key metrics, from the aggregate file


def done_rewards(t: int) -> list[float]:
    return [reward(t, r) for r in range(REPEATS) if (t, r) not in FAILED]


def test_figure_data_is_what_the_profile_says(run):
    tasks = taskstats.load_profile(run)
    fd = report.figure_data(tasks)
    assert sorted(fd["means"]["agent_a"]) == sorted(sum(done_rewards(t)) / len(done_rewards(t)) for t in range(6))
    assert fd["token_field"] == "output_tokens"
    tok = dict(zip(range(6, 10), fd["tokens"]["agent_b"]))
    assert tok[6][0] == pytest.approx(sum(tokens_of(6, r) for r in range(4)) / 4)
    assert tok[8][0] == pytest.approx(sum(tokens_of(8, r) for r in range(1, 4)) / 3)  # rollout 0 failed
    # pass@4 over the agent_a tasks with 4 finished rollouts (task 3 has 3): tasks 0 and 5 are never solved
    assert fd["curves"]["agent_a"][4] == pytest.approx(100.0 * 3 / 5)
    assert fd["curves"]["agent_b"][4] == pytest.approx(100.0)
    p1 = [sum(done_rewards(t)) / len(done_rewards(t)) for t in range(6)]
    assert fd["curves"]["agent_a"][1] == pytest.approx(100.0 * sum(p1) / 6)
    assert all(not math.isnan(s) for _, s in fd["mean_std"]["agent_a"])


def test_embedded_report_inlines_the_same_pngs(run):
    result = report.build_report(run, embed=True)
    uris = re.findall(r"src='data:image/png;base64,([^']+)'", result.html.read_text())
    assert [base64.b64decode(u) for u in uris] == [p.read_bytes() for p in result.figures]


def test_partial_run_without_tokens_still_renders_every_figure(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, lambda t, r: 0.25 * t, unsealed={1})
    merge_run(run_dir, allow_partial=True)
    rows = list(store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir)))
    # drop every token field, as a server that reports no usage would
    stripped = [{k: v for k, v in r.items() if "tokens" not in k} for r in rows]
    store.merged_reward_profiling_path(run_dir).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in stripped))
    result = report.build_report(run_dir)
    for p in result.figures:
        assert_png(p)
    page = result.html.read_text()
    assert "1 shard(s) are not sealed" in page and "1 sealed of 2" in page


def test_slurm_run_adds_sacct_gpu_hours(tmp_path, monkeypatch):
    run_dir, _ = planned_run(
        tmp_path,
        [input_row(i) for i in range(4)],
        num_repeats=2,
        num_shards=2,
        cluster={"executor": "slurm", "gpus_per_node": 2},
    )
    seal_shards(run_dir, reward, job_prefix="500")
    merge_run(run_dir)
    fake = tmp_path / "bin" / "sacct"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho '500_0|COMPLETED|0:0|x|y|7200|cpu=8,gres/gpu=2,node=1'\n"
        "echo '500_1|COMPLETED|0:0|x|y|3600|cpu=8,gres/gpu=2,node=1'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    assert "<td>GPU-hours (sacct)</td><td>6.00</td>" in report.build_report(run_dir).html.read_text()
    assert "GPU-hours (sacct)" not in report.build_report(run_dir, use_sacct=False).html.read_text()
    # with launch records, only the jobs launched on Slurm go to sacct
    store.append_launch(run_dir, {"executor": "slurm", "jobs": {"0": "500_0"}})
    assert "<td>GPU-hours (sacct)</td><td>4.00</td>" in report.build_report(run_dir).html.read_text()
    store.append_launch(run_dir, {"executor": "local", "jobs": {"1": "500_1"}})
    plan = store.load_plan(run_dir)
    base = {"plan_fingerprint": "f", "rollouts_sha256": "0", "rollouts_bytes": 0, "num_rollouts": 0, "num_failed": 0}
    shards = cost.shard_costs([Seal.model_validate(base | {"shard_index": i, "job_id": f"500_{i}"}) for i in (1, 0)])
    assert report.slurm_job_ids([LaunchRecord(executor="local", jobs={"0": "500_0"})], plan, shards) == []
    assert report.slurm_job_ids([], plan, shards) == ["500_0", "500_1"]  # no records: the plan says Slurm


def test_without_matplotlib_the_error_says_how_to_install_it(run, monkeypatch):
    import sys

    import shardrun.analysis

    monkeypatch.setitem(sys.modules, "shardrun.analysis.figures", None)  # as if matplotlib were not installed
    monkeypatch.delattr(shardrun.analysis, "figures", raising=False)
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
def test_profile_and_pass_at_k_equal_gyms(tmp_path, gym_venv_each):
    """Gym's own RewardProfiler and pass@k on the same rollouts (each supported Gym version) give the statistics the
    report and select read."""
    gym_venv = gym_venv_each
    import subprocess
    from pathlib import Path

    rows = [input_row(i, "agent_a" if i % 3 else "agent_b") for i in range(12)]
    run_dir, _ = planned_run(tmp_path, rows, num_repeats=5, num_shards=3)
    failed = {(1, 4), (2, 0), (7, 3)}  # Gym profiles each task's finished rollouts
    seal_shards(run_dir, lambda t, r: [1.0, 0.0, 0.5][(t + r) % 3] if t % 4 == 0 else reward(t, r), failed=failed)
    merge_run(run_dir)
    plan = store.load_plan(run_dir)
    mat = [r for s in plan.shards for r in store.iter_jsonl_objects(store.materialized_path(run_dir, s.index))]
    mat_done = [r for r in mat if (r["_ng_task_index"], r["_ng_rollout_index"]) not in failed]
    (tmp_path / "gym").mkdir()
    (tmp_path / "m.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in mat_done))
    script = Path(__file__).parent.parent / "gym_scripts" / "profile_and_pass_at_k.py"
    subprocess.run(
        [
            str(gym_venv / "bin" / "python"),
            str(script),
            str(tmp_path / "m.jsonl"),
            str(store.merged_dir(run_dir) / "rollouts.jsonl"),
            str(tmp_path / "gym"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )

    gym_tasks = taskstats.task_stats(store.iter_jsonl_objects(tmp_path / "gym" / "rollouts_reward_profiling.jsonl"))
    ours = taskstats.load_profile(run_dir)
    assert [t.task_index for t in ours] == [t.task_index for t in gym_tasks]
    for g, o in zip(gym_tasks, ours):
        assert (o.agent, o.num_rollouts, o.rewards) == (g.agent, g.num_rollouts, g.rewards)
        assert dict(o.stats) == pytest.approx(dict(g.stats))
    gym_pass = orjson.loads((tmp_path / "gym" / "pass_at_k.json").read_bytes())
    for agent, tasks in taskstats.by_agent(ours).items():
        for k in range(1, 6):
            assert taskstats.pass_at_k(tasks, k) == pytest.approx(gym_pass[agent].get(f"pass@{k}/accuracy")), (agent, k)
