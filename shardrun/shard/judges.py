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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from shardrun.core.config import JudgeConfig
from shardrun.core.errors import BadInput, ServerFailure
from shardrun.shard import gym_stack, policy, processes, slot_gate

JUDGES_DIR = "judges"  # SHARD (or worker) dir / judges / NAME: a self-hosted judge's scratch and logs/vllm.log


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
        from shardrun.shard import vllm

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


def start_all(
    judges: Mapping[str, JudgeConfig], home: Path, env: Mapping[str, str] | None = None
) -> tuple[list[Judge], str | None]:
    """Every judge ready, in the config's order, or none left running; and the CUDA_VISIBLE_DEVICES the policy
    keeps (None: unchanged)."""
    env = dict(os.environ if env is None else env)
    policy_devices, devices = split_devices(env, judges)
    started: list[Judge] = []
    try:
        for name, cfg in judges.items():
            started.append(start_one(name, cfg, home, env, devices.get(name)))
    except BaseException:
        stop_all(started)
        raise
    return started, policy_devices


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


def preview(judges: Mapping[str, JudgeConfig], home: str = "SHARD") -> list[str]:
    """`submit --dry-run`: each judge as a job starts it (a self-hosted one's command line, its GPUs and log; an
        external one's URL, model, cap and key variable) and the Gym model-server config shardrun writes for it. The
        port of a self-hosted judge shows as its `vllm.port`, or 8100+k where a free one is chosen at start; a judge's gate
    shows as port GATE. Pure."""
    if not judges:
        return []
    import yaml

    from shardrun.shard import vllm

    out = ["", f"# ---- judges, started once per job before the policy ({len(judges)}; docs/judges.md)"]
    bindings = []
    for k, (name, cfg) in enumerate(judges.items()):
        key = f"${cfg.api_key_env}" if cfg.api_key_env else "none"
        if cfg.vllm is not None:
            v = cfg.vllm
            port = v.port or 8100 + k
            cmd = vllm.build_command(v, v.host, port, {})
            gpus = f"{cfg.gpus} GPU(s) of its own, the last of the node's" if cfg.gpus else "no GPU (vllm.device: cpu)"
            out.append(f"# judge {name}: self-hosted on the job's first node, {gpus}; key {key}")
            out.append(f"#   log {home}/{JUDGES_DIR}/{name}/logs/vllm.log")
            out.append("#   " + " ".join(cmd))
            url, model = vllm.root_url(v.host, port) + "/v1", vllm.served_name(v)
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
    out.append(f"# ---- {gym_stack.JUDGES_YAML} (added to gym.config_paths; the keys come from env.yaml)")
    out.append(yaml.safe_dump(gym_stack.judges_config(bindings), sort_keys=False).rstrip("\n"))
    return out
