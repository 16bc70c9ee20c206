"""The environment a run collects in, as part of its identity: `environment.json` beside plan.json.

The plan fingerprint covers what decides which rollouts exist (input, repeats, seeds, shards). What they are run
*against* is the manifest's: the Gym release and venv, every config file (the paths as given, where they resolve and
a digest of their content, nested `config_paths` included), the Hydra overrides of the stack and the collector,
how the servers' venvs are made, and the policy (endpoint or self-hosted model, served name, the sampling defaults
shardrun sends), and the judges (model or endpoint). Secrets are never in it: the policy key, the judges' keys and
`gym.secrets` are named by their variables only.

The first launch writes the manifest. Every later launch (submit or resume) builds it again from its config and
refuses a difference, naming each changed item, unless the change is allowed (`resume --allow-config-change`);
an allowed change becomes the manifest and is recorded in its `changes` list (when, what, by which flag), so a
run that mixes two environments says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import orjson
import yaml

from shardrun.core import failure_classes, gym_version
from shardrun.core.config import RunConfig
from shardrun.core.errors import PlanMismatch
from shardrun.rundir import store

MANIFEST_FILE = "environment.json"
MANIFEST_VERSION = 1
ALLOW_FLAG = "--allow-config-change"
MAX_NESTED_CONFIGS = 1000


def manifest_path(run_dir: Path) -> Path:
    return Path(run_dir) / MANIFEST_FILE


def _sha256(path: Path) -> str | None:
    try:
        return store.sha256_file(path)
    except OSError:
        return None


def _site_packages(venv: Path | None) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages")) if venv else []
    return found[-1] if found else None


def resolve_config(path: str, cwd: Path, site: Path | None) -> Path | None:
    """Where Gym finds a config path: as given when absolute, else under the working directory, else under the Gym
    install (site-packages); None when it is in neither."""
    p = Path(path)
    if p.is_absolute():
        return p if p.is_file() else None
    for root in (cwd, site):
        if root is not None and (root / p).is_file():
            return root / p
    return None


def _nested_paths(resolved: Path) -> list[str]:
    try:
        data = yaml.safe_load(resolved.read_text(errors="replace"))
    except (OSError, yaml.YAMLError):
        return []
    nested = data.get("config_paths") if isinstance(data, dict) else None
    return [str(x) for x in nested] if isinstance(nested, list) else []


def config_files(paths: Iterable[str], cwd: Path, site: Path | None) -> list[dict[str, Any]]:
    """Every config file the stack loads (nested `config_paths` too, once each): path, where it resolves, digest."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    todo = list(paths)
    while todo and len(out) < MAX_NESTED_CONFIGS:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        resolved = resolve_config(path, cwd, site)
        out.append(
            {
                "path": path,
                "resolved": str(resolved) if resolved else None,
                "sha256": _sha256(resolved) if resolved else None,
            }
        )
        if resolved is not None:
            todo.extend(_nested_paths(resolved))
    return out


