"""A run is made with one Gym release and one environment (#14): the version found in gym.venv is recorded in
plan.json and every `.done` marker and shown by status; submit/resume and the shard refuse a venv of another
version; the environment manifest (environment.json) makes a changed Gym or policy configuration a refusal with
its differences, unless `resume --allow-config-change`, which is recorded.

The Gym venvs here are stand-ins with nemo-gym's installed metadata only: nothing starts a server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from shardrun.core.errors import BadInput, PlanMismatch
from shardrun.launch import status, submission
from shardrun.rundir import env_manifest, store
from shardrun.core import gym_adapter
from shardrun.shard import runtime
from tests import builders
from tests.builders import input_rows

CONFIG = "resources_servers/toy/configs/toy.yaml"


def stand_in_venv(root: Path, version: str) -> Path:
    """A directory laid out like a Gym venv of `version`: its metadata, its commands, one server config."""
    venv = root / f"gym-{version}"
    (venv / "bin").mkdir(parents=True)
    for script in ("ng_run", "gym"):
        (venv / "bin" / script).write_text("")
    site = venv / "lib" / "python3.12" / "site-packages"
    meta = site / f"nemo_gym-{version}.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"Metadata-Version: 2.4\nName: nemo-gym\nVersion: {version}\n")
    (site / CONFIG).parent.mkdir(parents=True)
    (site / CONFIG).write_text("config_paths: [resources_servers/toy/configs/nested.yaml]\ntoy: {x: 1}\n")
    (site / "resources_servers/toy/configs/nested.yaml").write_text("nested: 1\n")
    return venv


def config_file(tmp: Path, venv: Path, **policy) -> Path:
    """A 2-shard run of 4 tasks with the Gym venv `venv` (one server config, one override) and these policy settings."""
    src = tmp / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in input_rows(4)))
    return builders.write_config(
        tmp / "run.yaml",
        src,
        tmp / "run",
        shards=2,
        gym={"venv": str(venv), "config_paths": [CONFIG], "overrides": ["+a=1"]},
        policy={"base_url": "http://127.0.0.1:9/v1", "model_name": "m1"} | policy,
    )


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def launched(tmp: Path, venv: Path) -> tuple[Path, Path]:
    """A planned run whose first launch saved its settings and manifest (what submit does before launching)."""
    from shardrun.core import config as config_mod

    cfg_path = config_file(tmp, venv)
    done = cli("plan", str(cfg_path), "--write", cwd=tmp)
    assert done.returncode == 0, done.stderr
    cfg = config_mod.load(cfg_path, [])
    store.write_launch_settings(cfg.run_dir, cfg)
    assert env_manifest.check_and_record(cfg.run_dir, cfg) == []
    return cfg_path, cfg.run_dir


def test_the_plan_records_the_venvs_version_and_status_shows_it(tmp_path: Path) -> None:
    _, run_dir = launched(tmp_path, stand_in_venv(tmp_path, "0.7.0"))
    plan = store.load_plan(run_dir)
    assert plan.gym_version == "0.7.0" and orjson.loads(store.plan_path(run_dir).read_bytes())["gym_version"] == "0.7.0"
    st = status.collect(run_dir, query_live=lambda names: {}, query_ended=lambda ids: {})
    assert st.gym_version == "0.7.0" and "nemo-gym 0.7.0" in status.render(st)
    manifest = env_manifest.read(run_dir)
    assert manifest is not None and manifest["gym"]["version"] == "0.7.0"
    files = {f["path"]: f for f in manifest["gym"]["config_files"]}
    assert set(files) == {CONFIG, "resources_servers/toy/configs/nested.yaml"}  # nested config_paths followed
    assert all(f["sha256"] and f["resolved"].startswith(str(tmp_path)) for f in files.values())


def test_resume_refuses_a_venv_of_another_gym_version(tmp_path: Path) -> None:
    cfg_path, run_dir = launched(tmp_path, stand_in_venv(tmp_path, "0.4.0"))
    other = stand_in_venv(tmp_path, "0.7.0")
    done = cli("resume", str(run_dir), f"gym.venv={other}", "--dry-run", "--allow-config-change", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "holds nemo-gym 0.7.0, but this run was planned with nemo-gym 0.4.0" in done.stderr
    assert "never mixes" in done.stderr
    unsupported = stand_in_venv(tmp_path / "x", "0.5.1")
    done = cli("resume", str(run_dir), f"gym.venv={unsupported}", "--dry-run", cwd=tmp_path)
    assert done.returncode == 2 and "nemo-gym 0.5.1 is not supported" in done.stderr


def test_the_shard_refuses_a_venv_of_another_gym_version(tmp_path: Path, monkeypatch) -> None:
    _, run_dir = launched(tmp_path, stand_in_venv(tmp_path, "0.4.0"))
    monkeypatch.setenv("SHARDRUN_GYM_VENV", str(stand_in_venv(tmp_path / "y", "0.7.0")))
    plan = store.load_plan(run_dir)
    cfg = runtime.launch_config(run_dir, plan)
    assert cfg.gym is not None
    cfg = cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"venv": None})})  # the environment's venv now
    shard = runtime.Shard(run_dir, 0, plan, cfg, lambda m: None, None, 1)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="never mixes Gym versions"):
        shard.gym_release()


def test_a_changed_environment_is_refused_with_its_differences_unless_allowed(tmp_path: Path) -> None:
    venv = stand_in_venv(tmp_path, "0.4.0")
    cfg_path, run_dir = launched(tmp_path, venv)
    nested = venv / "lib/python3.12/site-packages/resources_servers/toy/configs/nested.yaml"
    nested.write_text("nested: 2\n")  # a config file's content
    done = cli("resume", str(run_dir), "gym.overrides=['+a=2']", "policy.model_name=m2", "--dry-run", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert "the Gym or policy configuration changed" in err and "--allow-config-change" in err
    assert "gym.config_files[resources_servers/toy/configs/nested.yaml]: content changed" in err
    assert 'gym.overrides: ["+a=1"] -> ["+a=2"]' in err and 'policy.model_name: "m1" -> "m2"' in err
    before = env_manifest.read(run_dir)

    done = cli("resume", str(run_dir), "--dry-run", "--allow-config-change", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "configuration change accepted (--allow-config-change, recorded)" in done.stdout
    assert env_manifest.read(run_dir) == before  # a dry run records nothing

    from shardrun.core import config as config_mod

    cfg = config_mod.load(cfg_path, [])
    changes = env_manifest.check_and_record(run_dir, cfg, allow_change=True, now=5.0)
    assert any("nested.yaml" in c for c in changes)
    after = env_manifest.read(run_dir)
    assert after is not None and after["changes"] == [
        {"at": 5.0, "allowed_by": "--allow-config-change", "differences": changes}
    ]
    assert env_manifest.check_and_record(run_dir, cfg) == []  # the accepted environment is the run's now


def test_the_manifest_never_holds_the_key(tmp_path: Path, monkeypatch) -> None:
    from shardrun.core import config as config_mod

    monkeypatch.setenv("SHARDRUN_TEST_KEY_NAME", "sk-not-in-any-file-1234567890")
    cfg = config_mod.load(
        config_file(tmp_path, stand_in_venv(tmp_path, "0.4.0"), api_key_env="SHARDRUN_TEST_KEY_NAME"), []
    )
    text = orjson.dumps(env_manifest.build(cfg)).decode()
    assert "SHARDRUN_TEST_KEY_NAME" in text and "sk-not-in-any-file" not in text


def test_check_gym_version_of_a_launch(tmp_path: Path) -> None:
    from shardrun.core import config as config_mod

    cfg = config_mod.load(config_file(tmp_path, stand_in_venv(tmp_path, "0.7.0")), [])
    plan = store.scan_input(cfg)
    assert plan.gym_version == "0.7.0" and type(gym_adapter.for_version(plan.gym_version)).__name__ == "GymV07"
    submission.check_gym_version(cfg, plan)
    with pytest.raises(PlanMismatch, match="planned with nemo-gym 0.4.0"):
        submission.check_gym_version(cfg, type(plan)(**{**plan.__dict__, "gym_version": "0.4.0"}))


def test_the_report_shows_the_gym_version_and_each_agents_coverage() -> None:
    from shardrun.analysis import report
    from shardrun.profile.taskstats import AgentSummary

    rows = report.agent_rows([AgentSummary("math", 3, 9, 12, 0.5, 50.0, 4, 75.0)], {"math": 16})
    assert rows[0][-1] == "9 of 16 (56.2%)" and report.AGENT_HEADER[-1] == "coverage (of planned)"
    assert report.agent_rows([AgentSummary("tool", 1, 2, 2, 1.0, 100.0, 2, 100.0)])[0][-1] == "2 of 2 (100.0%)"


def test_the_tests_and_setup_sh_know_the_same_gym_versions() -> None:
    import re

    from tests.conftest import GYM_VERSIONS, REPO

    setup = (REPO / "scripts" / "setup.sh").read_text()
    listed = re.search(r'^GYM_VERSIONS="([^"]+)"', setup, re.M)
    assert listed is not None and tuple(listed.group(1).split()) == GYM_VERSIONS
    assert "setup.sh project gyms" in (REPO / "scripts" / "test.sh").read_text()  # CI builds every version
    for version in GYM_VERSIONS:
        gym_adapter.for_version(version)  # each has its adapter


def test_a_gym_0_7_failure_row_gives_its_reason() -> None:
    """The row is one nemo-gym 0.7.0 wrote for a /run whose model call the stand-in policy rejected with a 400."""
    from shardrun.core import gym_errors
    from shardrun.rundir import ledger
    from tests.conftest import REPO

    row = orjson.loads((REPO / "tests" / "golden" / "gym07_failure_row.json").read_bytes())
    assert row["_ng_failure_class"] == "agent_run_error" and "reward" not in row
    want = "/run failed with HTTP 500 (VLLMModel___policy_model: injected 400)"
    assert gym_errors.sidecar_reason(row) == ledger.failure_reason(row) == want
    assert ledger.failure_reason(row | {"reason": "shardrun's own"}) == "shardrun's own"
    assert ledger.failure_reason({"_ng_failure_class": "agent_request_failed"}) == "agent_request_failed"


@pytest.mark.parametrize("version,routed", [("0.4.0", ["a", "own", "a"]), ("0.7.0", ["a", "a", "a"])])
def test_agent_name_follows_the_gym_versions_semantics(tmp_path: Path, monkeypatch, version, routed) -> None:
    """Gym 0.4's +agent_name fills in rows without an agent_ref; Gym 0.7's routes every row to it (a new agent_ref),
    a dict num_repeats still matching the row's own agent when the routed one has no entry."""
    from shardrun.core import config as config_mod

    monkeypatch.setenv("SHARDRUN_GYM_VENV", str(stand_in_venv(tmp_path, version)))
    rows = [{"responses_create_params": {"input": "x"}}, {"responses_create_params": {"input": "y"}}]
    rows[1]["agent_ref"] = {"type": "responses_api_agents", "name": "own"}
    rows.append({"responses_create_params": {"input": "z"}})
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    cfg = config_mod.validate(
        {
            "input_jsonl": str(src),
            "run_dir": str(tmp_path / "run"),
            "agent_name": "a",
            "num_repeats": {"own": 3, "_default": 1},
        }
    )
    plan, _ = store.write_plan(cfg)
    planned = [orjson.loads(x) for x in store.materialized_path(cfg.run_dir, 0).read_bytes().splitlines()]
    by_task = {r["_ng_task_index"]: r["agent_ref"]["name"] for r in planned}
    assert [by_task[t] for t in sorted(by_task)] == routed
    assert sum(1 for r in planned if r["_ng_task_index"] == 1) == 3  # "own"'s repeats either way
    assert ("agent_name_overrides" in plan.planning) == (version == "0.7.0")
