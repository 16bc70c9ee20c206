#!/usr/bin/env python3
"""Benchmark: `shardrun status` on 1,000 synthetic shards, and the sbatch calls for 2,500 shards.

    .venv/bin/python scripts/bench_status.py                  # both; uses the local Slurm if it runs (see below)
    .venv/bin/python scripts/bench_status.py --shards 1000 --submit-shards 2500 --max-array-size 1001

1. status. A planned run of N shards x 16 rollouts in Gym's format (tests/builders.py): 60% sealed, 25% part-way
   (a quarter of them with a torn last line), 5% failed with an error record, 10% never started; one Slurm launch
   record for the launched ones, so status makes its real squeue call (and one sacct call) when Slurm answers.
   Prints the time of `shardrun status RUN_DIR` as a command (process start included) and in-process.
   Target: under 1 s for 1,000 shards.
2. labels (`--label-shards N`, 0 skips it). A blend of 8 labels over N sealed shards, rows of `--row-kb` KB (Gym's
   rows hold the whole conversation): `status` with seals that count their rollouts per label (`label_rollouts`,
   what a shard writes now) against the same seals without it (what status parsed before: every sealed shard's
   rows), and the rows-only cost it keeps (each seal's file is still counted, `rundir/seal.against_file`).
3. sbatch calls. Submits M shards with MaxArraySize 1001 to the local Slurm through launch.submit_shards, every job
   held (--hold) and cancelled at once, counting sbatch calls with a PATH shim around the real sbatch.
   Target for 2,500 shards: 3 (plus 1 for the merge job). Without Slurm it counts the scripts `submit --dry-run`
   renders instead, and says so.

Slurm: set SLURM_CONF (`eval "$(scripts/local-slurm.sh start)"`); with --start-slurm the bench starts the local
cluster itself through scripts/local-slurm.sh (stop it with `scripts/local-slurm.sh stop`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from blendkit import make_blend_run
from builders import input_rows, make_run, rollout_row, seal_shard, write_shard

from shardrun.launch import status
from shardrun.rundir import store


def slurm_available() -> bool:
    return (
        shutil.which("squeue") is not None
        and shutil.which("sbatch") is not None
        and subprocess.run(["squeue", "--noheader", "--name=nothing"], capture_output=True, timeout=30).returncode == 0
    )


def start_slurm() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "local-slurm.sh"), "start"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line[7:].partition("=")
            os.environ[key] = value


def synthetic_run(tmp: Path, shards: int):
    run = make_run(tmp, input_rows(shards * 4, agents=("math",)), num_repeats=4, num_shards=shards)
    jobs = {}
    n_sealed, n_partial, n_failed = int(shards * 0.60), int(shards * 0.25), int(shards * 0.05)
    for i in range(shards):
        if i < n_sealed:
            write_shard(run, i, seed=i)
        elif i < n_sealed + n_partial:
            write_shard(run, i, missing=6, torn=i % 4 == 0, seal_it=False, seed=i)
        elif i < n_sealed + n_partial + n_failed:
            write_shard(run, i, missing=12, seal_it=False, seed=i)
            store.atomic_write_json(
                store.shard_failure_path(run.run_dir, i),
                {"job_id": f"900001_{i}", "error": "ServerFailure: vLLM exited with code 1"},
            )
        else:
            continue  # never started
        jobs[str(i)] = f"900001_{i}"
    store.append_launch(
        run.run_dir,
        {
            "executor": "slurm",
            "submitted_at": time.time() - 3600,
            "host": "bench",
            "tag": "shardrun-bench0000",
            "merge_job_name": "shardrun-bench0000-merge",
            "arrays": ["900001"],
            "jobs": jobs,
            "max_attempts": 3,
            "gpus_per_shard": 8,
            "done_at_submit": 0,
        },
    )
    return run


def bench_status(shards: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        t0 = time.perf_counter()
        run = synthetic_run(Path(tmp), shards)
        built = time.perf_counter() - t0
        live = "real squeue + sacct" if slurm_available() else "squeue unavailable: no Slurm call"
        inproc = []
        for _ in range(repeats):
            t = time.perf_counter()
            st = status.collect(run.run_dir)
            status.render(st)
            inproc.append(time.perf_counter() - t)
        cli = []
        for args in (["status", str(run.run_dir)], ["status", str(run.run_dir), "--json"]):
            for _ in range(repeats):
                t = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "shardrun.cli", *args], capture_output=True, check=True, timeout=120
                )
                cli.append((args[-1] == "--json", time.perf_counter() - t))
        text_s = statistics.median(t for j, t in cli if not j)
        json_s = statistics.median(t for j, t in cli if j)
        startup = []
        for _ in range(repeats):
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-c", "import shardrun.cli, shardrun.launch.status"], check=True, timeout=120
            )
            startup.append(time.perf_counter() - t)
        print(
            f"status: {shards:,} shards x 16 rollouts ({st.counts}), {live}; run built in {built:.1f} s; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        print(
            f"  shardrun status RUN_DIR         {text_s * 1000:7.0f} ms  (command, median of {repeats}; "
            f"target < 1000 ms: {'OK' if text_s < 1 else 'MISSED'})"
        )
        print(f"  shardrun status RUN_DIR --json  {json_s * 1000:7.0f} ms")
        print(f"  status.collect + render         {statistics.median(inproc) * 1000:7.0f} ms  (in-process)")
        print(f"  python start + imports          {statistics.median(startup) * 1000:7.0f} ms  (of the command's time)")


def bench_labels(shards: int, row_kb: int, repeats: int) -> None:
    labels = [(f"env{i}", "a" if i % 2 else "b", shards * 2) for i in range(8)]  # 16 tasks x 8 repeats a shard
    with tempfile.TemporaryDirectory(prefix="bench-labels-") as tmp:
        run = make_blend_run(Path(tmp), labels, num_repeats=8, num_shards=shards)
        pad = "x" * (row_kb * 1024)
        for i in range(shards):
            rows = [rollout_row(m) | {"output_text": pad} for m in run.materialized(i)]
            path = store.rollouts_path(run.run_dir, i)
            path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            seal_shard(run, i, hours=1 / 60, label_rollouts=run.plan.label_counts([r["_ng_task_index"] for r in rows]))
        size = sum(store.rollouts_path(run.run_dir, i).stat().st_size for i in range(shards))

        def timed() -> float:
            took = []
            for _ in range(repeats):
                t = time.perf_counter()
                st = status.collect(run.run_dir)
                took.append(time.perf_counter() - t)
            assert st.counts["sealed"] == shards and sum(r["collected"] for r in st.labels) == run.plan.num_rollouts
            return statistics.median(took)

        counted = timed()
        rows_only = statistics.median(
            timed_call(lambda: [store.count_complete_lines(store.rollouts_path(run.run_dir, i)) for i in range(shards)])
            for _ in range(repeats)
        )
        for i in range(shards):  # the same seals as they were before seals counted labels
            path = store.done_path(run.run_dir, i)
            path.write_bytes(
                orjson.dumps({k: v for k, v in orjson.loads(path.read_bytes()).items() if k != "label_rollouts"})
            )
        parsed = timed()
        print(
            f"labels: a blend of {len(labels)} labels, {shards:,} sealed shards x 128 rollouts of {row_kb} KB "
            f"({size / 1e9:.2f} GB); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
        print(f"  status.collect, seals count labels  {counted * 1000:7.0f} ms  (median of {repeats})")
        print(f"  status.collect, every row parsed    {parsed * 1000:7.0f} ms  (seals without label_rollouts)")
        print(f"  of which counting the sealed rows   {rows_only * 1000:7.0f} ms  (the seal check both keep)")


def timed_call(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


SHIM = """#!/bin/sh
echo "$@" >> {log}
exec {real} "$@"
"""


def bench_sbatch_calls(shards: int, max_array_size: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-sbatch-") as tmp:
        tmp = Path(tmp)
        src = tmp / "input.jsonl"
        src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in input_rows(shards)))
        cfg_path = tmp / "run.yaml"
        cfg_path.write_text(
            yaml.safe_dump(
                {
                    "input_jsonl": str(src),
                    "run_dir": str(tmp / "run"),
                    "num_repeats": 1,
                    "sharding": {"num_shards": shards},
                    "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
                    "policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
                    "cluster": {
                        "executor": "slurm",
                        "partition": os.environ.get("SLURM_LOCAL_PARTITION", "debug"),
                        "max_array_size": max_array_size,
                        "array_parallelism": 64,
                        "time_limit": "00:10:00",
                        "cpus_per_task": 1,
                        "mem_gb": 1,
                        "additional_parameters": {"hold": True},
                    },
                }
            )
        )
        if not slurm_available():
            out = subprocess.run(
                [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path), "--dry-run"],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            ).stdout
            n = out.count("# ---- sbatch script for array")
            print(
                f"sbatch calls: {shards:,} shards, MaxArraySize {max_array_size}: {n} arrays + 1 merge job "
                f"(counted from `submit --dry-run`: no Slurm here; target 3)"
            )
            return
        shim_dir = tmp / "shim"
        shim_dir.mkdir()
        log = tmp / "sbatch-calls.log"
        (shim_dir / "sbatch").write_text(SHIM.format(log=log, real=shutil.which("sbatch")))
        (shim_dir / "sbatch").chmod(0o755)
        env = dict(os.environ, PATH=f"{shim_dir}:{os.environ['PATH']}")
        t = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        took = time.perf_counter() - t
        subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "cancel", str(tmp / "run")], capture_output=True, timeout=300
        )
        if out.returncode != 0:
            raise SystemExit(f"submit failed:\n{out.stdout}\n{out.stderr}")
        calls = log.read_text().splitlines() if log.exists() else []
        rec = store.read_launches(tmp / "run")[-1]
        arrays = len(rec["arrays"])
        print(
            f"sbatch calls: {shards:,} shards, MaxArraySize {max_array_size}: {len(calls)} sbatch calls = "
            f"{arrays} job arrays + {len(calls) - arrays} merge job (real Slurm, jobs held then cancelled; "
            f"target 3 arrays: {'OK' if arrays == 3 else 'MISSED'}); submit took {took:.1f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--label-shards", type=int, default=200, help="sealed shards of the blend (0: skip)")
    p.add_argument("--row-kb", type=int, default=8, help="padding per rollout row in the blend, KB")
    p.add_argument("--submit-shards", type=int, default=2500)
    p.add_argument("--max-array-size", type=int, default=1001)
    p.add_argument("--start-slurm", action="store_true", help="start the local Slurm (scripts/local-slurm.sh) first")
    args = p.parse_args()
    if args.start_slurm:
        start_slurm()
    if args.shards:
        bench_status(args.shards, args.repeats)
    if args.label_shards:
        bench_labels(args.label_shards, args.row_kb, args.repeats)
    if args.submit_shards:
        bench_sbatch_calls(args.submit_shards, args.max_array_size)


if __name__ == "__main__":
    main()
