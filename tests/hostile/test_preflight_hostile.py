"""Configs that cannot work, found before anything is launched: `submit` and `resume` check everything a shard
needs (the Gym venv, the config paths, the policy, the environment variables jobs take from the submitting
shell) and refuse with exit 2, every problem named by its key, nothing written, no job, no launch record.

The Gym venv here is a stand-in with the installed layout only (dist-info, bin/ng_run, site-packages): these
cases never start Gym. A shard whose every rollout is accounted for seals without servers, so a resume of such a
run needs none of this (the valid-but-unusual case)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import hostilekit
from hostilekit import invoke, refused
from reportkit import input_row, planned_run, seal_shards, write_input

from shardrun.core.errors import BadInput
from shardrun.rundir import store

CONFIG = "resources_servers/math/configs/math.yaml"


def stand_in_venv(root: Path, version: str = "0.4.0") -> Path:
    """A directory laid out like a Gym venv (what preflight reads), with one server config in site-packages."""
    return hostilekit.stand_in_venv(root, version, (CONFIG,))


@pytest.fixture()
def clean_env(tmp_path, monkeypatch):
    """No Gym venv from the environment or the setup cache: each case names what it has."""
    monkeypatch.delenv("SHARDRUN_GYM_VENV", raising=False)
    monkeypatch.delenv("SHARDRUN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    monkeypatch.delenv("SHARDRUN_TEST_UNSET_KEY", raising=False)
    monkeypatch.delenv("SHARDRUN_TEST_UNSET_VAR", raising=False)


def launch_config(tmp: Path, *, gym: dict | None = None, policy: dict | None = None, cluster: dict | None = None):
    inp = write_input(tmp / "input.jsonl", [input_row(i) for i in range(4)])
    venv = stand_in_venv(tmp)
    data = {
        "input_jsonl": str(inp),
        "run_dir": str(tmp / "run"),
        "num_repeats": 2,
        "sharding": {"num_shards": 2},
        "gym": {"venv": str(venv), "config_paths": [CONFIG]} | (gym or {}),
        "policy": policy or {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
        "cluster": {"executor": "local", "array_parallelism": 1} | (cluster or {}),
    }
    path = tmp / "launch.yaml"
    path.write_text(json.dumps(data))
    return path


CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "venv is an empty directory": ({"gym": {"venv": "EMPTY"}}, ("gym.venv", "no nemo-gym")),
    "venv does not exist": ({"gym": {"venv": "/nonexistent/gym-venv"}}, ("gym.venv", "/nonexistent/gym-venv")),
    "no venv anywhere": ({"gym": {"venv": None}}, ("gym.venv", "not set", "SHARDRUN_GYM_VENV")),
    "venv of an unsupported release": ({"gym": {"venv": "OLD"}}, ("gym.venv", "0.1.0")),
    "a config path that resolves nowhere": (
        {"gym": {"config_paths": [CONFIG, "resources_servers/nope/configs/nope.yaml"]}},
        ("gym.config_paths", "resources_servers/nope/configs/nope.yaml"),
    ),
    "an absolute config path that is missing": (
        {"gym": {"config_paths": ["/nonexistent/gym.yaml"]}},
        ("gym.config_paths", "/nonexistent/gym.yaml"),
    ),
    "a nested config path that is missing": (
        {"gym": {"config_paths": ["NESTED"]}},
        ("gym.config_paths", "inner/missing.yaml"),
    ),
    "no config paths": ({"gym": {"config_paths": []}}, ("gym.config_paths", "empty")),
    "the API key variable is unset": (
        {"policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m", "api_key_env": "SHARDRUN_TEST_UNSET_KEY"}},
        ("policy.api_key_env", "SHARDRUN_TEST_UNSET_KEY"),
    ),
    "a pass-through variable is unset": (
        {"cluster": {"env_vars": ["SET_HERE=1", "SHARDRUN_TEST_UNSET_VAR"]}},
        ("cluster.env_vars", "SHARDRUN_TEST_UNSET_VAR"),
    ),
    "a base_url that is not http": (
        {"policy": {"base_url": "ftp://models.internal/v1", "model_name": "m"}},
        ("policy.base_url", "ftp://models.internal/v1"),
    ),
    "a base_url without a host": (
        {"policy": {"base_url": ["http://127.0.0.1:9/v1", "http:///v1"], "model_name": "m"}},
        ("policy.base_url", "http:///v1"),
    ),
    "a vLLM interpreter that does not exist": (
        {"policy": {"vllm": {"model": "some/model-id", "python": "/nonexistent/vllm-venv"}}},
        ("policy.vllm.python", "/nonexistent/vllm-venv"),
    ),
    "a vLLM model path that does not exist": (
        {"policy": {"vllm": {"model": "/nonexistent/checkpoint", "command": ["true"]}}},
        ("policy.vllm.model", "/nonexistent/checkpoint"),
    ),
}


def resolve(tmp: Path, settings: dict) -> dict:
    """Fill in the placeholders (paths made under tmp) of a case's settings."""
    gym = dict(settings.get("gym") or {})
    if gym.get("venv") == "EMPTY":
        (tmp / "empty-venv").mkdir()
        gym["venv"] = str(tmp / "empty-venv")
    if gym.get("venv") == "OLD":
        gym["venv"] = str(stand_in_venv(tmp / "old", "0.1.0"))
    if gym.get("config_paths") == ["NESTED"]:
        outer = tmp / "outer.yaml"
        outer.write_text("config_paths:\n  - inner/missing.yaml\n")
        gym["config_paths"] = [str(outer)]
    return {**settings, **({"gym": gym} if gym else {})}


