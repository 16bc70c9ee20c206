"""Before `submit` or `resume` launch anything: everything a shard needs is there, or nothing is launched.

A config that cannot work used to be found by every shard on its own (eight shards, eight times the same
BadInput). Here, once, before a job exists or a launch is recorded:

- every environment variable a job takes from the submitting shell is set: `policy.api_key_env`, each bare
  NAME in `cluster.env_vars`, each variable `gym.secrets` names and each judge's `api_key_env` (`plan` checks
  these too: `check_secrets`);
- a self-hosted policy (`policy.vllm`) whose jobs are Slurm jobs fits the job: tensor x pipeline x data parallel
  size GPUs within `cluster.nodes` x `cluster.gpus_per_node`, and no GPU-less job unless `policy.vllm.device: cpu`
  says so (`gpu_problems`; `plan` checks this too: `check_gpus`); self-hosted judges' GPUs fit the job's first
  node beside the policy, or with `cluster.judge_nodes` the judge nodes, the policy keeping the others
  (`judge_gpu_problems`, also at `plan`);
- Slurm jobs in a container image name the image's interpreter (`cluster.container_python`);
- a `sandbox.image` on the local executor names a container runtime that is on PATH (`sandbox.runtime`);
- and when some shard to launch still has rollouts to collect (a shard whose every identity is accounted for
  seals without servers):
  - the Gym venv (`gym.venv`, else $SHARDRUN_GYM_VENV, else the venv `scripts/setup.sh gym` builds) holds a
    supported nemo-gym with its commands (not looked for when Slurm jobs run in a container image: it is the
    image's, as are the Gym configs and vLLM's interpreter);
  - every `gym.config_paths` entry, and each nested one, resolves where Gym looks for it;
  - the policy is complete: an http(s) URL with a host for each `policy.base_url`, or for `policy.vllm` an
    interpreter or launcher that exists and a model directory that exists when the model is given as a path.

One BadInput lists every problem with its key (exit 2).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping
from urllib.parse import urlparse

from shardrun.core import gym_version
from shardrun.core.config import GymConfig, PolicyConfig, RunConfig
from shardrun.core.errors import BadInput, ShardFailed
from shardrun.launch import slurm
from shardrun.plan.planner import Plan
from shardrun.rundir import env_manifest, ledger, seal, store
from shardrun.shard import gym_stack, server_layout, vllm


def check(cfg: RunConfig, run_dir: Path, plan: Plan, env: Mapping[str, str] | None = None) -> None:
    """BadInput listing everything a shard of `plan` in `run_dir` would miss; nothing is written. A run directory
    holding another plan is PlanMismatch (store.existing_plan_matches), as planning would say."""
    env = os.environ if env is None else env
    cfg.require("gym", "policy")
    assert cfg.gym is not None and cfg.policy is not None
    problems = gpu_problems(cfg) + judge_gpu_problems(cfg) + missing_environment(cfg, env) + sandbox_problems(cfg, env)
    if in_container(cfg) and not cfg.cluster_or_default.container_python:
        problems.append(slurm.container_python_missing())
    if needs_servers(cfg, run_dir, plan):
        here = not in_container(cfg)
        problems += (gym_problems(cfg.gym, env) if here else []) + policy_problems(cfg.policy, env, here)
        problems += judge_problems(cfg, env, here)
    if problems:
        raise BadInput(f"{run_dir}: nothing was launched; a shard would fail with this config", problems)


def sandbox_problems(cfg: RunConfig, env: Mapping[str, str]) -> list[str]:
    """`sandbox.image` runs as a pyxis step in a Slurm job, or with `sandbox.runtime` (found on PATH) locally."""
    from shardrun.launch import backends
    from shardrun.shard import sandbox

    box = cfg.sandbox
    if box is None or box.image is None or backends.for_config(cfg).runs_on_slurm(cfg.cluster_or_default):
        return []
    if box.runtime is None:
        return [sandbox.image_needs_runtime()]
    if shutil.which(box.runtime, path=env.get("PATH")) is None:
        return [f"sandbox.runtime: {box.runtime} is not on PATH here (the local executor runs the image with it)"]
    return []


def in_container(cfg: RunConfig) -> bool:
    """Slurm jobs that run in a container image (pyxis): the venv, the Gym configs and vLLM's interpreter are
    the image's, which cannot be looked into from here."""
    from shardrun.launch import backends

    cluster = cfg.cluster_or_default
    return backends.for_config(cfg).runs_on_slurm(cluster) and bool(cluster.containers.get(slurm.CONTAINER_ROLE))


