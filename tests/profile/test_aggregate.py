"""pass@k, pass@1[avg-of-k], majority@k and the across-run statistics against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardrun.profile import aggregate
from shardrun.merge.rowtable import NO_ANSWER, answer_code

NAN = float("nan")


def table(tasks: list[list[float]], answers: list[list[object]] | None = None) -> aggregate.AgentRollouts:
    task = np.array([t for t, rs in enumerate(tasks) for _ in rs], np.int64)
    reward = np.array([x for rs in tasks for x in rs], np.float64)
    codes = None
    if answers is not None:
        codes = np.array([answer_code(a) for rs in answers for a in rs], np.int64)
    return aggregate.score_table(task, reward, codes)


BINARY = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1]]


def test_unbiased_pass_at_k_by_hand() -> None:
    r = table(BINARY)
    score = r.scores["accuracy"]
    # task 0: n=4, 3 wrong: pass@1 = 1 - 3/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1 (3 wrong < 4)
    # task 1: all wrong -> 0; task 2: n=2 all right -> 1, left out of pass@4 (fewer than 4 rollouts)
    assert aggregate.pass_at_k(r, score, 1) == pytest.approx(100 * (0.25 + 0 + 1) / 3)
    assert aggregate.pass_at_k(r, score, 2) == pytest.approx(100 * (0.5 + 0 + 1) / 3)
    assert aggregate.pass_at_k(r, score, 4) == pytest.approx(100 * (1 + 0) / 2)
    assert aggregate.pass_at_k(r, score, 8) is None


def test_unbiased_estimator_values() -> None:
    # n=5, c=2 correct: pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10
    r = table([[1, 0, 1, 0, 0]])
    assert aggregate.pass_at_k(r, r.scores["accuracy"], 2) == pytest.approx(70.0)
    assert aggregate.pass_at_k(r, r.scores["accuracy"], 3) == pytest.approx(100 * (1 - 1 / 10))
    assert aggregate.pass_at_k(r, r.scores["accuracy"], 4) == pytest.approx(100.0)


def test_continuous_scores_use_max_of_first_k() -> None:
    r = table([[0.2, 0.9, 0.5], [1, 0, 1]])
    score = r.scores["accuracy"]
    assert aggregate.pass_at_k(r, score, 1) == pytest.approx(100 * (0.2 + 2 / 3) / 2)
    assert aggregate.pass_at_k(r, score, 2) == pytest.approx(100 * (0.9 + 1.0) / 2)


def test_avg_of_k_and_runs() -> None:
    r = table(BINARY)
    score = r.scores["accuracy"]
    assert aggregate.avg_of_k(r, score, 1) == pytest.approx(100 * 2 / 3)
    assert aggregate.avg_of_k(r, score, 2) == pytest.approx(100 * (0.5 + 0 + 1) / 3)
    assert aggregate.avg_of_k(r, score, 4) == pytest.approx(100 * (0.25 + 0 + 1) / 3)
    assert aggregate.per_sample_aggregate(r, score) == pytest.approx([200 / 3, 100 / 3, 0.0, 0.0])
    m = aggregate.agent_pass_metrics(r, 4)
    runs2 = [200 / 3, 100 / 3]
    std2 = math.sqrt(sum((x - 50) ** 2 for x in runs2))
    assert m["pass@1[avg-of-2]/accuracy/std_dev_across_runs"] == pytest.approx(std2)
    assert m["pass@1[avg-of-2]/accuracy/std_err_across_runs"] == pytest.approx(std2 / math.sqrt(2))
    runs4 = [200 / 3, 100 / 3, 0.0, 0.0]
    std4 = math.sqrt(sum((x - 25) ** 2 for x in runs4) / 3)
    assert m["pass@1[avg-of-4]/accuracy/std_dev_across_runs"] == pytest.approx(std4)
    assert m["pass@1[avg-of-4]/accuracy/std_err_across_runs"] == pytest.approx(std4 / 2)
    assert "pass@1[avg-of-1]/accuracy/std_dev_across_runs" not in m
    assert m["per_sample_aggregate"] == {"accuracy": pytest.approx(runs4)}


def test_majority_at_k_with_ties_and_missing_answers() -> None:
    rewards = [[1, 0, 1, 0], [1, 1, 1, 0], [0, 0]]
    answers = [["A", "A", "B", None], ["7", 7.0, "7", "x"], [None, None]]
    r = table(rewards, answers)
    acc = r.scores["accuracy"]
    # task 0, k=4: pairs (A,1) (A,0) (B,1) each once -> tie of three -> 2/3; k=2: (A,1) (A,0) -> 1/2
    # task 1, k=4: ("7",1) twice, (7.0,1) once, ("x",0) once -> 1; task 2: no answer -> 0
    assert aggregate.majority_at_k(r, acc, 4) == pytest.approx(100 * (2 / 3 + 1 + 0) / 3)
    assert aggregate.majority_at_k(r, acc, 2) == pytest.approx(100 * (0.5 + 1 + 0) / 3)
    no_answer = r.scores["no_answer"]
    assert no_answer.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1, 1]
    assert aggregate.pass_at_k(r, no_answer, 1) == pytest.approx(100 * (0.25 + 0 + 1) / 3)


def test_answer_codes_follow_python_equality() -> None:
    assert answer_code(1) == answer_code(1.0) == answer_code(True)
    assert answer_code("1") != answer_code(1)
    assert answer_code(None) == NO_ANSWER and answer_code("") != NO_ANSWER
    assert answer_code({"a": 1, "b": 2}) == answer_code({"b": 2, "a": 1})
    assert answer_code(0.5) != answer_code(0)


def test_missing_rewards_are_not_scored() -> None:
    r = table([[1, NAN, 0], [NAN]])
    acc = r.scores["accuracy"]
    assert aggregate.pass_at_k(r, acc, 1) == pytest.approx(50.0)  # task 1 has no scored rollout
    assert aggregate.pass_at_k(r, acc, 3) is None
    assert aggregate.avg_of_k(r, acc, 2) == pytest.approx(100.0)  # first two of task 0: 1 and (unscored)


def test_ks_and_metric_names() -> None:
    assert aggregate.ks_for(1) == [1]
    assert aggregate.ks_for(16) == [1, 2, 4, 8, 16]
    assert aggregate.ks_for(5) == [1, 2, 4, 5]
    m = aggregate.agent_pass_metrics(table([[1, 0, 1, 1, 0]], [["a"] * 5]), 5)
    assert [k for k in m if k.endswith("/accuracy") and "@" in k][:3] == [
        "pass@1/accuracy",
        "pass@1[avg-of-1]/accuracy",
        "majority@1/accuracy",
    ]
    assert {k.split("/")[0] for k in m} >= {"pass@5", "pass@1[avg-of-5]", "majority@5", "per_sample_aggregate"}
    keys = aggregate.key_metrics({"mean/reward": 0.5, **m})
    assert list(keys) == [
        "mean/reward",
        "pass@1[avg-of-5]/accuracy",
        "pass@1[avg-of-5]/no_answer",
        "pass@5/accuracy",
        "majority@5/accuracy",
    ]


def test_no_k_beyond_the_rollouts_present() -> None:
    m = aggregate.agent_pass_metrics(table([[1, 0], [0]]), 8)
    assert "pass@2/accuracy" in m and "pass@4/accuracy" not in m and "pass@8/accuracy" not in m
