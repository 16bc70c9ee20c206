"""Run configuration: a YAML file plus Hydra-syntax overrides, composed with hydra-core, validated by pydantic.

Only the planning keys (input_jsonl, run_dir, num_repeats, agent_name, seed_offset, sharding) are needed to plan;
`gym`, `policy` and `cluster` are validated when present and required by the commands that launch work.
Secrets are never values here: the config names the environment variables that hold them.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic_core import ErrorDetails
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shardrun.core import slurm_values
from shardrun.core.credentials import find_credentials, name_reason, redact, secret_reason
from shardrun.core.errors import BadInput
from shardrun.core.gym_names import LABEL_MAX, MAX_REPEATS, label_problem
from shardrun.core.task_rules import TaskRules, problems

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENV_YAML_POLICY_KEYS = ("policy_base_url", "policy_api_key", "policy_model_name")
"""The keys shardrun writes into Gym's env.yaml for the policy (shard/gym_stack.py: env_yaml_text)."""
ENV_YAML_RESERVED = (*ENV_YAML_POLICY_KEYS, "config_paths", "head_server", "skip_venv_if_present", "uv_venv_dir")
"""Top-level keys of Gym's config a `gym.secrets` key must not take: the policy's, and those shardrun sets itself."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JUDGE_KEY_PREFIX = "shardrun_judge_api_key_"
"""env.yaml key of a judge's API key: this prefix + the judge's name (shard/gym_stack.py writes it, 0600)."""
DEFAULT_MAX_ARRAY_SIZE = 1001


def _numeric(annotation: Any) -> bool:
    """Whether a field's type takes a number and never a boolean (`int`, `float | None`, `int | Literal[...]`)."""
    if annotation is bool:
        return False
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return (
        bool(args)
        and typing.get_origin(annotation) is not Literal
        and any(_numeric(a) for a in args)
        and (bool not in args)
    )


def _boolean_for_a_number(annotation: Any, value: Any) -> bool:
    """Whether `value` holds a boolean where `annotation` takes a number (at the top, or as a dict's value or a
    list's item: `num_repeats: {agent: true}`)."""
    if isinstance(value, bool):
        return _numeric(annotation)
    if isinstance(value, (dict, list)):
        for arg in (annotation, *typing.get_args(annotation)):
            origin, inner = typing.get_origin(arg), typing.get_args(arg)
            if origin is dict and isinstance(value, dict) and len(inner) == 2:
                return any(_boolean_for_a_number(inner[1], x) for x in value.values())
            if origin is list and isinstance(value, list) and len(inner) == 1:
                return any(_boolean_for_a_number(inner[0], x) for x in value)
    return False


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # every number is finite

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        """YAML's `true`/`yes`/`on` is not 1: a boolean in a number field is refused, naming the field."""
        if info.field_name and _boolean_for_a_number(cls.model_fields[info.field_name].annotation, v):
            raise ValueError("takes a number, not a boolean (true/false, yes/no, on/off)")
        return v


class ShardingConfig(StrictModel):
    num_shards: int | None = Field(
        None, ge=1, le=10_000_000, description="Number of shards (exclusive with rollouts_per_shard)."
    )
    rollouts_per_shard: int | None = Field(None, ge=1, le=2**40, description="Target rollouts per shard.")
    slicing: Literal["contiguous", "round_robin"] = Field(
        "contiguous",
        description="contiguous keeps a task's rollouts together where sizes allow; round_robin deals rollout i "
        "to shard i mod N so slow tasks spread over all shards.",
    )

    @model_validator(mode="after")
    def _one_size(self) -> "ShardingConfig":
        if self.num_shards is not None and self.rollouts_per_shard is not None:
            raise ValueError("give either sharding.num_shards or sharding.rollouts_per_shard, not both")
        return self


class GymConfig(StrictModel):
    config_paths: list[str] = Field(default_factory=list, description="NeMo Gym config_paths for ng_run.")
    venv: str | None = Field(
        None,
        description="Python environment (venv dir) that has nemo-gym and uv (default: $SHARDRUN_GYM_VENV, else the "
        "venv scripts/setup.sh gym builds, $SHARDRUN_CACHE/gym-venv, when it exists).",
    )
    num_samples_in_parallel: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Collector concurrency per shard; with warm workers, the policy's slots: the requests it gets at "
        "once (docs/workers.md).",
    )
    responses_create_params: dict[str, Any] = Field(
        default_factory=dict, description="Shallow overrides merged into every row's responses_create_params."
    )
    overrides: list[str] = Field(default_factory=list, description="Extra Hydra overrides passed to ng_run.")
    collect_overrides: list[str] = Field(
        default_factory=list, description="Extra Hydra overrides passed to ng_collect_rollouts."
    )
    ready_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for the Gym servers to be ready.")
    stall_timeout_s: float = Field(
        600.0, gt=0, description="Stop a shard when no rollout lands for this long or a server is dead."
    )
    max_rollout_attempts: int = Field(
        3, ge=1, le=100_000, description="Attempts per rollout before it is recorded as failed."
    )
    server_venvs: Literal["shared", "uv"] = Field(
        "shared",
        description="shared: every Gym server runs from gym.venv (which must hold the servers' requirements; "
        "scripts/setup.sh gym installs them), no uv and no network at shard start. uv: Gym builds one venv per "
        "server with uv into gym.uv_venv_dir once, then reuses it.",
    )
    uv_venv_dir: str | None = Field(
        None, description="Where Gym's per-server venvs live with server_venvs=uv (default: beside gym.venv)."
    )
    health_interval_s: float = Field(5.0, gt=0, description="Seconds between the watchdog's server health checks.")
    secrets: dict[str, str] = Field(
        default_factory=dict,
        description="Secrets Gym's configs reference (`${nv_inference_api_key}`), by NAME: variable -> the "
        "environment variable holding it ({nv_inference_api_key: NV_INFERENCE_API_KEY}). Read from the environment "
        "at stack start and written into the stack's env.yaml (0600, deleted at stop), never into plan.json, job "
        "scripts or logs; a variable not set where you plan or submit is refused.",
    )

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: dict[str, str]) -> dict[str, str]:
        """Keys: top-level keys of Gym's config (letters, digits, _) none of shardrun's own; values: names of
        environment variables. The messages name the key, never the value (it may be the secret pasted in)."""
        for key, name in v.items():
            if not _NAME.fullmatch(key):
                raise ValueError(
                    f"gym.secrets key {key!r} is not a variable Gym's configs can reference as ${{...}} "
                    f"(letters, digits, _)"
                )
            if key in ENV_YAML_RESERVED or key.startswith(JUDGE_KEY_PREFIX):
                raise ValueError(
                    f"gym.secrets key {key!r} is one shardrun writes into env.yaml itself "
                    f"({', '.join(ENV_YAML_RESERVED)}, {JUDGE_KEY_PREFIX}*); name the variable differently"
                )
            reason = name_reason(name)
            if reason:
                raise ValueError(f"gym.secrets.{key} {reason}; give the NAME of the environment variable holding it")
        return v


def words(v: Any) -> Any:
    """YAML (and override parsing) turn `8000` into a number; command-line words are strings."""
    return (
        [str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in v]
        if isinstance(v, list)
        else v
    )


