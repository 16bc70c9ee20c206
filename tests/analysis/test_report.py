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

from shardrun.rundir.records import LocalJobsLaunch, Seal
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
        never = sum(not any(rs) for rs in rewards)
        always = sum(all(rs) for rs in rewards)
        buckets = [(c, round(100 * c / len(rewards))) for c in (never, len(rewards) - never - always, always)]
        row = re.search(
            f"<td>{agent}</td><td>{len(rewards)}</td><td>{n} / {len(rewards) * REPEATS}</td><td>{mean:.3f}</td>"
            rf"<td>{p1:.1f}%\xa0\[([\d.]+)–([\d.]+)\]</td><td>{pk:.1f}%\xa0\[([\d.]+)–([\d.]+)\]</td>"
            + "".join(f"<td>{c}\xa0\\({share}%\\)</td>" for c, share in buckets),
            page,
        )
        assert row, agent
        low1, high1, lowk, highk = map(float, row.groups())
        assert low1 <= round(p1, 1) <= high1 and lowk <= round(pk, 1) <= highk
        assert agg[agent]["pass@1/accuracy"] == pytest.approx(p1)  # the merge's aggregate metrics agree
        assert agg[agent]["pass@4/accuracy"] == pytest.approx(pk)
    assert "10 profiled of 10 planned" in page and "38 completed of 40 planned" in page
    assert "2 rows in the failures file; 2 planned rollouts without a result" in page and "4 sealed of 4" in page
    gpu_hours = sum(2 * (1800 + 60 * i) / 3600 for i in range(4))
    assert f"<td>GPU-hours (markers)</td><td>{gpu_hours:,.2f}</td>" in page
    # Gym's key metrics, from the aggregate file, pivoted: one row per agent, one column per metric
    header, rows = report.key_metrics_table(report.read_key_metrics(store.merged_aggregate_metrics_path(run)))
    assert [r[0] for r in rows] == ["agent_a", "agent_b"] and "pass@4/accuracy" in header
    column = header.index("pass@4/accuracy")
    assert [r[column] for r in rows] == [f"{agg[a]['pass@4/accuracy']:.4g}" for a in ("agent_a", "agent_b")]
    assert "<th>pass@4 [95% CI]</th>" in page  # both agents have k = 4: said once, in the header
    assert "<th colspan='1'>pass@4</th>" in page and "<th>accuracy</th>" in page
    per_table = report.METRICS_PER_TABLE  # more metrics than that go on in a second table
    assert len(header) - 1 > per_table
    assert "<tr>" + "".join(f"<td>{c}</td>" for c in rows[0][: 1 + per_table]) + "</tr>" in page
    assert "<tr>" + "".join(f"<td>{c}</td>" for c in [rows[0][0], *rows[0][1 + per_table :]]) + "</tr>" in page


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
    assert report.slurm_job_ids([LocalJobsLaunch(jobs={"0": "500_0"})], plan, shards) == []
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


# ---------------------------------------------------------------- what select would keep, empty panels, ticks


def test_what_select_would_keep_is_what_its_command_writes(run, tmp_path, monkeypatch):
    """Each preset's command line, run as it is printed, writes exactly the tasks the report counts per agent."""
    import shlex

    result = report.build_report(run)
    page = result.html.read_text()
    previews = report.select_previews(result.data)
    assert [p.title for p in previews] == [
        "drop never and always solved",
        "mean reward within 0.2–0.8",
        "the 2 hardest (a quarter)",
    ]
    monkeypatch.chdir(tmp_path)
    for p in previews:
        assert p.error is None and p.undecided == 0
        assert f"<code>{p.command}</code>" in page
        argv = shlex.split(p.command)
        assert argv[:3] == ["shardrun", "select", str(run)]
        res = CliRunner().invoke(app, argv[1:])
        assert res.exit_code == 0, res.output
        written = [orjson.loads(line) for line in (tmp_path / report.SELECT_OUTPUT).read_bytes().splitlines()]
        agents = [r["agent_ref"]["name"] for r in written]
        assert dict(p.kept) == {a: agents.count(a) for a in ("agent_a", "agent_b")}, p.title
    # drop never and always solved keeps the sometimes-solved tasks: the per-agent table's middle bucket
    assert dict(previews[0].kept) == {"agent_a": 3, "agent_b": 3}
    assert "<td>drop never and always solved</td><td>3 of 6</td><td>3 of 4</td><td>6 of 10</td>" in page


