"""Run directories for the fault tests that need no servers: planned with the real planner, shard outputs in NeMo
Gym's formats from tests/builders.py, and launch settings (gym + policy sections) so that `shardrun resume` and
`run-shard` work on them. A shard whose every planned identity is accounted for seals without starting any server
(runtime: "sealing without starting servers"), so sealing, resume and submit run for real and fast.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardrun.core import config
from shardrun.rundir import ledger
from shardrun.rundir import store
from tests import builders

MAX_ROLLOUT_ATTEMPTS = 2
UNREACHABLE_POLICY = "http://127.0.0.1:9/v1"  # never contacted: these shards seal without servers


def launch_config(run: builders.Run, *, api_key_env: str | None = None, **cluster) -> config.RunConfig:
    data = run.cfg.model_dump(mode="json")
    data.update(
        gym={
            "config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"],
            "max_rollout_attempts": MAX_ROLLOUT_ATTEMPTS,
        },
        policy={"base_url": UNREACHABLE_POLICY, "model_name": "m", "api_key_env": api_key_env},
        cluster={"executor": "local", "array_parallelism": 1, "max_attempts": 10_000} | cluster,
    )
    return config.validate(data)


def launch_config_file(run: builders.Run, path: Path, *, api_key_env: str | None = None, **cluster) -> Path:
    """The run's launch config (launch_config) as a file, what a user passes to `shardrun submit`."""
    data = launch_config(run, api_key_env=api_key_env, **cluster).model_dump(mode="json")
    inp, run_dir, repeats = data.pop("input_jsonl"), data.pop("run_dir"), data.pop("num_repeats")
    return builders.write_config(path, inp, run_dir, repeats=repeats, as_json=True, **data)


def make(tmp: Path, *, tasks: int, shards: int, seal: bool, name: str = "run") -> builders.Run:
    """A run with every shard's outputs written. Unsealed shards are ready to seal without servers: some have
    a torn last line, duplicates, Gym failure rows (2 per identity = MAX_ROLLOUT_ATTEMPTS: failed), and one
    identity that failed its attempts in shardrun's retry ledger only (quarantined into the sidecar at seal)."""
    run = builders.make_run(
        tmp,
        builders.input_rows(tasks, agents=("math", "tool")),
        num_repeats={"math": 6, "_default": 3},
        num_shards=shards,
        slicing="round_robin",
        name=name,
    )
    for i in range(shards):
        wrote = builders.write_shard(
            run,
            i,
            failed=1 if i % 3 == 0 else 0,
            duplicates=1 if i % 4 == 1 else 0,
            torn=i % 4 == 2 and not seal,
            missing=1 if i % 5 == 0 and not seal else 0,
            seal_it=seal,
        )
        if not seal and wrote.missing:
            store.append_jsonl(
                store.rollout_attempts_path(run.run_dir, i),
                [
                    ledger.attempt_row(k, "/run failed with HTTP 500 (injected)", 1)
                    for k in wrote.missing
                    for _ in range(MAX_ROLLOUT_ATTEMPTS)
                ],
            )
    store.write_launch_settings(run.run_dir, launch_config(run))
    return run


def restore(src: Path, dst: Path) -> None:
    """Put the run directory back to a saved state (same path, so launch records and logs stay valid)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, symlinks=True)


def shard_files(run_dir: Path, num_shards: int) -> dict[str, bytes]:
    """What sealing must produce identically whatever happened before: rollouts and failure sidecars."""
    out = {}
    for i in range(num_shards):
        for path in (store.rollouts_path(run_dir, i), store.failures_path(run_dir, i)):
            if path.exists():
                out[str(path.relative_to(run_dir))] = path.read_bytes()
    return out


def temps(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(store.TMP_PREFIX + "*") if p.is_file())