class VllmConfig(StrictModel):
    model: str = Field(..., description="Checkpoint directory or model id served by vLLM.")
    served_model_name: str | None = Field(None, description="Name clients use; defaults to the model path's name.")
    python: str | None = Field(None, description="Python interpreter (or venv dir) with vLLM installed.")
    command: list[str] | None = Field(
        None, description="Launcher prefix; default `<python> -m vllm.entrypoints.openai.api_server`."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=4096, description="vLLM --tensor-parallel-size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=4096, description="vLLM --pipeline-parallel-size.")
    data_parallel_size: int = Field(1, ge=1, le=4096, description="vLLM --data-parallel-size.")
    device: Literal["gpu", "cpu"] = Field(
        "gpu",
        description="What serves the model. gpu: on Slurm, tensor x pipeline x data parallel size GPUs must fit "
        "cluster.nodes x cluster.gpus_per_node (checked at plan and submit). cpu: a CPU build of vLLM on purpose "
        "(cluster.gpus_per_node may be 0); not passed to vLLM, whose build decides the device.",
    )
    max_model_len: int | None = Field(None, ge=1, le=2**31 - 1)
    extra_args: list[str] = Field(default_factory=list, description="More vLLM CLI arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the vLLM process.")
    port: int | None = Field(None, ge=1, le=65535, description="Port; default derived from the shard index.")
    ready_timeout_s: float = Field(
        1200.0,
        gt=0,
        description="Seconds to wait for the vLLM server(s) to be ready: /health answers 200 and /v1/models lists "
        "the served name (loading the model included; some models load for more than 10 minutes).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the server binds (0.0.0.0 to serve other nodes too). Servers of a job over several "
        "nodes bind their node's hostname instead, which the other nodes reach (docs/policy.md, 'Shapes').",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=4096,
        description="Independent vLLM servers per job, spread over its nodes (cluster.nodes), each with tensor x "
        "pipeline x data parallel size GPUs; the collector's requests spread over all of them (Gym's list of base "
        "URLs, or policy.router). The slot budget (gym.num_samples_in_parallel) is per job.",
    )
    nodes_per_replica: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Nodes one server spans. Default: tensor x pipeline x data parallel size over "
        "cluster.gpus_per_node, rounded up (1 without GPUs). Above 1, one server runs across nodes with vLLM's own "
        "multi-node launch: --nnodes/--node-rank/--master-addr and --headless (tensor x pipeline), or native data "
        "parallel with headless ranks (data_parallel_size); no Ray.",
    )
    liveness_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="While collecting, a server whose /health does not answer for this long fails the job as a "
        "server failure (an exit of any server, status 0 included, fails it at once).",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_strings(cls, v: Any) -> Any:
        """YAML (and override parsing) turn `1` into a number; environment values are strings."""
        if isinstance(v, dict):
            return {
                k: (str(x).lower() if isinstance(x, bool) else str(x)) if isinstance(x, (int, float)) else x
                for k, x in v.items()
            }
        return v

    @field_validator("command", "extra_args", mode="before")
    @classmethod
    def _args_as_strings(cls, v: Any) -> Any:
        return words(v)

    @field_validator("command", "extra_args")
    @classmethod
    def _no_key_on_command_line(cls, v: list[str] | None) -> list[str] | None:
        if any(a == "--api-key" or a.startswith("--api-key=") for a in v or ()):
            raise ValueError(
                "secrets are not allowed in config files or on the logged command line; set "
                "policy.api_key_env to the NAME of the environment variable holding the key"
            )
        return v


class RouterOptions(StrictModel):
    """vllm-router's settings. The defaults are NVIDIA's reward-profiling recipe's, chosen after its stock health
    checks ejected busy engines (a slow /health means busy, not dead)."""

    command: list[str] = Field(default_factory=lambda: ["vllm-router"], description="The router's launcher.")
    port: int | None = Field(None, ge=1, le=65535, description="Its port; default the policy's port + 1000.")
    policy: str = Field("cache_aware", description="vllm-router --policy.")
    health_timeout_s: int = Field(60, ge=1, description="--health-check-timeout-secs (upstream default 5).")
    health_interval_s: int = Field(120, ge=1, description="--health-check-interval-secs.")
    health_failures: int = Field(10, ge=1, description="--health-failure-threshold (upstream default 3).")
    request_timeout_s: int | None = Field(
        None,
        ge=1,
        description="--request-timeout-secs: finite and below the walltime. Default 3600, or half the job's time "
        "limit when that is shorter.",
    )
    queue_size: int | None = Field(
        None, ge=0, description="--queue-size and --max-concurrent-requests; default the job's concurrency."
    )
    circuit_breaker: bool = Field(False, description="Off: a fixed fleet inside one job has nowhere to fail over to.")
    startup_timeout_s: int = Field(1200, ge=1, description="--worker-startup-timeout-secs.")
    extra_args: list[str] = Field(default_factory=list, description="More vllm-router arguments.")

    @field_validator("command", "extra_args", mode="before")
    @classmethod
    def _args_as_strings(cls, v: Any) -> Any:
        return words(v)


class PolicyConfig(StrictModel):
    base_url: str | list[str] | None = Field(None, description="Pre-hosted OpenAI-compatible endpoint(s), .../v1.")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the API key.")
    model_name: str | None = Field(None, description="Model name sent to a pre-hosted endpoint.")
    vllm: VllmConfig | None = Field(None, description="Self-hosted vLLM, started per shard.")
    router: Literal["vllm-router"] | None = Field(
        None,
        description="vllm-router: one router on the job's first node in front of the policy.vllm replicas; the "
        "collector talks to it alone (settings: policy.router_options).",
    )
    router_options: RouterOptions = Field(default_factory=RouterOptions)
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="Seconds a shard or warm worker waits for a pre-hosted endpoint (base_url) to answer GET "
        "/models with 200 before it fails with exit code 3 (a self-hosted vLLM waits policy.vllm.ready_timeout_s).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "PolicyConfig":
        if (self.base_url is None) == (self.vllm is None):
            raise ValueError("set exactly one of policy.base_url (pre-hosted) or policy.vllm (self-hosted)")
        if self.base_url is not None and not self.model_name:
            raise ValueError("policy.model_name is required with policy.base_url")
        if self.router is not None and self.vllm is None:
            raise ValueError(
                "policy.router starts a router in front of the self-hosted replicas (policy.vllm); a pre-hosted "
                "endpoint (policy.base_url) is used as it is"
            )
        return self

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("must be the NAME of an environment variable (letters, digits, _), not a key")
        return v


