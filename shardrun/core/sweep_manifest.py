"""NeMo Gym's reward-profiling manifest (benchmarks/nemotron_3.5_super/reward_profiling in the nemo-gym wheel),
translated into a run config (docs/blends.md has the mapping table). Pure: a parsed YAML mapping in, a run-config
mapping out.

Carried out: nickname, num_shards, entries, materialize, gym_env_start (config_paths; an external judge's
openai_model block as `judges.NAME`, its `${var}` key read from $VAR; every other key, a Gym config overlay, as a
`++key=value` override of ng_run, with a note for each `${var}` it references, which gym.secrets must name),
gym_eval_run (num_repeats, num_samples_in_parallel; the
rest as `++key=value` overrides of the collection), sbatch (account, partition, qos, timelimit; other keys as
extra sbatch parameters), vllm.model, srun.sandbox_container (sandbox.image, with sandbox_workers and sandbox_port:
one sandbox per job beside the Gym servers, docs/sandboxes.md). A manifest states no GPUs per node and no parallel
sizes: a self-hosted policy on Slurm is refused at plan and submit until cluster.gpus_per_node and the sizes are
given (overrides after the manifest; launch/preflight.py's gpu_problems names them). vllm.prefill_nodes +
decode_nodes become the job's nodes with a replica on each behind vllm-router, its settings from vllm_router (the P/D
split itself is not carried out). Named and skipped (a warning in the plan): vllm's P/D and launcher settings,
srun's other keys (container, mounts, sandbox_nodes, sandbox_lb_port), gym_eval_profile. Refused:
agent_ref_override (it would rewrite rows; shardrun sends every row as it is in its file) and any other key (a typo
would otherwise be dropped).
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from shardrun.core.errors import BadInput
from shardrun.core.gym_names import LABEL_MAX, label_problem

MANIFEST_ONLY = ("gym_env_start", "gym_eval_run", "gym_eval_profile", "num_shards", "sbatch", "srun", "vllm_router")
KNOWN = (
    "nickname",
    "num_shards",
    "entries",
    "materialize",
    "gym_env_start",
    "gym_eval_run",
    "gym_eval_profile",
    "sbatch",
    "srun",
    "vllm",
    "vllm_router",
)
RUN_CONFIG_ONLY = (
    "run_dir",
    "input_jsonl",
    "sharding",
    "gym",
    "policy",
    "cluster",
    "sampling",
    "num_repeats",
    "sandbox",
)
SRUN_SANDBOX_KEYS = {  # the manifest's srun key -> the sandbox section's (one sandbox per job: sandbox_nodes is not)
    "sandbox_container": "image",
    "sandbox_workers": "workers",
    "sandbox_port": "port",
}
SBATCH_KEYS = {"account": "account", "partition": "partition", "qos": "qos", "timelimit": "time_limit"}
ENTRY_KEYS = ("label", "data", "agent", "configs", "num_repeats", "limit", "owner", "notes")
_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_manifest(data: Any) -> bool:
    """A Gym reward-profiling manifest (not a run config): it has a key only a manifest has, or entries and a
    nickname and none of a run config's own keys."""
    if not isinstance(data, dict):
        return False
    if any(k in data for k in MANIFEST_ONLY):
        return True
    return "entries" in data and "nickname" in data and not any(k in data for k in RUN_CONFIG_ONLY)


