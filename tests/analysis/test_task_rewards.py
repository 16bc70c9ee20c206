"""`shardrun profile` and the per-task picture that ends `merge-and-profile` and `report`: the numbers are pandas'
over the merged profile's rows, a blend groups by label, the hardest and easiest lists are ordered (ties by task
index), `--json` is JSON alone, a run not merged yet is refused as `report` refuses it, and text from data reaches
the terminal escaped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pandas as pd
import pytest
from typer.testing import CliRunner

from reportkit import input_row, merge_run, planned_run, seal_shards
from shardrun.analysis import task_rewards
from shardrun.cli import app
from shardrun.profile import taskstats
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import store
from tests.blendkit import LABELS, label_of, make_blend_run, write_lane_shards

REPEATS = 4
EVIL = "evil \x1b]52;c;aGk=\x07 prompt\u202e\nsecond line"


def reward(t: int, r: int) -> float:
    """Never, sometimes (binary and partial credit) and always solved tasks, and one tiny non-zero mean."""
    if t % 5 == 0:
        return 0.0
    if t % 5 == 1:
        return 1.0
    if t % 5 == 2:
        return 0.5
    if t == 13:
        return 0.0008 if r == 0 else 0.0
    return 1.0 if r < t % 5 else 0.0


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a" if i < 8 else "agent_b") for i in range(15)]
    rows[3]["responses_create_params"]["input"][0]["content"] = EVIL
    run_dir, _ = planned_run(tmp_path, rows, num_repeats=REPEATS, num_shards=3)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    return run_dir


def profile_frame(run_dir: Path) -> pd.DataFrame:
    """The merged profile's rows as pandas reads them, with each task's rewards: the reference computation."""
    lines = store.merged_reward_profiling_path(run_dir).read_bytes().splitlines()
    rows = [orjson.loads(x) for x in lines]
    return pd.DataFrame(
        {
            "task": [r["_ng_task_index"] for r in rows],
            "agent": [r["sample"]["agent_ref"]["name"] for r in rows],
            "mean": [r["mean/reward"] for r in rows],
            "std": [r.get("std/reward") for r in rows],
            "n": [r["num_rollouts"] for r in rows],
            "rewards": [[i["reward"] for i in r["rollout_infos"]] for r in rows],
        }
    )


def test_the_numbers_are_pandas_over_the_profile_rows(run) -> None:
    df = profile_frame(run)
    picture = task_rewards.gather(run, "agent", 3)
    assert [g.name for g in picture.groups] == ["agent_a", "agent_b"]
    for g in picture.groups:
        mine = df[df.agent == g.name]
        assert g.tasks == len(mine)
        assert g.mean == pytest.approx(mine["mean"].mean())
        assert g.mean_std == pytest.approx(mine["std"].mean())
        q = mine["mean"].quantile([0, 0.25, 0.5, 0.75, 1.0]).tolist()
        assert [g.quartiles[k] for k in task_rewards.QUARTILES] == pytest.approx(q)
        never = sum(max(r) < 1 for r in mine.rewards)
        always = sum(min(r) >= 1 for r in mine.rewards)
        assert dict(g.buckets) == {"never": never, "sometimes": len(mine) - never - always, "always": always}
    ordered = df.assign(neg_std=-df["std"]).sort_values(["mean", "neg_std", "task"])
    assert [t.task_index for t in picture.hardest] == ordered.task.tolist()[:3]
    easy = df.assign(neg_mean=-df["mean"]).sort_values(["neg_mean", "std", "task"])
    assert [t.task_index for t in picture.easiest] == easy.task.tolist()[:3]
    for t in (*picture.hardest, *picture.easiest):
        row = df[df.task == t.task_index].iloc[0]
        assert (t.agent, t.mean, t.std, t.num_rollouts) == (row.agent, row["mean"], row["std"], row.n)
        assert t.prompt == f"What is {t.task_index} + {t.task_index}?"


def test_ties_are_broken_by_task_index_and_hardest_follows_select() -> None:
    def task(i: int, mean: float, std: float) -> taskstats.TaskStat:
        return taskstats.TaskStat(i, "a", 4, 4, {"mean/reward": mean, "std/reward": std}, (mean,) * 4)

    tasks = [task(5, 0.0, 0.0), task(2, 0.0, 0.0), task(9, 0.5, 0.2), task(7, 0.5, 0.6), task(1, 1.0, 0.0)]
    tasks += [task(3, 1.0, 0.0), task(4, 0.5, 0.6)]
    plan = SimpleNamespace(blend=(), labels=())
    picture = task_rewards.build(tasks, plan, "agent", 7)  # type: ignore[arg-type]
    # hardest: lowest mean, then higher std, then lower index (what `select --top-k-hardest` keeps)
    assert [t.task_index for t in picture.hardest] == [2, 5, 4, 7, 9, 1, 3]
    # easiest: highest mean, then lower std, then lower index
    assert [t.task_index for t in picture.easiest] == [1, 3, 9, 4, 7, 2, 5]
    assert [t.task_index for t in task_rewards.build(tasks, plan, "agent", 2).hardest] == [2, 5]  # type: ignore[arg-type]
    assert task_rewards.build(tasks, plan, "agent", 0).hardest == []  # type: ignore[arg-type]


def test_cli_profile_prints_the_summary_and_both_tables(run) -> None:
    res = CliRunner().invoke(app, ["profile", str(run), "--top", "2"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.startswith("per-task mean reward") and "the 2 hardest:" in out and "the 2 easiest:" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("agent "))
    assert header.split() == ["agent", "tasks", "mean", "min", "q1", "median", "q3", "max", "mean", "std"] + [
        "never",
        "sometimes",
        "always",
    ]
    hardest = out.split("the 2 hardest:\n")[1].split("\n\n")[0].splitlines()
    assert hardest[0].split() == ["task", "agent", "mean", "std", "rollouts", "prompt"]
    assert [line.split()[0] for line in hardest[1:]] == ["0", "5"]  # mean 0, std 0: by task index
    # task 13's mean (0.0002) is never shown as 0.000
    assert task_rewards.figure(0.0002) == "0.0002" and "0.0002" in CliRunner().invoke(app, ["profile", str(run)]).output


def test_profile_json_is_json_alone(run) -> None:
    res = CliRunner().invoke(app, ["profile", str(run), "--top", "3", "--json"])
    assert res.exit_code == 0, res.output
    data = orjson.loads(res.output)
    assert set(data) == {"run_dir", "by", "top", "groups", "hardest", "easiest", "unscored_tasks"}
    assert (data["by"], data["top"], data["unscored_tasks"]) == ("agent", 3, 0)
    assert set(data["groups"][0]) == {"agent", "tasks", "mean", "quartiles", "mean_std", "buckets"}
    assert set(data["groups"][0]["quartiles"]) == set(task_rewards.QUARTILES)
    assert len(data["hardest"]) == len(data["easiest"]) == 3
    assert set(data["hardest"][0]) == {"task_index", "agent", "mean", "std", "num_rollouts", "prompt"}
    by_task = {t["task_index"]: t for t in data["easiest"] + data["hardest"]}
    assert all(t["prompt"] == f"What is {i} + {i}?" for i, t in by_task.items())


def test_a_prompt_with_control_characters_is_shown_escaped(run) -> None:
    res = CliRunner().invoke(app, ["profile", str(run), "--top", "15"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("3 "))
    assert "evil \\x1b]52;c;aGk=\\x07 prompt\\u202e second line" in line  # one line, the controls escaped
    assert not any(c in res.output for c in "\x1b\x07\u202e")
    data = orjson.loads(CliRunner().invoke(app, ["profile", str(run), "--top", "15", "--json"]).output)
    assert next(t for t in data["hardest"] if t["task_index"] == 3)["prompt"] == EVIL.replace("\n", " ")


def test_preview_reads_the_last_user_message_and_is_cut() -> None:
    preview = task_rewards.prompt_preview
    assert preview({"responses_create_params": {"input": "plain  text\n\tinput"}}) == "plain text input"
    parts = [{"type": "input_text", "text": "first"}, {"type": "input_image"}, {"type": "input_text", "text": "b"}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "old"}]
    assert preview({"responses_create_params": {"input": messages + [{"role": "user", "content": parts}]}}) == "first b"
    assert preview({"responses_create_params": {"input": messages[:1]}}) == ""
    assert preview({"question": "q"}) == "" and preview(None) == ""
    long = preview({"responses_create_params": {"input": "x" * 300}})
    assert len(long) == task_rewards.PROMPT_CHARS and long.endswith("…")


def test_the_start_every_listed_prompt_shares_is_left_out_on_the_terminal() -> None:
    lead = "Solve the following problem. Put the answer in a box.\n\n"
    lines = [
        task_rewards.TaskLine(
            i, "a", None, m, 0.0, 4, task_rewards.prompt_preview({"responses_create_params": {"input": lead + q}})
        )
        for i, (m, q) in enumerate([(0.0, "What is 1 + 2?"), (1.0, "What is 10 - 4?"), (0.5, "x" * 90)])
    ]
    picture = task_rewards.Picture("agent", [], 3, lines, lines[::-1])
    text = task_rewards.render(picture)
    assert '(the listed prompts all start "Solve the following problem. Put the answer in a box. ": shown as …)' in text
    assert "  …What is 1 + 2?" in text and "  …What is 10 - 4?" in text and "…" + "x" * 58 + "…" in text
    assert task_rewards.shared_prefix(["What is 1?", "What is 2?"]) == 0  # too short to be an instruction
    assert task_rewards.shared_prefix([lines[0].prompt]) == 0


def test_figures_never_round_onto_an_integer_they_are_not() -> None:
    f = task_rewards.figure
    assert [f(0.0), f(1.0), f(0.25), f(2 / 3), f(None)] == ["0.000", "1.000", "0.250", "0.667", "—"]
    assert [f(0.0004), f(0.00042), f(0.9996), f(-0.0003), f(2.99999)] == [
        "0.0004",
        "0.00042",
        "0.9996",
        "-0.0003",
        "2.99999",
    ]
    p = task_rewards.percent
    assert [p(0, 5), p(1, 300), p(299, 300), p(300, 300), p(1, 3), p(0, 0)] == ["0%", "<1%", ">99%", "100%", "33%", "—"]


def test_a_run_not_merged_is_refused_as_report_refuses_it(tmp_path) -> None:
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, lambda t, r: 1.0)
    res = CliRunner().invoke(app, ["profile", str(run_dir)])
    report = CliRunner().invoke(app, ["report", str(run_dir), "--no-sacct"])
    assert res.exit_code == report.exit_code == 2, res.output
    assert f"run `shardrun merge-and-profile {run_dir}` first" in res.output


def test_by_label_on_a_run_without_a_blend_is_refused(run) -> None:
    res = CliRunner().invoke(app, ["profile", str(run), "--by", "label"])
    assert res.exit_code == 2 and "not a blend" in res.output
    res = CliRunner().invoke(app, ["profile", str(run), "--by", "task"])
    assert res.exit_code == 2 and "one of agent, label" in res.output


def test_a_blend_groups_by_label_in_config_order(tmp_path) -> None:
    run = make_blend_run(tmp_path, LABELS, num_repeats={"a": 3, "b": 2})
    write_lane_shards(run, failing="gamma")
    merge_and_profile(run.run_dir)
    picture = task_rewards.gather(run.run_dir, "label", 4)
    assert [(g.name, g.tasks) for g in picture.groups] == [("alpha", 4), ("beta", 3), ("gamma", 0)]
    tasks = taskstats.load_profile(run.run_dir)
    for g in picture.groups[:2]:
        means = [t.stat("mean") for t in tasks if label_of(t.task_index) == g.name]
        assert g.mean == pytest.approx(sum(means) / len(means))  # type: ignore[arg-type]
    assert all(t.label == label_of(t.task_index) for t in (*picture.hardest, *picture.easiest))
    by_agent = task_rewards.gather(run.run_dir, "agent", 0)
    assert [(g.name, g.tasks) for g in by_agent.groups] == [("a", 7)]  # gamma's agent b collected nothing
    res = CliRunner().invoke(app, ["profile", str(run.run_dir), "--by", "label"])
    assert res.exit_code == 0, res.output
    assert f"gamma  0      {task_rewards.NO_TASK}" in res.output
    table = res.output.split("the 7 hardest:\n")[1]  # --top 10 of 7 profiled tasks: all 7, said so
    assert table.splitlines()[0].split() == ["task", "agent", "label", "mean", "std", "rollouts", "prompt"]
    data = orjson.loads(CliRunner().invoke(app, ["profile", str(run.run_dir), "--by", "label", "--json"]).output)
    assert [g["label"] for g in data["groups"]] == ["alpha", "beta", "gamma"]
    assert data["groups"][2]["quartiles"] is None and all("label" in t for t in data["hardest"])
    short = task_rewards.load_short(run.run_dir)  # merge-and-profile's and report's: per agent, then per label
    assert short.index(", per agent:") < short.index(", per label:")


def picture_block(output: str) -> str:
    return output[output.index("per-task mean reward") :]


def test_merge_and_profile_and_report_end_with_the_picture(tmp_path) -> None:
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(6)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, reward)
    res = CliRunner().invoke(app, ["merge-and-profile", str(run_dir)])
    assert res.exit_code == 0, res.output
    lines = res.output.rstrip().splitlines()
    assert lines[-1] == f"next: shardrun report {run_dir}"  # the next step stays the last line
    assert lines[-2] == f"the hardest and easiest tasks: shardrun profile {run_dir}"
    expected = task_rewards.load_short(run_dir)
    assert res.output.rstrip().endswith(expected + f"\nnext: shardrun report {run_dir}")
    assert "agent_a" in lines[-3] and "the 10 hardest" not in res.output  # the short version: no task table
    report = CliRunner().invoke(app, ["report", str(run_dir), "--no-sacct"])
    assert report.exit_code == 0, report.output
    assert report.output.rstrip().endswith(expected) and picture_block(report.output).rstrip() == expected
    as_json = CliRunner().invoke(app, ["merge-and-profile", str(run_dir), "--json"])
    assert as_json.exit_code == 0 and orjson.loads(as_json.output)["tasks"] == 6  # JSON alone, as before