class JudgeConfig(StrictModel):
    """A judge model the environments' configs refer to by a Gym model-server name (`judges.<name>`): self-hosted
    (`vllm`, served inside the job like the policy) or external (`base_url` + `model_name`)."""

    vllm: VllmConfig | None = Field(
        None,
        description="Self-hosted: a vLLM server started once per job on GPUs of its own (the same keys as "
        "policy.vllm; one server within one node: replicas and nodes_per_replica stay 1), on the job's first node, "
        "or on a judge node (cluster.judge_nodes).",
    )
    base_url: str | None = Field(None, description="External: the judge's OpenAI-compatible endpoint, .../v1.")
    model_name: str | None = Field(None, description="External: the model name sent to base_url.")
    api_key_env: str | None = Field(
        None,
        description="NAME of the environment variable holding the judge's key (read at stack start, written only "
        "into the stack's env.yaml; a self-hosted judge requires it from its clients, as VLLM_API_KEY).",
    )
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="External: cap on in-flight requests to the judge (Gym's openai_model max_concurrent_requests); "
        "at scale a rate-limited judge otherwise degrades into a retry storm.",
    )
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="External: seconds to wait for GET base_url/models to answer 200 before the job fails (a "
        "self-hosted judge waits vllm.ready_timeout_s).",
    )
    request_timeout_s: float | None = Field(
        900.0,
        gt=0,
        le=86400,
        description="Seconds a judge request may go unanswered: shardrun's gate before the judge then answers 504, "
        "which Gym 0.7 records as a judge failure (retried by Gym first: up to 3 tries), never a hung rollout or a "
        "zero. null: no gate, the Gym servers reach the judge directly (Gym itself never times out).",
    )
    server_options: dict[str, Any] = Field(
        default_factory=dict,
        description="More keys of the judge's Gym model server (vllm_model when self-hosted, openai_model when "
        "external), e.g. extra_body or uses_reasoning_parser; written as given into its config.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "JudgeConfig":
        if (self.base_url is None) == (self.vllm is None):
            raise ValueError("set exactly one of vllm (self-hosted judge) or base_url (external judge)")
        if self.base_url is not None and not self.model_name:
            raise ValueError("model_name is required with base_url (the model the external judge serves)")
        if self.vllm is not None and (self.vllm.replicas != 1 or (self.vllm.nodes_per_replica or 1) != 1):
            raise ValueError(
                "a self-hosted judge is one vLLM server within one node: vllm.replicas and "
                "vllm.nodes_per_replica must be 1"
            )
        if self.vllm is not None and self.model_name is not None:
            raise ValueError("model_name is for an external judge; a self-hosted one is vllm.served_model_name")
        return self

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError("must be the NAME of an environment variable (letters, digits, _), not a key")
        return v

    @property
    def gpus(self) -> int:
        """GPUs the self-hosted judge takes (0 for an external one or one served on CPUs)."""
        v = self.vllm
        if v is None or v.device == "cpu":
            return 0
        return v.tensor_parallel_size * v.pipeline_parallel_size * v.data_parallel_size


SANDBOX_CLIENTS = ("ns_tools", "math_formal_lean", "competitive_coding_challenges")
"""NeMo Gym 0.7's resources servers that execute code in a NeMo-Skills sandbox (NEMO_SKILLS_SANDBOX_HOST/PORT)."""
SANDBOX_PORT_PLACEHOLDER = "{port}"
"""Where `sandbox.command` takes the port the sandbox is to listen on."""


class SandboxConfig(StrictModel):
    """A code-execution sandbox per job (NeMo-Skills' protocol: `POST /execute`, `GET /health`), started beside the
    Gym servers; its address reaches them as NEMO_SKILLS_SANDBOX_HOST/NEMO_SKILLS_SANDBOX_PORT (docs/sandboxes.md)."""

    command: str | None = Field(
        None,
        description="A shell command that serves the sandbox on `{port}` (replaced by the port); run with bash in "
        "its own process group on the node of the Gym servers. Give this or `image`.",
    )
    image: str | None = Field(
        None,
        description="A NeMo-Skills sandbox container image: on Slurm a pyxis step of the job (srun --overlap "
        "--container-image, with cluster.mounts) on the shard's node; on the local executor run with "
        "`sandbox.runtime` (docker or podman, --network=host). Give this or `command`.",
    )
    image_command: str = Field(
        "/start-with-nginx.sh",
        description="With `image`: what runs in it, with NGINX_PORT and LISTEN_PORT set to the port and "
        "NUM_WORKERS to `sandbox.workers` (the NeMo-Skills sandbox image's entry point, as NVIDIA's recipe runs it).",
    )
    runtime: Literal["docker", "podman"] | None = Field(
        None,
        description="With `image` on the local executor: the container runtime that runs it (required there; on "
        "Slurm the image runs with pyxis).",
    )
    workers: int = Field(8, ge=1, le=4096, description="With `image`: the sandbox's workers (NUM_WORKERS).")
    host: str = Field(
        "127.0.0.1",
        description="The address the Gym servers reach the sandbox at (NEMO_SKILLS_SANDBOX_HOST); the sandbox "
        "runs on their node, so loopback by default.",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port the sandbox listens on (NEMO_SKILLS_SANDBOX_PORT). null: a free port chosen at start, so "
        "that shards sharing a node never collide (NeMo-Skills' default is 6000).",
    )
    health_path: str = Field("/health", description="GET path that answers 200 while the sandbox serves.")
    ready_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="Seconds to wait at start for `health_path` to answer 200."
    )
    liveness_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="While collecting, a sandbox whose `health_path` has not answered 200 for this long is dead "
        "(its process exiting is at once): the rollouts it may have broken are taken back and it is restarted, "
        "at most cluster.max_server_restarts times over the life of the servers it was started with.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the sandbox process.")

    @model_validator(mode="after")
    def _one_source(self) -> "SandboxConfig":
        if (self.command is None) == (self.image is None):
            raise ValueError("set exactly one of sandbox.command (a shell command) or sandbox.image (an image)")
        if self.command is not None and SANDBOX_PORT_PLACEHOLDER not in self.command and self.port is None:
            raise ValueError(
                f"sandbox.command has no {SANDBOX_PORT_PLACEHOLDER} placeholder and sandbox.port is not set: the "
                f"sandbox must listen on the port shardrun hands to the Gym servers"
            )
        if self.runtime is not None and self.image is None:
            raise ValueError("sandbox.runtime runs sandbox.image; a sandbox.command runs as it is")
        if not self.health_path.startswith("/"):
            raise ValueError(f"sandbox.health_path must start with '/': {self.health_path!r}")
        return self

    @field_validator("command", "image", "image_command", "host")
    @classmethod
    def _one_line(cls, v: str | None) -> str | None:
        if v is not None:
            slurm_values.text(v, "sandbox setting")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not _NAME.fullmatch(k)]
        if bad:
            raise ValueError(f"not environment variable names: {', '.join(map(repr, bad))}")
        return v


