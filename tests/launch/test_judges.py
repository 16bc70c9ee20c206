"""`judges:` (issue #36, item 2; docs/judges.md), the fast part: the config (one source per judge, names Gym can
refer to, keys by name), the Gym server config written per judge (vllm_model for a self-hosted judge, openai_model
with the cap for an external one; the key only as `${...}` resolved from env.yaml), the GPUs (the judges take the
last of the node's, the policy the rest; preflight counts the judges' beside the policy's on Slurm), the key
variables passed to jobs and checked at plan/submit, the environment manifest (names only) and `submit --dry-run`
showing the judge servers. The real Gym stack with a judge: tests/e2e/test_judges_gym.py."""

from __future__ import annotations

import json
import secrets as pysecrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config
from shardrun.core.config import JUDGE_KEY_PREFIX, JudgeConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.launch import preflight, slurm
from shardrun.rundir import env_manifest
from shardrun.shard import gym_stack, judges
from tests.fakes import harness
from tests.faults import gymkit, synthetic

runner = CliRunner()
VAR = "SHARDRUN_TEST_JUDGE_KEY"
HOSTED = {"vllm": {"model": "/models/judge", "tensor_parallel_size": 2}, "api_key_env": VAR}
EXTERNAL = {"base_url": "https://judge.example/v1", "model_name": "qwen-235b", "api_key_env": VAR}


def validate(judges_section: dict, **more) -> RunConfig:
    return config.validate({"input_jsonl": "x", "run_dir": "y", "judges": judges_section, **more})


# ---------------------------------------------------------------- config


def test_a_judge_is_self_hosted_or_external() -> None:
    cfg = validate({"math_judge_model": HOSTED, "lc_judge_model": EXTERNAL | {"max_concurrent_requests": 64}})
    hosted, external = cfg.judges["math_judge_model"], cfg.judges["lc_judge_model"]
    assert hosted.vllm is not None and hosted.gpus == 2 and hosted.base_url is None
    assert external.vllm is None and external.gpus == 0 and external.max_concurrent_requests == 64
    assert JudgeConfig(vllm={"model": "m", "device": "cpu"}).gpus == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "said"),
    [
        ({"j": {}}, "set exactly one of vllm (self-hosted judge) or base_url (external judge)"),
        ({"j": HOSTED | EXTERNAL}, "set exactly one of vllm"),
        ({"j": {"base_url": "https://x/v1"}}, "model_name is required with base_url"),
        ({"j": {"vllm": {"model": "m", "replicas": 2}}}, "vllm.replicas and vllm.nodes_per_replica must be 1"),
        ({"j": {"vllm": {"model": "m"}, "model_name": "x"}}, "vllm.served_model_name"),
        ({"j": EXTERNAL | {"api_key_env": "not a name"}}, "judges.j.api_key_env: 'api_key_env' takes the NAME"),
        ({"j": EXTERNAL | {"max_concurrent_requests": 0}}, "judges.j.max_concurrent_requests"),
        ({"my-judge": EXTERNAL}, "'my-judge' is not a Gym server name"),
        ({"policy_model": EXTERNAL}, "'policy_model' is a name shardrun or Gym's policy binding uses itself"),
        ({"policy_api_key": EXTERNAL}, "'policy_api_key' is a name shardrun"),
        ({"j": EXTERNAL | {"api_key": "x"}}, "judges.j.api_key"),
    ],
)
def test_bad_judges_are_refused_naming_the_field(section: dict, said: str) -> None:
    with pytest.raises(BadInput) as e:
        validate(section)
    text = str(e.value) + " ".join(getattr(e.value, "problems", []))
    assert said in text, text


def test_a_key_pasted_in_place_of_its_name_is_refused_without_echoing_it() -> None:
    key = "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4"
    with pytest.raises(BadInput) as e:
        validate({"j": EXTERNAL | {"api_key_env": key}})
    assert key not in str(e.value) + " ".join(getattr(e.value, "problems", []))


