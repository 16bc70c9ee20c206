"""The policy's server step: every server of a job's layout (server_layout), started together and watched.

On a Slurm job over several nodes the step is `srun --overlap --kill-on-bad-exit=1 --nodes=N --ntasks=N
--ntasks-per-node=1 bash policy-servers.sh` (the shard or warm worker runs on the first node, in a step of its
own, hence --overlap); on one node the script runs here directly. Ready means every server's `/health` answers
200 and its `/v1/models` lists the served name (and the router's, behind it), within `policy.vllm.ready_timeout_s`.
While collecting, the step exiting (any status) or a server not answering `/health` for
`policy.vllm.liveness_timeout_s` is a server failure: rollouts are never sent to a dead address for ever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from shardrun.core.config import ClusterConfig, PolicyConfig
from shardrun.core.errors import BadInput, ServerFailure
from shardrun.rundir import fileio, store
from shardrun.shard import processes, server_layout, vllm

CONTAINER_ROLE = "shardrun"
SERVER_ROLE = "vllm"  # cluster.containers.vllm: the servers' image, where it differs from shardrun's


def container_args(cluster: ClusterConfig, role: str = CONTAINER_ROLE) -> list[str]:
    """pyxis's srun arguments for a step in the image of `role` (falling back to shardrun's image), with the
    mounts; none without an image. The one definition: the shard jobs' srun (launch/slurm.py) uses it too."""
    image = cluster.containers.get(role) or cluster.containers.get(CONTAINER_ROLE)
    if not image:
        if cluster.mounts:
            raise BadInput("cluster.mounts needs a container image: set cluster.containers.shardrun")
        return []
    args = [f"--container-image={image}"]
    if cluster.mounts:
        args.append("--container-mounts=" + ",".join(cluster.mounts))
    return args


def srun_command(n: int, script: Path, cluster: ClusterConfig) -> list[str]:
    """The server step over the job's `n` nodes, one task per node; a task that fails ends the step."""
    return [
        "srun",
        "--overlap",
        "--kill-on-bad-exit=1",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        *container_args(cluster, SERVER_ROLE),
        "bash",
        str(script),
    ]


def slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    """The job's nodes in order (`scontrol show hostnames $SLURM_JOB_NODELIST`); the first runs this process."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ServerFailure("cluster.nodes > 1 but SLURM_JOB_NODELIST is not set: not inside a Slurm job")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ServerFailure(f"scontrol show hostnames {nodelist}: {e}") from None
    hosts = tuple(h.strip() for h in out.splitlines() if h.strip())
    if not hosts:
        raise ServerFailure(f"scontrol show hostnames {nodelist} listed no node")
    return hosts


def job_nodes(
    cluster: ClusterConfig | None, env: Mapping[str, str], gpus_here: int, concurrency: int | None
) -> server_layout.JobNodes:
    """This job's nodes. Inside a Slurm job: Slurm's node list when the config asks for several nodes, the config's
    GPUs per node and the job's time limit; elsewhere this machine with the GPUs it shows."""
    cluster = cluster or ClusterConfig()
    if not env.get("SLURM_JOB_ID"):
        return server_layout.JobNodes((os.uname().nodename,), gpus_here, None, concurrency)
    hosts = slurm_hosts(env) if cluster.nodes > 1 else (os.uname().nodename,)
    return server_layout.JobNodes(hosts, cluster.gpus_per_node, cluster.shard_time_minutes() * 60, concurrency)


@dataclass
class ServerStep:
    """The running servers of one job. Quacks like vllm.VllmServer for the shard (proc, base_url, alive, stop)."""

    proc: processes.Proc
    layout: server_layout.ServerLayout
    script: Path
    liveness: vllm.Liveness
    ready_s: float = 0.0
    api_key: str | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return self.layout.urls[0]

    @property
    def model_name(self) -> str:
        return self.layout.model_name

    @property
    def log_path(self) -> Path:
        return self.proc.log_path

    def alive(self) -> bool:
        return self.proc.alive()

    def problem(self) -> str | None:
        if not self.proc.alive():
            return (
                f"the policy server step exited: {self.proc.describe_exit()}; any exit of a server, status 0 "
                f"included, ends it (each server's log: {store.vllm_log_path(self.script.parent.parent).parent})"
            )
        return self.liveness.problem()

    def stop(self) -> int | None:
        return processes.stop(self.proc, grace=vllm.STOP_GRACE_S)


def step_env(base: Mapping[str, str], api_key: str | None) -> dict[str, str]:
    env = dict(base)
    env.pop(server_layout.RANK_VAR, None)
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key  # in the environment only: never in the script or on a command line
    else:
        env.pop("VLLM_API_KEY", None)
    return env


def start(
    policy: PolicyConfig,
    cluster: ClusterConfig | None,
    job: server_layout.JobNodes,
    shard_dir: Path,
    port: int,
    env: Mapping[str, str],
    api_key: str | None,
) -> ServerStep:
    """Write the layout's script, start the step, wait until every server is ready; ServerFailure (the step
    stopped) when one exits or is not ready in time."""
    v = policy.vllm
    assert v is not None
    lay = server_layout.layout(policy, job, port, shard_dir, env)
    script = store.vllm_scratch_dirs(shard_dir)[0].parent / server_layout.SCRIPT_NAME
    script.parent.mkdir(parents=True, exist_ok=True)
    store.vllm_scratch_dirs(shard_dir)[1].mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_bytes(script, server_layout.node_script(lay).encode())
    senv = step_env(env, api_key)
    if job.spans_nodes:
        cmd = srun_command(len(job.hosts), script, cluster or ClusterConfig())
        if shutil.which("srun", path=senv.get("PATH")) is None:
            raise ServerFailure(
                "srun is not on PATH in the shard's job, so the policy's server step over the job's nodes cannot "
                "start; in a container image, the image needs Slurm's client commands and the Slurm config "
                "(docs/cluster-configs.md, 'Jobs over several nodes, in containers')"
            )
    else:
        for root in lay.roots:
            host, _, p = root.rpartition("//")[2].rpartition(":")
            if vllm.port_answers(host.strip("[]"), int(p)):
                raise ServerFailure(f"policy server port {p} is already in use on {host}")
        cmd = ["bash", str(script)]
        senv[server_layout.RANK_VAR] = "0"
    log = store.vllm_log_path(shard_dir).with_name("policy-servers.log")
    proc = processes.start(cmd, log, name="policy servers", env=senv)
    step = ServerStep(proc, lay, script, vllm.Liveness(lay.roots, v.liveness_timeout_s), api_key=api_key)
    t0 = time.monotonic()
    try:
        for root in lay.roots:
            left = max(1.0, v.ready_timeout_s - (time.monotonic() - t0))
            vllm.wait_ready(proc, root, lay.model_name, api_key, left)
    except BaseException:
        step.stop()
        raise
    step.ready_s = time.monotonic() - t0
    return step