class ClusterConfig(StrictModel):
    """Key names follow NeMo-Skills cluster configs where they exist."""

    executor: Literal["local", "slurm"] = "local"
    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    containers: dict[str, str] = Field(default_factory=dict, description="Image per role, e.g. {shardrun: ...}.")
    mounts: list[str] = Field(default_factory=list, description="Container mounts SRC:DST.")
    container_python: str | None = Field(
        None,
        description="With containers.shardrun: the interpreter inside the image that has shardrun installed (e.g. "
        "/opt/venv/bin/python3, or python3 on the image's PATH); the jobs run it instead of this checkout's. "
        "Required with an image (docs/cluster-configs.md, 'Containers').",
    )
    env_vars: list[str] = Field(
        default_factory=list, description="NAME=value to set, or NAME to pass through from the submitting shell."
    )
    timeouts: dict[str, str] = Field(default_factory=dict, description="Time limit per partition, HH:MM:SS.")
    job_name_prefix: str = "shardrun"
    time_limit: str | None = Field(None, description="Default shard time limit HH:MM:SS.")
    nodes: int = Field(1, ge=1, le=100_000)
    judge_nodes: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Of a Slurm job's `nodes`, this many (the last) run the self-hosted judges, in a server step of "
        "their own; the policy is laid out over the others, the first of which runs Gym and the collector "
        "(docs/judges.md). 0: the judges run on the job's first node beside a one-server policy.",
    )
    gpus_per_node: int = Field(0, ge=0, le=1024)
    cpus_per_task: int | None = Field(None, ge=1, le=100_000)
    mem_gb: float | None = Field(None, gt=0, le=2**30)
    setup: list[str] = Field(default_factory=list, description="Shell lines run before each shard (module load).")
    array_parallelism: int = Field(
        64, ge=1, le=4_000_001, description="Max shards running at once (array throttle / local cap)."
    )
    max_array_size: int | None = Field(None, ge=2, le=4_000_001, description="Override the cluster's MaxArraySize.")
    max_attempts: int = Field(3, ge=1, le=100_000, description="Attempts per shard before resume gives up on it.")
    max_requeues: int = Field(
        10,
        ge=0,
        le=1000,
        description="Times a shard job is requeued after reaching its time limit "
        "(submitit checkpoint); a preemption counts only near the time limit.",
    )
    signal_delay_s: int = Field(
        120,
        ge=1,
        le=7 * 86400,
        description="Seconds before the time limit at which the shard is asked "
        "to stop and requeue (USR2); capped at half the time limit.",
    )
    merge_partition: str | None = Field(None, description="Partition of the CPU merge job (default: partition).")
    merge_time_limit: str = Field("01:00:00", description="Time limit of the merge job.")
    merge_cpus_per_task: int = Field(4, ge=1, le=100_000, description="CPUs of the merge job.")
    merge_mem_gb: float = Field(16, gt=0, le=2**30, description="Memory of the merge job.")
    additional_parameters: dict[str, Any] = Field(default_factory=dict, description="Extra sbatch parameters.")
    workers: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Warm workers: this many jobs that start their servers once and claim shards until none are "
        "left (docs/workers.md); null: one job per shard.",
    )
    claim_heartbeat_s: float = Field(30.0, gt=0, le=86400, description="Seconds between a worker's claim renewals.")
    claim_lease_s: float = Field(
        180.0, gt=0, le=7 * 86400, description="A claim not renewed for this long is stale and taken over."
    )
    max_server_restarts: int = Field(
        2,
        ge=0,
        le=1000,
        description="Times a worker restarts servers that were up and died before it exits non-zero (exit code "
        "3). Servers that never came up (the first start failed: an endpoint down, a config error) are not "
        "retried: the worker fails at once with the cause.",
    )
    auto_resume_rounds: int = Field(
        3,
        ge=0,
        le=1000,
        description="Slurm with workers: times the job after the workers resubmits workers for unsealed shards "
        "before it merges.",
    )

    @property
    def uses_slurm(self) -> bool:
        """Do this config's jobs run on Slurm (`executor: slurm`)? The one place the executor is compared: asked by
        the launch backends (which answer everyone else: launch/backends.py) and by this module's own checks
        (tests/launch/test_launchers.py fails on any other comparison, and on this property read elsewhere)."""
        return self.executor == "slurm"

    def shard_time_minutes(self) -> int:
        """A shard job's time limit in minutes: timeouts[partition] if set, else time_limit, else 04:00:00."""
        if self.partition and self.partition in self.timeouts:
            return slurm_values.parse_time_limit(self.timeouts[self.partition])
        return slurm_values.parse_time_limit(self.time_limit or slurm_values.DEFAULT_TIME_LIMIT)

    @property
    def policy_nodes(self) -> int:
        """The job's nodes left to the policy (and to Gym and the collector, on the first): all but the judges'."""
        return self.nodes - self.judge_nodes

    @model_validator(mode="after")
    def _judge_nodes_leave_one(self) -> "ClusterConfig":
        if self.judge_nodes and self.judge_nodes >= self.nodes:
            raise ValueError(
                f"cluster.judge_nodes {self.judge_nodes} must be below cluster.nodes {self.nodes}: the job's first "
                f"node runs Gym, the collector and the policy; raise cluster.nodes (to {self.judge_nodes + 1} or "
                f"more) or lower cluster.judge_nodes"
            )
        return self

    @model_validator(mode="after")
    def _lease_over_heartbeat(self) -> "ClusterConfig":
        if self.claim_lease_s < 2 * self.claim_heartbeat_s:
            raise ValueError(
                f"cluster.claim_lease_s ({self.claim_lease_s:g}) must be at least twice cluster.claim_heartbeat_s "
                f"({self.claim_heartbeat_s:g}): a claim would go stale between two heartbeats"
            )
        return self

    @field_validator("env_vars")
    @classmethod
    def _env_vars(cls, v: list[str]) -> list[str]:
        for item in v:
            name = item.split("=", 1)[0]
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{item!r} is not NAME or NAME=value")
        slurm_values.lines(v, "cluster.env_vars entry")
        return v

    # what reaches an sbatch script or a Slurm command (core/slurm_values.py says why)

    @field_validator("account", "partition", "qos", "merge_partition", "job_name_prefix")
    @classmethod
    def _slurm_name(cls, v: str | None) -> str | None:
        return slurm_values.name(v)

    @field_validator("time_limit", "merge_time_limit")
    @classmethod
    def _time_limit(cls, v: str | None) -> str | None:
        slurm_values.time_limit(v)
        return v

    @field_validator("timeouts")
    @classmethod
    def _timeouts(cls, v: dict[str, str]) -> dict[str, str]:
        for partition, limit in v.items():
            slurm_values.name(partition)
            slurm_values.time_limit(limit)
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        slurm_values.lines(v, "setup line (one shell line per entry)")
        return v

    @field_validator("containers")
    @classmethod
    def _containers(cls, v: dict[str, str]) -> dict[str, str]:
        slurm_values.lines(v.values(), "container image")
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for item in v:
            slurm_values.mount(item)
        return v

    @field_validator("additional_parameters")
    @classmethod
    def _additional_parameters(cls, v: dict[str, Any]) -> dict[str, Any]:
        return slurm_values.additional_parameters(v)


class CollectorConfig(StrictModel):
    """How a warm worker collects (docs/workers.md): one long-lived Gym collector, how many rollouts it keeps in
    flight per policy slot, how many shards it holds at once. (Their old names under `cluster.` still work, with a
    warning.)"""

    service: bool = Field(
        True,
        description="Warm workers: collect every shard through one long-lived Gym collector per worker, whose "
        "budget of rollouts in flight (collector.rollouts_per_slot) the shards it holds share (docs/workers.md); false: "
        "a collector process per shard.",
    )
    rollouts_per_slot: float = Field(
        3.0,
        ge=1.0,
        le=64.0,
        description="Warm workers with the collector service: rollouts in flight per policy slot (the service runs "
        "gym.num_samples_in_parallel x this, rounded up, while the slot gate lets at most gym.num_samples_in_parallel "
        "requests reach the policy), so a slot one rollout's answer frees is taken at once by another rollout's "
        "request while the first runs its agent, tool and verification steps (docs/workers.md); 1: a rollout holds "
        "its slot through those steps too.",
    )
    pipeline_shards: int = Field(
        4,
        ge=1,
        le=64,
        description="Shards a warm worker holds at most at once: it claims a further one when those it holds no "
        "longer fill its collector service's budget of rollouts in flight (they drain their slowest rollouts), and all "
        "their rollouts share that budget (docs/workers.md); 1: one shard after another.",
    )


# old key under cluster. -> its key under collector.: still read, with a warning in the plan
MOVED_TO_COLLECTOR = {
    "collector_service": "service",
    "rollouts_per_slot": "rollouts_per_slot",
    "pipeline_shards": "pipeline_shards",
}


def moved_keys(data: Any) -> tuple[Any, list[str]]:
    """`data` (a run config's dict) with the collector settings still under their old `cluster.` names moved to
    `collector.`, and a warning for each; a key set under both names is refused."""
    if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
        return data, []
    cluster = dict(data["cluster"])
    old = [k for k in MOVED_TO_COLLECTOR if k in cluster]
    if not old:
        return data, []
    collector = data.get("collector")
    if collector is None:
        collector = {}
    if not isinstance(collector, dict):
        return data, []  # the collector section's own error says what is wrong
    collector = dict(collector)
    notes = []
    for key in old:
        new = MOVED_TO_COLLECTOR[key]
        if new in collector:
            raise ValueError(
                f"cluster.{key} and collector.{new} are both set; cluster.{key} is the old name of collector.{new}: "
                f"keep one (collector.{new})"
            )
        collector[new] = cluster.pop(key)
        notes.append(f"cluster.{key} is deprecated: it is now collector.{new} (the old key still works, for now)")
    return {**data, "cluster": cluster, "collector": collector}, notes


class SamplingConfig(StrictModel):
    """Adaptive sampling (docs/adaptive-sampling.md): stop collecting a task once its rollouts decide it."""

    stop_when_decided: TaskRules | None = Field(
        None,
        description="The per-task rules of `shardrun select` (agents, min_mean, max_mean, drop_unsolved, "
        "drop_solved, solved_threshold, metric): a task whose rollouts so far decide what these rules do with it "
        "gets no more rollouts. Unset: every planned rollout is collected.",
    )
    wave: int = Field(
        2, ge=1, le=MAX_REPEATS, description="Repeats of a task issued together: shards are cut wave by wave."
    )
    min_repeats: int = Field(0, ge=0, le=MAX_REPEATS, description="No task stops before this many rollouts ended.")
    metric_range: tuple[float, float] = Field(
        (0.0, 1.0), description="[low, high] bounds of the rules' metric; a rollout outside it is an error."
    )

    @field_validator("stop_when_decided", mode="before")
    @classmethod
    def _per_task_rules_only(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in ("top_k_hardest", "min_std"):
                if key in v:
                    raise ValueError(
                        f"{key} cannot stop sampling: its outcome for one task depends "
                        + ("on the other tasks" if key == "top_k_hardest" else "on the spread of all its rollouts")
                        + f"; stop on the per-task rules and apply --{key.replace('_', '-')} with `shardrun select`"
                    )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingConfig":
        low, high = self.metric_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"metric_range {[low, high]}: must be two finite numbers, low < high")
        if self.stop_when_decided is not None:
            found = problems(self.stop_when_decided, lambda field: f"stop_when_decided.{field}")
            if found:
                raise ValueError("; ".join(found))
        return self

    def planning_view(self) -> dict[str, Any] | None:
        """What the plan fingerprint covers; None (nothing) without stop_when_decided."""
        return None if self.stop_when_decided is None else self.model_dump(mode="json")