def test_judges_take_hydra_overrides_of_their_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"input_jsonl": "x", "run_dir": "y", "judges": {"math_judge_model": HOSTED}}))
    cfg = config.load(
        path,
        [
            "judges.math_judge_model.vllm.tensor_parallel_size=4",
            "++judges.ext={base_url:'https://judge.example/v1',model_name:qwen-235b}",
        ],
    )
    assert cfg.judges["math_judge_model"].gpus == 4 and cfg.judges["ext"].model_name == "qwen-235b"
    with pytest.raises(BadInput, match="judges.math_judge_model.vllm.tensor_paralel_size"):
        config.load(path, ["judges.math_judge_model.vllm.tensor_paralel_size=4"])


def test_gym_secrets_may_not_take_a_judge_key_name() -> None:
    with pytest.raises(BadInput, match=f"{JUDGE_KEY_PREFIX}"):
        config.validate({"input_jsonl": "x", "run_dir": "y", "gym": {"secrets": {JUDGE_KEY_PREFIX + "j": VAR}}})


# ---------------------------------------------------------------- the Gym server config per judge


def test_the_gym_config_binds_each_judge_by_name_with_its_key_from_env_yaml() -> None:
    key = "judge-" + pysecrets.token_hex(8)
    bindings = [
        gym_stack.JudgeBinding("math_judge_model", "http://127.0.0.1:8100/v1", "judge", True, key),
        gym_stack.JudgeBinding(
            "lc_judge_model", "https://judge.example/v1", "qwen", False, key, 64, {"extra_body": {"seed": 1}}
        ),
        gym_stack.JudgeBinding("keyless", "http://h:1/v1", "m", False),
    ]
    written = gym_stack.judges_config(bindings)
    assert written["math_judge_model"] == {
        "responses_api_models": {
            "vllm_model": {
                "entrypoint": "app.py",
                "base_url": "http://127.0.0.1:8100/v1",
                "api_key": "${shardrun_judge_api_key_math_judge_model}",
                "model": "judge",
                "return_token_id_information": False,
                "uses_reasoning_parser": False,
            }
        }
    }
    assert written["lc_judge_model"] == {
        "responses_api_models": {
            "openai_model": {
                "entrypoint": "app.py",
                "openai_base_url": "https://judge.example/v1",
                "openai_api_key": "${shardrun_judge_api_key_lc_judge_model}",
                "openai_model": "qwen",
                "max_concurrent_requests": 64,
                "extra_body": {"seed": 1},
            }
        }
    }
    assert "max_concurrent_requests" not in written["keyless"]["responses_api_models"]["openai_model"]
    assert key not in yaml.safe_dump(written)
    keys = gym_stack.judge_keys(bindings)
    assert keys == {
        "shardrun_judge_api_key_math_judge_model": key,
        "shardrun_judge_api_key_lc_judge_model": key,
        "shardrun_judge_api_key_keyless": "EMPTY",
    }
    env_yaml = yaml.safe_load(gym_stack.env_yaml_text(["http://p/v1"], None, "policy", keys))
    assert env_yaml["shardrun_judge_api_key_math_judge_model"] == key and env_yaml["policy_api_key"] == "EMPTY"
    assert repr(bindings[0]).count(key) == 0  # never in a repr (logs, errors)


def test_ng_run_gets_the_judges_config_after_the_environments(tmp_path: Path) -> None:
    from shardrun.core import gym_adapter

    gym = config.GymConfig(config_paths=["a.yaml", "b.yaml"])
    cmd = gym_stack.ng_run_command(
        gym_adapter.for_version("0.7.0"), tmp_path, gym, 1234, tmp_path, [gym_stack.JUDGES_YAML]
    )
    assert f"+config_paths=[a.yaml,b.yaml,{gym_stack.JUDGES_YAML}]" in cmd


# ---------------------------------------------------------------- GPUs


def test_judges_take_the_last_gpus_and_the_policy_the_rest() -> None:
    two = {"a": JudgeConfig(vllm={"model": "m", "tensor_parallel_size": 2}), "b": JudgeConfig(vllm={"model": "m"})}  # type: ignore[arg-type]
    assert judges.split_devices({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, two) == (
        "0,1,2,3,4",
        {"a": "6,7", "b": "5"},
    )
    assert judges.split_devices({}, two) == (None, {})  # no GPU listed: nothing changed
    external = {"e": JudgeConfig(base_url="http://h/v1", model_name="m")}
    assert judges.split_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, external) == (None, {})
    with pytest.raises(BadInput, match="judges.a 2 \\+ judges.b 1 GPU\\(s\\) of their own, but this node shows 3"):
        judges.split_devices({"CUDA_VISIBLE_DEVICES": "0,1,2"}, two)


