#!/usr/bin/env python3
"""Benchmark one small shard end to end and print where its wall time goes.

    .venv/bin/python scripts/bench_shard.py [--tasks 8] [--repeats 2] [--runs 2] [--policy-url URL --model NAME]

Each run plans a fresh one-shard run directory, then runs the shard the way a job does (`shardrun run-shard` in a
new process) against real NeMo Gym ($SHARDRUN_GYM_VENV). The policy is the stand-in server from tests/fakes
(instant deterministic answers, so the figures are about shardrun and Gym, not a model) unless --policy-url is
given. Printed per run and as the median:

    servers ready   policy check + ng_run until every Gym server answers   (marker server_wait_s)
    collection      ng_collect_rollouts rounds under the watchdog          (marker collect_s)
    teardown        stopping ng_run and its Ray processes after sealing    (shard.log)
    overhead        everything else: interpreter start, imports, plan and ledger reads, env.yaml, seal (target < 2 s)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardrun.core import config as config_mod
from shardrun.rundir import store
from tests.fakes import harness

TEARDOWN = re.compile(r"servers stopped in ([0-9.]+) s")


def plan(tmp: Path, args: argparse.Namespace, policy_url: str, model: str, gym_venv: Path) -> Path:
    rows = (ROOT / "examples/arith/input.jsonl").read_text().splitlines()[: args.tasks]
    (tmp / "input.jsonl").write_text("".join(r + "\n" for r in rows))
    cfg_path = harness.write_config(
        tmp / "run.yaml",
        tmp / "input.jsonl",
        tmp / "run",
        policy_url,
        repeats=args.repeats,
        shards=1,
        config_paths=harness.CONFIG_PATHS,  # the servers docs/runtime.md measured
        gym={"num_samples_in_parallel": args.parallel, "venv": str(gym_venv), "server_venvs": args.server_venvs}
        | ({"uv_venv_dir": args.uv_venv_dir} if args.uv_venv_dir else {}),
    )
    cfg = config_mod.load(cfg_path, [f"policy.model_name={model}"])
    store.write_plan(cfg)
    return cfg.run_dir


def one_run(args: argparse.Namespace, policy_url: str, model: str, gym_venv: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-shard-") as tmp:
        run_dir = plan(Path(tmp), args, policy_url, model, gym_venv)
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "run-shard", str(run_dir), "0"],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=ROOT,
        )
        wall = time.monotonic() - t0
        if done.returncode != 0:
            raise SystemExit(f"shard failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        marker = json.loads(store.done_path(run_dir, 0).read_text())
        teardown = float(TEARDOWN.findall(store.shard_log_path(run_dir, 0).read_text())[-1])
    ready, collect = marker["server_wait_s"], marker["collect_s"]
    return {
        "rollouts": marker["num_rollouts"],
        "wall": wall,
        "ready": ready,
        "collect": collect,
        "teardown": teardown,
        "overhead": wall - ready - collect - teardown,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=8, help="arithmetic tasks from examples/arith (max 36)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parallel", type=int, default=8, help="gym.num_samples_in_parallel")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument(
        "--server-venvs",
        choices=("shared", "uv"),
        default="shared",
        help="gym.server_venvs: shared (symlinks to the Gym venv) or uv (Gym builds per-server venvs)",
    )
    p.add_argument("--uv-venv-dir", default=None, help="gym.uv_venv_dir for --server-venvs uv")
    p.add_argument("--policy-url", default=None, help="use this endpoint instead of the stand-in server")
    p.add_argument("--model", default="fake-model")
    args = p.parse_args()
    gym_venv = Path(os.environ.get("SHARDRUN_GYM_VENV", Path.home() / ".cache/shardrun/gym-venv"))
    os.environ.setdefault(harness.API_KEY_ENV, harness.API_KEY)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-policy-") as ptmp:
        if args.policy_url:
            runs = [one_run(args, args.policy_url, args.model, gym_venv) for _ in range(args.runs)]
        else:
            with harness.fake_policy(Path(ptmp)) as fake:
                runs = [one_run(args, fake.base_url, "fake-model", gym_venv) for _ in range(args.runs)]
        results.extend(runs)
    cols = ("rollouts", "wall", "ready", "collect", "teardown", "overhead")
    print(
        f"one shard, {args.tasks} tasks x {args.repeats} repeats, num_samples_in_parallel={args.parallel}, "
        f"server venvs {args.server_venvs}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print("run  " + "".join(f"{c:>10}" for c in cols))
    for i, r in enumerate(results, 1):
        print(f"{i:<5}" + "".join(f"{r[c]:>10.0f}" if c == "rollouts" else f"{r[c]:>9.2f}s" for c in cols))
    med = {c: statistics.median(r[c] for r in results) for c in cols}
    print("med  " + "".join(f"{med[c]:>10.0f}" if c == "rollouts" else f"{med[c]:>9.2f}s" for c in cols))
    print(
        f"servers ready {med['ready']:.2f} s, collection {med['collect']:.2f} s, teardown {med['teardown']:.2f} s, "
        f"shardrun overhead {med['overhead']:.2f} s (target < 2 s)"
    )


if __name__ == "__main__":
    main()
