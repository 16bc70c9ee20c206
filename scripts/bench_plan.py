#!/usr/bin/env python3
"""Benchmark: plan and materialize a generated N-task x R-repeat input; print wall time, rows/s, peak RSS.

    .venv/bin/python scripts/bench_plan.py                       # 100k and 1M tasks x 16 repeats
    .venv/bin/python scripts/bench_plan.py --tasks 100000 --repeats 16 --shards 64 --slicing round_robin

Each size runs `shardrun plan --write` in a fresh child process, so peak RSS is that process's own.
Target (2-core machine): 1M x 16 in under 60 s, and peak RSS that does not grow with the task count.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent


def generate(path: Path, tasks: int) -> None:
    with open(path, "wb") as f:
        buf = []
        for i in range(tasks):
            agent = "math_with_judge_simple_agent" if i % 5 else "example_single_tool_call_simple_agent"
            buf.append(
                orjson.dumps(
                    {
                        "responses_create_params": {
                            "input": [{"role": "user", "content": f"What is {i % 97} + {i % 13}?"}],
                            "max_output_tokens": 256,
                        },
                        "question": f"What is {i % 97} + {i % 13}?",
                        "expected_answer": str(i % 97 + i % 13),
                        "agent_ref": {"name": agent},
                    }
                )
                + b"\n"
            )
            if len(buf) == 10000:
                f.write(b"".join(buf))
                buf.clear()
        f.write(b"".join(buf))


def run_once(work: Path, tasks: int, repeats: int, shards: int, slicing: str) -> dict:
    inp = work / f"in-{tasks}.jsonl"
    generate(inp, tasks)
    run_dir = work / f"run-{tasks}"
    cfg = work / f"cfg-{tasks}.yaml"
    cfg.write_text(
        f"input_jsonl: {inp}\nrun_dir: {run_dir}\nnum_repeats: {repeats}\n"
        f"sharding: {{num_shards: {shards}, slicing: {slicing}}}\n"
    )
    code = (
        "import resource, sys; from shardrun.cli import app\n"
        "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, "plan", str(cfg), "--write"], capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - t0
    rss_kb = int(out.stdout.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    rows = tasks * repeats
    size = sum(p.stat().st_size for p in run_dir.rglob("*.jsonl"))
    shutil.rmtree(run_dir)
    inp.unlink()
    return {
        "tasks": tasks,
        "rollouts": rows,
        "wall_s": wall,
        "rows_per_s": rows / wall,
        "peak_rss_mb": rss_kb / 1024,
        "materialized_gb": size / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, nargs="*", default=[100_000, 1_000_000])
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--shards", type=int, default=256)
    ap.add_argument("--slicing", default="contiguous", choices=["contiguous", "round_robin"])
    ap.add_argument("--workdir", default=None, help="where to generate (default: a temp dir, removed after)")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardrun-bench-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{'tasks':>10} {'rollouts':>11} {'wall s':>8} {'rows/s':>11} {'peak RSS MB':>12} {'output GB':>10}")
    try:
        for n in args.tasks:
            r = run_once(work, n, args.repeats, args.shards, args.slicing)
            print(
                f"{r['tasks']:>10,} {r['rollouts']:>11,} {r['wall_s']:>8.1f} {r['rows_per_s']:>11,.0f} "
                f"{r['peak_rss_mb']:>12.0f} {r['materialized_gb']:>10.2f}",
                flush=True,
            )
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"(cpus: {os.cpu_count()}, slicing: {args.slicing}, shards: {args.shards}; target: 1M x 16 < 60 s, "
        f"peak RSS flat in task count)"
    )


if __name__ == "__main__":
    main()