def build(cfg: RunConfig, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """The manifest of `cfg` as launched from `cwd` with `env` (pure apart from reading the config files)."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    out: dict[str, Any] = {"manifest_version": MANIFEST_VERSION}
    gym = cfg.gym
    if gym is not None:
        venv = gym_version.configured_venv(gym.venv, env)
        out["gym"] = {
            "version": gym_version.installed_version(venv) if venv else None,
            "venv": str(venv) if venv else None,
            "config_files": config_files(gym.config_paths, cwd, _site_packages(venv)),
            "overrides": list(gym.overrides),
            "collect_overrides": list(gym.collect_overrides),
            "server_venvs": gym.server_venvs,
            "uv_venv_dir": gym.uv_venv_dir,
            "responses_create_params": dict(gym.responses_create_params),
        }
        if gym.secrets:  # the NAMEs of the variables only, never a value; recorded only when set (runs before compare)
            out["gym"]["secrets"] = dict(gym.secrets)
    pol = cfg.policy
    if pol is not None:
        policy: dict[str, Any] = {"api_key_env": pol.api_key_env}
        if pol.vllm is not None:
            v = pol.vllm
            policy.update(
                model=v.model,
                served_model_name=v.served_model_name,
                max_model_len=v.max_model_len,
                tensor_parallel_size=v.tensor_parallel_size,
                data_parallel_size=v.data_parallel_size,
                extra_args=list(v.extra_args),  # the server's sampling defaults (e.g. --generation-config) live here
            )
            if v.pipeline_parallel_size != 1:  # recorded only when set: runs launched before it compare unchanged
                policy["pipeline_parallel_size"] = v.pipeline_parallel_size
        else:
            policy.update(base_url=pol.base_url, model_name=pol.model_name)
        out["policy"] = policy
    if cfg.judges:  # what scores the rollouts; recorded only when set (runs before judges compare unchanged)
        out["judges"] = {
            name: {
                "api_key_env": j.api_key_env,
                "server_options": dict(j.server_options),
                **(
                    {
                        "model": j.vllm.model,
                        "served_model_name": j.vllm.served_model_name,
                        "max_model_len": j.vllm.max_model_len,
                        "extra_args": list(j.vllm.extra_args),
                    }
                    if j.vllm is not None
                    else {"base_url": j.base_url, "model_name": j.model_name}
                ),
            }
            for name, j in cfg.judges.items()
        }
    return out


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: leaf} of a manifest (config files keyed by their path, so a reorder reads as one)."""
    if isinstance(value, dict):
        items: dict[str, Any] = {}
        for k, v in value.items():
            items.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return items
    if isinstance(value, list) and value and all(isinstance(x, dict) and "path" in x for x in value):
        items = {}
        for x in value:
            items.update(_flat({k: v for k, v in x.items() if k != "path"}, f"{prefix}[{x['path']}]"))
        items[f"{prefix} (order)"] = [x["path"] for x in value]
        return items
    return {prefix: value}


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What changed from `old` to `new`, one line per item (empty when nothing did)."""
    a = _flat({k: v for k, v in old.items() if k not in ("changes", "written_at")})
    b = _flat({k: v for k, v in new.items() if k not in ("changes", "written_at")})
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            if key.endswith(".sha256") and a.get(key) and b.get(key):
                out.append(f"{key[: -len('.sha256')]}: content changed (sha256 {a[key][:12]}… -> {b[key][:12]}…)")
            else:
                out.append(f"{key}: {_shown(a.get(key))} -> {_shown(b.get(key))}")
    return out


def _shown(value: Any) -> str:
    text = orjson.dumps(value).decode() if value is not None else "(none)"
    return text if len(text) <= 200 else text[:197] + "..."


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = orjson.loads(store.read_regular(manifest_path(run_dir)))
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as e:
        raise PlanMismatch(f"{manifest_path(run_dir)}: not valid JSON ({e}); restore it or remove it") from None
    return data if isinstance(data, dict) else None


def check_and_record(
    run_dir: Path, cfg: RunConfig, *, allow_change: bool = False, dry_run: bool = False, now: float | None = None
) -> list[str]:
    """Compare `cfg`'s manifest with the run's: write it when the run has none; PlanMismatch listing the changes
    unless `allow_change` (then the new manifest replaces the old and the change is recorded). Returns the changes
    (empty when none). The caller holds the run lock; `dry_run` writes nothing."""
    new = build(cfg)
    old = read(run_dir)
    if old is None:
        if not dry_run:
            store.atomic_write_json(manifest_path(run_dir), new | {"written_at": now or time.time(), "changes": []})
        return []
    diffs = differences(old, new)
    if not diffs:
        return []
    if not allow_change:
        raise PlanMismatch(
            f"{run_dir}: the Gym or policy configuration changed since this run was launched "
            f"({manifest_path(run_dir).name}):\n"
            + "\n".join(f"  - {d}" for d in diffs)
            + f"\nResuming would mix two environments in one run. Restore the original configuration, or pass "
            f"{ALLOW_FLAG} to `shardrun resume` to accept the change (it is recorded in {MANIFEST_FILE})."
        )
    if not dry_run:
        record = {"at": now or time.time(), "allowed_by": ALLOW_FLAG, "differences": diffs}
        changes = list(old.get("changes") or []) + [record]
        store.atomic_write_json(manifest_path(run_dir), new | {"written_at": old.get("written_at"), "changes": changes})
    return diffs


def server_roles(run_dir: Path) -> failure_classes.ServerRoles:
    """The run's policy and judge model servers (failure_classes.ServerRoles.from_gym_configs) from the Gym config
    files its manifest records (where they resolved when it was launched) and its Hydra overrides; the default
    roles (`policy_model` is the policy) where the run has no manifest or a file no longer reads."""
    manifest = read(run_dir)
    gym = manifest.get("gym") if isinstance(manifest, dict) else None
    if not isinstance(gym, dict):
        return failure_classes.DEFAULT_ROLES
    configs = []
    for entry in gym.get("config_files") or []:
        resolved = entry.get("resolved") if isinstance(entry, dict) else None
        if not isinstance(resolved, str):
            continue
        try:
            configs.append(yaml.safe_load(Path(resolved).read_text(errors="replace")))
        except (OSError, yaml.YAMLError):
            continue
    overrides = [o for o in (gym.get("overrides") or []) + (gym.get("collect_overrides") or []) if isinstance(o, str)]
    roles = failure_classes.ServerRoles.from_gym_configs(configs, overrides)
    judges = manifest.get("judges") if isinstance(manifest, dict) else None  # the model servers shardrun serves
    if isinstance(judges, dict):  # as judges (a `judges` section, recorded by name) are judges too
        roles = roles.union(failure_classes.ServerRoles(policies=frozenset(), judges=frozenset(map(str, judges))))
    return roles
