"""The job's code-execution sandbox (shard/sandbox.py, the `sandbox:` section, docs/sandboxes.md): its config, its
command, the address handed to the Gym servers, its health check and liveness, and the rows it vouches for.

The sandbox here is the NeMo-Skills-protocol stand-in (tests/fakes/sandbox_server.py: Python really runs, in a
subprocess with a timeout); it starts in well under a second."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardrun.core.config import RunConfig, SandboxConfig
from shardrun.core.errors import BadInput, ServerFailure
from shardrun.rundir import store
from shardrun.shard import sandbox as sandboxes
from shardrun.shard import gym_stack

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "sandbox_server.py"


def fake_command(*extra: str) -> str:
    return " ".join([sys.executable, str(FAKE), "--port", "{port}", *extra])


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


# ---------------------------------------------------------------- config


def test_a_sandbox_is_a_command_or_an_image_never_both_nor_neither():
    assert SandboxConfig(command="serve --port {port}").command == "serve --port {port}"
    assert SandboxConfig(image="/images/sandbox.sqsh").image_command == "/start-with-nginx.sh"
    for bad, says in [
        ({}, "exactly one of sandbox.command"),
        ({"command": "x {port}", "image": "y"}, "exactly one of sandbox.command"),
        ({"command": "serve"}, "no {port} placeholder"),
        ({"command": "x {port}", "runtime": "docker"}, "sandbox.runtime runs sandbox.image"),
        ({"image": "y", "health_path": "health"}, "must start with '/'"),
        ({"image": "y", "env": {"A-B": "1"}}, "not environment variable names"),
        ({"image": "y\nz"}, "control character"),
        ({"image": "y", "runtime": "lxc"}, "docker"),
    ]:
        with pytest.raises(ValidationError, match=says):
            SandboxConfig(**bad)
    assert SandboxConfig(command="serve", port=6000).port == 6000  # a fixed port needs no placeholder


def test_the_run_config_takes_a_sandbox_section_and_hydra_overrides_of_it(tmp_path):
    from shardrun.core import config

    (tmp_path / "in.jsonl").write_text('{"responses_create_params": {"input": "x"}, "agent_ref": {"name": "a"}}\n')
    path = tmp_path / "run.yaml"
    path.write_text(
        f"input_jsonl: {tmp_path / 'in.jsonl'}\nrun_dir: {tmp_path / 'run'}\nsandbox:\n  command: serve {{port}}\n"
    )
    cfg = config.load(path, ["sandbox.liveness_timeout_s=5", "sandbox.port=6123"])
    assert cfg.sandbox == SandboxConfig(command="serve {port}", liveness_timeout_s=5, port=6123)
    assert RunConfig.model_validate({"input_jsonl": "x", "run_dir": "r"}).sandbox is None


def test_a_sandbox_client_environment_without_a_sandbox_is_a_plan_warning():
    base = {"input_jsonl": "x", "run_dir": "r", "gym": {"config_paths": ["resources_servers/ns_tools/configs/x.yaml"]}}
    (warning,) = RunConfig.model_validate(base).sandbox_warnings()
    assert "ns_tools" in warning and "sandbox.image" in warning and "sandbox.command" in warning
    assert RunConfig.model_validate(base | {"sandbox": {"image": "i"}}).sandbox_warnings() == []
    plain = base | {"gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]}}
    assert RunConfig.model_validate(plain).sandbox_warnings() == []


# ---------------------------------------------------------------- command and address


def test_the_command_gets_its_port_and_an_image_runs_as_the_recipe_runs_it():
    cmd = sandboxes.command(SandboxConfig(command="serve --port {port} --json '{}'"), 6111, env={})
    assert cmd == ["bash", "-c", "serve --port 6111 --json '{}'"]
    image = SandboxConfig(image="/i/sandbox.sqsh", workers=16)
    from shardrun.core.config import ClusterConfig

    in_job = sandboxes.command(
        image,
        6000,
        cluster=ClusterConfig(mounts=["/lustre:/lustre"], containers={"shardrun": "/i/s.sqsh"}),
        env={"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "node3"},
    )
    assert in_job[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=node3"]
    assert "--container-image=/i/sandbox.sqsh" in in_job and "--container-mounts=/lustre:/lustre" in in_job
    assert in_job[-1] == "export NGINX_PORT=6000 LISTEN_PORT=6000 NUM_WORKERS=16; exec /start-with-nginx.sh"
    local = sandboxes.command(image.model_copy(update={"runtime": "podman"}), 6000, env={})
    assert local[:5] == ["podman", "run", "--rm", "--network=host", "/i/sandbox.sqsh"]
    with pytest.raises(BadInput, match="sandbox.runtime to docker or podman"):
        sandboxes.command(image, 6000, env={})


def test_the_gym_servers_get_the_address_the_way_gym_reads_it(tmp_path):
    """NeMo Gym's sandbox clients read NEMO_SKILLS_SANDBOX_HOST/PORT (ns_tools.yaml: ${oc.env:NEMO_SKILLS_...});
    gym_stack.start puts them into ng_run's environment, beside what stack_env sets."""
    address = sandboxes.gym_env("127.0.0.1", 6123)
    assert address == {"NEMO_SKILLS_SANDBOX_HOST": "127.0.0.1", "NEMO_SKILLS_SANDBOX_PORT": "6123"}
    env = gym_stack.stack_env({"PATH": "/bin"} | address, tmp_path, tmp_path / "ray", shared=True)
    assert env["NEMO_SKILLS_SANDBOX_HOST"] == "127.0.0.1" and env["NEMO_SKILLS_SANDBOX_PORT"] == "6123"