def slurm_config(policy_vllm: dict | None, judges_section: dict, nodes: int = 1, gpus: int = 8) -> RunConfig:
    data = {
        "input_jsonl": "x",
        "run_dir": "y",
        "gym": {"config_paths": ["a.yaml"]},
        "policy": {"vllm": policy_vllm} if policy_vllm else {"base_url": "http://h:1/v1", "model_name": "m"},
        "cluster": {"executor": "slurm", "nodes": nodes, "gpus_per_node": gpus},
        "judges": judges_section,
    }
    return config.validate(data)


def test_preflight_counts_the_judges_gpus_beside_the_policys() -> None:
    judge4 = {"j": {"vllm": {"model": "/m", "tensor_parallel_size": 4}}}
    assert preflight.judge_gpu_problems(slurm_config({"model": "/p", "tensor_parallel_size": 4}, judge4)) == []
    [problem] = preflight.judge_gpu_problems(slurm_config({"model": "/p", "tensor_parallel_size": 8}, judge4))
    assert problem.startswith("judges.j.vllm tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4 GPU(s)")
    assert "policy.vllm 8 + the judges' 4 = 12 GPUs, and cluster.gpus_per_node is 8" in problem
    # a pre-hosted policy leaves the node to the judges
    assert (
        preflight.judge_gpu_problems(slurm_config(None, {"j": {"vllm": {"model": "/m", "tensor_parallel_size": 8}}}))
        == []
    )
    [none] = preflight.judge_gpu_problems(slurm_config(None, judge4, gpus=0))
    assert "cluster.gpus_per_node: 0" in none and "judges.NAME.vllm.device: cpu" in none
    [spread] = preflight.judge_gpu_problems(slurm_config({"model": "/p", "replicas": 2}, judge4, nodes=2))
    assert "set cluster.judge_nodes" in spread and "cluster.nodes 2" in spread  # judge nodes: test_judge_nodes.py
    # external judges and CPU judges need no GPU; local jobs are not checked (as for the policy)
    assert preflight.judge_gpu_problems(slurm_config({"model": "/p", "tensor_parallel_size": 8}, {"e": EXTERNAL})) == []
    local = slurm_config({"model": "/p", "tensor_parallel_size": 8}, judge4).model_copy(
        update={"cluster": config.ClusterConfig(executor="local")}
    )
    assert preflight.judge_gpu_problems(local) == []


def test_plan_refuses_judges_that_do_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"responses_create_params": {"input": "q"}}) + "\n")
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "input_jsonl": "in.jsonl",
                "run_dir": "runs/r",
                "agent_name": "a",
                "policy": {"vllm": {"model": "/p", "tensor_parallel_size": 8}},
                "cluster": {"executor": "slurm", "gpus_per_node": 8},
                "judges": {"math_judge_model": {"vllm": {"model": "/m", "tensor_parallel_size": 2}}},
            }
        )
    )
    res = runner.invoke(app, ["plan", str(path)])
    assert res.exit_code == 2, res.output
    assert "the self-hosted policy and judges do not fit the Slurm job" in res.output
    assert "policy.vllm 8 + the judges' 2 = 10 GPUs" in res.output


# ---------------------------------------------------------------- keys by name


def with_judges(cfg: RunConfig, section: dict) -> RunConfig:
    return config.validate(cfg.model_dump(mode="json") | {"judges": section})