def check_gpus(cfg: RunConfig) -> None:
    """`plan`: BadInput when a self-hosted policy's GPUs do not fit the job the config asks for (gpu_problems)."""
    problems = gpu_problems(cfg) + judge_gpu_problems(cfg)
    if problems:
        what = "policy does" if not cfg.judges else "policy and judges do"
        raise BadInput(f"{cfg.run_dir}: the self-hosted {what} not fit the Slurm job", problems)


def gpu_problems(cfg: RunConfig) -> list[str]:
    """A self-hosted vLLM in Slurm jobs: the GPUs it asks for (tensor x pipeline x data parallel size) must fit
    the job's (cluster.nodes x cluster.gpus_per_node), and a job without GPUs serves on CPUs only on purpose
    (policy.vllm.device: cpu). Local jobs use this machine's GPUs as they are: not checked."""
    from shardrun.launch import backends

    v = cfg.policy.vllm if cfg.policy is not None else None
    router = cfg.policy.router if cfg.policy is not None else None
    cluster = cfg.cluster_or_default
    if v is None or not backends.for_config(cfg).runs_on_slurm(cluster):
        return []
    nodes = cluster.policy_nodes
    said = f"cluster.nodes {cluster.nodes}"
    nodes_key = "cluster.nodes"
    if cluster.judge_nodes:  # the last nodes are the judges'
        said += f" - cluster.judge_nodes {cluster.judge_nodes} = {nodes} node(s)"
        nodes_key = "cluster.nodes - cluster.judge_nodes"
    if v.device == "cpu":
        return server_layout.shape_problems(v, router, nodes, 0, nodes_key)
    tp, pp, dp, r = v.tensor_parallel_size, v.pipeline_parallel_size, v.data_parallel_size, v.replicas
    needs = tp * pp * dp * r
    asked = (
        (f"policy.vllm.replicas {r} x " if r != 1 else "policy.vllm.")
        + f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
        + (f" x data_parallel_size {dp}" if dp != 1 else "")
    )
    if cluster.gpus_per_node == 0:
        return [
            f"cluster.gpus_per_node: 0, so the Slurm job has no GPU, but {asked} needs {needs} GPU(s) for the "
            f"self-hosted policy (policy.vllm); set cluster.gpus_per_node (and cluster.nodes) to give them, or "
            f"policy.vllm.device: cpu to serve on CPUs on purpose (a CPU build of vLLM)"
        ]
    gives = nodes * cluster.gpus_per_node
    if needs > gives:
        return [
            f"{asked} needs {needs} GPUs; {said} x cluster.gpus_per_node {cluster.gpus_per_node} gives {gives}; "
            f"raise cluster.nodes or cluster.gpus_per_node, or lower the parallel sizes"
        ]
    return server_layout.shape_problems(v, router, nodes, cluster.gpus_per_node, nodes_key)


def judge_gpu_problems(cfg: RunConfig) -> list[str]:
    """Self-hosted judges in Slurm jobs take GPUs of their own: on the job's first node beside a policy of one
    server (their GPUs plus the policy's must fit that node, cluster.gpus_per_node), or, with cluster.judge_nodes,
    on the job's last nodes (each judge within one node, all of them on those nodes, none idle). A policy of several
    servers or nodes with self-hosted judges needs judge nodes. Local jobs: not checked, as for the policy."""
    from shardrun.launch import backends

    cluster = cfg.cluster_or_default
    hosted = {name: j for name, j in cfg.judges.items() if j.vllm is not None}
    if not backends.for_config(cfg).runs_on_slurm(cluster):
        return []
    if cluster.judge_nodes and not hosted:
        return [
            f"cluster.judge_nodes {cluster.judge_nodes}: no judge is self-hosted (judges.NAME.vllm), so the judge "
            f"nodes would stay idle; set cluster.judge_nodes: 0"
        ]
    if not hosted:
        return []
    on_gpus = {name: j.gpus for name, j in hosted.items() if j.gpus}
    parallel = {
        n: f"judges.{n}.vllm tensor_parallel_size {j.vllm.tensor_parallel_size} x pipeline_parallel_size "
        f"{j.vllm.pipeline_parallel_size}"
        + (f" x data_parallel_size {j.vllm.data_parallel_size}" if j.vllm.data_parallel_size != 1 else "")
        for n, j in hosted.items()
        if j.vllm is not None and n in on_gpus
    }
    asked = " + ".join(parallel.values())
    if on_gpus and cluster.gpus_per_node == 0:
        return [
            f"cluster.gpus_per_node: 0, so the Slurm job has no GPU, but {asked} needs {sum(on_gpus.values())} "
            f"GPU(s) for the self-hosted judges; set cluster.gpus_per_node, or judges.NAME.vllm.device: cpu"
        ]
    if cluster.judge_nodes:
        return judge_node_problems(cluster.judge_nodes, cluster.gpus_per_node, list(hosted), on_gpus, parallel)
    v = cfg.policy.vllm if cfg.policy is not None else None
    if v is not None and (cluster.nodes > 1 or v.replicas > 1 or (cfg.policy and cfg.policy.router)):
        return [
            f"judges.{next(iter(hosted))}: a self-hosted judge runs on the job's first node beside one policy "
            f"server unless the judges have nodes of their own; with a policy of several servers or nodes "
            f"(policy.vllm.replicas {v.replicas}, cluster.nodes {cluster.nodes}"
            f"{', policy.router' if cfg.policy and cfg.policy.router else ''}) set cluster.judge_nodes (the job's "
            f"last nodes run the judges: e.g. cluster.judge_nodes 1 and cluster.nodes {cluster.nodes + 1}), or use "
            f"an external judge (judges.NAME.base_url)"
        ]
    if not on_gpus:
        return []
    policy_gpus = (
        0
        if v is None or v.device == "cpu"
        else v.tensor_parallel_size * v.pipeline_parallel_size * v.data_parallel_size
    )
    needs = policy_gpus + sum(on_gpus.values())
    if needs > cluster.gpus_per_node:
        mine = f"policy.vllm {policy_gpus} + " if policy_gpus else ""
        return [
            f"{asked} needs {sum(on_gpus.values())} GPU(s) of their own on the job's first node; {mine}the judges' "
            f"{sum(on_gpus.values())} = {needs} GPUs, and cluster.gpus_per_node is {cluster.gpus_per_node}; raise "
            f"cluster.gpus_per_node or lower the parallel sizes, or give the judges nodes of their own "
            f"(cluster.judge_nodes)"
        ]
    return []


