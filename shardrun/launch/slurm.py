"""Slurm specifics, pure: job naming, array layout, sbatch parameters, time limits, what a Slurm submission
consists of (`SlurmPlan`) and the sbatch scripts it renders to. What asks or tells the scheduler after submission
(squeue, sacct, scancel, scontrol) is scheduler.py; what submits is the backends' (slurm_arrays.py,
warm_workers.py), through submitit.

The sbatch parameters use submitit's SlurmExecutor names (`time` in minutes, `mem` as "64GB", `setup`,
`srun_args`, `additional_parameters`, ...); the backends hand them to submitit, which renders the script.
`submitit_sbatch` is the one place that calls submitit's private renderer (tests/launch/test_sbatch_golden.py pins its
output), so what `submit --dry-run` prints is exactly what sbatch receives.

Containers (pyxis) go to `srun_args`, not to `#SBATCH` lines: submitit runs the shard through `srun` inside the
batch script, and pyxis's `sbatch --container-image` would put the batch script itself in the container, where
`srun` is not available.
"""

from __future__ import annotations

import hashlib
import math
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from shardrun.core.config import ClusterConfig, RunConfig
from shardrun.core import slurm_values
from shardrun.core.errors import BadInput
from shardrun.rundir import store
from shardrun.shard import server_step

DEFAULT_TIME_LIMIT = slurm_values.DEFAULT_TIME_LIMIT
MERGE_SUFFIX = "-merge"
CONTAINER_ROLE = server_step.CONTAINER_ROLE

_SECRET_NAME = re.compile(r"(KEY|TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL)S?$", re.IGNORECASE)


# ---------------------------------------------------------------- naming


def job_tag(prefix: str, run_dir: Path | str, fingerprint: str) -> str:
    """The job name every shard job of this run carries; `status`, `resume` and `cancel` find jobs by it.

    It covers the run directory (resolved) and the plan, so two runs of the same plan in two directories, or two
    plans in one directory over time, never see each other's jobs."""
    digest = hashlib.sha256(f"{Path(run_dir).resolve()}\n{fingerprint}".encode()).hexdigest()
    return f"{prefix}-{digest[:10]}"


def merge_job_name(tag: str) -> str:
    return tag + MERGE_SUFFIX


# ---------------------------------------------------------------- array layout


@dataclass(frozen=True)
class ArrayChunk:
    """One job array: array task i runs shard `shards[i]`; at most `parallelism` tasks run at once."""

    shards: tuple[int, ...]
    parallelism: int

    @property
    def size(self) -> int:
        return len(self.shards)


def array_layout(shards: Sequence[int], max_array_size: int, parallelism: int) -> list[ArrayChunk]:
    """Split shard indices into job arrays of at most `max_array_size` tasks (Slurm's MaxArraySize: task ids run
    0..MaxArraySize-1) and share the run's parallelism cap among them in proportion to their sizes, so the arrays
    together never run more than `parallelism` shards and finish at about the same time. Each array gets at least
    one slot, so with more arrays than `parallelism` the cap is the number of arrays."""
    if max_array_size < 1:
        raise BadInput(f"MaxArraySize must be >= 1, got {max_array_size}")
    if parallelism < 1:
        raise BadInput(f"array_parallelism must be >= 1, got {parallelism}")
    groups = [tuple(shards[i : i + max_array_size]) for i in range(0, len(shards), max_array_size)]
    if not groups:
        return []
    total = len(shards)
    budget = max(parallelism, len(groups))
    exact = [budget * len(g) / total for g in groups]
    shares = [max(1, math.floor(x)) for x in exact]
    # largest remainder: hand out what flooring left, biggest remainders first, never above an array's size
    order = sorted(range(len(groups)), key=lambda k: (-(exact[k] - math.floor(exact[k])), k))
    left = budget - sum(shares)
    for k in order:
        if left <= 0:
            break
        if shares[k] < len(groups[k]):
            shares[k] += 1
            left -= 1
    return [ArrayChunk(g, min(s, len(g))) for g, s in zip(groups, shares)]


