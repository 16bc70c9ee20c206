"""The shard's policy model endpoint: a pre-hosted one (checked before use) or a self-hosted vLLM (started here,
through shardrun.shard.vllm, and stopped with the shard). Either way the shard gets base URL(s), a model name and the
API key read from the environment variable the config names (never from a file)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from shardrun.shard import processes, server_layout
from shardrun.core.config import ClusterConfig, PolicyConfig
from shardrun.core.errors import BadInput, ServerFailure


def api_key(policy: PolicyConfig, env: Mapping[str, str]) -> str | None:
    return key_from(env, policy.api_key_env, "policy.api_key_env", "shard's")


def key_from(env: Mapping[str, str], name: str | None, key: str, whose: str) -> str | None:
    """The value of the variable `name` (None when no variable is named); BadInput naming the config `key` and the
    variable, never a value, when it is not set in `whose` environment."""
    if not name:
        return None
    value = env.get(name)
    if not value:
        raise BadInput(
            f"{key} names ${name}, which is not set in the {whose} environment (export it where you submit; it is "
            f"read at shard start, never stored)"
        )
    return value


def base_urls(policy: PolicyConfig) -> list[str]:
    urls = policy.base_url if isinstance(policy.base_url, list) else [policy.base_url]
    return [u.rstrip("/") for u in urls if u]


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_ids(body: bytes) -> list[str]:
    try:
        return [
            m["id"] for m in json.loads(body).get("data") or [] if isinstance(m, dict) and isinstance(m.get("id"), str)
        ]
    except (ValueError, AttributeError):
        return []


@dataclass
class PolicyEndpoint:
    base_urls: list[str]
    model_name: str
    api_key: str | None = field(default=None, repr=False)
    server: Any = None  # shardrun.shard.vllm.VllmServer when self-hosted
    notes: list[str] = field(default_factory=list)
    what: str = "policy server"  # what messages call it (a judge's endpoint: "judge NAME")

    def problem(self) -> str | None:
        """Why the policy server is unusable now, or None (for the watchdog)."""
        if self.server is not None:
            return self.server.problem()
        for url in self.base_urls:
            got = processes.http_get(url + "/models", timeout=5.0, headers=auth(self.api_key))
            if got is None:
                return f"{self.what} {url} does not answer (GET {url}/models)"
            if got[0] >= 500:
                return f"{self.what} {url} answers HTTP {got[0]} to GET {url}/models"
        return None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def check_prehosted(endpoint: PolicyEndpoint, timeout: float) -> float:
    """Wait (up to `timeout`) until every pre-hosted URL answers GET /models with 200."""

    def answers(url: str) -> Callable[[], bool]:
        def check() -> bool:
            got = processes.http_get(url + "/models", timeout=5.0, headers=auth(endpoint.api_key))
            if got is not None and got[0] in (401, 403):
                raise ServerFailure(f"{endpoint.what} {url} refused the API key (HTTP {got[0]} on GET /models)")
            if got is None or got[0] != 200:
                return False
            ids = model_ids(got[1])
            if ids and endpoint.model_name not in ids:
                endpoint.notes.append(f"{url}/models does not list {endpoint.model_name!r} (lists {ids[:5]})")
            return True

        return check

    waited = 0.0
    for url in endpoint.base_urls:
        waited += processes.wait_until(
            answers(url), timeout=max(1.0, timeout - waited), interval=1.0, what=f"pre-hosted {endpoint.what} {url}"
        )
    return waited


def one_server(policy: PolicyConfig, job: "server_layout.JobNodes") -> bool:
    """A single vLLM beside Gym (started by vllm.start_vllm), or a layout of several (server_step)."""
    v = policy.vllm
    return (
        v is not None
        and v.replicas == 1
        and policy.router is None
        and not job.spans_nodes
        and (server_layout.nodes_per_server(v, job.gpus_per_node) == 1)
    )


def open_policy(
    policy: PolicyConfig,
    shard_dir: Path,
    env: Mapping[str, str] | None = None,
    *,
    cluster: ClusterConfig | None = None,
    concurrency: int | None = None,
) -> PolicyEndpoint:
    """Start (self-hosted) or check (pre-hosted) the policy endpoint; ServerFailure when it is not usable.
    A self-hosted policy of several servers or nodes (docs/policy.md, 'Shapes') is one server step over the job."""
    env = dict(os.environ if env is None else env)
    key = api_key(policy, env)
    if policy.vllm is not None:
        from shardrun.shard import server_step, vllm

        port = policy.vllm.port or processes.free_port()
        job = server_step.job_nodes(cluster, env, gpus_visible(env), concurrency)
        if one_server(policy, job):
            server = vllm.start_vllm(policy.vllm, shard_dir, port, api_key=key, env=env)
            return PolicyEndpoint([server.base_url], server.model_name, key, server)
        step = server_step.start(policy, cluster, job, shard_dir, port, env, key)
        endpoint = PolicyEndpoint(step.layout.urls, step.model_name, key, step)
        endpoint.notes.append(server_layout.describe(step.layout))
        return endpoint
    endpoint = PolicyEndpoint(base_urls(policy), str(policy.model_name), key)
    try:
        check_prehosted(endpoint, policy.ready_timeout_s)
    except ServerFailure as e:
        raise ServerFailure(
            f"{e} (waited policy.ready_timeout_s = {policy.ready_timeout_s:g} s for GET /models to answer 200; is "
            f"the endpoint up and reachable from this node?)"
        ) from None
    return endpoint


def gpus_visible(env: Mapping[str, str]) -> int:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES)."""
    devices = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([d for d in devices.split(",") if d.strip() and d.strip() != "-1"]) if devices else 0
