"""Hostile secrets, never echoed or stored: a refused secret is named by its key and place, never printed back
(Hydra's and YAML's own errors quote an override or a line whole); a URL with a `user:password@` part is refused
wherever it is (the password belongs in an environment variable the config names, like policy.api_key_env) and
never reaches plan.json; a secret pasted where the NAME of a variable belongs is refused without its value."""

from __future__ import annotations

import pytest
import yaml
from hostilekit import invoke_bounded, refused

OPENAI = "sk-proj-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2"
PASSWORD = "q8#Zr!2vLp$9wXe4Tn"  # characters Hydra's override lexer refuses: its error quotes the override
URL_PASSWORD = "Hunter2Hunter2xyz"
SECRETS = (OPENAI, PASSWORD, URL_PASSWORD)


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"responses_create_params": {"input": "hi"}, "agent_ref": {"name": "a"}}\n')
    return tmp_path


def config(workspace, **sections) -> str:
    data = {
        "input_jsonl": "in.jsonl",
        "run_dir": "run",
        "num_repeats": 2,
        "policy": {"base_url": "http://localhost:8000/v1", "model_name": "m"},
        **sections,
    }
    (workspace / "run.yaml").write_text(yaml.safe_dump(data))
    return str(workspace / "run.yaml")


CASES = {
    # the named cases: a refused secret printed back, a password in policy.base_url stored in plan.json
    "a key under an unknown key (Hydra's error quotes the override)": ({}, [f"policy.api_key={OPENAI}"], "api_key"),
    "a password in policy.base_url": (
        {"policy": {"base_url": f"http://bob:{URL_PASSWORD}@gpu-node:8000/v1", "model_name": "m"}},
        [],
        "policy.base_url",
    ),
    # and more
    "a password in policy.base_url, as an override": (
        {},
        [f"policy.base_url=http://bob:{URL_PASSWORD}@gpu-node:8000/v1"],
        "policy.base_url",
    ),
    "a password with characters Hydra cannot lex": ({}, [f"+policy.password={PASSWORD}"], "policy.password"),
    "the key itself in api_key_env": (
        {"policy": {"base_url": "http://h:1/v1", "model_name": "m", "api_key_env": PASSWORD}},
        [],
        "policy.api_key_env",
    ),
    "the key itself in api_key_env, as an override": ({}, [f"policy.api_key_env={OPENAI}"], "policy.api_key_env"),
    "a password in a URL in a setup line": (
        {"cluster": {"setup": [f"git clone https://ci:{URL_PASSWORD}@git.example.com/x.git"]}},
        [],
        "cluster.setup[0]",
    ),
    "a password in a URL in a Gym override": (
        {"gym": {"overrides": [f"judge_base_url=http://u:{URL_PASSWORD}@judge:9000/v1"]}},
        [],
        "gym.overrides[0]",
    ),
    "a key in a cluster override": ({}, [f"cluster.account={OPENAI}"], "cluster.account"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["plan", "submit"])
def test_a_secret_is_refused_by_its_place_and_never_echoed(workspace, unchanged, case, command):
    sections, overrides, where = CASES[case]
    cfg = config(workspace, **sections)
    args = ("plan", cfg, *overrides, "--write") if command == "plan" else ("submit", cfg, *overrides, "--dry-run")
    with unchanged(workspace):
        outcome = invoke_bounded(*args)
    refused(outcome, where)
    assert "environment variable" in outcome.output
    for secret in SECRETS:
        assert secret not in outcome.output
    assert not (workspace / "run").exists()


def test_a_url_password_message_says_where_the_password_belongs(workspace, unchanged):
    cfg = config(workspace, policy={"base_url": f"https://bob:{URL_PASSWORD}@h/v1", "model_name": "m"})
    with unchanged(workspace):
        outcome = invoke_bounded("plan", cfg, "--write")
    refused(outcome, "policy.base_url", "user:password@", "policy.api_key_env")
    assert URL_PASSWORD not in outcome.output


def test_a_yaml_error_on_a_line_holding_a_key_does_not_quote_it(workspace, unchanged):
    (workspace / "run.yaml").write_text(f"input_jsonl: in.jsonl\nrun_dir: run\npolicy: {{api: {OPENAI}\n")
    with unchanged(workspace):
        outcome = invoke_bounded("plan", str(workspace / "run.yaml"))
    refused(outcome, "run.yaml", "not valid YAML")
    assert OPENAI not in outcome.output


@pytest.mark.parametrize(
    "line",
    [
        "git clone https://ci:$GIT_TOKEN@git.example.com/x.git",  # the shell expands it where the job runs
        "curl -u ci http://gpu-node:8000/v1/models",  # a port is not a password
        "curl http://localhost:8000/v1/models",
    ],
)
def test_a_url_without_a_stored_password_stays_allowed(workspace, line):
    cfg = config(workspace, cluster={"setup": [line]})
    outcome = invoke_bounded("plan", cfg, "--write")
    assert outcome.exit_code == 0, outcome.output
    assert (workspace / "run" / "plan.json").exists()