def judge_node_problems(
    judge_nodes: int, gpus_per_node: int, hosted: list[str], on_gpus: Mapping[str, int], parallel: Mapping[str, str]
) -> list[str]:
    """The self-hosted judges (`hosted`, in config order; `on_gpus`: the GPUs of those that take some) on
    `judge_nodes` nodes of `gpus_per_node` GPUs: each within one node, all of them placed as a job places them
    (server_layout.place_judges), and no judge node left idle."""
    big = [n for n, g in on_gpus.items() if g > gpus_per_node]
    if big:
        return [
            f"{parallel[n]} needs {on_gpus[n]} GPUs; a judge runs within one judge node, and cluster.gpus_per_node "
            f"is {gpus_per_node}; lower its parallel sizes"
            for n in big
        ]
    if judge_nodes > len(hosted):
        return [
            f"cluster.judge_nodes {judge_nodes} but {len(hosted)} self-hosted judge(s): a judge runs within one "
            f"node, so {judge_nodes - len(hosted)} judge node(s) would stay idle; lower cluster.judge_nodes"
        ]
    placed = server_layout.place_judges({n: on_gpus.get(n, 0) for n in hosted}, judge_nodes, gpus_per_node)
    left = [n for n in hosted if n not in placed]
    if left:
        return [
            f"{' + '.join(parallel.values())} need {sum(on_gpus.values())} GPUs on cluster.judge_nodes {judge_nodes} "
            f"node(s) of cluster.gpus_per_node {gpus_per_node}, and {', '.join(f'judges.{n}' for n in left)} find "
            f"no room (each judge within one node); raise cluster.judge_nodes (and cluster.nodes) or lower the "
            f"parallel sizes"
        ]
    return []


