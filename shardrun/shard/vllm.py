"""The self-hosted policy server: the real vLLM OpenAI server, started for one shard and stopped with it.

`launch_spec` is pure: config in, command line, environment and URLs out. `start_vllm` makes the shard's scratch
directories, starts the command through `processes` (own process group, output appended to the shard's
logs/vllm.log), waits until `GET /health` answers 200 and the served name is listed by `GET /v1/models` (while
checking the process is alive; 503 from /health means the engine died), and returns a `VllmServer` handle whose
`stop()` ends the whole process tree. The API key, when configured, travels only in the environment (VLLM_API_KEY)
and in memory, never on the command line that the log records.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from shardrun.shard import processes
from shardrun.rundir import store
from shardrun.core.config import VllmConfig
from shardrun.core.errors import BadInput, ServerFailure

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VENV_ENV = "SHARDRUN_VLLM_VENV"
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# vLLM's ZeroMQ IPC sockets are `<VLLM_RPC_BASE_PATH>/<uuid4>`; a Unix socket path holds at most 107 bytes.
UNIX_SOCKET_PATH_MAX = 107
IPC_NAME_LEN = 1 + 36
STOP_GRACE_S = 15.0


# ---------------------------------------------------------------- pure: command line and environment


def python_for(vcfg: VllmConfig, env: Mapping[str, str]) -> str:
    """The interpreter that runs vLLM: `vllm.python` (a file, or a venv directory), else $SHARDRUN_VLLM_VENV's,
    else `python3` from PATH (a container image that has vLLM)."""
    if vcfg.python:
        p = Path(vcfg.python)
        return str(p) if p.name.startswith("python") else str(p / "bin" / "python")
    if env.get(VENV_ENV):
        return str(Path(env[VENV_ENV]) / "bin" / "python")
    return "python3"


def launcher(vcfg: VllmConfig, env: Mapping[str, str]) -> list[str]:
    """The command prefix: `vllm.command` as given, or `<python> -m vllm.entrypoints.openai.api_server`."""
    if vcfg.command:
        return list(vcfg.command)
    return [python_for(vcfg, env), "-m", API_SERVER_MODULE]


def model_args(prefix: list[str], model: str) -> list[str]:
    """`vllm serve` takes the model as its first argument; the api_server module takes `--model`."""
    return [model] if prefix and prefix[-1] == "serve" else ["--model", model]


def served_name(vcfg: VllmConfig) -> str:
    return vcfg.served_model_name or Path(vcfg.model.rstrip("/")).name


def build_command(vcfg: VllmConfig, host: str, port: int, env: Mapping[str, str]) -> list[str]:
    prefix = launcher(vcfg, env)
    cmd = (
        prefix
        + model_args(prefix, vcfg.model)
        + [
            "--served-model-name",
            served_name(vcfg),
            "--host",
            host,
            "--port",
            str(port),
            "--tensor-parallel-size",
            str(vcfg.tensor_parallel_size),
            "--pipeline-parallel-size",
            str(vcfg.pipeline_parallel_size),
            "--data-parallel-size",
            str(vcfg.data_parallel_size),
        ]
    )
    if vcfg.max_model_len is not None:
        cmd += ["--max-model-len", str(vcfg.max_model_len)]
    return cmd + list(vcfg.extra_args)


def connect_host(bind_host: str) -> str:
    """Where a client on the same node reaches a server bound to `bind_host`."""
    return "127.0.0.1" if bind_host in WILDCARD_HOSTS else bind_host


def root_url(host: str, port: int) -> str:
    h = connect_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def ipc_dir_fits(path: Path) -> bool:
    return len(str(path)) + IPC_NAME_LEN <= UNIX_SOCKET_PATH_MAX


def build_env(
    vcfg: VllmConfig, base_env: Mapping[str, str], tmp_dir: Path, cache_dir: Path, rpc_dir: Path, api_key: str | None
) -> dict[str, str]:
    """The server's environment: the caller's, then `vllm.env`, then the per-server scratch paths (always last,
    so two servers on one node never share IPC sockets or compile caches)."""
    env = dict(base_env)
    env.update(vcfg.env)
    env.update({"TMPDIR": str(tmp_dir), "VLLM_CACHE_ROOT": str(cache_dir), "VLLM_RPC_BASE_PATH": str(rpc_dir)})
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key
    else:
        env.pop("VLLM_API_KEY", None)
    return env


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one server and to talk to it."""

    cmd: list[str]
    env: dict[str, str] = field(repr=False)
    root_url: str
    model_name: str
    log_path: Path
    tmp_dir: Path
    cache_dir: Path
    rpc_dir: Path

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"


