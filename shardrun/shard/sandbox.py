"""The job's code-execution sandbox (NeMo-Skills' protocol): started beside the Gym servers, ready, watched, restarted.

NeMo Gym's sandbox clients (ns_tools, math_formal_lean, competitive_coding_challenges) find the sandbox through
NEMO_SKILLS_SANDBOX_HOST and NEMO_SKILLS_SANDBOX_PORT in the environment of the servers `ng_run` starts (their
configs read `${oc.env:NEMO_SKILLS_SANDBOX_HOST,127.0.0.1}`); `gym_env` is that pair, which the Gym stack gets in
its environment. Those clients turn a sandbox that does not answer into a tool or verifier output ("Client timed
out", a 502, a transport error), so a rollout that ran while the sandbox was down is written with a reward like any
other. The runtime therefore never trusts rows that landed after the last health check the sandbox passed
(`Sandbox.healthy_mark`): when the sandbox is found dead they are taken back and run again (shard/runtime.py).

A sandbox is `sandbox.command` (bash, `{port}` replaced) or `sandbox.image` (pyxis on Slurm, docker/podman
locally), in its own process group; readiness is GET `health_path` answering 200 within `ready_timeout_s`;
liveness while collecting is the process alive and `health_path` answering 200 within `liveness_timeout_s`.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from shardrun.core.config import SANDBOX_PORT_PLACEHOLDER, ClusterConfig, SandboxConfig
from shardrun.core.errors import BadInput, ServerFailure
from shardrun.rundir import store
from shardrun.shard import processes

HOST_ENV = "NEMO_SKILLS_SANDBOX_HOST"
PORT_ENV = "NEMO_SKILLS_SANDBOX_PORT"
STOP_GRACE_S = 5.0


# ---------------------------------------------------------------- pure parts


def gym_env(host: str, port: int) -> dict[str, str]:
    """What the Gym servers read to find the sandbox (their configs' `${oc.env:NEMO_SKILLS_SANDBOX_*}`)."""
    return {HOST_ENV: host, PORT_ENV: str(port)}


def in_slurm_job(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def image_script(cfg: SandboxConfig, port: int) -> str:
    """The shell line run inside the image: the NeMo-Skills sandbox's entry with its port and workers."""
    return (
        f"export NGINX_PORT={port} LISTEN_PORT={port} NUM_WORKERS={cfg.workers}; exec {shlex.quote(cfg.image_command)}"
    )


def command(
    cfg: SandboxConfig, port: int, *, cluster: ClusterConfig | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    """The sandbox's command line. `command`: bash -c with `{port}` replaced. `image`: in a Slurm job (SLURM_JOB_ID
    set) a pyxis step on this node beside the running shard (srun --overlap, cluster.mounts); elsewhere
    `sandbox.runtime`'s `run --rm --network=host`. BadInput for an image with no way to run it."""
    if cfg.command is not None:
        return ["bash", "-c", cfg.command.replace(SANDBOX_PORT_PLACEHOLDER, str(port))]
    assert cfg.image is not None
    env = os.environ if env is None else env
    script = image_script(cfg, port)
    if in_slurm_job(env):
        mounts = list((cluster or ClusterConfig()).mounts)
        return [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={env.get('SLURMD_NODENAME') or os.uname().nodename}",
            "--gpus=0",
            f"--container-image={cfg.image}",
            *(["--container-mounts=" + ",".join(mounts)] if mounts else []),
            "--no-container-mount-home",
            "bash",
            "-lc",
            script,
        ]
    if cfg.runtime is None:
        raise BadInput(image_needs_runtime())
    return [cfg.runtime, "run", "--rm", "--network=host", cfg.image, "bash", "-lc", script]


def image_needs_runtime() -> str:
    return (
        "sandbox.image: outside a Slurm job an image needs a container runtime: set sandbox.runtime to docker or "
        "podman, or give sandbox.command (a command that serves the sandbox on {port})"
    )


# ---------------------------------------------------------------- liveness


@dataclass
class Health:
    """GET `url`: 200 is alive; no answer or another status is a problem once it has lasted `timeout_s` (a busy
    sandbox answers late, not never). `clock` for tests."""

    url: str
    timeout_s: float
    clock: Callable[[], float] = time.monotonic
    get: Callable[[str], tuple[int, bytes] | None] = field(default=lambda url: processes.http_get(url, timeout=5.0))
    failing_since: float | None = None
    last_ok: bool = False  # did the last check get 200?

    def problem(self) -> str | None:
        got = self.get(self.url)
        self.last_ok = got is not None and got[0] == 200
        if self.last_ok:
            self.failing_since = None
            return None
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        if now - self.failing_since >= self.timeout_s:
            said = "no answer" if got is None else f"status {got[0]}"
            return (
                f"sandbox {self.url}: {said} for {now - self.failing_since:.0f} s "
                f"(sandbox.liveness_timeout_s = {self.timeout_s:g})"
            )
        return None


# ---------------------------------------------------------------- the running sandbox


@dataclass
class Sandbox:
    """A started, ready sandbox on `port`; `restarts` counts its restarts in place (same port: the Gym servers keep
    its address), for the life of the servers it was started with."""

    cfg: SandboxConfig
    proc: processes.Proc
    port: int
    log_path: Path
    cluster: ClusterConfig | None = None
    restarts: int = 0
    ready_s: float = 0.0
    health: Health = field(init=False)

    def __post_init__(self) -> None:
        self.health = Health(self.url(self.cfg.health_path), self.cfg.liveness_timeout_s)

    def url(self, path: str = "") -> str:
        host = self.cfg.host if ":" not in self.cfg.host else f"[{self.cfg.host}]"
        return f"http://{host}:{self.port}{path}"

    @property
    def gym_env(self) -> dict[str, str]:
        return gym_env(self.cfg.host, self.port)

    def describe(self) -> str:
        how = f"image {self.cfg.image}" if self.cfg.image else "command"
        return f"sandbox ({how}) at {self.url()}, log {self.log_path}"

    def problem(self) -> str | None:
        """Why the sandbox cannot serve now, or None: its process exited (at once), or its health check has failed
        for sandbox.liveness_timeout_s."""
        if not self.proc.alive():
            return f"the sandbox exited: {self.proc.describe_exit()}"
        return self.health.problem()

    def restart(self, limit: int, log: Callable[[str], None]) -> None:
        """Stop it and start it again on the same port, ready; ServerFailure when it has already been restarted
        `limit` times (cluster.max_server_restarts) or does not come back."""
        reason = self.problem() or "its health check failed"
        if self.restarts >= limit:
            raise ServerFailure(
                f"{reason}; the sandbox was restarted {self.restarts} time(s) already "
                f"(cluster.max_server_restarts = {limit})"
            )
        self.restarts += 1
        log(f"restarting the sandbox ({self.restarts} of {limit}): {reason}")
        self.stop()
        self.proc, self.ready_s = launch(self.cfg, self.port, self.log_path, cluster=self.cluster)
        self.health = Health(self.url(self.cfg.health_path), self.cfg.liveness_timeout_s)
        log(f"sandbox ready again in {self.ready_s:.1f} s")

    def stop(self) -> None:
        processes.stop(self.proc, grace=STOP_GRACE_S)


def launch(
    cfg: SandboxConfig,
    port: int,
    log_path: Path,
    *,
    cluster: ClusterConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[processes.Proc, float]:
    """Start the sandbox process and wait for its health path; (process, seconds to ready), or ServerFailure with
    its log's last lines (the process stopped)."""
    base = dict(os.environ if env is None else env)
    cmd = command(cfg, port, cluster=cluster, env=base)
    proc = processes.start(cmd, log_path, name="sandbox", env=base | dict(cfg.env))
    host = cfg.host if ":" not in cfg.host else f"[{cfg.host}]"
    try:
        waited = processes.wait_http(
            f"http://{host}:{port}{cfg.health_path}",
            watch=[proc],
            timeout=cfg.ready_timeout_s,
            what=f"sandbox on port {port} (GET {cfg.health_path})",
            interval=0.5,
        )
    except BaseException:
        processes.stop(proc, grace=STOP_GRACE_S)
        raise
    return proc, waited


def start(
    cfg: SandboxConfig,
    home: Path,
    *,
    cluster: ClusterConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> Sandbox:
    """Start the sandbox for the servers living in `home` (a shard's directory, or a warm worker's) on
    `sandbox.port` or a free one, its log `home/logs/sandbox.log`; ready, or ServerFailure."""
    port = cfg.port if cfg.port is not None else processes.free_port(cfg.host)
    log_path = store.sandbox_log_path(home)
    proc, waited = launch(cfg, port, log_path, cluster=cluster, env=env)
    return Sandbox(cfg=cfg, proc=proc, port=port, log_path=log_path, cluster=cluster, ready_s=waited)


@dataclass
class Guard:
    """Which rows on disk the sandbox vouches for. `problem` (the watchdog's check) reads the sizes of `files` (the
    shard's rollouts and failures) before it checks the sandbox; when the check is answered 200 those sizes become
    `mark`: every row within them was written while the sandbox served (a sandbox's process, once dead, stays dead
    until it is restarted). When it is found dead, `take_back` cuts the files back to `mark`: the rows after it
    may have met a dead sandbox, which Gym's clients score as a failed execution, so they are run again."""

    box: Sandbox
    files: Sequence[Path]
    mark: list[int] | None = None
    tripped: str | None = None

    def problem(self) -> str | None:
        sizes = [size(p) for p in self.files]
        problem = self.box.problem()
        if problem is None and self.box.health.last_ok:
            self.mark = sizes
        self.tripped = problem
        return problem

    def settle(self, interval_s: float, sleep: Callable[[float], None] = time.sleep) -> str | None:
        """Check until the sandbox answers 200 (None: `mark` is now) or is dead (its problem); bounded by
        sandbox.liveness_timeout_s."""
        while True:
            problem = self.problem()
            if problem is not None or self.box.health.last_ok:
                return problem
            sleep(interval_s)

    def take_back(self) -> int:
        """Cut the files back to `mark` (each to its last complete line); the bytes removed."""
        if self.mark is None:
            raise ServerFailure("the sandbox never passed a health check this round; its rows cannot be vouched for")
        cut = 0
        for path, keep in zip(self.files, self.mark):
            cut += store.cut_back(path, keep)
            store.repair_torn_tail(path)
        self.tripped = None
        return cut


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
