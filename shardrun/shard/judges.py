"""The job's judge models (`judges:` in the run config; docs/judges.md): each self-hosted judge is one vLLM server
started once per job (a shard job's, or a warm worker's) on GPUs of its own, with the policy's readiness and liveness
rules (shard/vllm.py); each external judge is checked like a pre-hosted policy (GET /models answers 200, with its
key). Either way the Gym stack gets a `gym_stack.JudgeBinding` per judge, which defines the model server the
environments' configs name, and the runtime's watchdog checks every judge while collecting: a dead judge fails the
job as a server failure, as a dead policy does.

Timeouts: Gym never times out a judge request (its HTTP client has no timeout), so a judge that hangs would hang
its rollouts for ever. Unless `request_timeout_s` is null, the Gym stack reaches each judge through a gate of its
own (shard/slot_gate.py, in this process, on loopback) that answers 504 to a request left unanswered past it; Gym
retries it, then Gym 0.7 records the rollout as `judge_failed`, a failure and never a score (docs/failures.md).

GPUs: where CUDA_VISIBLE_DEVICES lists the job's GPUs, the judges take the last ones (in the order of the config)
and the policy keeps the others (`split_devices`); launch/preflight.py checks the arithmetic before submitting.

Judge nodes: in a Slurm job with `cluster.judge_nodes` J, the self-hosted judges run on the job's last J nodes
instead, in a server step of their own (`srun --kill-on-bad-exit=1` over those nodes, the script
server_layout.judge_script renders, `start_on_nodes`), each bound to its node's hostname; any exit of a judge ends
the step, and the judge it names fails the job as a server failure. The policy keeps the other nodes.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from shardrun.core.config import ClusterConfig, JudgeConfig
from shardrun.core.errors import BadInput, ServerFailure
from shardrun.rundir import store
from shardrun.shard import gym_stack, policy, processes, server_layout, server_step, slot_gate, vllm

JUDGES_DIR = server_layout.JUDGES_DIR  # SHARD (or worker) dir / judges / NAME: a judge's scratch and logs/vllm.log
STEP_LOG = "judge-servers.log"  # SHARD / logs / this: the judges' server step (which judge exited, on which node)
# the judges' step script says which judge exited: "[shardrun] judge NAME[ NAME...] on HOST (node K) exited with ..."
EXITED = re.compile(r"\[shardrun\] judge (.+?) on \S+ \(node \d+\) exited with status (-?\d+)")


@dataclass
class Judge:
    """A judge that is ready: its endpoint (a started server, or an external URL) and how the Gym stack binds it."""

    name: str
    endpoint: policy.PolicyEndpoint
    binding: gym_stack.JudgeBinding
    gate: slot_gate.Gate | None = None

    def problem(self) -> str | None:
        """Why the judge is unusable now (named), or None."""
        found = self.endpoint.problem() or (self.gate.problem() if self.gate is not None else None)
        if found is None or found.startswith(self.endpoint.what):
            return found
        return f"{self.endpoint.what}: {found}"

    def describe(self) -> str:
        where = "self-hosted" if self.binding.self_hosted else "external"
        cap = self.binding.max_concurrent_requests
        timeout = f", a request unanswered after {self.gate.timeout_s:g} s is a judge failure" if self.gate else ""
        return (
            f"judge {self.name} ready ({where}): {self.endpoint.base_urls[0]} model {self.endpoint.model_name}"
            + (f", at most {cap} requests at once" if cap else "")
            + timeout
        )

    def stop(self) -> None:
        try:
            self.endpoint.stop()
        finally:
            if self.gate is not None:
                self.gate.stop()


def gated(judge: Judge, cfg: JudgeConfig) -> Judge:
    """The judge with its gate started and its binding pointing at the gate (unchanged when request_timeout_s is
    null); the judge is stopped when the gate cannot start."""
    if cfg.request_timeout_s is None:
        return judge
    try:
        gate = slot_gate.Gate(
            [judge.binding.base_url],
            None,
            timeout_s=cfg.request_timeout_s,
            what=f"judge {judge.name}",
            setting=f"judges.{judge.name}.request_timeout_s",
        )
    except BaseException:
        judge.stop()
        raise
    return replace(judge, binding=replace(judge.binding, base_url=gate.urls[0]), gate=gate)


def key_for(name: str, cfg: JudgeConfig, env: Mapping[str, str]) -> str | None:
    """The value of the variable `api_key_env` names; BadInput naming the key and the variable (never a value)."""
    return policy.key_from(env, cfg.api_key_env, f"judges.{name}.api_key_env", "job's")


def split_devices(env: Mapping[str, str], judges: Mapping[str, JudgeConfig]) -> tuple[str | None, dict[str, str]]:
    """(the policy's CUDA_VISIBLE_DEVICES, {judge: its CUDA_VISIBLE_DEVICES}): the judges take the last of the
    visible GPUs, the policy the rest. (None, {}) where no GPU is listed or no judge needs one (CPU serving, or
    external judges): nothing is changed. BadInput when the judges would leave the policy none."""
    devices = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip() and d.strip() != "-1"]
    need = {name: j.gpus for name, j in judges.items() if j.gpus}
    if not devices or not need:
        return None, {}
    total = sum(need.values())
    if total >= len(devices):
        raise BadInput(
            f"judges: {' + '.join(f'judges.{n} {g}' for n, g in need.items())} GPU(s) of their own, but this node "
            f"shows {len(devices)} (CUDA_VISIBLE_DEVICES) and the policy needs at least one of them"
        )
    out: dict[str, str] = {}
    end = len(devices)
    for name, gpus in need.items():
        out[name] = ",".join(devices[end - gpus : end])
        end -= gpus
    return ",".join(devices[:end]), out


def start_one(name: str, cfg: JudgeConfig, home: Path, env: Mapping[str, str], devices: str | None = None) -> Judge:
    """Start (self-hosted) or check (external) one judge; ServerFailure when it is not usable."""
    key = key_for(name, cfg, env)
    what = f"judge {name}"
    if cfg.vllm is not None:
        server_env = dict(env)
        if devices is not None:
            server_env["CUDA_VISIBLE_DEVICES"] = devices
        server = vllm.start_vllm(
            cfg.vllm,
            home / JUDGES_DIR / name,
            cfg.vllm.port or processes.free_port(),
            api_key=key,
            env=server_env,
            what=what,
            setting=f"judges.{name}.vllm",
        )
        endpoint = policy.PolicyEndpoint([server.base_url], server.model_name, key, server, what=what)
        binding = gym_stack.JudgeBinding(
            name, server.base_url, server.model_name, True, key, None, dict(cfg.server_options)
        )
        return gated(Judge(name, endpoint, binding), cfg)
    url = str(cfg.base_url).rstrip("/")
    endpoint = policy.PolicyEndpoint([url], str(cfg.model_name), key, what=what)
    try:
        policy.check_prehosted(endpoint, cfg.ready_timeout_s)
    except ServerFailure as e:
        raise ServerFailure(
            f"{e} (waited judges.{name}.ready_timeout_s = {cfg.ready_timeout_s:g} s for GET /models to answer 200; "
            f"is the judge up and reachable from this node?)"
        ) from None
    binding = gym_stack.JudgeBinding(
        name, url, str(cfg.model_name), False, key, cfg.max_concurrent_requests, dict(cfg.server_options)
    )
    return gated(Judge(name, endpoint, binding), cfg)


@dataclass
class JudgeStep:
    """The judges' server step on the job's judge nodes: one srun for every self-hosted judge."""

    proc: processes.Proc
    layout: server_layout.JudgeLayout
    script: Path

    def gone(self) -> set[str]:
        """The judges the step's log says exited (empty when it does not say: the step itself ended)."""
        names: set[str] = set()
        for line in processes.log_tail(self.proc.log_path, 200).splitlines():
            found = EXITED.search(line)
            if found:
                names.update(found.group(1).split())
        return names & {s.name for s in self.layout.launches}

    def stop(self) -> None:
        processes.stop(self.proc, grace=vllm.STOP_GRACE_S)


@dataclass
class OnJudgeNode:
    """One judge of the judges' step, for its PolicyEndpoint (problem, stop: as a vllm.VllmServer)."""

    step: JudgeStep
    name: str
    liveness: vllm.Liveness

    def problem(self) -> str | None:
        if not self.step.proc.alive():
            gone = self.step.gone()
            if gone and self.name not in gone:
                return None  # another judge exited: its own problem() says so
            return (
                f"judge {self.name}: the judges' server step exited: {self.step.proc.describe_exit()}; any exit of a "
                f"judge, status 0 included, ends it (the judge's log: {store.vllm_log_path(self.home)})"
            )
        return self.liveness.problem()

    @property
    def home(self) -> Path:
        return self.step.script.parent / self.name

    def stop(self) -> None:
        self.step.stop()


def start_on_nodes(
    judges: Mapping[str, JudgeConfig],
    job: server_layout.JobNodes,
    cluster: ClusterConfig,
    home: Path,
    env: Mapping[str, str],
) -> list[Judge]:
    """The self-hosted `judges` started as one server step over the judge nodes `job`, each ready (/health 200,
    its served name in /v1/models, within its vllm.ready_timeout_s) and behind its gate; or ServerFailure and none
    left running. Each key reaches its judge only through the step's environment."""
    keys = {name: key_for(name, cfg, env) for name, cfg in judges.items()}
    servers = {name: cfg.vllm for name, cfg in judges.items() if cfg.vllm is not None}
    ports: dict[str, int] = {}
    for name, v in servers.items():
        ports[name] = v.port or processes.free_port()
        while not v.port and list(ports.values()).count(ports[name]) > 1:
            ports[name] = processes.free_port()
    lay = server_layout.judge_layout(judges, job, ports, home, env)
    for name in servers:
        store.vllm_scratch_dirs(home / JUDGES_DIR / name)[1].mkdir(parents=True, exist_ok=True)
        store.vllm_log_path(home / JUDGES_DIR / name).parent.mkdir(parents=True, exist_ok=True)
    senv = server_step.step_env(env, None)
    senv.update({server_layout.JUDGE_KEY_VAR + name: key for name, key in keys.items() if key})
    script = home / JUDGES_DIR / server_layout.JUDGE_SCRIPT_NAME
    text = server_layout.judge_script(lay)
    log = store.vllm_log_path(home).with_name(STEP_LOG)
    proc = server_step.start_step(script, text, job.hosts, True, True, cluster, senv, log, "judge servers")
    step = JudgeStep(proc, lay, script)
    started: list[Judge] = []
    t0 = time.monotonic()
    try:
        for (name, v), root, model in zip(servers.items(), lay.roots, lay.model_names):
            try:
                vllm.wait_ready(proc, root, model, keys[name], max(1.0, v.ready_timeout_s - (time.monotonic() - t0)))
            except ServerFailure as e:
                raise ServerFailure(f"judge {name} on {root}: {e}") from None
        for (name, v), root, model in zip(servers.items(), lay.roots, lay.model_names):
            what = f"judge {name}"
            live = vllm.Liveness(
                [root], v.liveness_timeout_s, what=what, setting=f"judges.{name}.vllm.liveness_timeout_s"
            )
            endpoint = policy.PolicyEndpoint(
                [root + "/v1"], model, keys[name], OnJudgeNode(step, name, live), what=what
            )
            binding = gym_stack.JudgeBinding(
                name, root + "/v1", model, True, keys[name], None, dict(judges[name].server_options)
            )
            started.append(gated(Judge(name, endpoint, binding), judges[name]))
    except BaseException:
        try:
            stop_all(started)
        finally:
            step.stop()
        raise
    return started


def start_all(
    judges: Mapping[str, JudgeConfig],
    home: Path,
    env: Mapping[str, str] | None = None,
    cluster: ClusterConfig | None = None,
) -> tuple[list[Judge], str | None]:
    """Every judge ready, in the config's order, or none left running; and the CUDA_VISIBLE_DEVICES the policy
    keeps (None: unchanged). In a Slurm job with `cluster.judge_nodes`, the self-hosted judges run on the judge
    nodes (start_on_nodes) and the policy keeps this node's GPUs."""
    env = dict(os.environ if env is None else env)
    hosted = {name: cfg for name, cfg in judges.items() if cfg.vllm is not None}
    on_nodes = server_step.judge_nodes(cluster, env) if cluster is not None and hosted else None
    policy_devices, devices = (None, {}) if on_nodes is not None else split_devices(env, judges)
    started: list[Judge] = []
    try:
        if on_nodes is not None:
            started += start_on_nodes(hosted, on_nodes, cluster or ClusterConfig(), home, env)
        for name, cfg in judges.items():
            if on_nodes is None or name not in hosted:
                started.append(start_one(name, cfg, home, env, devices.get(name)))
    except BaseException:
        stop_all(started)
        raise
    order = list(judges)
    return sorted(started, key=lambda j: order.index(j.name)), policy_devices


def stop_all(judges: Sequence[Judge]) -> None:
    """Stop every self-hosted judge; each is stopped even when another's stop fails."""
    errors: list[BaseException] = []
    for j in judges:
        try:
            j.stop()
        except Exception as e:  # the others are stopped first, then the first error is raised
            errors.append(e)
    if errors:
        raise errors[0]


def problem(judges: Sequence[Judge]) -> str | None:
    """The first judge's problem (for the watchdog), or None."""
    for j in judges:
        found = j.problem()
        if found:
            return found
    return None


def preview(judges: Mapping[str, JudgeConfig], home: str = "SHARD", cluster: ClusterConfig | None = None) -> list[str]:
    """`submit --dry-run`: each judge as a job starts it (a self-hosted one's command line, its GPUs and log; an
    external one's URL, model, cap and key variable) and the Gym model-server config shardrun writes for it. The
    port of a self-hosted judge shows as its `vllm.port`, or 8100+k where a free one is chosen at start; a judge's gate
    shows as port GATE. `cluster`: Slurm jobs' (None: local jobs); with `judge_nodes`, the self-hosted judges show
    as the judges' server step over the job's last nodes, NODE<k> as the policy's step names them. Pure."""
    if not judges:
        return []
    import yaml

    out = ["", f"# ---- judges, started once per job before the policy ({len(judges)}; docs/judges.md)"]
    ports = {name: (cfg.vllm.port or 8100 + k) for k, (name, cfg) in enumerate(judges.items()) if cfg.vllm}
    lay = None
    if cluster is not None and cluster.judge_nodes and ports:
        hosts = tuple(f"NODE{k}" for k in range(cluster.policy_nodes, cluster.nodes))
        hosted = {name: cfg for name, cfg in judges.items() if cfg.vllm is not None}
        job = server_layout.JobNodes(hosts, cluster.gpus_per_node)
        lay = server_layout.judge_layout(hosted, job, ports, Path(home), {})
    bindings = []
    for name, cfg in judges.items():
        key = f"${cfg.api_key_env}" if cfg.api_key_env else "none"
        if cfg.vllm is not None:
            v = cfg.vllm
            gpus = f"{cfg.gpus} GPU(s) of its own" if cfg.gpus else "no GPU (vllm.device: cpu)"
            if lay is not None:
                s = next(s for s in lay.launches if s.name == name)
                where = f"on judge node {lay.nodes.hosts[s.node]}" + (
                    f" (GPUs {s.gpus[0]}-{s.gpus[0] + s.gpus[1] - 1} of it)" if s.gpus else ""
                )
                cmd = list(s.cmd)
                url = lay.roots[lay.launches.index(s)] + "/v1"
            else:
                where = "on the job's first node"
                gpus += ", the last of the node's" if cfg.gpus else ""
                cmd = vllm.build_command(v, v.host, ports[name], {})
                url = vllm.root_url(v.host, ports[name]) + "/v1"
            out.append(f"# judge {name}: self-hosted {where}, {gpus}; key {key}")
            out.append(f"#   log {home}/{JUDGES_DIR}/{name}/logs/vllm.log")
            out.append("#   " + " ".join(cmd))
            model = vllm.served_name(v)
        else:
            cap = cfg.max_concurrent_requests
            url, model = str(cfg.base_url).rstrip("/"), str(cfg.model_name)
            out.append(
                f"# judge {name}: external {url} model {model}; key {key}; "
                + (f"at most {cap} requests at once" if cap else "no cap on concurrent requests")
            )
        if cfg.request_timeout_s is not None:
            out.append(
                f"#   reached through a gate on loopback ({slot_gate.HOST}, a port chosen at start) answering 504 to "
                f"a request unanswered after {cfg.request_timeout_s:g} s (judges.{name}.request_timeout_s): a "
                f"judge failure"
            )
            url = f"http://{slot_gate.HOST}:GATE{urlsplit(url).path}"
        bindings.append(
            gym_stack.JudgeBinding(
                name, url, model, cfg.vllm is not None, None, cfg.max_concurrent_requests, dict(cfg.server_options)
            )
        )
    if lay is not None and cluster is not None:
        script = Path(home) / JUDGES_DIR / server_layout.JUDGE_SCRIPT_NAME
        step = server_step.srun_command(len(lay.nodes.hosts), script, cluster, lay.nodes.hosts)
        out.append(f"# ---- the judges' server step in each job: {lay.describe()}")
        out.append(
            f"# ({', '.join(lay.nodes.hosts)}: the last cluster.judge_nodes {cluster.judge_nodes} of the job's nodes; "
            f"each judge's key reaches it as {server_layout.JUDGE_KEY_VAR}NAME in the step's environment)"
        )
        out.append(shlex.join(step))
        out.append(f"# ---- {script}")
        out.append(server_layout.judge_script(lay).rstrip("\n"))
    out.append(f"# ---- {gym_stack.JUDGES_YAML} (added to gym.config_paths; the keys come from env.yaml)")
    out.append(yaml.safe_dump(gym_stack.judges_config(bindings), sort_keys=False).rstrip("\n"))
    return out
