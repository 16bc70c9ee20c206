#!/usr/bin/env python3
"""What deciding at shard start costs as a run grows (adaptive sampling, #16), read from files only: no servers.

    .venv/bin/python scripts/bench_decide.py [--tasks 5000] [--repeats 16] [--wave 2] [--shards 64] [--row-kb 4]

Plans an adaptive run (`sampling.stop_when_decided: {drop_solved: true, drop_unsolved: true}`, wave-major) with the
real planner, then walks its shards in index order as the array runs them. Before each shard it decides, and then it
writes the shard's rollouts (the rows not skipped, each padded to `--row-kb` KiB as a model's response makes it;
task i is solved with a fixed pass rate). Each decision is made twice on the same files:

    fresh   what a shard job does: read every shard's rollouts and failures sidecar from the start
    kept    what a warm worker does: one `decided.RunRollouts` for its life, reading only what was appended

Both must decide the same (checked at every shard). Printed: seconds and MiB read in all, and for the last shard.
Target: `kept` reads each byte once (MiB read equal to the rollouts of every shard but the last, which is written
after the last decision), so its total grows with the run's size, where `fresh` grows with shards x size.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson
import yaml

from shardrun.core import config
from shardrun.rundir import decided, store


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--wave", type=int, default=2)
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--row-kb", type=float, default=4.0, help="size of a rollout row in KiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    rates = [rng.betavariate(0.5, 0.5) for _ in range(args.tasks)]
    pad = "x" * int(args.row_kb * 1024)
    with tempfile.TemporaryDirectory(prefix="bench-decide-") as tmp_name:
        tmp = Path(tmp_name)
        inp = tmp / "input.jsonl"
        inp.write_bytes(
            b"".join(
                orjson.dumps(
                    {
                        "responses_create_params": {"input": [{"role": "user", "content": f"task {i}"}]},
                        "agent_ref": {"name": "math_agent"},
                    }
                )
                + b"\n"
                for i in range(args.tasks)
            )
        )
        cfg_path = tmp / "run.yaml"
        cfg_path.write_text(
            yaml.safe_dump(
                {
                    "input_jsonl": str(inp),
                    "run_dir": str(tmp / "run"),
                    "num_repeats": args.repeats,
                    "sharding": {"num_shards": args.shards},
                    "sampling": {"stop_when_decided": {"drop_solved": True, "drop_unsolved": True}, "wave": args.wave},
                }
            )
        )
        cfg = config.load(cfg_path)
        plan, _ = store.write_plan(cfg)
        run_dir = cfg.run_dir
        known = decided.RunRollouts(run_dir, plan, "reward")
        fresh_s = kept_s = 0.0
        fresh_bytes = 0
        last: dict[str, float] = {}
        run_rollouts = skipped = 0
        for spec in plan.shards:
            t0 = time.perf_counter()
            reader = decided.RunRollouts(run_dir, plan, "reward")
            fresh = decided.decide_shard(run_dir, plan, spec.index, max_attempts=3, known=reader)
            t1 = time.perf_counter()
            before = known.bytes_read
            kept = decided.decide_shard(run_dir, plan, spec.index, max_attempts=3, known=known)
            t2 = time.perf_counter()
            if (kept.skip, kept.verdicts) != (fresh.skip, fresh.verdicts):
                print(f"FAIL: shard {spec.index}: the kept reader decided otherwise than a fresh read")
                return 1
            fresh_s, kept_s, fresh_bytes = fresh_s + (t1 - t0), kept_s + (t2 - t1), fresh_bytes + reader.bytes_read
            last = {"fresh_s": t1 - t0, "kept_s": t2 - t1, "fresh_mib": reader.bytes_read / 2**20}
            last["kept_mib"] = (known.bytes_read - before) / 2**20
            out = []
            for row in store.iter_jsonl_objects(store.materialized_path(run_dir, spec.index)):
                key = (row["_ng_task_index"], row["_ng_rollout_index"])
                if key in fresh.skip:
                    skipped += 1
                    continue
                solved = random.Random(hash(key)).random() < rates[key[0]]
                out.append(orjson.dumps({**row, "reward": 1.0 if solved else 0.0, "response": pad}) + b"\n")
            store.rollouts_path(run_dir, spec.index).write_bytes(b"".join(out))
            run_rollouts += len(out)
        size = sum(store.rollouts_path(run_dir, s.index).stat().st_size for s in plan.shards) / 2**20
        # what the last start could read: every shard but the last, written after it
        readable = size - store.rollouts_path(run_dir, plan.shards[-1].index).stat().st_size / 2**20
    result = {
        "tasks": args.tasks,
        "repeats": args.repeats,
        "shards": args.shards,
        "rollouts_written": run_rollouts,
        "rollouts_skipped": skipped,
        "run_mib": round(size, 1),
        "fresh_total_s": round(fresh_s, 2),
        "fresh_total_mib": round(fresh_bytes / 2**20, 1),
        "kept_total_s": round(kept_s, 2),
        "kept_total_mib": round(known.bytes_read / 2**20, 1),
        "last_shard": {k: round(v, 3) for k, v in last.items()},
    }
    print(
        f"adaptive run: {args.tasks} tasks x {args.repeats} repeats in {args.shards} shards, {run_rollouts} rollouts "
        f"written ({skipped} skipped as decided), {size:.1f} MiB of rollouts"
    )
    print(f"  fresh (a shard job per shard): {fresh_s:8.2f} s in all, {fresh_bytes / 2**20:9.1f} MiB read")
    print(f"  kept  (one warm worker):       {kept_s:8.2f} s in all, {known.bytes_read / 2**20:9.1f} MiB read")
    print(
        f"  the last shard's start: fresh {last['fresh_s']:.2f} s ({last['fresh_mib']:.1f} MiB), "
        f"kept {last['kept_s']:.3f} s ({last['kept_mib']:.1f} MiB)"
    )
    once = abs(known.bytes_read / 2**20 - readable) < 0.01
    print(f"{'PASS' if once else 'FAIL'}: the kept reader read each byte once ({known.bytes_read / 2**20:.1f} MiB)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if once else 1


if __name__ == "__main__":
    sys.exit(main())