def describe_layout(layout: Sequence[ArrayChunk]) -> str:
    """Human-readable array layout for `submit --dry-run`."""
    lines = [
        f"{len(layout)} job array(s), {sum(c.size for c in layout)} shard(s); "
        f"at most {sum(c.parallelism for c in layout)} running at once"
    ]
    for k, c in enumerate(layout):
        lines.append(f"  array {k}: --array=0-{c.size - 1}%{c.parallelism}  shards {format_ranges(c.shards)}")
    return "\n".join(lines)


def format_ranges(values: Iterable[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    out: list[str] = []
    run: list[int] = []
    for v in sorted(values):
        if run and v == run[-1] + 1:
            run.append(v)
            continue
        if run:
            out.append(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [v]
    if run:
        out.append(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


# ---------------------------------------------------------------- resources

parse_time_limit = slurm_values.parse_time_limit  # Slurm's time syntax, one definition (core/slurm_values.py)


def shard_time_minutes(cluster: ClusterConfig) -> int:
    """The shard time limit in minutes (ClusterConfig.shard_time_minutes: timeouts[partition], else time_limit,
    else DEFAULT_TIME_LIMIT)."""
    return cluster.shard_time_minutes()


def signal_delay_s(cluster: ClusterConfig, time_min: int) -> int:
    """Seconds before the time limit at which Slurm sends USR2 (submitit's checkpoint signal). At most half of
    the time limit, so a short job still gets to work before it is asked to stop."""
    return max(1, min(cluster.signal_delay_s, time_min * 30))


def mem_string(mem_gb: float) -> str:
    """Same spelling submitit uses for --mem."""
    return f"{int(mem_gb)}GB" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}MB"


def env_setup_lines(env_vars: Sequence[str], pass_through: Sequence[str] = ()) -> list[str]:
    """Shell lines for the job's environment. NAME=value is exported; a bare NAME is passed through from the
    submitting shell by sbatch (--export=ALL), so only a check that it arrived is written, never its value."""
    lines: list[str] = []
    for item in env_vars:
        name, sep, value = item.partition("=")
        if sep:
            if _SECRET_NAME.search(name):
                raise BadInput(
                    f"cluster.env_vars: {name} looks like a secret; list it as a bare {name} so it is "
                    f"passed through from your shell instead of written into the job script"
                )
            lines.append(f"export {name}={shlex.quote(value)}")
        else:
            lines.append(_require_env(name))
    for name in pass_through:
        line = _require_env(name)
        if line not in lines:
            lines.append(line)
    return lines


def missing_pass_through(env_vars: Sequence[str], pass_through: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The names a job expects from the submitting shell (bare env_vars entries, the policy key) that are unset."""
    names = [item for item in env_vars if "=" not in item] + list(pass_through)
    return sorted({n for n in names if not environ.get(n)})


def _require_env(name: str) -> str:
    return f': "${{{name}:?{name} is not set (it is passed through from the shell that submitted the job)}}"'


def job_python(cluster: ClusterConfig) -> str | None:
    """The interpreter the jobs run shardrun with: in a container image, `cluster.container_python` (the image's;
    this checkout's interpreter does not exist there); else None, this interpreter (sys.executable). BadInput
    naming the field when an image is set without it."""
    if not cluster.containers.get(CONTAINER_ROLE):
        return None
    if not cluster.container_python:
        raise BadInput(container_python_missing())
    return cluster.container_python


def container_python_missing() -> str:
    return (
        f"cluster.container_python: not set, but cluster.containers.{CONTAINER_ROLE} runs the jobs in a container "
        f"image, where this checkout's interpreter ({sys.executable}) does not exist; name the interpreter in the "
        f"image that has shardrun installed (e.g. /opt/venv/bin/python3, or python3 on the image's PATH)"
    )


def container_srun_args(cluster: ClusterConfig) -> list[str]:
    """pyxis's arguments for the job's srun (server_step.container_args: one definition with the server step's)."""
    return server_step.container_args(cluster)


def driver_srun_args(cluster: ClusterConfig) -> list[str]:
    """The shard or warm worker runs once per job, on its first node: a job over several nodes gives the others to
    the policy's server step (shard/server_step.py), which the shard starts itself."""
    return ["--nodes=1", "--ntasks=1"] if cluster.nodes > 1 else []


def shard_parameters(
    cluster: ClusterConfig, *, job_name: str, comment: str, pass_through_env: Sequence[str] = ()
) -> dict:
    """sbatch parameters (submitit SlurmExecutor names) for the shard job arrays. Pure."""
    time_min = shard_time_minutes(cluster)
    params: dict = {
        "job_name": job_name,
        "time": time_min,
        "nodes": cluster.nodes,
        "ntasks_per_node": 1,
        "signal_delay_s": signal_delay_s(cluster, time_min),
        "stderr_to_stdout": True,
        "comment": comment,
        "setup": env_setup_lines(cluster.env_vars, pass_through_env) + list(cluster.setup),
        "additional_parameters": {"requeue": True, "export": "ALL", **cluster.additional_parameters},
    }
    for key in ("partition", "account", "qos", "cpus_per_task"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem_gb is not None:
        params["mem"] = mem_string(cluster.mem_gb)
    srun_args = driver_srun_args(cluster) + container_srun_args(cluster)
    if srun_args:
        params["srun_args"] = srun_args
    return params


def merge_parameters(cluster: ClusterConfig, *, job_name: str, comment: str, after: Sequence[str]) -> dict:
    """sbatch parameters for the CPU merge job: starts after every array ended in any state (afterany); a
    dependency Slurm knows can never be met kills it (--kill-on-invalid-dep=yes) instead of leaving it pending."""
    time_min = parse_time_limit(cluster.merge_time_limit)
    params: dict = {
        "job_name": job_name,
        "time": time_min,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": cluster.merge_cpus_per_task,
        "mem": mem_string(cluster.merge_mem_gb),
        "signal_delay_s": signal_delay_s(cluster, time_min),
        "stderr_to_stdout": True,
        "comment": comment,
        "setup": [line for line in env_setup_lines(cluster.env_vars) if line.startswith("export ")]
        + list(cluster.setup),
        "additional_parameters": {
            "kill-on-invalid-dep": "yes",
            "export": "ALL",
            **({"dependency": "afterany:" + ":".join(after)} if after else {}),
        },
    }
    partition = cluster.merge_partition or cluster.partition
    if partition:
        params["partition"] = partition
    for key in ("account", "qos"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)
    srun_args = container_srun_args(cluster)
    if srun_args:
        params["srun_args"] = srun_args
    return params


# ---------------------------------------------------------------- a submission, rendered


def pass_through_env(cfg: RunConfig) -> list[str]:
    """Environment variables a shard job (or warm worker) needs from the submitting shell besides cluster.env_vars:
    the API key, the variables gym.secrets names and the judges' keys (written into the Gym stack's env.yaml at its
    start)."""
    names = [cfg.policy.api_key_env] if cfg.policy and cfg.policy.api_key_env else []
    names += cfg.gym.secrets.values() if cfg.gym else []
    names += [j.api_key_env for j in cfg.judges.values() if j.api_key_env]
    return list(dict.fromkeys(names))


def merge_command(run_dir: Path, python: str | None = None) -> list[str]:
    """What the merge job runs: `shardrun merge-and-profile RUN_DIR` (it re-verifies every shard's seal itself,
    since Slurm counts a dependency on a purged job id as met; missing shards: non-zero exit, 'shardrun resume'),
    with `python` (job_python: the image's), else this interpreter."""
    return [python or sys.executable, "-m", "shardrun.cli", "merge-and-profile", str(run_dir)]


@dataclass(frozen=True)
class SlurmPlan:
    """What a Slurm submission consists of (pure): the job name, the arrays and the parameters."""

    tag: str
    merge_name: str
    layout: list[ArrayChunk]
    shard_params: dict[str, Any]
    merge_params: dict[str, Any] | None
    python: str | None = None  # the jobs' interpreter in a container image (job_python); None: the submitting one

    def array_params(self, chunk: ArrayChunk) -> dict[str, Any]:
        return {**self.shard_params, "array_parallelism": chunk.parallelism}


def slurm_plan(
    cfg: RunConfig,
    run_dir: Path,
    fingerprint: str,
    indices: Sequence[int],
    *,
    max_array_size: int,
    merge_job: bool,
    after: Sequence[str] = (),
) -> SlurmPlan:
    cluster = cfg.cluster_or_default
    python = job_python(cluster)
    tag = job_tag(cluster.job_name_prefix, run_dir, fingerprint)
    comment = f"shardrun {run_dir}"
    shard_params = shard_parameters(cluster, job_name=tag, comment=comment, pass_through_env=pass_through_env(cfg))
    merge_name = merge_job_name(tag)
    merge_params = merge_parameters(cluster, job_name=merge_name, comment=comment, after=after) if merge_job else None
    return SlurmPlan(
        tag,
        merge_name,
        array_layout(list(indices), max_array_size, cluster.array_parallelism),
        shard_params,
        merge_params,
        python,
    )


def submitit_sbatch(command: str, folder: Path, map_count: int | None, params: Mapping[str, Any]) -> str:
    """submitit's own sbatch renderer, the script its SlurmExecutor hands to sbatch for these parameters. The one
    call of a private submitit function in shardrun; tests/launch/test_sbatch_golden.py pins what it returns, so a
    submitit release that changes it fails there, not on a cluster."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, map_count=map_count, **params)


def render_sbatch(params: dict[str, Any], folder: Path, *, map_count: int | None, python: str | None = None) -> str:
    """The sbatch script submitit writes for these parameters (pure: nothing is submitted). A job array when
    `map_count` is given (submitit submits a single shard as a plain job)."""
    folder = Path(folder).absolute()
    command = " ".join([shlex.quote(python or sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return submitit_sbatch(command, folder, map_count, params)


def slurm_scripts(sp: SlurmPlan, run_dir: Path, *, python: str | None = None) -> list[tuple[str, str]]:
    """(title, sbatch script) for every sbatch call of the submission, in order (pure). The jobs run the image's
    interpreter in a container (sp.python), else `python` (default: this one, as submitit does)."""
    jobs_dir = store.jobs_dir(run_dir)
    python = sp.python or python
    out = []
    for k, chunk in enumerate(sp.layout):
        out.append(
            (
                f"array {k}: shards {format_ranges(chunk.shards)}",
                render_sbatch(
                    sp.array_params(chunk), jobs_dir, map_count=chunk.size if chunk.size > 1 else None, python=python
                ),
            )
        )
    if sp.merge_params is not None:
        out.append(
            (
                f"merge job: shardrun merge-and-profile {shlex.quote(str(run_dir))}",
                render_sbatch(sp.merge_params, jobs_dir, map_count=None, python=python),
            )
        )
    return out


def server_step_preview(cfg: RunConfig, run_dir: Path, where: str) -> list[str]:
    """`submit --dry-run`: the policy's server step a job starts (the srun line and the script each node runs, for
    node names as Slurm will give them), for a self-hosted policy of several servers or nodes; none otherwise."""
    from shardrun.shard import policy as policy_mod, server_layout

    p, cluster = cfg.policy, cfg.cluster_or_default
    if p is None or p.vllm is None:
        return []
    gpus = cluster.gpus_per_node
    hosts = tuple(f"NODE{k}" for k in range(cluster.policy_nodes))  # the judge nodes (the last) are the judges
    job = server_layout.JobNodes(
        hosts, gpus, cluster.shard_time_minutes() * 60, cfg.gym.num_samples_in_parallel if cfg.gym else None
    )
    if policy_mod.one_server(p, job):
        return []
    home = Path(where)
    lay = server_layout.layout(p, job, p.vllm.port or 8000, home, {})
    script = store.vllm_scratch_dirs(home)[0].parent / server_layout.SCRIPT_NAME
    subset = hosts if cluster.judge_nodes else None  # exactly the policy's nodes
    step = server_step.srun_command(len(hosts), script, cluster, subset) if job.spans_nodes else ["bash", str(script)]
    return [
        "",
        f"# ---- the policy's server step in each job: {server_layout.describe(lay)}",
        f"# (NODE0..NODE{len(hosts) - 1}: the job's nodes"
        + (f" but the last cluster.judge_nodes {cluster.judge_nodes}, the judges'" if cluster.judge_nodes else "")
        + f", `scontrol show hostnames $SLURM_JOB_NODELIST`; port "
        f"{p.vllm.port or 8000} stands for policy.vllm.port, or a free one)",
        shlex.join(step),
        f"# ---- {script}",
        server_layout.node_script(lay).rstrip("\n"),
    ]
