"""NVIDIA's example_judge.yaml (the nemo-gym 0.7.0 wheel's reward-profiling manifests) as it is (issue #36, item
4): its judge block (`math_judge_model`, Gym's openai_model with `openai_api_key: ${nv_inference_api_key}` and
`max_concurrent_requests: 64`) becomes the external judge `judges.math_judge_model`, its key read from
$NV_INFERENCE_API_KEY; its `lc_judge` block (the environment's binding to that judge) stays a Gym override. It plans
and `submit --dry-run`s with only its data (a local file, through data_root), the model and that variable; the plan
says where the key is read from, and refuses naming the variable while it is not set. The key is in no output."""

from __future__ import annotations

import json
import secrets as pysecrets
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config
from shardrun.shard import gym_stack
from tests.interface.test_cli_manifest import WHEEL

pytestmark = [
    pytest.mark.gym,  # the nemo-gym 0.7.0 wheel's own files
    pytest.mark.skipif(not WHEEL.is_dir(), reason="the nemo-gym 0.7.0 wheel (scripts/setup.sh gym) is not installed"),
]
runner = CliRunner()
MANIFEST = WHEEL / "manifests" / "example_judge.yaml"
KEY_ENV = "NV_INFERENCE_API_KEY"
JUDGE = "math_judge_model"


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gym_venv: Path) -> list[str]:
    """The overrides a user gives: where the data is, the run dir, the model (a local directory, served by the
    vLLM of this interpreter's venv). The data file: a few long-context rows under the manifest's file name."""
    raw = yaml.safe_load(MANIFEST.read_text())
    data = tmp_path / "data" / Path(raw["entries"][0]["data"]).name
    data.parent.mkdir()
    data.write_text(
        "".join(
            json.dumps(
                {
                    "responses_create_params": {"input": [{"role": "user", "content": f"Question {i}?"}]},
                    "question": f"Question {i}?",
                    "expected_answer": str(i),
                }
            )
            + "\n"
            for i in range(5)
        )
    )
    model = tmp_path / "models" / "policy"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    monkeypatch.delenv(KEY_ENV, raising=False)
    return [
        f"data_root={data.parent}",
        f"run_dir={tmp_path / 'run'}",
        f"policy.vllm.model={model}",
        f"policy.vllm.python={sys.executable}",
    ]


def test_its_judge_block_becomes_an_external_judge_with_its_key_by_name(local: list[str]) -> None:
    cfg = config.load(MANIFEST, local)
    judge = cfg.judges[JUDGE]
    assert (judge.base_url, judge.model_name) == ("https://inference-api.nvidia.com/v1", "nvidia/qwen/qwen-235b")
    assert judge.api_key_env == KEY_ENV and judge.max_concurrent_requests == 64 and judge.server_options == {}
    assert cfg.gym is not None and cfg.gym.overrides == [
        "++lc_judge={resources_servers:{equivalence_llm_judge:{judge_model_server:{type:'responses_api_models',"
        "name:'math_judge_model'}}}}"
    ]
    assert not any(JUDGE in o and "openai_model" in o for o in cfg.gym.overrides)  # not defined twice
    assert cfg.gym.config_paths == [
        "responses_api_models/vllm_model/configs/vllm_model.yaml",
        "resources_servers/equivalence_llm_judge/configs/lc_judge.yaml",
    ]
    [note] = cfg.translation_notes
    assert note == (
        "gym_env_start.math_judge_model: the external judge judges.math_judge_model (Gym's openai_model at "
        "https://inference-api.nvidia.com/v1, model nvidia/qwen/qwen-235b, at most 64 requests at once); its key "
        "${nv_inference_api_key} is read from $NV_INFERENCE_API_KEY (export it where you plan and submit, or set "
        "judges.math_judge_model.api_key_env to the variable that holds it)"
    )


def test_it_plans_once_the_key_variable_is_set(local: list[str], tmp_path: Path, monkeypatch) -> None:
    refused = runner.invoke(app, ["plan", str(MANIFEST), *local])
    assert refused.exit_code == 2, refused.output
    assert f"judges.math_judge_model.api_key_env: ${KEY_ENV} is not set in this shell" in refused.output
    key = "nvapi-" + pysecrets.token_hex(20)
    monkeypatch.setenv(KEY_ENV, key)
    res = runner.invoke(app, ["plan", str(MANIFEST), *local, "--write"])
    assert res.exit_code == 0, res.output
    assert "manifest: gym_env_start.math_judge_model: the external judge judges.math_judge_model" in res.output
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["num_rollouts"] == 5 * 8  # 5 rows x the manifest's gym_eval_run.num_repeats
    assert plan["config"]["judges"][JUDGE]["api_key_env"] == KEY_ENV
    assert key not in res.output and [p for p in (tmp_path / "run").rglob("*") if key.encode() in _bytes(p)] == []


def _bytes(p: Path) -> bytes:
    return p.read_bytes() if p.is_file() else b""


def test_it_submits_dry_run_on_slurm_showing_the_judge(local: list[str], monkeypatch) -> None:
    key = "nvapi-" + pysecrets.token_hex(20)
    monkeypatch.setenv(KEY_ENV, key)
    slurm = ["++cluster.executor=slurm", "++cluster.gpus_per_node=8", "policy.vllm.tensor_parallel_size=8"]
    res = runner.invoke(app, ["submit", str(MANIFEST), *local, *slurm, "--dry-run"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert (
        f"# judge {JUDGE}: external https://inference-api.nvidia.com/v1 model nvidia/qwen/qwen-235b; key "
        f"${KEY_ENV}; at most 64 requests at once"
    ) in out
    # Gym reaches the judge through its gate, which ends a request unanswered after judges.NAME.request_timeout_s
    assert f"answering 504 to a request unanswered after 900 s (judges.{JUDGE}.request_timeout_s)" in out
    shown = yaml.safe_load(out[out.index(f"# ---- {gym_stack.JUDGES_YAML}") :].split("\n", 1)[1])
    assert shown[JUDGE]["responses_api_models"]["openai_model"] == {
        "entrypoint": "app.py",
        "openai_base_url": "http://127.0.0.1:GATE/v1",
        "openai_api_key": "${shardrun_judge_api_key_math_judge_model}",
        "openai_model": "nvidia/qwen/qwen-235b",
        "max_concurrent_requests": 64,
    }
    assert f': "${{{KEY_ENV}:?' in out  # the job script checks the variable arrived, never holding its value
    assert key not in out


def test_the_super_manifests_gateway_judges_map_alike(tmp_path: Path) -> None:
    """nemotron_3_5_super.yaml defines four judge names with one YAML anchor (the gateway judge): four external
    judges, one key variable."""
    path = WHEEL / "manifests" / "nemotron_3_5_super.yaml"
    cfg = config.load(path, [f"run_dir={tmp_path / 'run'}"])
    assert sorted(cfg.judges) == ["genrm_model", "judge_model", "math_judge_model", "nl2bash_judge_model"]
    assert {(j.base_url, j.api_key_env, j.max_concurrent_requests) for j in cfg.judges.values()} == {
        ("https://inference-api.nvidia.com/v1", KEY_ENV, 64)
    }
    assert len(cfg.translation_notes) == 4
