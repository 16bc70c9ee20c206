"""shardrun/shard/vllm.py: the pure command/environment builder, start-up/readiness/stop against a stand-in that takes
vLLM's command line (tests/fakes/vllm_cli.py), and the real vLLM CPU build serving the tiny model (marked vllm)."""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shardrun.core import config
from shardrun.shard import processes
from shardrun.rundir import store
from shardrun.shard import vllm
from shardrun.core.config import VllmConfig
from shardrun.core.errors import BadInput, ServerFailure
from tests.ports import VLLM, free_port

FAKE = Path(__file__).resolve().parent.parent / "fakes" / "vllm_cli.py"


def family(server: vllm.VllmServer) -> set[int]:
    return {pid for pid, _ in processes._family(server.proc.pgid, server.proc.pid)}


def all_gone(pids: set[int]) -> bool:
    return all(processes._start_time(p) is None for p in pids)


# ---------------------------------------------------------------- pure: command line


def test_default_command_is_api_server_module_of_the_configured_venv(tmp_path: Path) -> None:
    v = VllmConfig(
        model="/models/SmolLM2-135M-Instruct",
        python="/opt/vllm-venv",
        max_model_len=2048,
        extra_args=["--enforce-eager", "--tool-call-parser", "hermes"],
    )
    cmd = vllm.build_command(v, "127.0.0.1", 22100, env={})
    assert cmd == [
        "/opt/vllm-venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/SmolLM2-135M-Instruct",
        "--served-model-name",
        "SmolLM2-135M-Instruct",
        "--host",
        "127.0.0.1",
        "--port",
        "22100",
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--data-parallel-size",
        "1",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--tool-call-parser",
        "hermes",
    ]


def test_vllm_serve_prefix_takes_the_model_positionally_with_parallel_sizes() -> None:
    v = VllmConfig(
        model="org/Model-7B",
        served_model_name="policy",
        command=["vllm", "serve"],
        tensor_parallel_size=4,
        pipeline_parallel_size=2,
        data_parallel_size=2,
    )
    cmd = vllm.build_command(v, "0.0.0.0", 8000, env={})
    assert cmd[:3] == ["vllm", "serve", "org/Model-7B"]
    assert "--model" not in cmd and "--max-model-len" not in cmd
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {
        "--served-model-name": "policy",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--tensor-parallel-size": "4",
        "--pipeline-parallel-size": "2",
        "--data-parallel-size": "2",
    }


@pytest.mark.parametrize(
    "python, env, expected",
    [
        ("/venvs/v", {}, "/venvs/v/bin/python"),
        ("/usr/bin/python3.11", {}, "/usr/bin/python3.11"),
        (None, {"SHARDRUN_VLLM_VENV": "/cache/vllm-venv"}, "/cache/vllm-venv/bin/python"),
        (None, {}, "python3"),
    ],
)
def test_interpreter_choice(python, env, expected) -> None:
    assert vllm.python_for(VllmConfig(model="m", python=python), env) == expected


def test_served_name_defaults_to_the_model_directory_name() -> None:
    assert vllm.served_name(VllmConfig(model="/cache/models/tiny-chatml/")) == "tiny-chatml"
    assert vllm.served_name(VllmConfig(model="/x/y", served_model_name="policy")) == "policy"


def test_urls_reach_a_wildcard_bind_through_loopback() -> None:
    assert vllm.root_url("0.0.0.0", 22001) == "http://127.0.0.1:22001"
    assert vllm.root_url("10.1.2.3", 22001) == "http://10.1.2.3:22001"
    assert vllm.root_url("::1", 22001) == "http://[::1]:22001"


# ---------------------------------------------------------------- pure: environment


def test_env_puts_scratch_under_the_shard_and_config_env_cannot_override_it(tmp_path: Path) -> None:
    shard = tmp_path / "shards" / "00003"
    v = VllmConfig(model="m", env={"VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": "/tmp"})
    spec = vllm.launch_spec(v, shard, 22100, {"PATH": "/bin", "VLLM_API_KEY": "inherited"})
    tmp, cache = store.vllm_scratch_dirs(shard)
    assert tmp.parent.parent == shard and cache.parent.parent == shard
    assert spec.env["TMPDIR"] == str(tmp) and spec.env["VLLM_CACHE_ROOT"] == str(cache)
    assert spec.env["VLLM_RPC_BASE_PATH"] == str(tmp)
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and spec.env["PATH"] == "/bin"
    assert "VLLM_API_KEY" not in spec.env  # no key configured: an inherited one would lock Gym out
    assert spec.log_path == shard / "logs" / "vllm.log"
    assert spec.base_url == "http://127.0.0.1:22100/v1" and spec.model_name == "m"


