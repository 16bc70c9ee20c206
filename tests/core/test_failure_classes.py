"""Failure classes (core/failure_classes.py): each class from structured fields first, old records from their
reason, the roles from Gym's config; and early stopping never decides a task from failed rollouts."""

from __future__ import annotations

import pytest

from shardrun.core import failure_classes as fc
from shardrun.core import stopping
from shardrun.core.errors import BadRecord
from shardrun.core.task_rules import TaskRules
from shardrun.rundir import ledger

POLICY_CFG = {"policy_model": {"responses_api_models": {"vllm_model": {"base_url": "${policy_base_url}"}}}}
JUDGE_CFG = {
    "math_judge_model": {"responses_api_models": {"openai_model": {"openai_model": "q"}}},
    "lc_judge": {"resources_servers": {"equivalence_llm_judge": {"judge_model_server": {"name": "math_judge_model"}}}},
    "lc_judge_simple_agent": {"responses_api_agents": {"simple_agent": {"model_server": {"name": "policy_model"}}}},
}
ROLES = fc.ServerRoles.from_gym_configs([POLICY_CFG, JUDGE_CFG]).union(
    fc.ServerRoles(sandboxes=frozenset({"10.0.0.5:6000"}))
)


def nested(server: str, message: str) -> str:
    inner = f'{{"error": {{"message": "{message}"}}}}'
    return f"Hit an exception in SimpleAgent___agent calling an inner server: b'Hit an exception in {server} calling an inner server: {inner}'"


def classed(row: dict) -> str:
    return ledger.failed_rollout(0, 0, 0, [row], ROLES).failure_class


def test_roles_come_from_gym_config_not_names() -> None:
    assert ROLES.policies == {"policy_model"} and ROLES.judges == {"math_judge_model"}
    # a model server named by a Hydra override only is a judge too; one an agent uses is the policy
    roles = fc.ServerRoles.from_gym_configs([JUDGE_CFG], ["+other_judge.responses_api_models.openai_model.x=1"])
    assert roles.judges == {"math_judge_model", "other_judge"} and roles.policies == {"policy_model"}


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"_ng_failure_class": "judge_failed", "_ng_failure_judge_error": "TimeoutError: judge"}, fc.JUDGE),
        ({"_ng_failure_class": "provider_unavailable"}, fc.SANDBOX),
        ({"_ng_failure_class": "gdpval:eval_missing"}, fc.ENVIRONMENT),
        ({"_ng_failure_class": "timeout_exceeded"}, fc.TIMEOUT),
        ({"_ng_failure_class": "cancelled"}, fc.OTHER),
        (  # Gym 0.7's /run failure: the innermost server of the nested body decides
            {
                "_ng_failure_class": "agent_run_error",
                "_ng_failure_http_status": 500,
                "_ng_failure_response_body": nested("VLLMModel___policy_model", "injected 400"),
            },
            fc.POLICY,
        ),
        (
            {
                "_ng_failure_class": "agent_run_error",
                "_ng_failure_http_status": 500,
                "_ng_failure_response_body": nested("OpenAIModel___math_judge_model", "rate limited"),
            },
            fc.JUDGE,
        ),
        (
            {
                "_ng_failure_class": "agent_run_error",
                "_ng_failure_http_status": 500,
                "_ng_failure_response_body": nested("LLMJudgeResourcesServer___lc_judge", "KeyError"),
            },
            fc.ENVIRONMENT,
        ),
        (
            {
                "_ng_failure_class": "agent_request_failed",
                "_ng_failure_type": "TimeoutError",
                "_ng_failure_message": "",
                "_ng_failure_http_status": None,
            },
            fc.TIMEOUT,
        ),
        ({"error": "Cannot connect to host 10.0.0.5:6000 ssl:default"}, fc.SANDBOX),
        ({"error": "something odd"}, fc.OTHER),
        ({"failure_class": "judge", "reason": "/run failed with HTTP 500"}, fc.JUDGE),  # shardrun's own, recorded
    ],
)
def test_each_class(row: dict, expected: str) -> None:
    assert classed(row) == expected


