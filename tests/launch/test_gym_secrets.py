"""`gym.secrets` (issue #36): variables Gym's configs reference (`${nv_inference_api_key}`), given by the NAME of the
environment variable that holds each. The value is read at stack start and written into the stack's env.yaml (0600)
only; `plan`, `submit --dry-run` (and so `submit` and `resume`, through the same preflight) refuse a variable not
set, naming the key and the variable; job scripts hold a `: "${NAME:?...}"` check, never the value."""

from __future__ import annotations

import json
import secrets as pysecrets
import stat
from pathlib import Path

import orjson
import pytest
import yaml
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config
from shardrun.core.config import GymConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.launch import preflight, slurm
from shardrun.rundir import env_manifest
from shardrun.shard import gym_stack
from tests.faults import gymkit, synthetic
from tests.planning_helpers import row

runner = CliRunner()
VAR = "SHARDRUN_TEST_JUDGE_KEY"


@pytest.fixture
def judge_key() -> str:
    return "nvapi-judge-" + pysecrets.token_hex(16)


# ---------------------------------------------------------------- config


def test_secrets_map_gym_variables_to_environment_variable_names() -> None:
    gym = GymConfig(secrets={"nv_inference_api_key": "NV_INFERENCE_API_KEY", "judge2_key": "MY_KEY_2024_PROD"})
    assert gym.secrets == {"nv_inference_api_key": "NV_INFERENCE_API_KEY", "judge2_key": "MY_KEY_2024_PROD"}
    cfg = config.validate(
        {"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": {"nv_inference_api_key": "NV_INFERENCE_API_KEY"}}}
    )
    assert cfg.gym is not None and cfg.gym.secrets == {"nv_inference_api_key": "NV_INFERENCE_API_KEY"}


@pytest.mark.parametrize(
    ("secrets", "said"),
    [
        ({"policy_api_key": "X"}, "'policy_api_key' is one shardrun writes into env.yaml itself"),
        ({"policy_base_url": "X"}, "'policy_base_url' is one shardrun writes"),
        ({"policy_model_name": "X"}, "'policy_model_name' is one shardrun writes"),
        ({"config_paths": "X"}, "'config_paths' is one shardrun writes"),
        ({"judge-key": "X"}, "'judge-key' is not a variable Gym's configs can reference"),
        ({"1key": "X"}, "'1key' is not a variable"),
    ],
)
def test_bad_and_reserved_keys_are_refused_naming_the_key(secrets: dict[str, str], said: str) -> None:
    with pytest.raises(BadInput) as e:
        config.validate({"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": secrets}})
    assert said in str(e.value) and "gym.secrets" in str(e.value)


@pytest.mark.parametrize(
    "value",
    [
        "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4",  # an OpenAI key's shape
        "nvapi-" + "x" * 40,  # not a name at all
        "has spaces in it",
        "aB3dE5fG7hJ9kL1mN3pQ7rS",  # a long random word: a key, not a name
        "0123456789abcdef0123456789abcdef",  # hex
    ],
)
def test_a_value_that_is_not_a_name_is_refused_without_echoing_it(value: str) -> None:
    for data in (
        {"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": {"judge_key": value}}},
        {"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": {"plain": value}}},
    ):
        with pytest.raises(BadInput) as e:
            config.validate(data)
        key = next(iter(data["gym"]["secrets"]))  # type: ignore[index]
        assert f"gym.secrets.{key}" in str(e.value) and value not in str(e.value)
    with pytest.raises(ValueError) as e2:  # the model itself, built without validate()
        GymConfig(secrets={"judge_key": value})
    assert value not in str(e2.value).replace(repr({"judge_key": value}), "")