def launch_spec(
    vcfg: VllmConfig,
    shard_dir: Path,
    port: int,
    base_env: Mapping[str, str],
    api_key: str | None = None,
    short_rpc_dir: Path | None = None,
) -> LaunchSpec:
    """Pure. `short_rpc_dir` replaces the shard's tmp dir for vLLM's IPC sockets when that path is too long."""
    tmp_dir, cache_dir = store.vllm_scratch_dirs(shard_dir)
    rpc_dir = tmp_dir if ipc_dir_fits(tmp_dir) or short_rpc_dir is None else short_rpc_dir
    return LaunchSpec(
        cmd=build_command(vcfg, vcfg.host, port, base_env),
        env=build_env(vcfg, base_env, tmp_dir, cache_dir, rpc_dir, api_key),
        root_url=root_url(vcfg.host, port),
        model_name=served_name(vcfg),
        log_path=store.vllm_log_path(shard_dir),
        tmp_dir=tmp_dir,
        cache_dir=cache_dir,
        rpc_dir=rpc_dir,
    )


# ---------------------------------------------------------------- readiness


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def health_ok(url: str) -> bool:
    """True on 200; False while nothing answers (the port opens only once the engine is loaded)."""
    got = processes.http_get(url + HEALTH_PATH, timeout=5.0)
    if got is None:
        return False
    status, body = got
    if status == 503:
        raise ServerFailure(
            f"vLLM at {url}: {HEALTH_PATH} answered 503, the engine is dead: {body[:300].decode('utf-8', 'replace')}"
        )
    return status == 200


def lists_model(url: str, name: str, api_key: str | None) -> bool:
    got = processes.http_get(url + MODELS_PATH, timeout=5.0, headers=auth_headers(api_key))
    if got is None or got[0] != 200:
        return False
    return name in model_ids(got[1])


def model_ids(body: bytes) -> list[str]:
    try:
        data = json.loads(body).get("data") or []
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    except (ValueError, AttributeError):
        return []


def wait_ready(proc: processes.Proc, url: str, name: str, api_key: str | None, timeout: float) -> float:
    """Seconds until /health is 200 and /v1/models lists `name`; ServerFailure if the process dies or on timeout."""
    t0 = time.monotonic()
    what = f"vLLM {name} at {url}"
    processes.wait_until(lambda: health_ok(url), watch=[proc], timeout=timeout, what=what + " (/health)", interval=1.0)
    left = max(1.0, timeout - (time.monotonic() - t0))
    processes.wait_until(
        lambda: lists_model(url, name, api_key),
        watch=[proc],
        timeout=left,
        what=what + f" ({MODELS_PATH} listing {name!r})",
        interval=0.5,
    )
    return time.monotonic() - t0


