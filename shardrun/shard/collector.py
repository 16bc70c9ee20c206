"""The collector: `ng_collect_rollouts` over exactly the shard's planned rows, and what its log says went wrong.

The shard directory holds `rollouts_materialized_inputs.jsonl` (the planned rows, global identities and seeds)
and `rollouts.jsonl`. With `+resume_from_cache=true` Gym 0.4.0 takes the materialized file as the source of truth
and dispatches exactly the identities that are neither in rollouts.jsonl nor gated in rollouts_failures.jsonl,
appending each finished rollout; the same call resumes a half-finished shard. `+input_jsonl_fpath` must name an
existing file but is not read on this route (we pass the materialized file itself).

A /run that fails aborts Gym's collector (exit 1). With the stack's request debugging on, the collector prints
`[rollout_collection] /run failed status=<code> row={"_ng_rollout_index": r, "_ng_task_index": t, ...}` first:
`failed_identities` reads those lines (and the response body printed just before, for the reason).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

from shardrun.shard import processes
from shardrun.rundir import store
from shardrun.core.config import GymConfig
from shardrun.shard.gym_stack import HEAD_HOST, GymStack, stack_env

FAILED_RUN = re.compile(r"\[rollout_collection\] /run failed status=(\S+) row=(\{[^\n]*\})")
RESPONSE_CONTENT = re.compile(r"Response content: (b?['\"].*)")
MESSAGE = re.compile(r"[\"']message[\"']\s*:\s*[\"']([^\"']{1,200})")
WHERE = re.compile(r"Hit an exception in (\S+?) calling")
EXCEPTION = re.compile(r"\b([A-Za-z_]\w*(?:Error|Exception))\(['\"]([^'\"]{1,200})")  # e.g. a body that is no JSON
ATTEMPTS_ENV = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"


def command(venv: Path, stack_port: int, run_dir: Path, index: int, gym: GymConfig) -> list[str]:
    cmd = [
        str(venv / "bin" / "ng_collect_rollouts"),
        f"+head_server.host={HEAD_HOST}",
        f"+head_server.port={stack_port}",
        f"+input_jsonl_fpath={store.materialized_path(run_dir, index)}",
        f"+output_jsonl_fpath={store.rollouts_path(run_dir, index)}",
        "+resume_from_cache=true",
        "+disable_aggregation=true",
        "+upload_rollouts_to_wandb=false",
    ]
    if gym.num_samples_in_parallel:
        cmd.append(f"+num_samples_in_parallel={gym.num_samples_in_parallel}")
    return cmd + list(gym.collect_overrides)


def start(
    venv: Path, stack: GymStack, run_dir: Path, index: int, gym: GymConfig, env: Mapping[str, str] | None = None
) -> processes.Proc:
    """Start one collector round (after the caller repaired a torn tail of rollouts.jsonl)."""
    base = dict(os.environ if env is None else env)
    cmd_env = stack_env(base, venv, stack.ray_tmp, gym.server_venvs == "shared")
    cmd_env[ATTEMPTS_ENV] = str(gym.max_rollout_attempts)
    return processes.start(
        command(venv, stack.port, run_dir, index, gym),
        store.collector_log_path(run_dir, index),
        name="ng_collect_rollouts",
        cwd=store.gym_dir(run_dir, index),
        env=cmd_env,
    )


def failed_identities(log_text: str) -> dict[tuple[int, int], str]:
    """{identity: reason} for every /run failure the collector reported in `log_text`."""
    out = {}
    last_content = ""
    for line in log_text.splitlines():
        m = RESPONSE_CONTENT.search(line)
        if m:
            last_content = m.group(1)
            continue
        m = FAILED_RUN.search(line)
        if not m:
            continue
        try:
            row = json.loads(m.group(2))
            key = (int(row["_ng_task_index"]), int(row["_ng_rollout_index"]))
        except (ValueError, KeyError, TypeError):
            continue
        out[key] = reason_text(m.group(1), last_content)
        last_content = ""
    return out


def reason_text(status: str, content: str) -> str:
    """A short reason: the agent's HTTP status and the innermost error message of the (nested) response body."""
    flat = re.sub(r"\\+", "", content)
    messages = MESSAGE.findall(flat) or [f"{name}: {text}" for name, text in EXCEPTION.findall(flat)]
    where = WHERE.findall(flat)
    detail = ": ".join(x for x in (where[-1] if where else "", messages[-1].strip() if messages else "") if x)
    return f"/run failed with HTTP {status}" + (f" ({detail})" if detail else "")


def read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