class EntryConfig(StrictModel):
    """One entry of a blend (docs/blends.md): a JSONL file of tasks, the agent that runs them and the Gym configs
    that serve that agent. Every row reaches Gym as it is in its file, with only `agent_ref: {name: agent}` added
    where the row has none."""

    label: str = Field(
        ...,
        description=f"The entry's name ([A-Za-z0-9._-], not starting with '.', at most {LABEL_MAX}; unique).",
    )
    data: Path = Field(..., description="Its tasks: a JSONL file in NeMo Gym format (relative: to the current dir).")
    agent: str = Field(
        ...,
        min_length=1,
        description="The agent of its rows (added where a row has no agent_ref; a row naming "
        "another agent is refused).",
    )
    configs: list[str] = Field(
        default_factory=list, description="Gym config paths serving this entry (unioned into gym.config_paths)."
    )
    num_repeats: int | None = Field(
        None, ge=1, le=MAX_REPEATS, description="Rollouts per task of this entry (default: the run's num_repeats)."
    )
    limit: int | None = Field(
        None, ge=1, le=2**40, description="Rows to take from the file (overrides materialize.limit_per_entry)."
    )
    owner: str | None = Field(None, description="Who to ask about this data (shown, never interpreted).")
    notes: dict[str, Any] = Field(default_factory=dict, description="Free-form provenance, never interpreted.")

    @field_validator("label")
    @classmethod
    def _label_is_a_name(cls, v: str) -> str:
        why = label_problem(v)
        if why:
            raise ValueError(f"entry {ascii(v[: LABEL_MAX + 20])}: {why}")
        return v

    @field_validator("data", mode="before")
    @classmethod
    def _data_not_empty(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            raise ValueError("an empty path; name the entry's JSONL file")
        return v


class MaterializeConfig(StrictModel):
    """Which rows of each entry enter a blend (docs/blends.md)."""

    limit_per_entry: int | None = Field(
        None, ge=1, le=2**40, description="Rows to take from every entry (an entry's own limit wins); null: all."
    )
    sample: Literal["head", "random"] = Field(
        "head", description="head: the first rows; random: a uniform sample, kept in file order."
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**62,
        description="Seed of random sampling, mixed with each entry's label (other entries never move its sample).",
    )

    def limit_for(self, entry: EntryConfig) -> int | None:
        return entry.limit if entry.limit is not None else self.limit_per_entry


DEFAULT_UNRELIABLE_FAILURE_RATE = 0.05


class ReportConfig(StrictModel):
    """How the merge summary, `status` and the report judge a label's failures (docs/failures.md)."""

    unreliable_failure_rate: float = Field(
        DEFAULT_UNRELIABLE_FAILURE_RATE,
        ge=0.0,
        le=1.0,
        description="A label whose failed rollouts (failed for good: a judge, sandbox, policy or environment "
        "failure, never a score) exceed this share of its planned rollouts is named unreliable, not hard: its "
        "mean reward can be off by up to this much if the failures hit the tasks it would solve (or fail).",
    )


class RescoreConfig(StrictModel):
    """Set by `shardrun rescore` (docs/rescore.md), never by hand: this run re-verifies another run's stored
    rollouts with its own `gym` section, without the policy. It is in plan.json, so the fingerprint covers it."""

    source_run: Path = Field(..., description="The run whose sealed rollouts are re-verified.")
    source_fingerprint: str = Field(..., description="That run's plan fingerprint when the re-score was planned.")
    failed_only: bool = Field(
        False, description="Re-verify only the rollouts whose scoring failed (Gym's --judge-failed-only)."
    )
    force: bool = Field(
        False,
        description="Re-verify also against resources servers whose reverify_mode is not stateless (Gym's --force).",
    )


class RunConfig(StrictModel):
    input_jsonl: Path | None = Field(
        None, description="Input tasks, one JSON object per line (NeMo Gym format); or give `entries`."
    )
    run_dir: Path = Field(..., description="Run directory: plan, shards, merged results.")
    num_repeats: int | dict[str, int] = Field(
        1, description="Rollouts per task: an int, or a dict keyed by agent_ref.name with optional _default."
    )
    agent_name: str | None = Field(None, description="Agent for rows without agent_ref.")
    seed_offset: int = Field(0, ge=0, le=2**62, description="Sampling seed = seed_offset + rollout index.")
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    gym: GymConfig | None = None
    policy: PolicyConfig | None = None
    cluster: ClusterConfig | None = None
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    sandbox: SandboxConfig | None = Field(
        None, description="A code-execution sandbox per job beside the Gym servers (docs/sandboxes.md); null: none."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    entries: list[EntryConfig] | None = Field(
        None, description="A blend: several labelled input files run as one (docs/blends.md); instead of input_jsonl."
    )
    materialize: MaterializeConfig = Field(default_factory=MaterializeConfig)
    data_root: Path | None = Field(
        None,
        description="A blend: where its entries' data files are (docs/blends.md). A relative `data` path is "
        "resolved against it (instead of the current directory); an absolute one is rebased: the part below "
        "data_root_from is looked up below data_root (NVIDIA's manifests name data under /lustre).",
    )
    data_root_from: Path | None = Field(
        None,
        description="With data_root: the directory the absolute `data` paths are rebased from (default: the "
        "deepest directory that holds every absolute entry path).",
    )
    judges: dict[str, JudgeConfig] = Field(
        default_factory=dict,
        description="Judge models by the Gym model-server name the environments' configs refer to "
        "(`judge_model_server: {type: responses_api_models, name: NAME}`): shardrun serves each (self-hosted) or "
        "checks it (external), and defines the server NAME in the Gym stack's config (docs/judges.md).",
    )
    nickname: str | None = Field(None, description="The blend's name (a NeMo Gym manifest's nickname), shown.")
    rescore: RescoreConfig | None = Field(
        None, description="A re-score of another run's rollouts (set by `shardrun rescore`; docs/rescore.md)."
    )
    not_carried_out: list[str] = Field(
        default_factory=list,
        description="What a translated NeMo Gym manifest held that shardrun does not carry out (set by the "
        "translation; each is a warning in the plan).",
    )

    translation_notes: list[str] = Field(
        default_factory=list,
        description="What a translated NeMo Gym manifest's blocks became where the user has something to do (a "
        "judge's key variable to export; set by the translation; each is a note in the plan).",
    )

    _deprecated: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _moved_keys(cls, data: Any, handler: Any) -> "RunConfig":
        if isinstance(data, RunConfig):
            return handler(data)
        data, notes = moved_keys(data)
        cfg = handler(data)
        cfg._deprecated = notes
        return cfg

    def sandbox_warnings(self) -> list[str]:
        """A Gym environment that executes code in a sandbox (SANDBOX_CLIENTS) with no `sandbox:` section: its
        rollouts would reach nothing at the address its config falls back to (the plan says so)."""
        if self.sandbox is not None or self.gym is None:
            return []
        users = sorted(
            {name for name in SANDBOX_CLIENTS for path in self.gym.config_paths if f"resources_servers/{name}/" in path}
        )
        if not users:
            return []
        return [
            f"gym.config_paths: {', '.join(users)} execute(s) code in a NeMo-Skills sandbox, but there is no sandbox "
            f"section: give sandbox.image (NVIDIA's srun.sandbox_container) or sandbox.command (docs/sandboxes.md), "
            f"or those rollouts meet nothing at NEMO_SKILLS_SANDBOX_HOST/PORT"
        ]

    @property
    def deprecations(self) -> list[str]:
        """A warning for each old key this config was given (the plan prints them)."""
        return list(self._deprecated)

    @model_validator(mode="before")
    @classmethod
    def _blend_defaults(cls, data: Any) -> Any:
        """A blend: its entries' Gym configs join gym.config_paths (deduplicated, order kept), and its shards mix
        the labels (round_robin) unless sharding.slicing is set or adaptive sampling needs wave order."""
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list) or not data["entries"]:
            return data
        data = dict(data)
        extra = [c for e in data["entries"] if isinstance(e, dict) for c in (e.get("configs") or [])]
        if extra and (data.get("gym") is None or isinstance(data.get("gym"), dict)):
            gym = dict(data.get("gym") or {})
            paths = list(gym.get("config_paths") or [])
            gym["config_paths"] = list(dict.fromkeys(paths + [c for c in extra if isinstance(c, str)]))
            data["gym"] = gym
        sharding = data.get("sharding")
        sampling = data.get("sampling")
        adaptive = isinstance(sampling, dict) and sampling.get("stop_when_decided") is not None
        if (sharding is None or isinstance(sharding, dict)) and "slicing" not in (sharding or {}) and not adaptive:
            data["sharding"] = dict(sharding or {}) | {"slicing": "round_robin"}
        return data

    @model_validator(mode="after")
    def _one_input(self) -> "RunConfig":
        if (self.input_jsonl is None) == (self.entries is None):
            raise ValueError(
                "give exactly one of input_jsonl (one input file) or entries (a blend of labelled files)"
                if self.input_jsonl is None
                else "give input_jsonl or entries, not both"
            )
        if self.entries is not None:
            if not self.entries:
                raise ValueError("entries: an empty list; a blend needs at least one entry")
            labels = [e.label for e in self.entries]
            twice = sorted({x for x in labels if labels.count(x) > 1})
            if twice:
                raise ValueError(f"entries: label(s) used more than once: {', '.join(twice)} (each must be unique)")
            if self.agent_name is not None:
                raise ValueError(
                    "agent_name with entries: each entry names its agent (entries.N.agent); remove agent_name"
                )
        elif self.data_root is not None or self.data_root_from is not None:
            raise ValueError("data_root: only a blend's entries are looked up under it; this config names input_jsonl")
        if self.data_root_from is not None and self.data_root is None:
            raise ValueError("data_root_from without data_root: name where the data is now (data_root=DIR)")
        return self

    @field_validator("judges")
    @classmethod
    def _judge_names(cls, v: dict[str, JudgeConfig]) -> dict[str, JudgeConfig]:
        """A judge's name is the Gym model-server name a config refers to: a plain name, not the policy's server
        nor a top-level key shardrun writes itself."""
        for name in v:
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"judges key {name!r} is not a Gym server name an environment config can refer to "
                    f"(letters, digits, _)"
                )
            if name in (*ENV_YAML_RESERVED, "policy_model"):
                raise ValueError(
                    f"judges key {name!r} is a name shardrun or Gym's policy binding uses itself; give the judge's "
                    f"server the name the environment's judge_model_server refers to"
                )
        return v

    @field_validator("input_jsonl", "run_dir", mode="before")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        """An empty path would silently be the current directory."""
        if isinstance(v, str) and not v.strip():
            raise ValueError("an empty path (it would be the current directory); name the path")
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir_one_line(cls, v: Path) -> Path:
        slurm_values.text(str(v), "run directory")
        return v

    @model_validator(mode="after")
    def _run_dir_for_slurm(self) -> "RunConfig":
        if self.cluster is not None and self.cluster.uses_slurm:
            slurm_values.run_dir(str(self.run_dir), slurm=True)
        return self

    @field_validator("num_repeats")
    @classmethod
    def _repeats(cls, v: int | dict[str, int]) -> int | dict[str, int]:
        values = v.values() if isinstance(v, dict) else [v]
        if any(isinstance(x, bool) or x < 1 or x > MAX_REPEATS for x in values):
            raise ValueError(f"repeats must be integers from 1 to {MAX_REPEATS:,} (2^20)")
        return v

    def planning_view(self) -> dict[str, Any]:
        """The settings that decide which rollouts exist and what each sends: what the plan fingerprint covers."""
        return (
            {
                "num_repeats": self.num_repeats,
                "agent_name": self.agent_name,
                "seed_offset": self.seed_offset,
                "sharding": self.sharding.model_dump(mode="json"),
                "responses_create_params": dict(self.gym.responses_create_params) if self.gym else {},
            }
            | ({"sampling": sampling} if (sampling := self.sampling.planning_view()) is not None else {})
            | ({"blend": self.blend_view()} if self.entries else {})
        )

    def blend_view(self) -> dict[str, Any]:
        """What decides a blend's rows besides its files' bytes: each entry's label, agent, limit and repeats, and
        how rows are sampled (the files' hashes are in the plan's blend table)."""
        m = self.materialize
        return {
            "sample": m.sample,
            "seed": m.seed,
            "entries": [
                {"label": e.label, "agent": e.agent, "limit": m.limit_for(e), "num_repeats": e.num_repeats}
                for e in self.entries or ()
            ],
        }

    def require(self, *sections: str) -> None:
        missing = [s for s in sections if getattr(self, s) is None]
        if missing:
            raise BadInput(f"this command needs the config section(s) {', '.join(missing)}")

    @property
    def cluster_or_default(self) -> ClusterConfig:
        return self.cluster or ClusterConfig()