def test_an_image_on_the_local_executor_needs_a_runtime_on_path(tmp_path):
    from shardrun.launch import preflight

    cfg = RunConfig.model_validate({"input_jsonl": "x", "run_dir": "r", "sandbox": {"image": "i"}})
    (problem,) = preflight.sandbox_problems(cfg, {"PATH": str(tmp_path)})
    assert problem.startswith("sandbox.image: outside a Slurm job an image needs a container runtime")
    with_runtime = RunConfig.model_validate(
        {"input_jsonl": "x", "run_dir": "r", "sandbox": {"image": "i", "runtime": "docker"}}
    )
    (problem,) = preflight.sandbox_problems(with_runtime, {"PATH": str(tmp_path)})
    assert "docker is not on PATH" in problem
    (tmp_path / "docker").write_text("#!/bin/sh\n")
    (tmp_path / "docker").chmod(0o755)
    assert preflight.sandbox_problems(with_runtime, {"PATH": str(tmp_path)}) == []
    on_slurm = RunConfig.model_validate(
        {"input_jsonl": "x", "run_dir": "r", "sandbox": {"image": "i"}, "cluster": {"executor": "slurm"}}
    )
    assert preflight.sandbox_problems(on_slurm, {"PATH": str(tmp_path)}) == []  # pyxis runs it in the job


# ---------------------------------------------------------------- health and liveness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_forgives_silence_shorter_than_its_timeout_and_not_longer():
    answers: list[tuple[int, bytes] | None] = []
    clock = Clock()
    health = sandboxes.Health("http://h/health", 30.0, clock=clock, get=lambda _url: answers.pop(0))
    answers[:] = [(200, b"")]
    assert health.problem() is None and health.last_ok
    answers[:] = [None]
    assert health.problem() is None and not health.last_ok  # silent since now
    clock.now += 29
    answers[:] = [(502, b"")]
    assert health.problem() is None
    clock.now += 1
    answers[:] = [(502, b"")]
    assert health.problem() == "sandbox http://h/health: status 502 for 30 s (sandbox.liveness_timeout_s = 30)"
    answers[:] = [(200, b"")]
    assert health.problem() is None  # an answer clears it
    clock.now += 100
    answers[:] = [None]
    assert health.problem() is None


@pytest.fixture
def box(tmp_path):
    cfg = SandboxConfig(command=fake_command("--pid-file", str(tmp_path / "pid")), ready_timeout_s=60)
    started = sandboxes.start(cfg, tmp_path / "home")
    yield started
    started.stop()


def test_the_stand_in_runs_python_in_a_subprocess_with_a_timeout(box):
    assert box.problem() is None and box.log_path == store.sandbox_log_path(box.log_path.parents[1])
    url = box.url("/execute")
    ran = post(url, {"generated_code": "print(6 * 7)", "language": "python", "timeout": 10})
    assert ran == {"process_status": "completed", "stdout": "42\n", "stderr": ""}
    failed = post(url, {"generated_code": "raise SystemExit(3)", "language": "ipython", "timeout": 10})
    assert failed["process_status"] == "error"
    slow = post(url, {"generated_code": "import time; time.sleep(30)", "language": "python", "timeout": 0.5})
    assert slow["process_status"] == "timeout"


def test_a_dead_sandbox_is_said_at_once_and_restarted_on_its_port_counted(box, tmp_path):
    port = box.port
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    box.proc.wait(timeout=30)
    assert "the sandbox exited" in (box.problem() or "")
    said: list[str] = []
    box.restart(1, said.append)
    assert box.port == port and box.restarts == 1 and box.problem() is None
    assert said[0].startswith("restarting the sandbox (1 of 1): the sandbox exited")
    box.proc.stop()
    with pytest.raises(ServerFailure, match=r"restarted 1 time\(s\) already \(cluster.max_server_restarts = 1\)"):
        box.restart(1, said.append)


def test_the_guard_takes_back_only_the_rows_written_after_the_last_answer(box, tmp_path):
    rollouts, failures = tmp_path / "rollouts.jsonl", tmp_path / "failures.jsonl"
    rollouts.write_text('{"a": 1}\n')
    guard = sandboxes.Guard(box, [rollouts, failures])
    assert guard.settle(0.1) is None and guard.mark == [9, 0]
    with rollouts.open("a") as f:
        f.write('{"a": 2}\n{"a": 3, "half')  # written after the check: not vouched for
    failures.write_text('{"f": 1}\n')
    box.proc.stop()
    assert "the sandbox exited" in (guard.problem() or "") and guard.mark == [9, 0]  # a dead check keeps the mark
    assert guard.tripped is not None
    assert guard.take_back() == len('{"a": 2}\n{"a": 3, "half') + len('{"f": 1}\n')
    assert rollouts.read_text() == '{"a": 1}\n' and failures.read_text() == ""


def test_a_sandbox_that_never_answers_fails_its_start_with_its_log(tmp_path):
    cfg = SandboxConfig(command="echo no sandbox here {port}; exit 4", ready_timeout_s=30)
    with pytest.raises(ServerFailure, match="sandbox .pid [0-9]+. exited with code 4") as e:
        sandboxes.start(cfg, tmp_path)
    assert "no sandbox here" in str(e.value)
