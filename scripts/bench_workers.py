#!/usr/bin/env python3
"""One job per shard against warm workers: the same run twice, with the real NeMo Gym stack.

    .venv/bin/python scripts/bench_workers.py [--policy-startup-s 30] [--shards 16] [--parallel 2] [--json OUT]

Both runs plan the same input (the first `--tasks` math rows of examples/arith x `--repeats`) into `--shards` shards and
run them on the local executor, at most `--parallel` at once:

    per-shard   cluster.workers: null, array_parallelism: --parallel   (every shard starts and stops its servers)
    workers     cluster.workers: --parallel                             (each worker starts its servers once)

The policy is self-hosted (`policy.vllm.command`): the stand-in server from tests/fakes/policy_server.py, which
takes vLLM's command line and opens its port only after `--policy-startup-s` seconds (a model loading), then
answers every request after `--policy-delay-s` (generation). The Gym stack is real ($SHARDRUN_GYM_VENV). Printed
for both runs:

    wall               submit to the last job's end
    job-seconds        the jobs' time: per shard, every attempt's first shard.log line to its "sealed:" or
                       "FAILED:" line (after teardown); per worker, worker.json started_at to ended_at
    server starts      policy + Gym stack starts (per shard: attempts that started the policy; workers' server_starts)

A run whose shards failed (on a loaded machine a Gym stack can fail to start: Ray's "GCS has become overloaded") is
resumed, at most `--max-resumes` times; the wall time and job-seconds include the failed attempts.
    collecting-seconds the collector rounds, from the markers (collect_s)
    utilization        collecting-seconds / job-seconds

Targets (issue #12): workers' wall at most 0.5 of the per-shard run's, workers' utilization at least 0.7, server
starts equal to the number of workers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from shardrun.rundir import store
from shardrun.workers import worker
from tests import builders
from tests.fakes import harness
from tests.faults import gymkit

MATH_AGENT = "math_with_judge_simple_agent"  # the stack here serves math_with_judge only (the quickest real stack)
LINE = re.compile(r"^\[shardrun (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) shard \d+\] (.*)$")


def write_config(tmp: Path, mode: str, args: argparse.Namespace, gym_venv: Path) -> Path:
    rows = [r for r in (ROOT / "examples/arith/input.jsonl").read_text().splitlines() if MATH_AGENT in r]
    if len(rows) < args.tasks:
        sys.exit(f"examples/arith has {len(rows)} rows of {MATH_AGENT}; ask for at most that many --tasks")
    rows = rows[: args.tasks]
    (tmp / "input.jsonl").write_text("".join(r + "\n" for r in rows))
    stand_in = [
        sys.executable,
        str(harness.FAKE),
        f"--startup-delay={args.policy_startup_s:g}",  # one word each: a bare number would be typed by the config
        f"--delay={args.policy_delay_s:g}",
        "--correct-share=0.5",
    ]
    return builders.write_config(
        tmp / "run.yaml",
        tmp / "input.jsonl",
        tmp / "run",
        repeats=args.repeats,
        shards=args.shards,
        gym={
            "config_paths": gymkit.CONFIG_PATHS,
            "venv": str(gym_venv),
            "num_samples_in_parallel": args.parallel_rollouts,
            "stall_timeout_s": 600,
            "ready_timeout_s": 900,
        },
        policy={
            "api_key_env": harness.API_KEY_ENV,
            "vllm": {
                "model": "stand-in",
                "served_model_name": "fake-model",
                "command": stand_in,
                "ready_timeout_s": args.policy_startup_s + 600,
            },
        },
        cluster={
            "executor": "local",
            "array_parallelism": args.parallel,
            "workers": args.parallel if mode == "workers" else None,
        },
    )


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()


def shard_job_seconds(run_dir: Path, index: int) -> tuple[float, int]:
    """A shard's job time from its shard.log, every attempt: each "start: attempt" line to the attempt's "sealed:" or
    "FAILED:" line (both written after its teardown); and how many attempts started the policy."""
    total, start, starts = 0.0, None, 0
    for raw in store.shard_log_path(run_dir, index).read_text().splitlines():
        m = LINE.match(raw)
        if not m:
            continue
        text = m.group(2)
        if text.startswith("start: attempt"):
            start = stamp(m.group(1))
        elif text.startswith("policy ready in"):
            starts += 1
        elif text.startswith(("sealed: ", "FAILED: ")) and start is not None:
            total += stamp(m.group(1)) - start
            start = None
    return total, starts


def measure(run_dir: Path, mode: str, wall: float, shards: int) -> dict:
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in range(shards)]
    collecting = sum(float(m["collect_s"]) for m in markers)
    if mode == "workers":
        states = worker.read_states(run_dir)
        job_s = sum((s.ended_at or time.time()) - s.started_at for s in states)
        starts = sum(s.server_starts for s in states)
        jobs = len(states)
    else:
        spans = [shard_job_seconds(run_dir, i) for i in range(shards)]
        job_s = sum(t for t, _ in spans)
        starts = sum(n for _, n in spans)
        jobs = shards
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "job_s": round(job_s, 1),
        "server_starts": starts,
        "collecting_s": round(collecting, 1),
        "utilization": round(collecting / job_s, 3) if job_s > 0 else None,
        "jobs": jobs,
        "rollouts": sum(int(m["num_rollouts"]) for m in markers),
    }


def one_run(mode: str, args: argparse.Namespace, gym_venv: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-workers-{mode}-") as tmp:
        cfg = write_config(Path(tmp), mode, args, gym_venv)
        env = {**os.environ, harness.API_KEY_ENV: harness.API_KEY}
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "shardrun.cli", "submit", str(cfg)]
        resumes = 0
        while True:  # shards that failed (a Gym stack that did not start on a loaded machine) are resumed; it counts
            done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            if done.returncode != 4 or resumes >= args.max_resumes:
                sys.exit(f"{mode}: {cmd[3]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            resumes += 1
            print(f"{mode}: {done.stdout.count(': failed (')} shard(s) failed; resume {resumes}", flush=True)
            cmd = [sys.executable, "-m", "shardrun.cli", "resume", str(Path(tmp) / "run"), "cluster.max_attempts=100"]
        wall = time.monotonic() - t0
        result = measure(Path(tmp) / "run", mode, wall, args.shards) | {"resumes": resumes}
        print(f"{mode}: {result}", flush=True)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy-startup-s", type=float, default=30.0, help="seconds the stand-in policy takes to load")
    ap.add_argument("--policy-delay-s", type=float, default=5.0, help="seconds per answer (generation)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=2, help="shard jobs at once, and the number of workers")
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--parallel-rollouts", type=int, default=2, help="gym.num_samples_in_parallel")
    ap.add_argument("--only", choices=("per-shard", "workers"), help="run one of the two")
    ap.add_argument("--max-resumes", type=int, default=3, help="resumes of a run whose shards failed")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    venv = os.environ.get("SHARDRUN_GYM_VENV") or str(Path.home() / ".cache/shardrun/gym-venv")
    gym_venv = Path(venv)
    if not (gym_venv / ".shardrun-ok").exists():
        sys.exit(f"no NeMo Gym venv at {gym_venv}; run ./scripts/setup.sh gym")
    load = os.getloadavg()[0]
    modes = [args.only] if args.only else ["per-shard", "workers"]
    results = {m: one_run(m, args, gym_venv) for m in modes}
    print(
        f"\n{args.shards} shards x {args.tasks * args.repeats // args.shards} rollouts, {args.parallel} at a time; "
        f"policy start-up {args.policy_startup_s:g} s, {args.policy_delay_s:g} s per answer; load average {load:.1f}"
    )
    print(f"{'':<12}{'wall':>9}{'job-s':>9}{'server starts':>15}{'collecting-s':>14}{'utilization':>13}")
    for m, r in results.items():
        print(
            f"{m:<12}{r['wall_s']:>8.0f}s{r['job_s']:>8.0f}s{r['server_starts']:>15}{r['collecting_s']:>13.0f}s"
            f"{r['utilization']:>13.2f}"
        )
    verdict = {}
    if len(results) == 2:
        w, p = results["workers"], results["per-shard"]
        verdict = {
            "wall_ratio": round(w["wall_s"] / p["wall_s"], 3),
            "wall_ratio_ok": w["wall_s"] <= 0.5 * p["wall_s"],
            "utilization_ok": (w["utilization"] or 0) >= 0.7,
            "server_starts_ok": w["server_starts"] == args.parallel,
        }
        print(
            f"\ntargets: workers' wall / per-shard wall = {verdict['wall_ratio']:.2f} (<= 0.5: "
            f"{'met' if verdict['wall_ratio_ok'] else 'NOT met'}); workers' utilization {w['utilization']:.2f} "
            f"(>= 0.7: {'met' if verdict['utilization_ok'] else 'NOT met'}); server starts {w['server_starts']} "
            f"(= {args.parallel} workers: {'met' if verdict['server_starts_ok'] else 'NOT met'})"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "load": load, **results, "targets": verdict},
                indent=2,
                default=str,
            )
        )
    return 0 if all(v for k, v in verdict.items() if k.endswith("_ok")) else 1


if __name__ == "__main__":
    sys.exit(main())