def judge_problems(cfg: RunConfig, env: Mapping[str, str], files_here: bool = True) -> list[str]:
    """What is missing from a judge: an http(s) URL with a host (external); with `files_here`, the vLLM
    interpreter and a model given as a path (self-hosted)."""
    out = []
    for name, j in cfg.judges.items():
        if j.base_url is not None:
            parsed = urlparse(j.base_url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                out.append(f"judges.{name}.base_url: {j.base_url!r} is not an http(s) URL with a host")
        v = j.vllm
        if v is not None and files_here:
            program = vllm.launcher(v, env)[0]
            if not (Path(program).is_file() if os.sep in program else shutil.which(program, path=env.get("PATH"))):
                key = f"judges.{name}.vllm.command" if v.command else f"judges.{name}.vllm.python"
                out.append(f"{key}: {program} does not exist here; name the interpreter (or venv) that has vLLM")
            if v.model.startswith(("/", "./", "../", "~")) and not Path(v.model).expanduser().exists():
                out.append(f"judges.{name}.vllm.model: {v.model} does not exist")
    return out


def missing_environment(cfg: RunConfig, env: Mapping[str, str]) -> list[str]:
    """Each variable a job takes from this shell that is unset, by the key that names it (never a value)."""
    cluster = cfg.cluster_or_default
    key = cfg.policy.api_key_env if cfg.policy else None
    secrets = cfg.gym.secrets if cfg.gym else {}
    out = []
    for name in slurm.missing_pass_through(cluster.env_vars, [key] if key else [], env):
        where = "policy.api_key_env" if name == key else "cluster.env_vars"
        out.append(f"{where}: ${name} is not set in this shell; export it where you submit (jobs take it from here)")
    return out + missing_secrets(secrets, env) + missing_judge_keys(cfg, env)


def missing_judge_keys(cfg: RunConfig, env: Mapping[str, str]) -> list[str]:
    """`judges.NAME.api_key_env: $VAR is not set ...` for each judge whose key variable is unset in `env`."""
    return [
        f"judges.{name}.api_key_env: ${j.api_key_env} is not set in this shell; export it where you submit "
        f"(jobs take it from here)"
        for name, j in cfg.judges.items()
        if j.api_key_env and not env.get(j.api_key_env)
    ]


def missing_secrets(secrets: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """`gym.secrets.KEY: $NAME is not set ...` for each gym.secrets entry whose variable is unset in `env`."""
    return [
        f"gym.secrets.{key}: ${name} is not set in this shell; export it where you submit (jobs take it from here)"
        for key, name in secrets.items()
        if not env.get(name)
    ]


def check_secrets(cfg: RunConfig, env: Mapping[str, str] | None = None) -> None:
    """`plan`: BadInput naming each gym.secrets key whose environment variable is not set here (as submit checks)."""
    here = os.environ if env is None else env
    problems = missing_secrets(cfg.gym.secrets if cfg.gym else {}, here) + missing_judge_keys(cfg, here)
    if problems:
        raise BadInput(f"{cfg.run_dir}: a Gym stack could not write its env.yaml", problems)


def needs_servers(cfg: RunConfig, run_dir: Path, plan: Plan) -> bool:
    """Whether some shard of the plan still has rollouts to collect. A run not planned yet: every shard has."""
    if not store.existing_plan_matches(run_dir, plan):
        return True
    plan = store.load_plan(run_dir)  # the plan as recorded: its fingerprint is what the seals name
    assert cfg.gym is not None
    max_attempts = cfg.gym.max_rollout_attempts
    for spec in plan.shards:
        if seal.check(run_dir, plan, spec.index).sealed:
            continue
        try:
            book = ledger.load(run_dir, spec.index, max_attempts)
        except ShardFailed:
            return True  # the shard will say what is wrong with its files; the servers must be right too
        if any(book.attempts[k] < max_attempts for k in book.pending):
            return True
    return False


def gym_problems(gym: GymConfig, env: Mapping[str, str]) -> list[str]:
    venv = gym_version.configured_venv(gym.venv, env)
    if venv is None:
        return [
            f"gym.venv: not set, ${gym_version.VENV_ENV} is empty and scripts/setup.sh gym has not built "
            f"{gym_version.default_venv_path(env) or '~/.cache/shardrun/gym-venv'}; name the venv that has nemo-gym"
        ]
    try:
        gym_stack.gym_venv(gym, env)
    except BadInput as e:
        return [f"gym.venv: {e}"]
    if not gym.config_paths:
        return ["gym.config_paths: empty; name the Gym server configs the shards run"]
    site = gym_stack.site_packages(venv)
    return [
        f"gym.config_paths: {f['path']!r} is not found (as given, under {Path.cwd()}, or under the Gym install {site})"
        for f in env_manifest.config_files(gym.config_paths, Path.cwd(), site)
        if f["resolved"] is None
    ]


def policy_problems(policy: PolicyConfig, env: Mapping[str, str], files_here: bool = True) -> list[str]:
    """What is missing from the policy section; with `files_here`, also the vLLM interpreter and model path."""
    out = []
    urls = [policy.base_url] if isinstance(policy.base_url, str) else list(policy.base_url or [])
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            out.append(f"policy.base_url: {url!r} is not an http(s) URL with a host")
    if policy.base_url is not None and not urls:
        out.append("policy.base_url: an empty list; name the endpoint(s)")
    v = policy.vllm
    if v is not None and files_here:
        program = vllm.launcher(v, env)[0]
        if not (Path(program).is_file() if os.sep in program else shutil.which(program, path=env.get("PATH"))):
            key = "policy.vllm.command" if v.command else "policy.vllm.python"
            out.append(f"{key}: {program} does not exist here; name the interpreter (or venv) that has vLLM")
        if v.model.startswith(("/", "./", "../", "~")) and not Path(v.model).expanduser().exists():
            out.append(f"policy.vllm.model: {v.model} does not exist")
    return out