@pytest.mark.parametrize("case", sorted(CASES))
def test_submit_refuses_a_config_a_shard_could_not_run_and_writes_nothing(tmp_path, clean_env, unchanged, case):
    settings, named = CASES[case]
    cfg = launch_config(tmp_path, **resolve(tmp_path, settings))
    with unchanged(tmp_path):
        refused(invoke("submit", cfg), *named)
    assert not (tmp_path / "run").exists()  # nothing planned, launched or recorded


def test_every_problem_is_named_at_once(tmp_path, clean_env, unchanged):
    cfg = launch_config(
        tmp_path,
        gym={"config_paths": ["/nonexistent/a.yaml"]},
        policy={"base_url": "ftp://x/v1", "model_name": "m", "api_key_env": "SHARDRUN_TEST_UNSET_KEY"},
        cluster={"env_vars": ["SHARDRUN_TEST_UNSET_VAR"]},
    )
    with unchanged(tmp_path):
        refused(
            invoke("submit", cfg),
            "gym.config_paths",
            "policy.base_url",
            "policy.api_key_env",
            "cluster.env_vars",
            "nothing was launched",
        )


def run_with_shard_1_unsealed(tmp: Path, complete: bool) -> Path:
    """A planned run: shard 0 sealed; shard 1 not sealed, with every rollout written (`complete`: it seals without
    servers) or only its first one (the rest still to collect)."""
    run_dir, _ = planned_run(tmp, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, lambda t, r: 1.0, unsealed={1})
    if not complete:
        rollouts = store.rollouts_path(run_dir, 1)
        rollouts.write_bytes(rollouts.read_bytes().splitlines(keepends=True)[0])
    return run_dir


@pytest.fixture()
def half_sealed(tmp_path):
    return run_with_shard_1_unsealed(tmp_path, complete=False)


def test_resume_refuses_before_launching_and_records_nothing(tmp_path, clean_env, unchanged, half_sealed):
    cfg = launch_config(tmp_path, gym={"venv": "/nonexistent/gym-venv"})
    with unchanged(tmp_path):
        refused(invoke("resume", half_sealed, "--config", cfg), "gym.venv", "nothing was launched")
    assert not store.launches_path(half_sealed).exists() and not (half_sealed / "launch.json").exists()


def test_resume_refuses_a_linked_shard_directory_before_writing_anything(tmp_path, clean_env, unchanged, half_sealed):
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(str(store.shard_dir(half_sealed, 1)), str(outside / "00001"))
    store.shard_dir(half_sealed, 1).symlink_to(outside / "00001", target_is_directory=True)
    cfg = launch_config(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("resume", half_sealed, "--config", cfg), str(store.shard_dir(half_sealed, 1)), "symlink")


def test_a_run_whose_shards_need_no_servers_resumes_without_a_venv(tmp_path, clean_env):
    """Valid but unusual: every rollout of the unsealed shard is accounted for (its seal was lost), so the shard
    seals without servers; no Gym venv, config path or reachable policy is needed for that."""
    run_dir = run_with_shard_1_unsealed(tmp_path, complete=True)
    cfg = launch_config(tmp_path, gym={"venv": None, "config_paths": ["/nonexistent/gym.yaml"]})
    done = invoke("resume", run_dir, "--config", cfg)
    assert done.exit_code == 0, done.output
    assert store.done_path(run_dir, 1).exists()