# ---------------------------------------------------------------- composition (YAML + Hydra overrides)


def cluster_config_dirs(config_file: Path | None) -> list[Path]:
    dirs = [Path.cwd() / "cluster_configs"]
    if config_file is not None:
        dirs.append(config_file.resolve().parent / "cluster_configs")
    if os.environ.get("SHARDRUN_CLUSTER_CONFIGS"):
        dirs.insert(0, Path(os.environ["SHARDRUN_CLUSTER_CONFIGS"]))
    dirs.append(PROJECT_ROOT / "cluster_configs")
    return dirs


def find_cluster_config(name: str, config_file: Path | None) -> Path:
    searched = cluster_config_dirs(config_file)
    for d in searched:
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    known = sorted({p.stem for d in searched if d.is_dir() for p in d.glob("*.yaml")})
    hint = difflib.get_close_matches(name, known, n=1)
    msg = f"unknown cluster {name!r}: no {name}.yaml in {', '.join(str(d) for d in searched)}"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    elif known:
        msg += f" (known: {', '.join(known)})"
    raise BadInput(msg)


MAX_YAML_BYTES = 10 * 2**20
MAX_YAML_NODES = 100_000
"""What a config's YAML may expand to: aliases are counted as often as they are used, so a few hundred bytes of
nested aliases (an "alias bomb") are refused before anything expands them."""


