"""Hostile round 3, the config (issue 34): a secret refused by any validator is never echoed (the `(got ...)` of a
refusal included); a blend's label is a name, never a path (`..` would write over the run's own merged/ files),
in a run config and in a NeMo Gym manifest; YAML's `true`/`yes`/`on` in a number field is refused, naming the
field, instead of being taken for 1."""

from __future__ import annotations

import pytest
import yaml
from hostilekit import invoke_bounded, refused

KEY = "Zx9Yw8Vu7Ts6Rq5P"


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = '{"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}}\n'
    (tmp_path / "in.jsonl").write_text(row)
    (tmp_path / "one.jsonl").write_text(row)
    return tmp_path


def write(workspace, data: dict) -> str:
    (workspace / "run.yaml").write_text(yaml.safe_dump(data))
    return str(workspace / "run.yaml")


def plain(**extra) -> dict:
    return {
        "input_jsonl": "in.jsonl",
        "run_dir": "run",
        "num_repeats": 2,
        "policy": {"base_url": "http://localhost:8000/v1", "model_name": "m"},
    } | extra


def blend(label: str) -> dict:
    return {
        "run_dir": "run",
        "num_repeats": 1,
        "policy": {"base_url": "http://localhost:8000/v1", "model_name": "m"},
        "entries": [
            {"label": "ok", "data": "one.jsonl", "agent": "a"},
            {"label": label, "data": "one.jsonl", "agent": "a"},
        ],
    }


@pytest.mark.parametrize(
    "override",
    [
        f"policy.vllm.extra_args=[--api-key,{KEY}]",
        f"policy.vllm.extra_args=['--api-key={KEY}']",
        f"policy.vllm.command=[vllm,serve,--api-key,{KEY}]",
    ],
)
def test_a_key_on_the_vllm_command_line_is_refused_and_never_echoed(workspace, unchanged, override):
    cfg = write(workspace, plain(policy={"vllm": {"model": "/m"}}))
    with unchanged(workspace):
        outcome = invoke_bounded("plan", cfg, override, "--write")
    refused(outcome, "policy.vllm")
    assert KEY not in outcome.output
    assert "api_key_env" in outcome.output


@pytest.mark.parametrize(
    "label",
    ["..", ".", "../x", "a/b", "a\\b", ".hidden", "tab\there", "esc\x1b[31m", "x" * 101, "new\nline", ""],
)
def test_a_label_that_is_not_a_plain_name_is_refused(workspace, unchanged, label):
    cfg = write(workspace, blend(label))
    with unchanged(workspace):
        outcome = invoke_bounded("plan", cfg, "--write")
    refused(outcome, "entries.1.label")
    assert "\x1b" not in outcome.output
    assert not (workspace / "run").exists()


@pytest.mark.parametrize("label", ["a.b", "v1.2-x_y", "x" * 100, "a..b"])
def test_a_plain_label_stays_allowed(workspace, label):
    cfg = write(workspace, blend(label))
    outcome = invoke_bounded("plan", cfg, "--write")
    assert outcome.exit_code == 0, outcome.output


@pytest.mark.parametrize("label", ["..", "../merged", ".x"])
def test_a_manifest_label_that_is_not_a_plain_name_is_refused(workspace, unchanged, label):
    manifest = {
        "nickname": "sweep",
        "num_shards": 1,
        "gym_env_start": {"config_paths": []},
        "gym_eval_run": {"num_repeats": 1},
        "entries": [{"label": label, "agent": "a", "configs": [], "data": "one.jsonl"}],
    }
    (workspace / "m.yaml").write_text(yaml.safe_dump(manifest))
    with unchanged(workspace):
        outcome = invoke_bounded("plan", str(workspace / "m.yaml"), "run_dir=run", "--write")
    refused(outcome, "entries.0.label", repr(label))
    assert not (workspace / "run").exists()


@pytest.mark.parametrize(
    "field, data",
    [
        ("num_repeats", plain(num_repeats=True)),
        ("sharding.num_shards", plain(sharding={"num_shards": True})),
        ("sharding.rollouts_per_shard", plain(sharding={"rollouts_per_shard": True})),
        ("seed_offset", plain(seed_offset=True)),
        ("num_repeats", plain(num_repeats={"a": True})),
        ("materialize.limit_per_entry", {**blend("two"), "materialize": {"limit_per_entry": True}}),
        (
            "entries.0.limit",
            {**blend("two"), "entries": [{"label": "a", "data": "one.jsonl", "agent": "a", "limit": True}]},
        ),
        ("policy.vllm.ready_timeout_s", plain(policy={"vllm": {"model": "/m", "ready_timeout_s": True}})),
    ],
)
def test_a_boolean_in_a_number_field_is_refused(workspace, unchanged, field, data):
    cfg = write(workspace, data)
    with unchanged(workspace):
        outcome = invoke_bounded("plan", cfg, "--write")
    refused(outcome, field, "boolean")
    assert not (workspace / "run").exists()


@pytest.mark.parametrize("override", ["num_repeats=true", "sharding.num_shards=true", "seed_offset=false"])
def test_a_boolean_override_in_a_number_field_is_refused(workspace, unchanged, override):
    cfg = write(workspace, plain())
    with unchanged(workspace):
        outcome = invoke_bounded("plan", cfg, override, "--write")
    refused(outcome, override.split("=")[0])
