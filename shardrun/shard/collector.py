"""The collector: `ng_collect_rollouts` over exactly the shard's planned rows, and what its log says went wrong.

The shard directory holds `rollouts_materialized_inputs.jsonl` (the planned rows, global identities and seeds)
and `rollouts.jsonl`. With `+resume_from_cache=true` Gym (0.4 and 0.7 alike) takes the materialized file as the
source of truth and dispatches exactly the identities that are neither in rollouts.jsonl nor gated in
rollouts_failures.jsonl, appending each finished rollout; the same call resumes a half-finished shard.
`+input_jsonl_fpath` must name an existing file but is not read on this route (we pass the materialized file
itself).

The command and the release's own flags come from its adapter (gym_adapter.py), and so does how a failed /run
is learnt: Gym 0.4 aborts the collector and names the identity only in its log (`failed_identities` asks the
adapter to read it); Gym 0.7 records it in the failures sidecar and goes on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Mapping

import orjson

from shardrun.shard import processes
from shardrun.rundir import store
from shardrun.core.config import GymConfig
from shardrun.core.gym_names import FAILURES, MATERIALIZED, ROLLOUT_KEY, ROLLOUTS, TASK_KEY
from shardrun.core.gym_adapter import GymAdapter
from shardrun.shard.gym_stack import HEAD_HOST, GymStack, stack_env

ATTEMPTS_ENV = "NEMO_GYM_MAX_ROLLOUT_ATTEMPTS"  # read by Gym's resume (0.4 and 0.7): the retry cap per identity


def overrides(adapter: GymAdapter, stack_port: int, gym: GymConfig) -> list[str]:
    """The collector's Hydra overrides but its input and output: the stack to use, resume from the materialized
    file, no aggregation, the release's own flags, the concurrency, the user's collect_overrides."""
    out = [
        f"+head_server.host={HEAD_HOST}",
        f"+head_server.port={stack_port}",
        "+resume_from_cache=true",
        "+disable_aggregation=true",
        "+upload_rollouts_to_wandb=false",
        *adapter.collect_flags(),
    ]
    if gym.num_samples_in_parallel:
        out.append(f"+num_samples_in_parallel={gym.num_samples_in_parallel}")
    return out + list(gym.collect_overrides)


def command(
    adapter: GymAdapter,
    venv: Path,
    stack_port: int,
    run_dir: Path,
    index: int,
    gym: GymConfig,
    view: Path | None = None,
) -> list[str]:
    """The collector's command line; `view` (a `skipping_view`) in place of the shard directory when rows are
    skipped."""
    where = view or store.shard_dir(run_dir, index)
    return [
        *adapter.collect_command(venv),
        f"+input_jsonl_fpath={where / MATERIALIZED}",
        f"+output_jsonl_fpath={where / ROLLOUTS}",
        *overrides(adapter, stack_port, gym),
    ]


def environment(base: Mapping[str, str], venv: Path, stack: GymStack, gym: GymConfig) -> dict[str, str]:
    """The collector's environment: the stack's, and Gym's retry cap per identity."""
    out = stack_env(base, venv, stack.ray_tmp, gym.server_venvs == "shared")
    out[ATTEMPTS_ENV] = str(gym.max_rollout_attempts)
    return out


def start(
    adapter: GymAdapter,
    venv: Path,
    stack: GymStack,
    run_dir: Path,
    index: int,
    gym: GymConfig,
    env: Mapping[str, str] | None = None,
    view: Path | None = None,
) -> processes.Proc:
    """Start one collector round (after the caller repaired a torn tail of rollouts.jsonl)."""
    return processes.start(
        command(adapter, venv, stack.port, run_dir, index, gym, view),
        store.collector_log_path(run_dir, index),
        name="ng_collect_rollouts",
        cwd=store.gym_dir(run_dir, index),
        env=environment(dict(os.environ if env is None else env), venv, stack, gym),
    )


def skipping_view(run_dir: Path, index: int, skip: Collection[tuple[int, int]]) -> Path:
    """The shard as the collector should see it when rows are skipped because decided (adaptive sampling):
    `store.collect_dir` with the planned rows less `skip` as its materialized file, and links to the shard's own
    rollouts.jsonl and failures sidecar, which Gym appends to (through the links) and resumes from as usual."""
    view = store.collect_dir(run_dir, index)
    view.mkdir(exist_ok=True)
    with store.atomic_writer(view / MATERIALIZED) as f:
        for raw in store.complete_lines(store.materialized_path(run_dir, index)):
            row = orjson.loads(raw)
            if (row[TASK_KEY], row[ROLLOUT_KEY]) not in skip:
                f.write(raw)
    store.failures_path(run_dir, index).touch()
    for name in (ROLLOUTS, FAILURES):
        link = view / name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.join(os.pardir, name), link)
    return view


def failed_identities(adapter: GymAdapter, log_text: str) -> dict[tuple[int, int], str]:
    """{identity: reason} for every failed /run the collector reported only in `log_text` (see the adapter)."""
    return adapter.failed_identities(log_text)


def read_from(path: Path, offset: int) -> str:
    try:
        with store.open_regular(path) as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