def test_a_panel_with_nothing_to_show_says_so(tmp_path):
    """Every rollout with reward 0 (as a policy that never answers): no flat or one-point frame, a sentence."""
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=3, num_shards=2)
    seal_shards(run_dir, lambda t, r: 0.0)
    merge_run(run_dir)
    store.report_figure_path(run_dir, "mean_hist").write_bytes(b"stale")  # from an earlier report of this run
    result = report.build_report(run_dir)
    page = result.html.read_text()
    assert set(result.notes) == {"mean_hist", "mean_vs_std", "pass_at_k", "tokens_vs_reward"}
    assert "Every one of the 4 tasks has the same mean reward, 0." in page
    assert "All 4 tasks sit on one point: mean reward 0, std 0." in page
    assert "Every rollout has the same reward, 0: pass@k is 0.0% at every k." in page
    assert "Every task has the same mean reward, 0: tokens do not separate anything" in page
    for name in result.notes:
        assert not store.report_figure_path(run_dir, name).exists()
        assert f"<figure id='{name}'><p class='empty'>" in page
    assert [p.name for p in result.figures] == [f"report_{n}.png" for n in ("shard_timeline", "throughput")]
    for p in result.figures:
        assert_png(p)
    assert set(re.findall(r"src='([^']+)'", page)) == {p.name for p in result.figures}


def test_axes_that_count_things_have_integer_ticks(run, monkeypatch):
    from shardrun.analysis import figures

    saved = {}
    real_save = figures._save

    def keep(fig, path):
        saved[path.name] = fig
        return real_save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    report.build_report(run)

    def ticks(fig, axis, which=0):
        ax = fig.axes[which]
        lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
        values = [v for v in (ax.get_xticks() if axis == "x" else ax.get_yticks()) if lo - 1e-9 <= v <= hi + 1e-9]
        assert values, (axis, lo, hi)
        return values

    for name, axis, which in (
        ("report_pass_at_k.png", "x", 0),  # k
        ("report_shard_timeline.png", "y", 0),  # shard index
        ("report_mean_hist.png", "y", 0),  # tasks
        ("report_throughput.png", "y", 1),  # rollouts in sealed shards
    ):
        assert all(float(v).is_integer() for v in ticks(saved[name], axis, which)), (name, axis)
    assert ticks(saved["report_shard_timeline.png"], "y") == [0, 1, 2, 3]
    assert ticks(saved["report_pass_at_k.png"], "x") == [1, 2, 3, 4]


def test_one_shard_gets_one_whole_tick_and_equal_tokens_a_sentence(tmp_path, monkeypatch):
    from shardrun.analysis import figures

    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(3)], num_repeats=2, num_shards=1)
    seal_shards(run_dir, lambda t, r: 1.0 if r < t else 0.0)
    merge_run(run_dir)
    rows = list(store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir)))
    for r in rows:  # every task the same mean output tokens, as a policy that always writes two tokens
        r.update({k: 2.0 for k in r if k.endswith("/output_tokens")})
    store.merged_reward_profiling_path(run_dir).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    saved = {}
    real_save = figures._save
    monkeypatch.setattr(figures, "_save", lambda fig, path: saved.setdefault(path.name, fig) and real_save(fig, path))
    result = report.build_report(run_dir)
    ax = saved["report_shard_timeline.png"].axes[0]
    lo, hi = sorted(ax.get_ylim())
    assert [v for v in ax.get_yticks() if lo <= v <= hi] == [0]
    assert set(result.notes) == {"tokens_vs_reward"}
    assert (
        "Every task has the same mean output_tokens, 2: tokens do not separate the tasks"
        in result.notes["tokens_vs_reward"]
    )
