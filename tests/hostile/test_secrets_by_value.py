"""Hostile input, secrets by value: a credential is refused wherever a config would store or render it — under any
key, inside an override or NAME=value string, or resolved from ${oc.env:...} — with the location named, the value
never echoed, and nothing written. Paths and URLs read from the environment stay allowed."""

from __future__ import annotations

import pytest
import yaml
from hostilekit import invoke, refused

from shardrun.core.credentials import entropy, find_credentials, secret_reason, token_shape

OPENAI = "sk-proj-" + "Ab3dE5gH7jK9mN1pQ3sT5vW7yZ"
HF = "hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
GITHUB = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
AWS_ID = "AKIA" + "IOSFODNN7EXAMPLE"
SLACK = "xoxb-" + "123456789012-abcdefghijkl"
RANDOM_PASSWORD = "q8#Zr!2vLp$9wXe4Tn"


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}}\n')
    return tmp_path


def config(workspace, **sections) -> str:
    data = {"input_jsonl": "in.jsonl", "run_dir": "run", "num_repeats": 2, **sections}
    (workspace / "run.yaml").write_text(yaml.safe_dump(data))
    return str(workspace / "run.yaml")


CASES = {
    "HF token under policy.vllm.env": (
        {"policy": {"vllm": {"model": "m", "env": {"HF_TOKEN": HF}}}},
        [],
        "policy.vllm.env.HF_TOKEN",
    ),
    "OpenAI key inside a gym override": ({"gym": {"overrides": [f"policy_api_key={OPENAI}"]}}, [], "gym.overrides[0]"),
    "GitHub token in a setup line": (
        {"cluster": {"setup": [f"git clone https://{GITHUB}@github.com/x/y"]}},
        [],
        "cluster.setup[0]",
    ),
    "AWS key id as NAME=value in env_vars": (
        {"cluster": {"env_vars": [f"AWS_ACCESS_KEY_ID={AWS_ID}"]}},
        [],
        "cluster.env_vars[0]",
    ),
    "Slack token in additional_parameters": (
        {"cluster": {"additional_parameters": {"comment": SLACK}}},
        [],
        "cluster.additional_parameters.comment",
    ),
    "random password under a key-like name": (
        {"cluster": {"env_vars": [f"DB_PASSWORD={RANDOM_PASSWORD}"]}},
        [],
        "cluster.env_vars[0]",
    ),
    "token given as an override": (
        {},
        [f"++gym.responses_create_params.metadata={OPENAI}"],
        "gym.responses_create_params.metadata",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_credential_is_refused_where_it_would_be_stored(workspace, unchanged, case):
    sections, overrides, where = CASES[case]
    cfg = config(workspace, **sections)
    with unchanged(workspace):
        outcome = invoke("plan", cfg, *overrides, "--write")
    refused(outcome, where, "secrets are not allowed")
    for secret in (OPENAI, HF, GITHUB, AWS_ID, SLACK, RANDOM_PASSWORD):
        assert secret not in outcome.output
    assert not (workspace / "run").exists()


def test_a_credential_resolved_from_the_environment_is_refused(workspace, unchanged, monkeypatch):
    monkeypatch.setenv("LEAKY", HF)
    cfg = config(workspace, gym={"responses_create_params": {"metadata": {"note": "${oc.env:LEAKY}"}}})
    with unchanged(workspace):
        outcome = invoke("plan", cfg, "--write")
    refused(outcome, "gym.responses_create_params.metadata.note", "Hugging Face token")
    assert HF not in outcome.output


def test_paths_and_urls_from_the_environment_stay_allowed(workspace, monkeypatch):
    monkeypatch.setenv("MODEL_DIR", "/lustre/models/Qwen3-8B-Instruct-2507-x9Kq7Pz")
    monkeypatch.setenv("ENDPOINT", "http://node-17.cluster:8000/v1?session=Zx81Qa7LmN2pR5tY")
    cfg = config(
        workspace,
        policy={"vllm": {"model": "${oc.env:MODEL_DIR}", "env": {"VLLM_TOKENIZER": "${oc.env:MODEL_DIR}"}}},
        gym={"overrides": ["policy_base_url=${oc.env:ENDPOINT}"]},
    )
    outcome = invoke("plan", cfg, "--write")
    assert outcome.exit_code == 0, outcome.output
    assert (workspace / "run" / "plan.json").is_file()


@pytest.mark.parametrize(
    "name, value",
    [
        ("max_tokens", "4096"),
        ("model", "Qwen/Qwen3-8B-Instruct"),
        ("api_key_env", "OPENAI_API_KEY"),
        ("tokenizer", "meta-llama/Llama-3.1-8B-Instruct"),
        ("password", "short"),
        ("comment", "the_quick_brown_fox_jumps"),
        ("token", "/home/user/.cache/huggingface/token"),
    ],
)
def test_ordinary_values_are_not_credentials(name, value):
    assert secret_reason(name, value) is None


def test_every_token_shape_is_recognised_and_located_without_its_value():
    for value in (OPENAI, HF, GITHUB, AWS_ID, SLACK, "-----BEGIN RSA PRIVATE KEY-----"):
        assert token_shape(value) is not None
    found = list(find_credentials({"a": [{"b": f"x={HF}"}], "c": "fine"}))
    assert found == [("a[0].b", "holds what looks like a Hugging Face token")]
    assert entropy("aaaa") == 0.0 and entropy("abcd") == 2.0