def test_a_container_image_holds_the_venv_so_it_is_not_looked_for_here(tmp_path, clean_env, monkeypatch):
    """Valid but unusual: Slurm jobs in a pyxis image run the image's venv, configs and vLLM, which this machine
    cannot see; the variables the jobs take from this shell are still checked."""
    from shardrun.core import config
    from shardrun.launch import preflight

    image = {
        "executor": "slurm",
        "partition": "batch",
        "containers": {"shardrun": "/images/gym.sqsh"},
        "container_python": "python3",
        "gpus_per_node": 8,
    }
    path = launch_config(
        tmp_path,
        gym={"venv": "/opt/in-the-image/gym-venv", "config_paths": ["/opt/in-the-image/gym.yaml"]},
        policy={"vllm": {"model": "/models/in-the-image", "python": "/opt/in-the-image/vllm-venv"}},
        cluster=image,
    )
    cfg = config.load(path)
    plan = store.scan_input(cfg)
    preflight.check(cfg, cfg.run_dir, plan)  # nothing to refuse
    assert not cfg.run_dir.exists()
    monkeypatch.setenv("SHARDRUN_TEST_UNSET_KEY", "")
    assert cfg.cluster is not None
    keyed = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"env_vars": ["SHARDRUN_TEST_UNSET_KEY"]})})
    with pytest.raises(BadInput, match="cluster.env_vars"):
        preflight.check(keyed, keyed.run_dir, plan)


# ---------------------------------------------------------------- submit --dry-run rehearses submit (#35, item 6)


@pytest.mark.parametrize(
    "case",
    ["venv does not exist", "no venv anywhere", "a config path that resolves nowhere", "a base_url that is not http"],
)
def test_submit_dry_run_refuses_what_submit_refuses_with_the_same_exit_code_and_message(
    tmp_path, clean_env, unchanged, case
):
    settings, named = CASES[case]
    cfg = launch_config(tmp_path, **resolve(tmp_path, settings))
    with unchanged(tmp_path):
        rehearsal = invoke("submit", cfg, "--dry-run")
        real = invoke("submit", cfg)
    refused(rehearsal, *named)
    assert rehearsal.exit_code == real.exit_code and rehearsal.output == real.output
    assert "#!/bin/bash" not in rehearsal.output and "launch mode" not in rehearsal.output
    assert not (tmp_path / "run").exists()


def test_submit_dry_run_refuses_a_changed_recorded_configuration_as_submit_does(tmp_path, clean_env, unchanged):
    """A run launched with one Gym config: a dry run of a changed config is refused like the submit it rehearses."""
    from shardrun.core import config
    from shardrun.rundir import env_manifest

    cfg = config.load(launch_config(tmp_path))
    store.write_plan(cfg, store.scan_input(cfg))
    env_manifest.check_and_record(cfg.run_dir, cfg)
    changed = launch_config(tmp_path, policy={"base_url": "http://127.0.0.1:9/v1", "model_name": "another-model"})
    with unchanged(tmp_path):
        rehearsal = invoke("submit", changed, "--dry-run")
        real = invoke("submit", changed)
    assert rehearsal.exit_code == real.exit_code != 0, rehearsal.output
    assert "configuration changed" in rehearsal.output and rehearsal.output == real.output


def test_submit_dry_run_shows_the_plans_warnings_then_the_jobs(tmp_path, clean_env, unchanged):
    path = launch_config(tmp_path)
    data = json.loads(path.read_text())
    data["num_repeats"] = {"_default": 2, "agent_typo": 3}
    path.write_text(json.dumps(data))
    with unchanged(tmp_path):
        planned = invoke("plan", path)
        rehearsal = invoke("submit", path, "--dry-run")
    warning = "warning: num_repeats lists agent(s) no row uses (typo?): agent_typo"
    assert warning in planned.output
    assert rehearsal.exit_code == 0, rehearsal.output
    assert warning in rehearsal.output and "launch mode: local jobs" in rehearsal.output
    assert rehearsal.output.index(warning) < rehearsal.output.index("launch mode")


# ---------------------------------------------------------------- a self-hosted policy's GPUs fit the job (#35, item 5)

IMAGE = {
    "executor": "slurm",
    "partition": "batch",
    "containers": {"shardrun": "/images/gym.sqsh"},
    "container_python": "/opt/venv/bin/python3",
}