def test_judge_keys_are_passed_to_jobs_and_checked_by_name(tmp_path: Path) -> None:
    run = synthetic.make(tmp_path, tasks=4, shards=1, seal=False)
    cfg = with_judges(synthetic.launch_config(run, api_key_env=gymkit.KEY_ENV), {"j": EXTERNAL, "k": HOSTED})
    assert slurm.pass_through_env(cfg) == [gymkit.KEY_ENV, VAR]
    assert preflight.missing_environment(cfg, {gymkit.KEY_ENV: "x"}) == [
        f"judges.j.api_key_env: ${VAR} is not set in this shell; export it where you submit (jobs take it from here)",
        f"judges.k.api_key_env: ${VAR} is not set in this shell; export it where you submit (jobs take it from here)",
    ]
    with pytest.raises(BadInput, match=f"judges.j.api_key_env: \\${VAR} is not set"):
        preflight.check_secrets(cfg, {})
    with pytest.raises(BadInput, match=f"judges.j.api_key_env names \\${VAR}, which is not set"):
        judges.key_for("j", cfg.judges["j"], {})


def test_the_environment_manifest_records_the_judges_by_name_only() -> None:
    key = "judge-" + pysecrets.token_hex(8)
    cfg = validate({"j": EXTERNAL, "k": HOSTED}, gym={})
    built = env_manifest.build(cfg, env={VAR: key})
    assert built["judges"]["j"] == {
        "api_key_env": VAR,
        "server_options": {},
        "base_url": "https://judge.example/v1",
        "model_name": "qwen-235b",
    }
    assert built["judges"]["k"]["model"] == "/models/judge" and key not in json.dumps(built)
    assert "judges" not in env_manifest.build(validate({}, gym={}), env={})  # runs without judges compare as before


# ---------------------------------------------------------------- submit --dry-run