def test_overrides_of_secrets_take_names_and_refuse_values(tmp_path: Path, judge_key: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("input_jsonl: x\nrun_dir: y\n")
    cfg = config.load(path, [f"++gym.secrets.judge_key={VAR}"])
    assert cfg.gym is not None and cfg.gym.secrets == {"judge_key": VAR}
    with pytest.raises(BadInput) as e:
        config.load(path, [f"++gym.secrets.judge_key={judge_key}"])
    assert judge_key not in str(e.value) and "gym.secrets.judge_key" in str(e.value)


# ---------------------------------------------------------------- env.yaml


def test_env_yaml_holds_the_secrets_beside_the_policy_entries(tmp_path: Path, judge_key: str) -> None:
    gym = GymConfig(secrets={"judge_key": VAR})
    values = gym_stack.secret_values(gym, {VAR: judge_key})
    assert values == {"judge_key": judge_key}
    text = gym_stack.env_yaml_text(["http://a/v1"], "k", "m", values)
    assert yaml.safe_load(text) == {
        "policy_base_url": "http://a/v1",
        "policy_api_key": "k",
        "policy_model_name": "m",
        "judge_key": judge_key,
    }
    path = tmp_path / "gym" / "env.yaml"
    gym_stack.write_env_yaml(path, text)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and judge_key.encode() in path.read_bytes()
    with pytest.raises(BadInput, match="shardrun writes policy_api_key"):
        gym_stack.env_yaml_text(["http://a/v1"], "k", "m", {"policy_api_key": "x"})


def test_a_secret_missing_at_stack_start_names_key_and_variable() -> None:
    gym = GymConfig(secrets={"judge_key": VAR})
    with pytest.raises(BadInput) as e:
        gym_stack.secret_values(gym, {VAR: ""})
    assert f"gym.secrets.judge_key: ${VAR}" in str(e.value)


def test_environment_manifest_records_names_only(judge_key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, judge_key)
    cfg = config.validate({"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": {"judge_key": VAR}}})
    built = env_manifest.build(cfg, env={VAR: judge_key})
    assert built["gym"]["secrets"] == {"judge_key": VAR} and judge_key not in json.dumps(built)
    plain = env_manifest.build(config.validate({"input_jsonl": "x", "run_dir": "y", "gym": {}}), env={})
    assert "secrets" not in plain["gym"]  # runs without secrets compare as before


# ---------------------------------------------------------------- preflight and Slurm


def with_secrets(cfg: RunConfig, secrets: dict[str, str]) -> RunConfig:
    assert cfg.gym is not None
    return cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"secrets": secrets})})


def test_pass_through_and_preflight_name_the_secrets(tmp_path: Path) -> None:
    run = synthetic.make(tmp_path, tasks=4, shards=1, seal=False)
    cfg = with_secrets(synthetic.launch_config(run, api_key_env=gymkit.KEY_ENV), {"judge_key": VAR, "k2": VAR})
    assert slurm.pass_through_env(cfg) == [gymkit.KEY_ENV, VAR]  # each name once
    problems = preflight.missing_environment(cfg, {gymkit.KEY_ENV: "x"})
    assert problems == [
        f"gym.secrets.judge_key: ${VAR} is not set in this shell; export it where you submit (jobs take it from here)",
        f"gym.secrets.k2: ${VAR} is not set in this shell; export it where you submit (jobs take it from here)",
    ]
    assert preflight.missing_environment(cfg, {gymkit.KEY_ENV: "x", VAR: "y"}) == []
    with pytest.raises(BadInput, match=f"gym.secrets.judge_key: \\${VAR} is not set"):
        preflight.check_secrets(cfg, {})


def secrets_config(tmp_path: Path, **cluster) -> Path:
    run = synthetic.make(tmp_path, tasks=30, shards=3, seal=False)
    path = synthetic.launch_config_file(run, tmp_path / "run.yaml", **cluster)
    data = json.loads(path.read_text())
    data["gym"]["secrets"] = {"nv_inference_api_key": VAR}
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("executor", ["slurm", "local"])
def test_submit_dry_run_refuses_a_missing_secret_naming_key_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executor: str
) -> None:
    cfg = secrets_config(tmp_path, executor=executor)
    monkeypatch.delenv(VAR, raising=False)
    res = runner.invoke(app, ["submit", str(cfg), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert f"gym.secrets.nv_inference_api_key: ${VAR} is not set in this shell" in res.output


def test_submit_dry_run_scripts_check_the_variable_and_never_hold_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, judge_key: str
) -> None:
    cfg = secrets_config(tmp_path, executor="slurm", max_array_size=2)
    monkeypatch.setenv(VAR, judge_key)
    res = runner.invoke(app, ["submit", str(cfg), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.count("#!/bin/bash") == 3  # two arrays and the merge job
    assert res.output.count(f': "${{{VAR}:?') == 2  # each array's script checks it arrived; the merge job needs none
    assert judge_key not in res.output


def plan_config(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps(row(i)) + b"\n" for i in range(5)))
    path = tmp_path / "run.yaml"
    path.write_text(
        "input_jsonl: in.jsonl\nrun_dir: runs/r1\nnum_repeats: 2\nsharding:\n  num_shards: 2\n"
        f"gym:\n  secrets:\n    nv_inference_api_key: {VAR}\n"
    )
    return path


def test_plan_refuses_a_missing_secret_and_writes_no_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, judge_key: str
) -> None:
    cfg = plan_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(VAR, raising=False)
    res = runner.invoke(app, ["plan", str(cfg), "--write"])
    assert res.exit_code == 2, res.output
    assert f"gym.secrets.nv_inference_api_key: ${VAR} is not set in this shell" in res.output
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv(VAR, judge_key)
    res = runner.invoke(app, ["plan", str(cfg), "--write"])
    assert res.exit_code == 0, res.output
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "plan.json" for p in files)
    assert [p for p in files if judge_key.encode() in p.read_bytes()] == []
    assert judge_key not in res.output