def check_yaml_file(path: Path, what: str = "config file") -> None:
    """BadInput unless `path` is a regular YAML file of bounded size whose aliases expand to a bounded tree."""
    import yaml

    if not path.exists():
        raise BadInput(f"{what} not found: {path}")
    if not path.is_file():
        raise BadInput(f"{what} {path} is not a regular file (a directory, a FIFO or a device); name a YAML file")
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise BadInput(f"{path}: {size:,} bytes, over the {MAX_YAML_BYTES // 2**20} MiB a {what} may have")
    try:
        nodes = list(yaml.compose_all(path.read_text(), Loader=yaml.SafeLoader))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid YAML: {redact(str(e))}") from None
    sizes: dict[int, int] = {}

    def expanded(node: Any) -> int:
        key = id(node)
        if key not in sizes:
            sizes[key] = 1  # a node that contains itself (a recursive alias) counts once
            if isinstance(node, yaml.SequenceNode):
                sizes[key] = 1 + sum(expanded(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                sizes[key] = 1 + sum(expanded(k) + expanded(v) for k, v in node.value)
        return min(sizes[key], MAX_YAML_NODES + 1)

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        total = sum(expanded(n) for n in nodes)
    except RecursionError:
        raise BadInput(f"{path}: YAML nested too deeply") from None
    finally:
        sys.setrecursionlimit(limit)
    if total > MAX_YAML_NODES:
        line = next((n.start_mark.line + 1 for n in nodes if n is not None), 1)
        raise BadInput(
            f"{path}:{line}: the YAML expands to more than {MAX_YAML_NODES:,} values through its aliases "
            f"(&anchor / *alias); a config this large is refused"
        )


_CLUSTER_PICK = re.compile(r"^\+{0,2}cluster=([A-Za-z0-9_.\-]+)$")


def compose(config_file: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Compose the YAML file with Hydra overrides into a plain dict (cluster=<name> resolved to its YAML). A NeMo
    Gym reward-profiling manifest is translated first (core/sweep_manifest.py); the overrides apply after, in
    run-config keys."""
    path = Path(config_file)
    check_yaml_file(path)
    refuse_secret_overrides(overrides)
    manifest = _manifest_config(path)
    if manifest is None:
        return _smoke_cap(_compose(path, path, overrides), overrides)
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory(prefix="shardrun-manifest-") as d:
        translated = Path(d) / "manifest.yaml"
        translated.write_text(yaml.safe_dump(_escape_interpolations(manifest), sort_keys=False))
        return _smoke_cap(_compose(translated, path, overrides), overrides)


def _smoke_cap(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`materialize.limit_per_entry=N` on the command line caps every entry of a blend at N rows, its own `limit`
    included (a smoke run reaches every entry with at most N rows, as NeMo Gym's LIMIT_PER_ENTRY); in the file, an
    entry's own limit wins over limit_per_entry."""
    given = [o for o in overrides if o.lstrip("+").partition("=")[0].strip() == "materialize.limit_per_entry"]
    materialize = data.get("materialize")
    cap = materialize.get("limit_per_entry") if given and isinstance(materialize, dict) else None
    if not isinstance(cap, int) or isinstance(cap, bool) or not isinstance(data.get("entries"), list):
        return data
    for entry in data["entries"]:
        if isinstance(entry, dict) and isinstance(entry.get("limit"), int) and entry["limit"] > cap:
            entry["limit"] = cap
    return data


def _manifest_config(path: Path) -> dict[str, Any] | None:
    """The run config a NeMo Gym reward-profiling manifest at `path` means (core/sweep_manifest.py); None when the
    file is a run config."""
    import yaml

    from shardrun.core import sweep_manifest

    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid YAML: {redact(str(e))}") from None
    return sweep_manifest.translate(data, str(path)) if sweep_manifest.is_manifest(data) else None


def _escape_interpolations(data: Any, escape: bool = False) -> Any:
    """The translated manifest for Hydra: the Gym overrides (and a judge's server options) are passed on as they
    are, so an interpolation in them (`${judge_api_key}`) is Gym's to resolve, not ours; the notes say them."""
    if isinstance(data, dict):
        return {
            k: _escape_interpolations(
                v, escape or k in ("overrides", "collect_overrides", "server_options", "translation_notes")
            )
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_escape_interpolations(v, escape) for v in data]
    if escape and isinstance(data, str):
        return data.replace("${", "\\${")
    return data


def _compose(path: Path, shown_path: Path, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Compose the YAML file at `path` (a run config; `shown_path` is what the user named) with the overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import DictConfig, OmegaConf

    cluster_name = None
    rest = []
    for o in overrides:
        m = _CLUSTER_PICK.match(o.strip())
        if m and m.group(1) != "null":  # cluster=null is Hydra's None: no cluster section (the local default)
            cluster_name = m.group(1)
        else:
            rest.append(o)
    cluster_overrides = [o for o in rest if re.match(r"^\+{0,2}cluster\.", o)]
    rest = [_promote_known(o) for o in rest if o not in cluster_overrides]

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
            cfg = hydra_compose(config_name=path.stem, overrides=rest)
    except Exception as e:  # hydra raises several types; all mean "your overrides or YAML are wrong"
        hints = [h for h in (_unknown_key_hint(o) for o in rest) if h]
        if hints:  # a misspelt key: say so first, not Hydra's "use +key" (which then meets the schema's refusal)
            raise BadInput(f"{shown_path}: cannot compose config: {'; '.join(hints)}") from None
        raise BadInput(f"{shown_path}: cannot compose config: {redact(str(e))}") from None
    finally:
        GlobalHydra.instance().clear()

    OmegaConf.set_struct(cfg, False)
    picked = cluster_name or (cfg.get("cluster") if isinstance(cfg.get("cluster"), str) else None)
    if picked:
        cluster_file = find_cluster_config(picked, shown_path)
        check_yaml_file(cluster_file, "cluster config")
        try:
            loaded = OmegaConf.load(cluster_file)
        except Exception as e:
            raise BadInput(f"{cluster_file}: cannot read cluster config: {e}") from None
        from_manifest = (
            cfg.get("cluster") if path != shown_path and isinstance(cfg.get("cluster"), DictConfig) else None
        )
        if from_manifest is not None and isinstance(loaded, DictConfig):  # a manifest's sbatch block: merged under
            cfg.not_carried_out = list(cfg.get("not_carried_out") or []) + _replaced_sbatch(
                OmegaConf.to_container(from_manifest), OmegaConf.to_container(loaded), picked
            )
            loaded = OmegaConf.merge(from_manifest, loaded)
        cfg.cluster = loaded
    parser = OverridesParser.create()
    for o in cluster_overrides:  # applied after the cluster config: Hydra's grammar (null is None, [a,b] a list)
        try:
            parsed = parser.parse_override(o)
            if parsed.is_sweep_override():
                raise ValueError("a sweep (a,b / range / choice) gives a key several values; give it one")
            OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), force_add=True)
        except Exception as e:
            raise BadInput(f"bad override {redact(o)!r}: {redact(str(e))}") from None
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as e:
        raise BadInput(f"{shown_path}: cannot resolve config: {e}") from None
    return _parse_scalars(data)


def _replaced_sbatch(manifest: Any, cluster: Any, name: str) -> list[str]:
    """What `cluster=NAME` replaces of a manifest's sbatch block (translated to cluster keys): the cluster config is
    merged over it, so the manifest's keys it does not set are kept and those it sets are replaced, one warning
    each."""
    if not isinstance(manifest, dict) or not isinstance(cluster, dict):
        return []
    back = {v: k for k, v in sweep_manifest_keys().items()}
    out = []
    for key, value in manifest.items():
        if key == "executor" or key not in cluster:
            continue
        if key == "additional_parameters" and isinstance(value, dict) and isinstance(cluster[key], dict):
            out += [
                f"sbatch.{k}={v!r} (cluster={name} sets cluster.additional_parameters.{k}={cluster[key][k]!r}, "
                f"which wins)"
                for k, v in value.items()
                if k in cluster[key] and cluster[key][k] != v
            ]
        elif cluster[key] != value:
            out.append(
                f"sbatch.{back.get(key, key)}={value!r} (cluster={name} sets cluster.{key}={cluster[key]!r}, which "
                f"wins; the manifest's other sbatch keys are kept)"
            )
    return out


def sweep_manifest_keys() -> dict[str, str]:
    from shardrun.core import sweep_manifest

    return sweep_manifest.SBATCH_KEYS


def refuse_secret_overrides(overrides: Sequence[str]) -> None:
    """BadInput naming each override (by its place and key, never its value) that holds a credential: checked before
    Hydra parses them, as Hydra's own errors quote an override whole."""
    found = [
        f"override {i} ({redact(o.partition('=')[0].strip())}): {reason}; secrets are not allowed in configs or "
        f"overrides (they would be stored in plan.json or a job script): keep it in an environment variable and "
        f"name that variable instead (policy.api_key_env, judges.NAME.api_key_env, gym.secrets, or a bare NAME in cluster.env_vars)"
        for i, o in enumerate(overrides, 1)
        for _where, reason in find_credentials(o)
    ]
    if found:
        raise BadInput("overrides: invalid configuration", found)


def _promote_known(override: str) -> str:
    """`key=value` on a schema key the YAML leaves out (it has a default) works as Hydra's `++key=value`."""
    key, sep, _ = override.partition("=")
    if not sep or key.startswith(("+", "~")) or not _known_path(key.split(".")):
        return override
    return "++" + override


def _unknown_key_hint(override: str) -> str | None:
    """For an override whose key the config models do not know (below a section they define), what to write
    instead: 'override sharding.num_shard=...: unknown key sharding.num_shard (did you mean sharding.num_shards?)'.
    None for a known key or one below a free-form section (those are the user's)."""
    key, sep, _ = override.partition("=")
    key = key.lstrip("+~").strip()
    if not sep or not key:
        return None
    parts = key.split(".")
    for depth in range(len(parts)):
        parent = _walk(parts[:depth])
        if not isinstance(parent, type):  # free-form below here
            return None
        if parts[depth].isdigit() or parts[depth] in parent.model_fields or _expects_name(parts[:depth]):
            continue
        known = list(parent.model_fields)
        hint = difflib.get_close_matches(parts[depth], known, n=1)
        wrong = ".".join(parts[: depth + 1])
        return f"override {redact(key)}=...: unknown key {redact(wrong)}" + (
            f" (did you mean {'.'.join(parts[:depth] + [hint[0]])}?)"
            if hint
            else f" ({'.'.join(parts[:depth]) or 'the top level'} knows: {', '.join(known)})"
        )
    return None


def _expects_name(parts: list[str]) -> bool:
    """Is the key after `parts` a name of the user's: `parts` ends at a mapping of sections (judges)?"""
    import typing

    parent = _walk(parts[:-1]) if parts else None
    if not isinstance(parent, type):
        return False
    field = parent.model_fields.get(parts[-1])
    return field is not None and typing.get_origin(field.annotation) is dict and _model_in(field.annotation) is not None


def _known_path(parts: list[str]) -> bool:
    return _walk(parts) is not None


def _parse_scalars(data: Any) -> Any:
    """Cluster overrides arrive as strings; let YAML typing apply (e.g. array_parallelism=4 -> 4)."""
    import yaml

    if isinstance(data, dict):
        return {k: _parse_scalars(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_parse_scalars(v) for v in data]
    if isinstance(data, str) and data and data[0] in "0123456789":
        try:
            parsed = yaml.safe_load(data)
        except yaml.YAMLError:
            return data
        return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else data
    return data


_SECRET_KEYS = re.compile(r"(api_key|token|password|secret)$", re.IGNORECASE)


def validate(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a composed dict; one BadInput listing every problem, with 'did you mean' hints. A value that looks
    like a credential is refused wherever it is (also when an ${oc.env:...} interpolation put it there)."""
    secrets = [
        f"{where}: {reason}; secrets are not allowed in configs or overrides (they would be stored in "
        f"plan.json or a job script): keep it in an environment variable and name that variable instead "
        f"(policy.api_key_env, judges.NAME.api_key_env, gym.secrets, or a bare NAME in cluster.env_vars)"
        for where, reason in find_credentials(data)
    ]
    if secrets:
        raise BadInput(f"{source}: invalid configuration", secrets)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise BadInput(f"{source}: invalid configuration", [_describe(err, data) for err in e.errors()]) from None


def _holds_secret(name: str, value: Any, msg: str) -> bool:
    """Whether a refused value must not be echoed: the validator refused it as a secret, or it holds one anywhere
    (a credential by name or shape, a key after `--api-key` in a list of arguments)."""
    if "secret" in msg.lower():
        return True
    if isinstance(value, str):
        return secret_reason(name, value) is not None
    if isinstance(value, (list, tuple)) and any(isinstance(a, str) and a.startswith("--api-key") for a in value):
        return True
    return isinstance(value, (dict, list, tuple)) and any(True for _ in find_credentials(value, name))


def _describe(err: ErrorDetails, data: dict[str, Any]) -> str:
    loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "constrained-"))]
    where = ".".join(loc) or "(top level)"
    old = {v: k for k, v in MOVED_TO_COLLECTOR.items()}
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if len(loc) == 2 and loc[0] == "collector" and isinstance(cluster, dict) and old.get(loc[1]) in cluster:
        where = f"cluster.{old[loc[1]]} (now {where})"  # the user gave it under its old name
    if err["type"] == "extra_forbidden":
        key = loc[-1] if loc else ""
        if _SECRET_KEYS.search(key):
            return (
                f"{where}: secrets are not allowed in config files; name the environment variable instead "
                f"(e.g. api_key_env: MY_KEY_VAR)"
            )
        model = _model_at(loc[:-1])
        known = list(model.model_fields) if model else []
        hint = difflib.get_close_matches(key, known, n=1)
        return f"{where}: unknown key" + (
            f" (did you mean {'.'.join(loc[:-1] + [hint[0]])!r}?)"
            if hint
            else (f" (known keys: {', '.join(known)})" if known else "")
        )
    if "input" in err and err["type"] != "missing" and loc:  # at the top level the input is the whole config
        value = err.get("input")
        hidden = _holds_secret(loc[-1] if loc else "", value, str(err["msg"]))
        return redact(
            f"{where}: {err['msg']} (got {'a value not shown: it looks like a secret' if hidden else repr(value)})"
        )
    return redact(f"{where}: {err['msg']}")


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    found = _walk(loc)
    return found if isinstance(found, type) else None


_FREE_FORM = "free-form"


def _walk(parts: list[str]) -> type[BaseModel] | str | None:
    """Follow a dotted key through the config models: the model it lands on, _FREE_FORM once it enters a
    dict/list/scalar field (anything below is the user's), or None for an unknown key."""
    import typing

    model: type[BaseModel] = RunConfig
    named = False  # the part is a key of a mapping of sections (judges.NAME.vllm)
    for part in parts:
        if part.isascii() and part.isdigit():  # an item of a list of sections (entries.0.limit)
            continue
        if named:
            named = False
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        sub = _model_in(field.annotation)
        if sub is None:
            return _FREE_FORM
        named = typing.get_origin(field.annotation) is dict
        model = sub
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found:
            return found
    return None


def load(config_file: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose + validate. Relative paths stay relative to the current directory (resolved by callers)."""
    cfg = validate(compose(config_file, overrides), source=str(config_file))
    update: dict[str, Any] = {"run_dir": _abs(cfg.run_dir)}
    if cfg.input_jsonl is not None:
        update["input_jsonl"] = _abs(cfg.input_jsonl)
    if cfg.entries is not None:
        data = rebased_data(cfg) if cfg.data_root is not None else [e.data for e in cfg.entries]
        update["entries"] = [e.model_copy(update={"data": _abs(d)}) for e, d in zip(cfg.entries, data)]
        if cfg.data_root is not None:
            update["data_root"] = _abs(cfg.data_root)
    return cfg.model_copy(update=update)


def rebased_data(cfg: RunConfig) -> list[Path]:
    """Every entry's data path under `data_root`: a relative one joined to it, an absolute one rebased from
    `data_root_from` (default: the deepest directory holding every absolute entry path). BadInput for an absolute
    path outside data_root_from, naming the entry."""
    import os

    assert cfg.entries is not None and cfg.data_root is not None
    root = cfg.data_root.expanduser()
    absolute = [e.data for e in cfg.entries if e.data.is_absolute()]
    base = cfg.data_root_from
    if base is None and absolute:
        base = Path(os.path.commonpath([p.parent for p in absolute]))
    out = []
    for i, e in enumerate(cfg.entries):
        if not e.data.is_absolute():
            out.append(root / e.data)
            continue
        assert base is not None
        try:
            out.append(root / e.data.relative_to(base))
        except ValueError:
            raise BadInput(
                f"entries.{i}.data (entry {e.label!r}): {e.data} is not below data_root_from {base}; set "
                f"data_root_from to a directory that holds every entry's data, or give this entry's data its own path"
            ) from None
    return out


def _abs(p: Path) -> Path:
    """`~` is the home directory, as in a shell; a relative path is relative to the current directory."""
    p = p.expanduser()
    return p if p.is_absolute() else Path.cwd() / p
