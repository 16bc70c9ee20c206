"""The shard's NeMo Gym servers: env.yaml, `ng_run` in its own process group, readiness, health, teardown.

The command, the server kinds and the release's own flags come from the release's adapter (gym_adapter.py); what
every supported release needs here (docs/runtime.md has the measurements):
- `env.yaml` in ng_run's working directory carries `policy_base_url` (a string or a list), `policy_api_key` and
  `policy_model_name`, and each `gym.secrets` variable with the value of the environment variable it names (read
  here, at stack start); it holds keys, so it is written 0600 and deleted at teardown.
- A head-server port per stack (`+head_server.host` and `+head_server.port` together), chosen free by the kernel
  so stacks of two shards on one node never collide; the servers themselves get random free ports from Gym.
- uv must find the exact plain Python the Gym venv was made from (its pyvenv.cfg `home`) and must not download
  interpreters (UV_PYTHON_DOWNLOADS=never). Ray gets a short private RAY_TMPDIR (Unix socket paths are limited to
  107 bytes) and RAY_AUTH_MODE=disabled (no ~/.ray token).
- server_venvs=shared: `<uv_venv_dir>/<type>/<impl>/.venv` symlinks to the Gym venv and
  `+skip_venv_if_present=true`: no uv run at all (UV_OFFLINE=1 as a guard).
- ng_run's output reaches its log through processes' redactor, which masks the policy key and the secrets wherever
  Gym prints them.
- ng_run is stopped with SIGTERM to its process group, then stragglers (Ray workers leave the group) are killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import yaml

from shardrun.shard import processes
from shardrun.core.gym_adapter import GymAdapter, for_venv
from shardrun.rundir import store
from shardrun.core import gym_version
from shardrun.core.config import ENV_YAML_POLICY_KEYS, JUDGE_KEY_PREFIX, GymConfig
from shardrun.core.errors import BadInput, ServerFailure

VENV_ENV = gym_version.VENV_ENV
HEAD_HOST = "127.0.0.1"
STOP_GRACE_S = 5.0  # ng_run exits about 3 s after SIGTERM; results are on disk by then
STRAGGLER_GRACE_S = 0.5
START_TRIES = 3
# what a start of the stack can fail with that the next start gets past: a head port taken between choosing and
# binding it, and Ray giving up after its fixed 30 s wait for its own node on a loaded machine (0.7's `gym env start`
# and 0.4's ng_run both start Ray)
TRANSIENT_START = ("address already in use", "node timed out during startup", "while waiting for node to startup")
RAY_TMP_BASE_MAX = 40


# ---------------------------------------------------------------- pure parts


def env_yaml_text(
    base_urls: Sequence[str], api_key: str | None, model_name: str, secrets: Mapping[str, str] | None = None
) -> str:
    """Gym's env.yaml: the policy's three keys, then `secrets` (gym.secrets' variables with their values)."""
    url: str | list[str] = base_urls[0] if len(base_urls) == 1 else list(base_urls)
    base_url_key, api_key_key, model_key = ENV_YAML_POLICY_KEYS
    data: dict[str, object] = {base_url_key: url, api_key_key: api_key or "EMPTY", model_key: model_name}
    for key, value in (secrets or {}).items():
        if key in data:  # GymConfig refuses these; a guard for a caller that did not validate
            raise BadInput(f"gym.secrets.{key}: shardrun writes {key} into env.yaml itself")
        data[key] = value
    return yaml.safe_dump(data, sort_keys=False)


def secret_values(gym: GymConfig, env: Mapping[str, str]) -> dict[str, str]:
    """{gym.secrets key: the value of the environment variable it names}; BadInput naming the key and the variable
    (never a value) for one not set."""
    missing = [f"gym.secrets.{key}: ${name}" for key, name in gym.secrets.items() if not env.get(name)]
    if missing:
        raise BadInput(
            f"{', '.join(missing)} not set in the shard's environment (export it where you submit; it is read "
            f"at stack start, written only into the stack's env.yaml)"
        )
    return {key: env[name] for key, name in gym.secrets.items()}


JUDGES_YAML = "shardrun-judges.yaml"
"""The Gym config shardrun writes into the stack's working dir defining each judge's model server (no key in it)."""


@dataclass(frozen=True)
class JudgeBinding:
    """A judge as the Gym stack binds it: the model server `name` (what environment configs refer to), where it
    answers, and its key (into env.yaml only). Self-hosted judges are bound as Gym's vllm_model, external ones as
    its openai_model (which has the max_concurrent_requests cap)."""

    name: str
    base_url: str
    model_name: str
    self_hosted: bool
    api_key: str | None = field(default=None, repr=False)
    max_concurrent_requests: int | None = None
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def key_variable(self) -> str:
        return JUDGE_KEY_PREFIX + self.name


def judges_config(judges: Sequence[JudgeBinding]) -> dict[str, object]:
    """Gym config defining a responses_api_models server per judge; its key is `${shardrun_judge_api_key_NAME}`,
    which env.yaml resolves (pure; the text holds no secret)."""
    out: dict[str, object] = {}
    for j in judges:
        key_ref = "${" + j.key_variable + "}"
        server: dict[str, object]
        if j.self_hosted:
            impl = "vllm_model"
            server = {
                "entrypoint": "app.py",
                "base_url": j.base_url,
                "api_key": key_ref,
                "model": j.model_name,
                "return_token_id_information": False,
                "uses_reasoning_parser": False,
            }
        else:
            impl = "openai_model"
            server = {
                "entrypoint": "app.py",
                "openai_base_url": j.base_url,
                "openai_api_key": key_ref,
                "openai_model": j.model_name,
            }
            if j.max_concurrent_requests is not None:
                server["max_concurrent_requests"] = j.max_concurrent_requests
        server.update(j.options)
        out[j.name] = {"responses_api_models": {impl: server}}
    return out


def judge_keys(judges: Sequence[JudgeBinding]) -> dict[str, str]:
    """env.yaml's entries for the judges' keys ("EMPTY" for a judge without one, as the policy's)."""
    return {j.key_variable: j.api_key or "EMPTY" for j in judges}


def hydra_list(items: Sequence[str]) -> str:
    """A Hydra list literal; elements with Hydra's special characters are single-quoted."""

    def one(s: str) -> str:
        if any(c in s for c in " ,[]{}()='\"\\:$*?"):
            return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return s

    return "[" + ",".join(one(s) for s in items) + "]"


def ng_run_command(
    adapter: GymAdapter,
    venv: Path,
    gym: GymConfig,
    port: int,
    venvs_dir: Path,
    extra_configs: Sequence[str] = (),
    head: Sequence[str] | None = None,
) -> list[str]:
    """The stack's command: the release's stack command, or `head` (a command that starts the same servers itself,
    such as the release's re-verification), with shardrun's common overrides and gym.overrides; `extra_configs`
    (the judges' server config) join gym.config_paths."""
    return [
        *(adapter.stack_command(venv) if head is None else head),
        f"+config_paths={hydra_list([*gym.config_paths, *extra_configs])}",
        f"+head_server.host={HEAD_HOST}",
        f"+head_server.port={port}",
        *adapter.stack_flags(),
        "+skip_venv_if_present=true",
        f"+uv_venv_dir={venvs_dir}",
        *gym.overrides,
    ]


def base_python_dir(venv: Path) -> Path | None:
    """The directory of the plain interpreter the venv was made from (pyvenv.cfg `home`)."""
    try:
        for line in (venv / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                return Path(value.strip())
    except OSError:
        return None
    return None


def stack_env(base: Mapping[str, str], venv: Path, ray_tmp: Path, shared: bool) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV", "PYTHONPATH")}
    path = [str(venv / "bin")]
    home = base_python_dir(venv)
    if home is not None:
        path.append(str(home))
    env["PATH"] = os.pathsep.join(path + [base.get("PATH", "/usr/bin:/bin")])
    env.update(UV_PYTHON_DOWNLOADS="never", RAY_TMPDIR=str(ray_tmp), RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    if shared:
        env["UV_OFFLINE"] = "1"
    return env


def gym_venv(gym: GymConfig, env: Mapping[str, str]) -> Path:
    """The configured Gym venv; BadInput unless it holds a supported nemo-gym with its commands."""
    path = gym_version.configured_venv(gym.venv, env)
    if path is None:
        raise BadInput(
            f"gym.venv is not set and ${VENV_ENV} is empty: name the venv that has nemo-gym "
            f"(scripts/setup.sh gym builds one)"
        )
    adapter = for_venv(path)
    if not (path / "bin" / adapter.entry_point).exists():
        raise BadInput(
            f"gym venv {path} has nemo-gym {adapter.version} but no bin/{adapter.entry_point}; "
            f"reinstall it (scripts/setup.sh gym)"
        )
    return path


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise BadInput(f"gym venv {venv}: no lib/python3*/site-packages")
    return found[-1]


def link_server_venvs(venvs_dir: Path, venv: Path, server_kinds: Sequence[str]) -> int:
    """`<venvs_dir>/<kind>/<impl>/.venv` -> the Gym venv, for every server of these kinds the Gym install ships."""
    n = 0
    root = site_packages(venv)
    for kind in server_kinds:
        for server in sorted(p for p in (root / kind).glob("*") if p.is_dir() and not p.name.startswith("_")):
            link = venvs_dir / kind / server.name / ".venv"
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() and Path(os.readlink(link)) == venv:
                continue
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            link.symlink_to(venv, target_is_directory=True)
            n += 1
    return n


def ray_tmp_dir(shard: Path) -> Path:
    """A short RAY_TMPDIR named after the shard, emptied first: what a killed attempt left is removed by the next
    (the shard lock keeps attempts of one shard apart). Node-local $TMPDIR unless its path is too long for Ray's
    Unix sockets (107 bytes), then /tmp."""
    import hashlib

    base = tempfile.gettempdir()
    if len(base) > RAY_TMP_BASE_MAX:
        base = "/tmp"
    path = Path(base) / f"sr-ray-{hashlib.sha256(str(Path(shard).resolve()).encode()).hexdigest()[:12]}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---------------------------------------------------------------- the running stack


class StartLog:
    """ng_run's log from where one start of the stack began, read forward as it grows: the `phrases` are looked
    for in everything the start printed, not in the last lines a failure message carries (a head server that lost
    its port says so, then Ray and ng_run print many more lines: "Head server finished unexpectedly!" is what is
    left at the end). Each byte is read once; phrases match without regard to case, across read boundaries."""

    CHUNK = 1 << 20

    def __init__(self, path: Path, offset: int, phrases: Sequence[str]):
        self.path, self.offset = Path(path), offset
        self.phrases = [p.lower().encode() for p in phrases]
        self.found: set[str] = set()
        self._carry = b""

    def scan(self) -> set[str]:
        """The phrases (lower-case) the start log holds so far."""
        keep = max(map(len, self.phrases), default=1) - 1
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while data := f.read(self.CHUNK):
                    self.offset += len(data)
                    text = self._carry + data.lower()
                    self.found |= {p.decode() for p in self.phrases if p in text}
                    self._carry = text[-keep:] if keep else b""
        except FileNotFoundError:
            pass
        return self.found


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@dataclass
class GymStack:
    proc: processes.Proc
    port: int
    env_yaml: Path
    ray_tmp: Path
    instances: list[dict] = field(default_factory=list)
    log_from: int = 0  # where this start's part of ng_run's log (appended to by every start) begins
    start_log: StartLog = field(init=False)

    def __post_init__(self) -> None:
        self.start_log = StartLog(self.proc.log_path, self.log_from, [self.head_bind_failure, *TRANSIENT_START])

    @property
    def head_bind_failure(self) -> str:
        return f"attempting to bind on address ('{HEAD_HOST}', {self.port})"

    def transient_failure(self) -> str | None:
        """The TRANSIENT_START reason found anywhere in what this start wrote to ng_run's log, or None."""
        found = self.start_log.scan()
        return next((r for r in TRANSIENT_START if r in found), None)

    @property
    def head_url(self) -> str:
        return f"http://{HEAD_HOST}:{self.port}"

    def server_instances(self) -> list[dict] | None:
        got = processes.http_get(self.head_url + "/server_instances", timeout=5.0)
        if got is None or got[0] != 200:
            return None
        try:
            data = json.loads(got[1])
        except ValueError:
            return None
        return data if isinstance(data, list) else None

    def unanswered(self, instances: list[dict]) -> list[str]:
        """Names of servers whose URL does not answer HTTP at all (any status counts as alive, like ng_status)."""
        return [
            str(i.get("process_name") or i.get("name"))
            for i in instances
            if not i.get("url") or processes.http_get(str(i["url"]), timeout=3.0) is None
        ]

    def head_port_lost(self) -> bool:
        """Did the head server fail to bind its port (taken since it was chosen, often by one of Ray's own
        processes)? ng_run then waits for its head server forever, so the stack has to be started again."""
        return self.head_bind_failure.lower() in self.start_log.scan()

    def ready(self) -> bool:
        """Every server listed and answering; ServerFailure when the head server lost its port."""
        if self.head_port_lost():
            raise ServerFailure(f"Gym head server port {self.port}: address already in use (log {self.proc.log_path})")
        instances = self.server_instances()
        if not instances or self.unanswered(instances):
            return False
        self.instances = instances
        return True

    def problem(self) -> str | None:
        """Why the stack is unhealthy, or None (for the watchdog)."""
        if not self.proc.alive():
            return f"the Gym stack exited: {self.proc.describe_exit()}"
        dead = self.unanswered(self.instances)
        if dead:
            return f"Gym server(s) not answering: {', '.join(dead)} (log {self.proc.log_path})"
        return None

    def stop(self) -> None:
        """SIGTERM ng_run's group, kill stragglers, delete env.yaml (it holds the keys) and Ray's temp dir."""
        try:
            processes.stop(self.proc, grace=STOP_GRACE_S, straggler_grace=STRAGGLER_GRACE_S)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.env_yaml.unlink()
            shutil.rmtree(self.ray_tmp, ignore_errors=True)


def write_env_yaml(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with store.atomic_writer(path) as f:  # mkstemp: created 0600
        os.fchmod(f.fileno(), 0o600)
        f.write(text.encode())


@dataclass(frozen=True)
class StackPlace:
    """Where a Gym stack lives: `home` (a shard's directory, or a warm worker's), ng_run's working dir and log."""

    home: Path
    work: Path
    log: Path


def shard_place(run_dir: Path, index: int) -> StackPlace:
    return StackPlace(
        store.shard_dir(run_dir, index), store.gym_dir(run_dir, index), store.gym_log_path(run_dir, index)
    )


def start(
    run_dir: Path,
    index: int,
    gym: GymConfig,
    base_urls: Sequence[str],
    api_key: str | None,
    model_name: str,
    env: Mapping[str, str] | None = None,
    place: StackPlace | None = None,
    judges: Sequence[JudgeBinding] = (),
    extra_env: Mapping[str, str] | None = None,
    command: Callable[[GymAdapter, Path], list[str]] | None = None,
    extra: Sequence[str] = (),
) -> GymStack:
    """Write env.yaml (and the judges' server config) and start ng_run for shard `index`, or at `place` (a warm
    worker's), not waiting for readiness. `extra_env` joins ng_run's environment (the sandbox's address:
    shard/sandbox.py gym_env). `command(adapter, venv)`: another command of the release that starts the servers
    itself (the re-verification of `shardrun rescore`), with `extra` overrides after gym.overrides."""
    base_env = dict(os.environ if env is None else env) | dict(extra_env or {})
    venv = gym_venv(gym, base_env)
    adapter = for_venv(venv)
    place = place or shard_place(run_dir, index)
    work = place.work
    work.mkdir(parents=True, exist_ok=True)
    shared = gym.server_venvs == "shared"
    if shared:
        venvs_dir = work / store.SERVER_VENVS
        link_server_venvs(venvs_dir, venv, adapter.server_kinds)
    else:
        venvs_dir = Path(gym.uv_venv_dir) if gym.uv_venv_dir else venv.parent / (venv.name + "-server-venvs")
        venvs_dir.mkdir(parents=True, exist_ok=True)
    env_yaml = work / store.ENV_YAML
    secrets = secret_values(gym, base_env)
    keys = judge_keys(judges)
    clash = sorted(set(keys) & set(secrets))
    if clash:
        raise BadInput(f"gym.secrets.{clash[0]}: shardrun writes {clash[0]} into env.yaml itself (a judge's key)")
    write_env_yaml(env_yaml, env_yaml_text(base_urls, api_key, model_name, {**secrets, **keys}))
    extra_configs = []
    if judges:
        with store.atomic_writer(work / JUDGES_YAML) as f:
            f.write(yaml.safe_dump(judges_config(judges), sort_keys=False).encode())
        extra_configs.append(JUDGES_YAML)
    ray_tmp = ray_tmp_dir(place.home)
    log_from = log_size(place.log)  # ng_run's log is appended to: this start's part begins here
    port = processes.free_port(HEAD_HOST)
    cmd = ng_run_command(
        adapter, venv, gym, port, venvs_dir, extra_configs, command(adapter, venv) if command else None
    )
    cmd += list(extra)
    if not shared:
        cmd.append(f"+uv_cache_dir={venvs_dir / 'uv-cache'}")
    # with request debugging on, Gym's model adapter prints a failed request's headers (the key among them)
    proc = processes.start(
        cmd,
        place.log,
        name="ng_run",
        cwd=work,
        env=stack_env(base_env, venv, ray_tmp, shared),
        redact=([api_key] if api_key else []) + list(secrets.values()) + [j.api_key for j in judges if j.api_key],
    )
    return GymStack(proc=proc, port=port, env_yaml=env_yaml, ray_tmp=ray_tmp, log_from=log_from)


def wait_ready(stack: GymStack, timeout: float) -> float:
    """Seconds until the head server lists its servers and every one answers; ServerFailure otherwise."""
    return processes.wait_until(
        stack.ready,
        watch=[stack.proc],
        timeout=timeout,
        interval=1.0,
        what=f"Gym servers (ng_run, head server {stack.head_url})",
    )


def transient_start_failure(message: str, stack: GymStack | None = None) -> bool:
    """Did a start of the stack fail for a reason the next start gets past (TRANSIENT_START)? Read from the failure's
    message and, given the `stack`, from everything its start wrote to ng_run's log (the message carries only the
    log's last lines)."""
    return any(reason in message.lower() for reason in TRANSIENT_START) or (
        stack is not None and stack.transient_failure() is not None
    )


def start_ready(
    run_dir: Path,
    index: int,
    gym: GymConfig,
    base_urls: Sequence[str],
    api_key: str | None,
    model_name: str,
    env: Mapping[str, str] | None = None,
    place: StackPlace | None = None,
    judges: Sequence[JudgeBinding] = (),
    extra_env: Mapping[str, str] | None = None,
) -> tuple[GymStack, float]:
    """start + wait_ready, all within gym.ready_timeout_s; a start that failed for a TRANSIENT_START reason found
    anywhere in what it wrote to ng_run's log is started again (another head port, a fresh Ray), up to START_TRIES
    starts. Every start of every launch mode (a shard job, a Slurm array task, a warm worker) comes through here."""
    t0 = time.monotonic()
    for attempt in range(START_TRIES):
        stack = start(run_dir, index, gym, base_urls, api_key, model_name, env, place, judges, extra_env)
        try:
            wait_ready(stack, max(1.0, gym.ready_timeout_s - (time.monotonic() - t0)))
            return stack, time.monotonic() - t0
        except ServerFailure as e:
            stack.stop()
            reason = stack.transient_failure()
            if attempt + 1 < START_TRIES and transient_start_failure(str(e), stack):
                print(
                    f"[shardrun] Gym stack start {attempt + 1} of {START_TRIES} failed ({reason or 'transient'}, "
                    f"log {stack.proc.log_path}); starting it again",
                    flush=True,
                )
                continue
            if reason and reason not in str(e).lower():
                raise ServerFailure(f"{e}\n(earlier in the log: {reason})") from None
            raise
        except BaseException:
            stack.stop()
            raise
    raise AssertionError("unreachable")
