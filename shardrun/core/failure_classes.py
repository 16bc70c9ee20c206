"""Which part of the infrastructure a failed rollout failed in: its failure class (pure; the one definition).

A failed rollout is never a score: it is a row of Gym's failures sidecar (docs/failures.md). Its class says what
failed, so that `status`, the merge summary and the report can count failures per label and per class:

| class | what failed |
|---|---|
| `policy` | the policy model server (the innermost server of Gym's nested error is a policy model server) |
| `judge` | a judge: Gym 0.7's `judge_failed` rows (its `judge_failsafe`), or an innermost model server that is no policy |
| `sandbox` | a sandbox or other provider (`provider_*` classes, or the error names a sandbox address) |
| `environment` | a resources server, an agent or an environment server (the innermost server is one of those, or a class Gym gives environment faults) |
| `timeout` | a request timed out and no server says whose it was |
| `other` | nothing above applies (a cancelled or killed rollout, an error without a server) |

Structured fields win over text: shardrun's own `failure_class` on a row it wrote, then Gym's `_ng_failure_class`
(`failure_kind`), then the innermost server named in Gym's nested error (gym_errors.innermost_server) looked up in
the `ServerRoles` of the run's Gym config, then the error text (a sandbox address, a timeout). A row without any of
them (an old record) is classed from its reason text the same way (`classify_reason`).

Who is a judge comes from Gym's config, not from names: every `responses_api_models` server is a model server; one
that an agent uses as its `model_server` is a policy, every other one is a judge (`ServerRoles.from_gym_configs`).
Other sources (a `judges` section, a sandbox's address) extend the roles with `ServerRoles.union`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from shardrun.core import gym_errors

POLICY, JUDGE, SANDBOX, ENVIRONMENT, TIMEOUT, OTHER = "policy", "judge", "sandbox", "environment", "timeout", "other"
CLASSES = (POLICY, JUDGE, SANDBOX, ENVIRONMENT, TIMEOUT, OTHER)
CLASS_KEY = "failure_class"
"""The key of shardrun's own class on a failure row it writes (validated on read: one of CLASSES)."""
GYM_CLASS_KEYS = ("_ng_failure_class", "failure_kind")
GYM_TYPE_KEY = "_ng_failure_type"
DEFAULT_POLICY = "policy_model"
"""The policy's model server in Gym's configs (shardrun's env.yaml fills its policy_* keys)."""

