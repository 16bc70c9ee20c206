"""The pure parts of a re-score's shard (shard/rescoring.py): Gym's re-verification flags, Gym's refusal of servers
that are not stateless read from its log, and the failure rows a re-scored shard is sealed with."""

from __future__ import annotations

from pathlib import Path

import orjson

from shardrun.rundir import ledger
from shardrun.shard import rescoring

# what nemo-gym 0.7.0's `gym eval reverify` printed (wrapped by its console) when refusing, from a real run
GYM_REFUSAL = (
    'INFO:     127.0.0.1:39630 - "GET /global_config_dict_yaml HTTP/1.1" 200 OK\n'
    "Error: Resource server(s) ['example_single_tool_call', 'math_with_judge'] have \n"
    "reverify_mode=UNSUPPORTED or UNKNOWN. Rewards computed by reverification may be \n"
    "incorrect. Pass ++force=true to override (output will be prefixed with \n"
    "'unsafe_').\n"
    "Shutting down Ray cluster spun up by NeMo Gym...\n"
)


def test_gyms_refusal_of_servers_that_are_not_stateless_is_read_from_its_wrapped_log() -> None:
    said = rescoring.refusal(GYM_REFUSAL)
    assert said == (
        "resources server(s) ['example_single_tool_call', 'math_with_judge'] are not safe to re-verify "
        "statelessly (Gym: reverify_mode unsupported or unknown)"
    )
    assert rescoring.refusal("Error: Output file already exists\nNeMo Gym finished!") is None


def test_the_reverify_overrides_carry_force_and_failed_only_and_never_wait_for_the_policy() -> None:
    plain = rescoring.reverify_overrides(
        Path("/m.jsonl"), Path("/r.jsonl"), Path("/o.jsonl"), failed_only=False, force=False, parallel=None
    )
    assert "+force=false" in plain and "+judge_failed_only=false" in plain
    assert "+model_endpoint_readiness_timeout_seconds=0" in plain and "+disable_aggregation=true" in plain
    assert not any(o.startswith("+num_samples_in_parallel") for o in plain)
    both = rescoring.reverify_overrides(
        Path("/m.jsonl"), Path("/r.jsonl"), Path("/o.jsonl"), failed_only=True, force=True, parallel=4
    )
    assert {"+force=true", "+judge_failed_only=true", "+num_samples_in_parallel=4"} <= set(both)
    assert "+rollouts_jsonl_fpath=/r.jsonl" in both and "+output_jsonl_fpath=/o.jsonl" in both


def test_failures_of_this_verification_are_final_and_the_sources_unverified_failures_are_carried(
    tmp_path: Path,
) -> None:
    new = rescoring.final_failures([{"_ng_task_index": 0, "_ng_rollout_index": 1, "_ng_failure_class": "judge_failed"}])
    assert new == [
        {"_ng_task_index": 0, "_ng_rollout_index": 1, "_ng_failure_class": "judge_failed", ledger.TERMINAL_KEY: True}
    ]
    source = tmp_path / "rollouts_failures.jsonl"
    rows = [
        {"_ng_task_index": 0, "_ng_rollout_index": 1, "reason": "old"},
        {"_ng_task_index": 2, "_ng_rollout_index": 0, "reason": "timeout"},
        {"_ng_task_index": 2, "_ng_rollout_index": 0, "reason": "timeout"},
    ]
    source.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    assert rescoring.carried_failures(source, {(0, 1)}) == rows[1:]
    assert rescoring.carried_failures(tmp_path / "none.jsonl", set()) == []