def test_old_records_are_classed_from_their_reason() -> None:
    """A quarantine row written before classes existed (Gym 0.4: the reason from the log) still reads."""
    old = {"_ng_failure_class": "shardrun_max_attempts", "_ng_failure_terminal": True, "attempts": 3}
    assert classed(old | {"reason": "/run failed with HTTP 500 (VLLMModel___policy_model: injected 400)"}) == fc.POLICY
    assert classed(old | {"reason": "/run failed with HTTP 500 (VLLMModel___math_judge_model: boom)"}) == fc.JUDGE
    assert classed(old | {"reason": "/run failed with HTTP 500 (ValueError: bad)"}) == fc.OTHER
    # Gym 0.4's math_with_judge when its judge fails: the agent's inner call failed, no message (seen in a real run)
    agent = "/run failed with HTTP 500 (SimpleAgent___math_with_judge_simple_agent)"
    assert classed(old | {"reason": agent}) == fc.ENVIRONMENT
    assert classed(old | {"reason": "/run failed with HTTP 504"}) == fc.TIMEOUT
    # and a new quarantine row records its class
    row = ledger.quarantine_row((1, 2), None, "/run failed with HTTP 500 (VLLMModel___policy_model: x)", 3, ROLES)
    assert row["failure_class"] == fc.POLICY


def test_a_recorded_class_that_is_none_is_refused() -> None:
    with pytest.raises(BadRecord, match=r"shard 00003: the failure row of rollout 4:1: 'failure_class' is 'jury'"):
        ledger.failed_rollout(4, 1, 3, [{"failure_class": "jury"}], ROLES)


def test_a_judge_failure_row_is_a_failure_with_its_error_as_reason() -> None:
    """Gym 0.7's judge_failsafe writes reward 0.0 and mask_sample on the row, but routes it to the sidecar: it is a
    failed rollout (class judge), never a zero."""
    row = {"_ng_failure_class": "judge_failed", "_ng_failure_judge_error": "JudgeError: timed out", "reward": 0.0}
    f = ledger.failed_rollout(2, 0, 0, [row] * 3, ROLES)
    assert (f.failure_class, f.reason) == (fc.JUDGE, "judge call failed (JudgeError: timed out)")


RULES = TaskRules(drop_unsolved=True, drop_solved=True)


@pytest.mark.parametrize("policy", ["omit", "zero"])
def test_early_stopping_never_decides_from_failed_rollouts(policy: str) -> None:
    # 3 of 4 rollouts failed (a judge down), one open: nothing decides the task, whatever the policy
    assert stopping.decide(RULES, "a", stopping.Partial.of([], failed=3, open=1), policy=policy) is None
    # failures do not count toward min_repeats
    assert stopping.decide(RULES, "a", stopping.Partial.of([1.0], 2, 5), policy=policy, min_repeats=2) is None
    # a solved and an unsolved completed rollout decide it (drop neither rule's way: kept), failures or not
    assert stopping.decide(RULES, "a", stopping.Partial.of([1.0, 0.0], 2, 4), policy=policy) is stopping.KEEP


def test_under_zero_failures_are_not_taken_as_zeros_early() -> None:
    """Under `zero` a failed rollout counted as 0 would settle drop_solved's 'not every rollout solved'; it must
    not: the failed rollout is taken as open."""
    rules = TaskRules(drop_solved=True)
    assert stopping.decide(rules, "a", stopping.Partial.of([1.0], failed=1, open=2), policy="zero") is None


def test_the_runs_roles_come_from_its_manifests_config_files_overrides_and_judges(tmp_path) -> None:
    import orjson
    import yaml

    from shardrun.rundir import env_manifest

    assert env_manifest.server_roles(tmp_path) == fc.DEFAULT_ROLES  # no manifest: policy_model is the policy
    judge_yaml = tmp_path / "judge.yaml"
    judge_yaml.write_text(yaml.safe_dump(JUDGE_CFG))
    manifest = {
        "gym": {
            "config_files": [
                {"path": "judge.yaml", "resolved": str(judge_yaml)},
                {"path": "gone.yaml", "resolved": None},
            ],
            "overrides": ["+extra_judge.responses_api_models.openai_model.model=x"],
            "collect_overrides": [],
        },
        "judges": {"served_judge": {"api_key_env": None}},
    }
    env_manifest.manifest_path(tmp_path).write_bytes(orjson.dumps(manifest))
    roles = env_manifest.server_roles(tmp_path)
    assert roles.policies == {"policy_model"}
    assert roles.judges == {"math_judge_model", "extra_judge", "served_judge"}