def gpu_config(tmp: Path, vllm: dict, cluster: dict) -> Path:
    """A Slurm run (in an image: the vLLM interpreter is the image's) with a self-hosted policy."""
    return launch_config(tmp, policy={"vllm": {"model": "org/model", "python": "/opt/vllm"} | vllm}, cluster=cluster)


def test_more_gpus_than_the_job_has_are_refused_at_plan_submit_and_dry_run_naming_the_fields(
    tmp_path, clean_env, unchanged
):
    cfg = gpu_config(tmp_path, {"tensor_parallel_size": 8}, IMAGE | {"nodes": 1, "gpus_per_node": 2})
    says = (
        "policy.vllm.tensor_parallel_size 8 x pipeline_parallel_size 1 needs 8 GPUs; "
        "cluster.nodes 1 x cluster.gpus_per_node 2 gives 2"
    )
    with unchanged(tmp_path):
        for args in (("plan", cfg), ("plan", cfg, "--write"), ("submit", cfg), ("submit", cfg, "--dry-run")):
            refused(invoke(*args), says)
    assert not (tmp_path / "run").exists()


def test_a_gpu_less_slurm_job_for_a_self_hosted_policy_is_refused_unless_it_says_cpu(tmp_path, clean_env, unchanged):
    cfg = gpu_config(tmp_path, {}, IMAGE)  # gpus_per_node defaults to 0
    with unchanged(tmp_path):
        refused(invoke("plan", cfg), "cluster.gpus_per_node: 0", "policy.vllm.device: cpu")
        refused(invoke("submit", cfg, "--dry-run"), "cluster.gpus_per_node: 0", "needs 1 GPU(s)")
        on_cpu = invoke("submit", cfg, "--dry-run", "policy.vllm.device=cpu")
    assert on_cpu.exit_code == 0, on_cpu.output
    assert "launch mode: Slurm job arrays" in on_cpu.output and "#!/bin/bash" in on_cpu.output
    assert "--gpus-per-node" not in on_cpu.output


@pytest.mark.parametrize(
    "vllm, cluster, fits, names",
    [
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, {"nodes": 2, "gpus_per_node": 4}, True, ()),
        (
            {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "data_parallel_size": 2},
            {"nodes": 2, "gpus_per_node": 4},
            False,
            ("pipeline_parallel_size 2 x data_parallel_size 2 needs 16 GPUs", "cluster.nodes 2 x", "gives 8"),
        ),
        ({"pipeline_parallel_size": 3}, {"nodes": 1, "gpus_per_node": 2}, False, ("needs 3 GPUs", "gives 2")),
        ({"tensor_parallel_size": 2}, {"nodes": 1, "gpus_per_node": 8}, True, ()),  # fewer than the job has: fine
        ({"tensor_parallel_size": 8}, {"executor": "local"}, True, ()),  # local jobs: this machine's GPUs as they are
        ({"tensor_parallel_size": 8}, {"workers": 2, "gpus_per_node": 4}, False, ("needs 8 GPUs", "gives 4")),
    ],
)
def test_the_gpu_arithmetic(tmp_path, clean_env, vllm, cluster, fits, names):
    from shardrun.core import config
    from shardrun.launch import preflight

    cfg = config.load(gpu_config(tmp_path, vllm, IMAGE | cluster))
    problems = preflight.gpu_problems(cfg)
    assert (problems == []) is fits, problems
    for name in names:
        assert name in "\n".join(problems)
    if not fits:
        with pytest.raises(BadInput, match="does not fit the Slurm job"):
            preflight.check_gpus(cfg)


# ---------------------------------------------------------------- jobs in a container image (#35, item 4)


def test_a_container_image_without_its_interpreter_is_refused_naming_the_field(tmp_path, clean_env, unchanged):
    """This checkout's interpreter does not exist in the image: the jobs need the image's (cluster.container_python)."""
    image = {k: v for k, v in IMAGE.items() if k != "container_python"} | {"gpus_per_node": 1}
    cfg = gpu_config(tmp_path, {}, image)
    with unchanged(tmp_path):
        for args in (("submit", cfg), ("submit", cfg, "--dry-run")):
            refused(invoke(*args), "cluster.container_python: not set", "cluster.containers.shardrun")
        given = invoke("submit", cfg, "--dry-run", "cluster.container_python=/opt/venv/bin/python3")
    assert given.exit_code == 0, given.output
    assert "/opt/venv/bin/python3 -u -m submitit.core._submit" in given.output
    assert f"{sys.executable} -u -m" not in given.output