def port_answers(host: str, port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


# ---------------------------------------------------------------- liveness


@dataclass
class Liveness:
    """While collecting: a server whose /health answers 503 (a dead engine) is a problem at once; one that does not
    answer is a problem once it has not answered for `timeout_s` (a busy engine answers late, not never)."""

    roots: list[str]
    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    what: str = "policy server"  # what the messages call the server (a judge's: "judge NAME")
    setting: str = "policy.vllm.liveness_timeout_s"  # the config key of timeout_s
    silent_since: dict[str, float] = field(default_factory=dict)

    def problem(self) -> str | None:
        for root in self.roots:
            got = processes.http_get(root + HEALTH_PATH, timeout=10.0)
            if got is not None and got[0] == 503:
                return f"{self.what} {root}: {HEALTH_PATH} answered 503, the engine is dead"
            if got is not None and got[0] == 200:
                self.silent_since.pop(root, None)
                continue
            now = self.clock()
            since = self.silent_since.setdefault(root, now)
            if now - since >= self.timeout_s:
                return (
                    f"{self.what} {root} has not answered GET {HEALTH_PATH} for {now - since:.0f} s "
                    f"({self.setting} = {self.timeout_s:g})"
                )
        return None


# ---------------------------------------------------------------- the running server


@dataclass
class VllmServer:
    """A started, ready vLLM server. `base_url` ends in /v1 (what NeMo Gym's vllm_model wants)."""

    proc: processes.Proc
    spec: LaunchSpec
    ready_s: float
    api_key: str | None = field(default=None, repr=False)
    owned_rpc_dir: Path | None = None
    liveness: Liveness | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def model_name(self) -> str:
        return self.spec.model_name

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    def alive(self) -> bool:
        return self.proc.alive()

    def problem(self) -> str | None:
        """Why the server is unusable now, or None: it exited (any status: vLLM exits 0 when its engine dies), or
        it fails its liveness check."""
        if not self.proc.alive():
            return f"the vLLM server exited: {self.proc.describe_exit()}"
        return self.liveness.problem() if self.liveness is not None else None

    def stop(self) -> int | None:
        """Stop the whole server tree (SIGTERM, then SIGKILL) and remove its sockets; safe to call twice."""
        rc = processes.stop(self.proc, grace=STOP_GRACE_S)
        remove_scratch(self.spec.tmp_dir, self.owned_rpc_dir)
        return rc

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def remove_scratch(tmp_dir: Path, owned_rpc_dir: Path | None) -> None:
    """The tmp dir holds only sockets and temp files of a stopped server; VLLM_CACHE_ROOT is kept for reuse."""
    shutil.rmtree(tmp_dir, ignore_errors=True)
    if owned_rpc_dir is not None:
        shutil.rmtree(owned_rpc_dir, ignore_errors=True)


def start_vllm(
    vcfg: VllmConfig,
    shard_dir: Path,
    port: int | None = None,
    *,
    api_key: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    what: str = "policy server",
    setting: str = "policy.vllm",
) -> VllmServer:
    """Start vLLM for the shard in `shard_dir` on `port` (default `vllm.port`) and wait until it serves.

    `api_key` (the value behind policy.api_key_env, if any) is required by the server for /v1 routes and passed
    only through its environment. `env` is the base environment (default: this process's). Raises ServerFailure, with the log's last lines,
    when the server exits, reports a dead engine, or is not ready within `timeout` (default `vllm.ready_timeout_s`);
    the server is stopped before the error propagates. `what` and `setting` name the server and its config section
    in messages (a judge's: "judge NAME", "judges.NAME.vllm").
    """
    port = port if port is not None else vcfg.port
    if port is None:
        raise BadInput(f"{setting}: no port given (set {setting}.port or let the shard runtime choose one)")
    base_env = dict(os.environ if env is None else env)
    shard_dir = Path(shard_dir)
    tmp_dir, _ = store.vllm_scratch_dirs(shard_dir)
    owned = None if ipc_dir_fits(tmp_dir) else Path(tempfile.mkdtemp(prefix="shardrun-vllm-"))
    spec = launch_spec(vcfg, shard_dir, port, base_env, api_key, short_rpc_dir=owned)
    if port_answers(connect_host(vcfg.host), port):
        remove_scratch(spec.tmp_dir, owned)
        raise ServerFailure(f"vLLM for {shard_dir}: port {port} is already in use on {connect_host(vcfg.host)}")
    for d in (spec.tmp_dir, spec.cache_dir):
        d.mkdir(parents=True, exist_ok=True)
    proc = processes.start(spec.cmd, spec.log_path, name=f"vllm:{spec.model_name}:{port}", env=spec.env)
    liveness = Liveness([spec.root_url], vcfg.liveness_timeout_s, what=what, setting=f"{setting}.liveness_timeout_s")
    server = VllmServer(proc=proc, spec=spec, ready_s=0.0, api_key=api_key, owned_rpc_dir=owned, liveness=liveness)
    try:
        server.ready_s = wait_ready(
            proc,
            spec.root_url,
            spec.model_name,
            server.api_key,
            timeout if timeout is not None else vcfg.ready_timeout_s,
        )
    except BaseException:
        server.stop()
        raise
    return server
