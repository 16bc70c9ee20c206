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
from typing import Mapping, Sequence

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


def srun_command(n: int, script: Path, cluster: ClusterConfig, nodelist: Sequence[str] | None = None) -> list[str]:
    """The server step over `n` of the job's nodes, one task per node; a task that fails ends the step. `nodelist`:
    exactly those nodes (a job whose judges have nodes of their own: the policy's, or the judges'), whose ranks
    (SLURM_NODEID) follow the job's order."""
    return [
        "srun",
        "--overlap",
        "--kill-on-bad-exit=1",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        *([f"--nodelist={','.join(nodelist)}"] if nodelist else []),
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
    hosts = slurm_hosts(env)[: cluster.policy_nodes] if cluster.nodes > 1 else (os.uname().nodename,)
    return server_layout.JobNodes(hosts, cluster.gpus_per_node, cluster.shard_time_minutes() * 60, concurrency)


def judge_nodes(cluster: ClusterConfig, env: Mapping[str, str]) -> server_layout.JobNodes | None:
    """This Slurm job's judge nodes (its last `cluster.judge_nodes`), or None: no judge nodes asked for, or not in
    a Slurm job (the judges then run beside the policy on this node). ServerFailure when the job has too few."""
    if not cluster.judge_nodes or not env.get("SLURM_JOB_ID"):
        return None
    hosts = slurm_hosts(env)
    if len(hosts) <= cluster.judge_nodes:
        raise ServerFailure(
            f"cluster.judge_nodes is {cluster.judge_nodes} but this job has {len(hosts)} node(s) "
            f"({', '.join(hosts)}); the first runs Gym and the collector"
        )
    return server_layout.JobNodes(hosts[-cluster.judge_nodes :], cluster.gpus_per_node)


def start_step(
    script: Path,
    text: str,
    hosts: Sequence[str],
    over_srun: bool,
    nodelist: bool,
    cluster: ClusterConfig,
    env: dict[str, str],
    log: Path,
    name: str,
    local_roots: Sequence[str] = (),
) -> processes.Proc:
    """Write a server step's script (atomically) and start the step: `srun` over `hosts` (with `nodelist`: exactly
    those), or, on this node alone, `bash SCRIPT` as rank 0 after checking that no server answers at `local_roots`
    already. ServerFailure when srun is missing or a port is taken."""
    script.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_bytes(script, text.encode())
    if over_srun:
        cmd = srun_command(len(hosts), script, cluster, hosts if nodelist else None)
        if shutil.which("srun", path=env.get("PATH")) is None:
            raise ServerFailure(
                f"srun is not on PATH in the shard's job, so the {name} step over the job's nodes cannot start; in a "
                f"container image, the image needs Slurm's client commands and the Slurm config "
                f"(docs/cluster-configs.md, 'Jobs over several nodes, in containers')"
            )
    else:
        for root in local_roots:
            host, _, p = root.rpartition("//")[2].rpartition(":")
            if vllm.port_answers(host.strip("[]"), int(p)):
                raise ServerFailure(f"policy server port {p} is already in use on {host}")
        cmd = ["bash", str(script)]
        env[server_layout.RANK_VAR] = "0"
    return processes.start(cmd, log, name=name, env=env)


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
    store.vllm_scratch_dirs(shard_dir)[1].mkdir(parents=True, exist_ok=True)
    cluster = cluster or ClusterConfig()
    log = store.vllm_log_path(shard_dir).with_name("policy-servers.log")
    proc = start_step(
        script,
        server_layout.node_script(lay),
        job.hosts,
        job.spans_nodes,
        bool(cluster.judge_nodes),
        cluster,
        step_env(env, api_key),
        log,
        "policy servers",
        lay.roots,
    )
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