# Gym's failure names (nemo_gym/failure_kinds.py and the classes its servers write) -> class. A name not here is
# read further (the error's server, then its text); a namespaced `<server>:<kind>` is the environment's own.
GYM_CLASSES: dict[str, str] = {
    "judge_failed": JUDGE,
    "judge_unparseable": JUDGE,
    "judge_invalid": JUDGE,
    "provider_unavailable": SANDBOX,
    "provider_quota_exhausted": SANDBOX,
    "provider_oom_killed": SANDBOX,
    "transport_timeout": TIMEOUT,
    "agent_timeout": TIMEOUT,
    "timeout_exceeded": TIMEOUT,
    "environment_server_failed": ENVIRONMENT,
    "verifier_error": ENVIRONMENT,
    "session_lost": ENVIRONMENT,
    "session_expired": ENVIRONMENT,
    "session_release_failed": ENVIRONMENT,
    "infrastructure_error": ENVIRONMENT,
    "reference_missing": ENVIRONMENT,
    "eval_missing": ENVIRONMENT,
    "transport_ineligible": ENVIRONMENT,
    "agent_command_not_allowed": ENVIRONMENT,
    "cancelled": OTHER,
    "kill_shaped": OTHER,
    "shutdown": OTHER,
}
_NAMESPACED = re.compile(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*")
_TIMEOUT = re.compile(r"timeout|timed out|HTTP (?:408|504)\b", re.IGNORECASE)


@dataclass(frozen=True)
class ServerRoles:
    """The Gym server names of the run's policy and judges, and the sandboxes' addresses ("host:port")."""

    policies: frozenset[str] = frozenset({DEFAULT_POLICY})
    judges: frozenset[str] = frozenset()
    sandboxes: frozenset[str] = frozenset()

    def union(self, other: "ServerRoles") -> "ServerRoles":
        """Both sets of roles (a name that is a policy in either stays a policy, never a judge)."""
        policies = self.policies | other.policies
        return ServerRoles(policies, (self.judges | other.judges) - policies, self.sandboxes | other.sandboxes)

    @classmethod
    def from_gym_configs(cls, configs: Iterable[Any], overrides: Iterable[str] = ()) -> "ServerRoles":
        """The roles Gym's config files (parsed YAML) and Hydra overrides define: every `responses_api_models`
        server is a model server; one an agent (`responses_api_agents`) uses as its `model_server` is a policy,
        every other one a judge. Without an agent that names its model, `policy_model` is the policy."""
        models: set[str] = set()
        used_by_agents: set[str] = set()
        for data in configs:
            if not isinstance(data, Mapping):
                continue
            for name, server in data.items():
                if not isinstance(server, Mapping):
                    continue
                if isinstance(server.get("responses_api_models"), Mapping):
                    models.add(str(name))
                agents = server.get("responses_api_agents")
                for impl in agents.values() if isinstance(agents, Mapping) else ():
                    ref = impl.get("model_server") if isinstance(impl, Mapping) else None
                    if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
                        used_by_agents.add(ref["name"])
        for override in overrides:
            path = override.split("=", 1)[0].lstrip("+~").split(".")
            if len(path) > 1 and path[1] == "responses_api_models":
                models.add(path[0])
        policies = frozenset(used_by_agents or {DEFAULT_POLICY})
        return cls(policies, frozenset(models - policies))


DEFAULT_ROLES = ServerRoles()


def check_class(value: Any) -> str:
    """A recorded class: one of CLASSES; ValueError naming the value otherwise."""
    if value not in CLASSES:
        raise ValueError(f"{CLASS_KEY!r} is {value!r}: not one of {', '.join(CLASSES)}")
    return str(value)


def classify(row: Mapping[str, Any], reason: str, roles: ServerRoles = DEFAULT_ROLES) -> str:
    """The class of a failure row whose reason (rundir.ledger.failure_reason) is `reason`: shardrun's recorded
    class (checked: ValueError for an unknown one), else Gym's structured class, else `classify_reason`."""
    if row.get(CLASS_KEY) is not None:
        return check_class(row[CLASS_KEY])
    for key in GYM_CLASS_KEYS:
        name = row.get(key)
        if isinstance(name, str) and name in GYM_CLASSES:
            return GYM_CLASSES[name]
        if isinstance(name, str) and _NAMESPACED.fullmatch(name):
            return ENVIRONMENT
    body = row.get(gym_errors.SIDECAR_BODY)
    found = classify_reason(f"{reason} {body}" if isinstance(body, str) else reason, roles)
    if found == OTHER and "timeout" in str(row.get(GYM_TYPE_KEY) or "").lower():
        return TIMEOUT
    return found


def classify_reason(reason: str, roles: ServerRoles = DEFAULT_ROLES) -> str:
    """The class a reason text says: the innermost server Gym's nested error names (a policy, a judge, else an
    environment server), else a sandbox address in it, else a timeout, else `other`."""
    server = gym_errors.innermost_server(reason)
    if server is not None:
        name = server.split("___", 1)[-1]  # Gym names a server "<Class>___<config name>"
        if name in roles.policies:
            return POLICY
        if name in roles.judges:
            return JUDGE
        return ENVIRONMENT
    if any(address in reason for address in roles.sandboxes):
        return SANDBOX
    if _TIMEOUT.search(reason):
        return TIMEOUT
    return OTHER