def translate(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The run config a manifest means. BadInput names what cannot be carried out safely; what is skipped is
    listed in `not_carried_out` (a warning in the plan and on the terminal)."""
    unknown = [k for k in data if k not in KNOWN]
    if unknown:
        raise BadInput(
            f"{source}: not a key of a NeMo Gym reward-profiling manifest",
            [_unknown(k, KNOWN) for k in unknown],
        )
    skipped: list[str] = []
    nickname = data.get("nickname")
    out: dict[str, Any] = {"run_dir": f"runs/{nickname}" if isinstance(nickname, str) and nickname else "runs/blend"}
    if nickname is not None:
        out["nickname"] = nickname
    if data.get("num_shards") is not None:
        out["sharding"] = {"num_shards": data["num_shards"]}
    out["entries"] = [_entry(e, i, source) for i, e in enumerate(_list(data.get("entries"), "entries", source))]
    if data.get("materialize") is not None:
        out["materialize"] = data["materialize"]

    gym: dict[str, Any] = {}
    start = _mapping(data.get("gym_env_start"), "gym_env_start", source)
    if start.get("config_paths") is not None:
        gym["config_paths"] = start["config_paths"]
    notes: list[str] = []
    for key, value in start.items():
        if key == "config_paths":
            continue
        judge = external_judge(key, value)
        if judge is not None:
            out.setdefault("judges", {})[key] = judge
            notes.append(judge_note(key, value, judge))
            continue
        rendered = _override(key, value)
        if rendered is None:
            skipped.append(f"gym_env_start.{key} (cannot be written as a Gym override; put it in a Gym config file)")
        else:
            gym.setdefault("overrides", []).append(rendered)
            notes += [
                f"gym_env_start.{key} references ${{{var}}}{UNMAPPED_VARIABLE} ({var}: VARIABLE)"
                for var in dict.fromkeys(_INTERPOLATION.findall(rendered))
            ]
    run = _mapping(data.get("gym_eval_run"), "gym_eval_run", source)
    for key, value in run.items():
        if key == "num_repeats":
            out["num_repeats"] = value
        elif key == "num_samples_in_parallel":
            gym["num_samples_in_parallel"] = value
        else:
            rendered = _override(key, value)
            if rendered is None:
                skipped.append(f"gym_eval_run.{key} (cannot be written as an override of the collection)")
            else:
                gym.setdefault("collect_overrides", []).append(rendered)
    if gym:
        out["gym"] = gym

    sbatch = _mapping(data.get("sbatch"), "sbatch", source)
    if sbatch:
        cluster: dict[str, Any] = {"executor": "slurm"}
        for key, value in sbatch.items():
            if key in SBATCH_KEYS:
                cluster[SBATCH_KEYS[key]] = value
            else:
                cluster.setdefault("additional_parameters", {})[key] = value
        out["cluster"] = cluster

    vllm = _mapping(data.get("vllm"), "vllm", source)
    if vllm.get("model") is not None:
        out["policy"] = {"vllm": {"model": vllm["model"]}}
    nodes = [vllm[k] for k in ("prefill_nodes", "decode_nodes") if isinstance(vllm.get(k), int) and vllm[k] > 0]
    if nodes and "policy" in out:
        # the recipe's shape, without its P/D split: that many nodes per job, a replica on each, behind vllm-router
        out.setdefault("cluster", {"executor": "slurm"})["nodes"] = sum(nodes)
        out["policy"]["vllm"]["replicas"] = sum(nodes)
        out["policy"]["router"] = "vllm-router"
    rest = sorted(k for k in vllm if k != "model")
    if rest:
        asked = (
            f"; its {sum(nodes)} node(s) per shard become cluster.nodes {sum(nodes)} with one policy.vllm replica "
            f"each behind vllm-router (policy.router)"
            if nodes and "policy" in out
            else ""
        )
        skipped.append(
            f"vllm.{', vllm.'.join(rest)} (the P/D split and NVIDIA's launcher settings{asked}; the GPUs of a node "
            f"are cluster.gpus_per_node, used as policy.vllm.tensor_parallel_size x pipeline_parallel_size)"
        )
    router = _mapping(data.get("vllm_router"), "vllm_router", source)
    if router and out.get("policy", {}).get("router"):
        options, left = router_options(router)
        out["policy"]["router_options"] = options
        if left:
            skipped.append(f"vllm_router: {', '.join(left)} (no vllm-router setting of shardrun's takes them)")
    elif router:
        skipped.append(
            f"vllm_router: {', '.join(sorted(router))} (no router: the manifest's vllm block has no prefill or "
            f"decode nodes to put it in front of; set policy.router and policy.vllm.replicas)"
        )
    srun = _mapping(data.get("srun"), "srun", source)
    sandbox = {SRUN_SANDBOX_KEYS[k]: v for k, v in srun.items() if k in SRUN_SANDBOX_KEYS and v is not None}
    if "image" in sandbox:
        out["sandbox"] = sandbox
    srun_left = sorted(k for k in srun if "image" not in sandbox or k not in SRUN_SANDBOX_KEYS)
    if srun_left:
        skipped.append(
            f"srun: {', '.join(srun_left)} (the recipe's containers, mounts and multi-node sandbox tier; shardrun runs "
            f"its jobs in cluster.containers with cluster.mounts, and one sandbox per job beside the Gym servers "
            f"from srun.sandbox_container: sandbox.image, docs/sandboxes.md)"
        )
    if data.get("gym_eval_profile"):
        skipped.append(
            f"gym_eval_profile: {', '.join(sorted(_mapping(data['gym_eval_profile'], 'gym_eval_profile', source)))} "
            f"(the profiler's settings; merge-and-profile profiles what was collected)"
        )
    if skipped:
        out["not_carried_out"] = skipped
    if notes:
        out["translation_notes"] = notes
    return out


UNMAPPED_VARIABLE = (
    ", which Gym resolves from the stack's env.yaml: name the environment variable holding it in gym.secrets"
)
"""How a translation note about a `${var}` of a Gym override goes on (the plan drops it once gym.secrets maps var)."""
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
JUDGE_BLOCK_KEYS = ("entrypoint", "openai_base_url", "openai_model", "openai_api_key", "max_concurrent_requests")


def external_judge(key: str, value: Any) -> dict[str, Any] | None:
    """A gym_env_start block that defines an external judge as NVIDIA's example_judge manifest does
    (`NAME: {responses_api_models: {openai_model: {openai_base_url, openai_model, openai_api_key: ${var},
    max_concurrent_requests}}}`), as `judges.NAME` (docs/judges.md): external at that URL, its key read from the
    environment variable named as the Gym variable in capitals ($NV_INFERENCE_API_KEY for
    ${nv_inference_api_key}), its other settings as server_options. None for anything else (a plain URL and model
    name are required; a key written out is not taken, and stays a Gym override, which the secrets check reads)."""
    if not _ID.match(key) or not isinstance(value, dict) or list(value) != ["responses_api_models"]:
        return None
    models = value["responses_api_models"]
    if not isinstance(models, dict) or list(models) != ["openai_model"] or not isinstance(models["openai_model"], dict):
        return None
    block = models["openai_model"]
    url, model, api_key = block.get("openai_base_url"), block.get("openai_model"), block.get("openai_api_key")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or "${" in url:
        return None
    if not isinstance(model, str) or not model or "${" in model:
        return None
    found = _INTERPOLATION.fullmatch(api_key) if isinstance(api_key, str) else None
    if api_key is not None and found is None:
        return None
    cap = block.get("max_concurrent_requests")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)):
        return None
    judge: dict[str, Any] = {"base_url": url, "model_name": model}
    if found is not None:
        judge["api_key_env"] = found.group(1).upper()
    if cap is not None:
        judge["max_concurrent_requests"] = cap
    rest = {k: v for k, v in block.items() if k not in JUDGE_BLOCK_KEYS}
    if rest:
        judge["server_options"] = rest
    return judge


def judge_note(key: str, value: dict[str, Any], judge: dict[str, Any]) -> str:
    """What a judge block became, said in the plan: where the key is read from above all."""
    cap = judge.get("max_concurrent_requests")
    where = (
        f"gym_env_start.{key}: the external judge judges.{key} (Gym's openai_model at {judge['base_url']}, model "
        f"{judge['model_name']}" + (f", at most {cap} requests at once" if cap else "") + ")"
    )
    if "api_key_env" not in judge:
        return where + " without a key"
    var = value["responses_api_models"]["openai_model"]["openai_api_key"]
    return (
        f"{where}; its key {var} is read from ${judge['api_key_env']} (export it where you plan and submit, or "
        f"set judges.{key}.api_key_env to the variable that holds it)"
    )


ROUTER_KEYS = {  # the manifest's vllm_router key -> policy.router_options' (the same settings of vllm-router)
    "health_timeout_s": "health_timeout_s",
    "health_interval_s": "health_interval_s",
    "health_failures": "health_failures",
    "request_timeout_s": "request_timeout_s",
    "queue_size": "queue_size",
    "circuit_breaker": "circuit_breaker",
}
ROUTER_FLAGS = {"queue_timeout_s": "--queue-timeout-secs", "log_level": "--log-level"}


def router_options(block: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """policy.router_options from a manifest's vllm_router block, and the keys left over. max_concurrent is the
    queue's depth where queue_size is not given (shardrun sets both from one number)."""
    options: dict[str, Any] = {}
    extra: list[str] = []
    left = []
    for key, value in block.items():
        if key in ROUTER_KEYS and value is not None:
            options[ROUTER_KEYS[key]] = value
        elif key in ROUTER_FLAGS and value is not None:
            extra += [ROUTER_FLAGS[key], str(value)]
        elif key == "max_concurrent" and block.get("queue_size") is None and value is not None:
            options["queue_size"] = value
        elif value is not None:
            left.append(key)
    if extra:
        options["extra_args"] = extra
    return options, sorted(left)


def _entry(entry: Any, i: int, source: str) -> dict[str, Any]:
    where = f"entries.{i}"
    e = _mapping(entry, where, source)
    label = e.get("label", f"#{i}")
    why = label_problem(label) if isinstance(label, str) else None
    if why:
        raise BadInput(f"{source}: {where}.label (entry {ascii(label[: LABEL_MAX + 20])}): {why}")
    if e.get("agent_ref_override") is not None:
        raise BadInput(
            f"{source}: {where}.agent_ref_override (entry {label!r}): shardrun sends every row as it is in its "
            f"file and does not rewrite agent_ref; give the entry the agent its rows name, or rewrite the data"
        )
    unknown = [k for k in e if k not in ENTRY_KEYS and k != "agent_ref_override"]
    if unknown:
        raise BadInput(
            f"{source}: {where} (entry {label!r}): not a key of a manifest entry",
            [_unknown(k, ENTRY_KEYS) for k in unknown],
        )
    return {k: v for k, v in e.items() if k != "agent_ref_override"}


def _override(key: str, value: Any) -> str | None:
    """`++key=value` in Hydra's override grammar (what ng_run and ng_collect_rollouts parse), or None when the
    key or a nested key is not a plain identifier."""
    rendered = _value(value)
    return None if rendered is None or not _ID.match(key) else f"++{key}={rendered}"


def _value(v: Any) -> str | None:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, list):
        items = [_value(x) for x in v]
        return None if any(x is None for x in items) else "[" + ",".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(v, dict):
        parts = []
        for k, x in v.items():
            rendered = _value(x)
            if not isinstance(k, str) or not _ID.match(k) or rendered is None:
                return None
            parts.append(f"{k}:{rendered}")
        return "{" + ",".join(parts) + "}"
    return None


def _mapping(v: Any, where: str, source: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadInput(f"{source}: {where}: must be a mapping, got {type(v).__name__}")
    return v


def _list(v: Any, where: str, source: str) -> list[Any]:
    if not isinstance(v, list) or not v:
        raise BadInput(f"{source}: {where}: a manifest needs a non-empty list of entries")
    return v


def _unknown(key: Any, known: tuple[str, ...]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    return f"{key}: unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(known)})")
