"""The demo's configuration (scripts/demo.sh: examples/arith/config-vllm.yaml with examples/arith/input.jsonl), checked
without running the slow model: the math rows are right about their own answers and show SmolLM2 the worked
answer format that Gym 0.7's verifier rewards (`\\boxed{}`), the questions range from very easy to beyond a 135M
model, the config plans the 144 seeded rollouts the docs promise, and the demo's spread check (scripts/demo_spread.py)
tells a spread from a flat profile."""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from shardrun.core import config as config_mod
from shardrun.rundir import store

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "arith"
QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")
BOXED = "Make sure to put the answer (and only answer) inside \\boxed{}."
spread = runpy.run_path(str(REPO / "scripts" / "demo_spread.py"))


def rows() -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "input.jsonl").read_text().splitlines()]


def value(text: str) -> int:
    m = QUESTION.fullmatch(text)
    assert m, text
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def math_rows() -> list[dict]:
    return [r for r in rows() if r["agent_ref"]["name"] == "math_with_judge_simple_agent"]


def test_every_math_row_expects_its_own_answer_and_shows_worked_boxed_answers() -> None:
    math = math_rows()
    assert len(math) == 32
    for row in math:
        rcp = row["responses_create_params"]
        *shots, last = rcp["input"]
        assert row["expected_answer"] == str(value(row["question"]))
        assert (
            last["role"] == "user" and last["content"].endswith("\n\n" + row["question"]) and BOXED in last["content"]
        )
        # the worked examples: user/assistant pairs whose answers are right, written out, then boxed
        assert [m["role"] for m in shots] == ["user", "assistant"] * (len(shots) // 2) and shots
        for ask, answer in zip(shots[::2], shots[1::2]):
            q = ask["content"].rsplit("\n\n", 1)[1]
            v = value(q)
            assert answer["content"] == f"{q[8:-1]} = {v}\nThe answer is \\boxed{{{v}}}."
            assert q != row["question"]  # never the task's own question
        assert rcp["temperature"] > 0 and rcp["max_output_tokens"] >= 32


def test_questions_range_from_single_digit_sums_to_products_a_small_model_gets_wrong() -> None:
    questions = [r["question"] for r in math_rows()]
    assert len(set(questions)) == len(questions)
    easy = [q for q in questions if "+" in q and value(q) < 10]
    hard = [q for q in questions if value(q) >= 20 or value(q) < 0]
    assert len(easy) >= 8 and len(hard) >= 6


def test_the_tool_call_rows_are_gyms_weather_rows() -> None:
    tools = [r for r in rows() if r["agent_ref"]["name"] == "example_single_tool_call_simple_agent"]
    assert len(tools) == 4
    assert all(r["responses_create_params"]["tools"][0]["name"] == "get_weather" for r in tools)


def test_the_demo_config_plans_144_seeded_rollouts_in_4_shards(tmp_path: Path) -> None:
    cfg = config_mod.load(EXAMPLE / "config-vllm.yaml", [f"run_dir={tmp_path / 'run'}"])
    plan, written = store.write_plan(cfg)
    assert written and plan.num_tasks == 36 and plan.num_rollouts == 144 and len(plan.shards) == 4
    assert plan.agents["math_with_judge_simple_agent"]["tasks"] == 32
    seeds = {}
    for shard in plan.shards:
        for line in store.materialized_path(cfg.run_dir, shard.index).read_text().splitlines():
            row = json.loads(line)
            extra = json.loads(row["responses_create_params"]["metadata"]["extra_body"])
            seeds.setdefault(row["_ng_task_index"], []).append(extra["seed"])
    assert len(seeds) == 36 and all(sorted(s) == [0, 1, 2, 3] for s in seeds.values())


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        ([0.0, 0.25, 1.0], True),
        ([0.0, 0.5, 0.75, 1.0, 1.0], True),
        ([0.0] * 36, False),  # the flat profile the demo had under Gym 0.7 before worked examples
        ([0.0, 1.0, 1.0], False),  # two distinct means only
        ([1.0, 1.0, 1.0], False),
        ([0.25, 0.5, 0.75], True),
    ],
)
def test_spread_needs_three_distinct_means_one_above_0_and_one_below_1(means: list[float], expected: bool) -> None:
    assert spread["has_spread"](means) is expected


def test_spread_check_reads_a_profile_prints_the_means_and_exits_by_the_verdict(tmp_path: Path) -> None:
    def run(means: list[float], extra: str = "") -> subprocess.CompletedProcess[str]:
        path = tmp_path / "x_reward_profiling.jsonl"
        body = "".join(json.dumps({"_ng_task_index": i, "mean/reward": m}) + "\n" for i, m in enumerate(means))
        path.write_text(body + extra)
        script = str(REPO / "scripts" / "demo_spread.py")
        return subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True, timeout=60)

    ok = run([0.0, 0.25, 0.25, 1.0])
    assert ok.returncode == 0 and "3 distinct (0 x1, 0.25 x2, 1 x1): a spread" in ok.stdout
    flat = run([0.0, 0.0])
    assert flat.returncode == 1 and "NO spread" in flat.stdout
    bad = run([0.5], extra="{not json\n")
    assert bad.returncode == 2 and "cannot read the profile" in bad.stderr