def test_api_key_only_in_environment_never_on_the_command_line(tmp_path: Path) -> None:
    spec = vllm.launch_spec(VllmConfig(model="m"), tmp_path, 22100, {}, api_key="s3cret-key")
    assert spec.env["VLLM_API_KEY"] == "s3cret-key"
    assert not any("s3cret" in a for a in spec.cmd)
    assert "s3cret" not in repr(spec)


def test_long_shard_paths_move_ipc_sockets_to_a_short_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80) / "shards" / "00000"
    spec = vllm.launch_spec(VllmConfig(model="m"), deep, 22100, {}, short_rpc_dir=Path("/tmp/shardrun-vllm-ab"))
    assert not vllm.ipc_dir_fits(spec.tmp_dir)
    assert spec.env["VLLM_RPC_BASE_PATH"] == "/tmp/shardrun-vllm-ab"
    assert spec.env["TMPDIR"] == str(spec.tmp_dir)  # everything else stays under the shard
    assert vllm.ipc_dir_fits(Path("/tmp/shardrun-vllm-ab"))


@pytest.mark.parametrize("field", ["extra_args", "command"])
def test_config_refuses_an_api_key_on_the_vllm_command_line(field: str) -> None:
    data = {
        "input_jsonl": "in.jsonl",
        "run_dir": "r",
        "policy": {"vllm": {"model": "m", field: ["--enforce-eager", "--api-key=abc"]}},
    }
    with pytest.raises(BadInput, match="api_key_env"):
        config.validate(data)


def test_yaml_numbers_in_env_command_and_extra_args_become_strings(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        "input_jsonl: in.jsonl\nrun_dir: r\npolicy:\n  vllm:\n    model: m\n"
        "    env: {VLLM_CPU_KVCACHE_SPACE: 1, HF_HUB_OFFLINE: '1', SOME_FLAG: true}\n"
        "    command: [taskset, -c, 0, python, -m, vllm.entrypoints.openai.api_server]\n"
        "    extra_args: [--max-num-seqs, 64]\n"
    )
    v = config.load(tmp_path / "run.yaml", ["policy.vllm.command.2=1"]).policy.vllm
    assert v.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "SOME_FLAG": "true"}
    assert v.command == ["taskset", "-c", "1", "python", "-m", "vllm.entrypoints.openai.api_server"]
    assert v.extra_args == ["--max-num-seqs", "64"]


# ---------------------------------------------------------------- start / ready / stop against the stand-in


def fake_cfg(**kw) -> VllmConfig:
    return VllmConfig(model="/models/fake", served_model_name="fake-policy", command=[sys.executable, str(FAKE)], **kw)


def test_start_waits_for_health_and_model_then_stop_cleans_up(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_DELAY", "1.5")
    shard = tmp_path / "shard"
    server = vllm.start_vllm(fake_cfg(), shard, free_port(VLLM), api_key="k-123", timeout=30)
    try:
        assert server.ready_s >= 1.5 and server.alive()
        assert server.model_name == "fake-policy" and server.base_url.endswith("/v1")
        pids = family(server)
    finally:
        server.stop()
    assert all_gone(pids)
    log = server.log_path.read_text()
    assert server.log_path.parent == shard / "logs"
    tmp, cache = store.vllm_scratch_dirs(shard)
    assert f"fake-vllm env TMPDIR={tmp}" in log and f"VLLM_CACHE_ROOT={cache}" in log
    assert "api key set: True" in log and "k-123" not in log
    assert not tmp.exists() and cache.is_dir()  # sockets removed, caches kept
    server.stop()  # twice is harmless


def test_process_exit_before_ready_fails_fast_with_the_log_tail(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    t0 = time.monotonic()
    with pytest.raises(ServerFailure, match="exited with code 3") as e:
        vllm.start_vllm(fake_cfg(), tmp_path, free_port(VLLM), timeout=60)
    assert time.monotonic() - t0 < 20
    assert "engine failed to start (simulated)" in str(e.value)


def test_health_503_means_engine_dead_and_the_server_is_stopped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "dead")
    port = free_port(VLLM)
    with pytest.raises(ServerFailure, match="503, the engine is dead"):
        vllm.start_vllm(fake_cfg(), tmp_path, port, timeout=60)
    assert not vllm.port_answers("127.0.0.1", port)


def test_served_name_missing_from_models_times_out(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "noname")
    port = free_port(VLLM)
    with pytest.raises(ServerFailure, match="listing 'fake-policy'.*not ready after"):
        vllm.start_vllm(fake_cfg(), tmp_path, port, timeout=4)
    assert not vllm.port_answers("127.0.0.1", port)


def test_port_already_taken_is_refused_before_starting(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port(VLLM)))
        s.listen()
        with pytest.raises(ServerFailure, match="already in use"):
            vllm.start_vllm(fake_cfg(), tmp_path, s.getsockname()[1], timeout=10)
    assert not store.vllm_log_path(tmp_path).exists()


