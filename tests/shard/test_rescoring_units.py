"""The pure parts of a re-score's shard (shard/rescoring.py): Gym's re-verification flags, Gym's refusal of servers
that are not stateless read from its log, the failure rows a re-scored shard is sealed with, and the watch over
Gym's re-verification (a runner's check stops it; a dead server fails it)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shardrun.core import config
from shardrun.core.errors import ServerFailure
from shardrun.rundir import ledger
from shardrun.shard import processes, rescoring
from shardrun.shard.watchdog import Check

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


class Released(BaseException):
    """What a warm worker's claim check raises (workers.worker.ShardReleased: the shard goes back, nothing failed)."""


def test_a_runners_check_stops_gyms_reverification_and_a_dead_judge_fails_it_as_a_server_failure(
    tmp_path: Path,
) -> None:
    cfg = config.validate(
        {
            "input_jsonl": str(tmp_path / "input.jsonl"),
            "run_dir": str(tmp_path / "new"),
            "gym": {"config_paths": ["x.yaml"], "health_interval_s": 0.2},
            "policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
            "rescore": {"source_run": str(tmp_path / "source"), "source_fingerprint": "f" * 64},
        }
    )
    output = tmp_path / "scratch" / "rollouts.jsonl"
    output.parent.mkdir()

    def released() -> str | None:
        raise Released("the claim was lost")

    said: list[str] = []

    def rescore(check: Check) -> rescoring.Rescore:
        plan = None  # the watch reads no plan
        return rescoring.Rescore(tmp_path / "new", 0, plan, cfg, said.append, None, 1, checks=[check])  # type: ignore[arg-type]

    proc = processes.start(["sleep", "600"], tmp_path / "gym.log", name="gym")
    with pytest.raises(Released):
        rescore(Check("claim", released)).watch(proc, [], None, output)
    assert not proc.alive() and any("the claim was lost" in s for s in said)

    down = rescore(Check("judge j", lambda: "it died"))
    proc = processes.start(["sleep", "600"], tmp_path / "gym2.log", name="gym")
    with pytest.raises(ServerFailure, match="judge j: it died"):
        down.watch(proc, [], None, output)
    assert not proc.alive()