def test_submit_dry_run_shows_the_judge_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "judge-" + pysecrets.token_hex(8)
    run = synthetic.make(tmp_path, tasks=30, shards=3, seal=False)
    path = synthetic.launch_config_file(run, tmp_path / "run.yaml", executor="slurm", gpus_per_node=4)
    data = json.loads(path.read_text())
    data["judges"] = {
        "math_judge_model": {"vllm": {"model": "judge/model", "tensor_parallel_size": 2}, "api_key_env": VAR},
        "lc_judge_model": EXTERNAL | {"max_concurrent_requests": 64, "request_timeout_s": None},
    }
    path.write_text(json.dumps(data))
    monkeypatch.setenv(VAR, key)
    res = runner.invoke(app, ["submit", str(path), "--dry-run"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "# ---- judges, started once per job before the policy (2; docs/judges.md)" in out
    assert "# judge math_judge_model: self-hosted on the job's first node, 2 GPU(s) of its own" in out
    assert "--model judge/model --served-model-name model --host 127.0.0.1 --port 8100 --tensor-parallel-size 2" in out
    assert f"# judge lc_judge_model: external https://judge.example/v1 model qwen-235b; key ${VAR}; at most 64" in out
    shown = yaml.safe_load(out[out.index(f"# ---- {gym_stack.JUDGES_YAML}") :].split("\n", 1)[1])
    assert shown["lc_judge_model"]["responses_api_models"]["openai_model"]["max_concurrent_requests"] == 64
    # the self-hosted judge through its gate (request_timeout_s, 900 by default); the external one without (null)
    assert (
        "#   reached through a gate on loopback (127.0.0.1, a port chosen at start) answering 504 to a request "
        "unanswered after 900 s (judges.math_judge_model.request_timeout_s): a judge failure" in out
    )
    assert shown["math_judge_model"]["responses_api_models"]["vllm_model"]["base_url"] == "http://127.0.0.1:GATE/v1"
    assert shown["lc_judge_model"]["responses_api_models"]["openai_model"]["openai_base_url"] == EXTERNAL["base_url"]
    assert out.count("reached through a gate") == 1
    assert key not in out


# ---------------------------------------------------------------- a manifest's judge block


def judge_manifest(block: dict, **more) -> dict:
    return {
        "nickname": "j",
        "gym_env_start": {"config_paths": ["m.yaml"], "my_judge": {"responses_api_models": {"openai_model": block}}}
        | more,
        "entries": [{"label": "a", "agent": "a", "data": "a.jsonl"}],
    }


OPENAI_BLOCK = {
    "entrypoint": "app.py",
    "openai_base_url": "https://judge.example/v1",
    "openai_model": "qwen",
    "openai_api_key": "${my_judge_key}",
    "max_concurrent_requests": 8,
    "extra_body": {"seed": 1},
}


def test_a_manifest_judge_block_becomes_an_external_judge() -> None:
    from shardrun.core import sweep_manifest

    out = sweep_manifest.translate(judge_manifest(OPENAI_BLOCK), "m.yaml")
    assert out["judges"] == {
        "my_judge": {
            "base_url": "https://judge.example/v1",
            "model_name": "qwen",
            "api_key_env": "MY_JUDGE_KEY",
            "max_concurrent_requests": 8,
            "server_options": {"extra_body": {"seed": 1}},
        }
    }
    assert "overrides" not in out.get("gym", {})
    [note] = out["translation_notes"]
    assert "its key ${my_judge_key} is read from $MY_JUDGE_KEY" in note


@pytest.mark.parametrize(
    "change",
    [
        {"openai_base_url": "${judge_url}"},  # not a plain URL
        {"openai_api_key": "literal-key-in-the-file"},  # a key written out: not taken (the secrets check reads it)
        {"max_concurrent_requests": "64"},
    ],
)
def test_other_judge_blocks_stay_gym_overrides(change: dict) -> None:
    from shardrun.core import sweep_manifest

    out = sweep_manifest.translate(judge_manifest(OPENAI_BLOCK | change), "m.yaml")
    assert "judges" not in out and out["gym"]["overrides"][0].startswith("++my_judge=")


def test_a_variable_of_a_gym_override_is_noted_until_gym_secrets_maps_it(tmp_path: Path, monkeypatch) -> None:
    from shardrun.plan import planner

    manifest = judge_manifest(OPENAI_BLOCK | {"openai_base_url": "${judge_url}"})
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(manifest))
    cfg = config.load(path, [])
    notes = planner.translation_notes(cfg)
    assert [n.split(",")[0] for n in notes] == [
        "gym_env_start.my_judge references ${my_judge_key}",
        "gym_env_start.my_judge references ${judge_url}",
    ]
    mapped = config.load(path, ["++gym.secrets.judge_url=JUDGE_URL"])
    assert [n.split(",")[0] for n in planner.translation_notes(mapped)] == [
        "gym_env_start.my_judge references ${my_judge_key}"
    ]


# ---------------------------------------------------------------- a judge that hangs


def test_an_external_judge_is_reached_through_its_gate_which_ends_a_hung_request_with_504(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge is the stand-in model server (the fake at the model seam) hanging every request whose prompt holds
    "hang me" until it is stopped; the gate (judges.j.request_timeout_s) is the only way such a request ends."""
    key = "judge-" + pysecrets.token_hex(8)
    monkeypatch.setenv(VAR, key)
    with harness.fake_policy(tmp_path, "--fault", "hang:match=hang me", key=key) as stand_in:
        cfg = JudgeConfig.model_validate(
            {"base_url": stand_in.base_url, "model_name": "fake-model", "api_key_env": VAR, "request_timeout_s": 1}
        )
        [judge], _ = judges.start_all({"j": cfg}, tmp_path)
        try:
            bound = judge.binding.base_url
            assert bound.startswith("http://127.0.0.1:") and bound != stand_in.base_url and bound.endswith("/v1")
            assert "a request unanswered after 1 s is a judge failure" in judge.describe()

            def ask(text: str) -> tuple[int, dict]:
                body = {"model": "fake-model", "messages": [{"role": "user", "content": text}]}
                req = urllib.request.Request(
                    bound + "/chat/completions",
                    json.dumps(body).encode(),
                    {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                )
                try:
                    with urllib.request.urlopen(req, timeout=300) as resp:
                        return resp.status, json.loads(resp.read())
                except urllib.error.HTTPError as e:
                    return e.code, json.loads(e.read())

            status, body = ask("hang me, please")
            assert status == 504, body
            assert body["error"]["message"] == (
                "gate: the judge j did not answer within 1 s (judges.j.request_timeout_s = 1)"
            )
            status, body = ask("What is 1 + 1?")
            assert status == 200 and body["choices"][0]["message"]["content"], body
            assert judge.problem() is None
            assert [r["fault"] for r in stand_in.requests()] == ["hang", None]
        finally:
            judges.stop_all([judge])
        assert judge.gate is not None and judge.problem() is not None  # the gate is closed with the judge