def test_missing_port_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no port"):
        vllm.start_vllm(fake_cfg(), tmp_path)


def test_long_shard_path_gets_a_private_short_socket_dir_removed_on_stop(tmp_path: Path) -> None:
    shard = tmp_path / ("x" * 90)
    server = vllm.start_vllm(fake_cfg(), shard, free_port(VLLM), timeout=30)
    owned = server.owned_rpc_dir
    try:
        assert owned is not None and owned.is_dir() and vllm.ipc_dir_fits(owned)
        assert f"VLLM_RPC_BASE_PATH={owned}" in server.log_path.read_text()
    finally:
        server.stop()
    assert not owned.exists()


# ---------------------------------------------------------------- the real vLLM CPU build


def post_json(url: str, body: dict, key: str | None = None, timeout: float = 120) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_vllm_cpu_serves_the_tiny_model_and_stops_cleanly(
    tmp_path: Path, vllm_venv: Path, tiny_model: Path
) -> None:
    v = VllmConfig(
        model=str(tiny_model),
        served_model_name="tiny",
        python=str(vllm_venv),
        max_model_len=512,
        extra_args=["--enforce-eager"],
        ready_timeout_s=240,
        env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )
    shard = tmp_path / "run" / "shards" / "00000"
    t0 = time.monotonic()
    server = vllm.start_vllm(v, shard, free_port(VLLM), api_key="test-key-123")
    try:
        pids = family(server)
        print(
            f"\nvLLM tiny model ready in {server.ready_s:.1f} s ({time.monotonic() - t0:.1f} s with start); "
            f"{len(pids)} processes"
        )
        assert server.ready_s > 0 and server.alive()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.base_url + "/models", timeout=10)
        assert e.value.code == 401  # the key reached the server through its environment
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "max_tokens": 12,
            "temperature": 1.0,
            "seed": 7,
        }
        first = post_json(server.base_url + "/chat/completions", body, "test-key-123")
        second = post_json(server.base_url + "/chat/completions", body, "test-key-123")
        assert first["object"] == "chat.completion" and first["model"] == "tiny"
        assert first["usage"]["completion_tokens"] > 0 and first["usage"]["prompt_tokens"] > 0
        assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    finally:
        t1 = time.monotonic()
        server.stop()
        print(f"stopped in {time.monotonic() - t1:.1f} s")
    assert all_gone(pids)
    assert not server.alive()
    log = server.log_path.read_text()
    assert "Starting vLLM server" in log and "test-key-123" not in log
    assert not store.vllm_scratch_dirs(shard)[0].exists()


@pytest.mark.vllm
def test_tiny_model_template_renders_tool_call_turns(vllm_venv: Path, tiny_model: Path) -> None:
    """The chat template of the prepared models renders `content: null` assistant turns with tool calls (a
    plain concatenating template makes vLLM answer 400 to the second turn of a tool-calling rollout)."""
    import subprocess

    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "msgs = [{'role': 'user', 'content': [{'type': 'text', 'text': 'weather in Berlin?'}]},\n"
        "        {'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c1', 'type': 'function',\n"
        "         'function': {'name': 'get_weather', 'arguments': '{\"city\": \"Berlin\"}'}}]},\n"
        "        {'role': 'tool', 'tool_call_id': 'c1', 'content': 'sunny'}]\n"
        "print(json.dumps(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))\n"
    )
    out = subprocess.run(
        [str(vllm_venv / "bin" / "python"), "-c", script, str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == (
        "<|im_start|>user\nweather in Berlin?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n"
    )
