#!/usr/bin/env python3
"""Slot occupancy of one warm worker over many small shards: its collector service and pipeline against today's
one collector process per shard, one shard at a time.

    .venv/bin/python scripts/bench_occupancy.py [--shards 12] [--rollouts 16] [--slots 8] [--pipeline-shards N]
        [--rollouts-per-slot R] [--case small|large|both] [--repeat N] [--json OUT]

One warm worker (local executor, the real NeMo Gym stack from $SHARDRUN_GYM_VENV) runs `--shards` shards of
`--rollouts` rollouts (the math rows of examples/arith x repeats) with gym.num_samples_in_parallel = `--slots`.
The policy is the stand-in server (tests/fakes/policy_server.py, started by the worker as a self-hosted policy)
with a heavy-tailed latency: `--delay-s` per answer, and one (prompt, seed) in `1/--tail-share` takes `--tail-s`
more. The stand-in writes every answered request's start and end, so what is printed is what the policy saw:

    occupancy   summed request time / (slots x span), span = first request's start to the last one's end
    span        the collecting time as the policy saw it, against its lower bound:
                max(summed request time / slots, the longest request)
    wall        submit to the worker's end (servers' start-up and teardown included)
    empty slots the slot-seconds no request filled, before the slots first fill, in the middle (shard boundaries, a
                stack that cannot keep up) and after the last request started (the end of the run)
    cpu         the machine's busy share during the span (from /proc/stat) and the CPU seconds of the bench's own
                processes by role (stand-in policy, collector service, each Gym server, the worker): where the cores went
    worker occ. the worker's own figure (worker.json: its slot gate's request-seconds / (slots x time a shard was
                held)), what `shardrun status` and the report show

each for the worker as it is (collector.service on, collector.pipeline_shards = `--pipeline-shards` and
collector.rollouts_per_slot = `--rollouts-per-slot`, defaults the config's) and as it was (`collector.service: false`, `collector.pipeline_shards: 1`: a collector process per shard, one
shard after another; shown as pipeline 0). `--case large`: the same rollouts in one shard (the pipeline must be
no worse); `both` runs both cases.
Target (issue #22): occupancy >= 0.85 with the pipeline on the small case; on the large case no worse than today (pipeline 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from shardrun.core.config import CollectorConfig
from shardrun.rundir import records
from tests import builders
from tests.fakes import harness
from tests.faults import gymkit

MATH_AGENT = "math_with_judge_simple_agent"


def write_config(tmp: Path, shards: int, depth: int, args: argparse.Namespace, gym_venv: Path) -> Path:
    rows = [r for r in (ROOT / "examples/arith/input.jsonl").read_text().splitlines() if MATH_AGENT in r]
    total = args.shards * args.rollouts
    repeats = max(1, -(-total // len(rows)))
    tasks = total // repeats
    if tasks * repeats != total or tasks > len(rows):
        sys.exit(f"--shards x --rollouts = {total} must be a multiple of at most {len(rows)} tasks x repeats")
    (tmp / "input.jsonl").write_text("".join(r + "\n" for r in rows[:tasks]))
    stand_in = [
        sys.executable,
        str(harness.FAKE),
        f"--delay={args.delay_s:g}",  # one word each: a bare number would be typed by the config
        f"--tail-share={args.tail_share:g}",
        f"--tail-delay={args.tail_s:g}",
        f"--answer-log={tmp / 'answers.jsonl'}",
        "--correct-share=0.5",
    ]
    return builders.write_config(
        tmp / "run.yaml",
        tmp / "input.jsonl",
        tmp / "run",
        repeats=repeats,
        shards=shards,
        gym={
            "config_paths": gymkit.CONFIG_PATHS,
            "venv": str(gym_venv),
            "num_samples_in_parallel": args.slots,
            "stall_timeout_s": 600,
            "ready_timeout_s": 900,
        },
        policy={
            "api_key_env": harness.API_KEY_ENV,
            "vllm": {"model": "stand-in", "served_model_name": "fake-model", "command": stand_in},
        },
        cluster={"executor": "local", "workers": 1},
        collector={
            "pipeline_shards": max(depth, 1),
            "service": depth > 0,  # 0: the behaviour before #22, a collector process per shard
            "rollouts_per_slot": args.rollouts_per_slot,  # the service's; a collector process has slots rollouts
        },
    )


ROLES = (  # what a process is, by a word of its command line; the first that matches names it
    ("policy_server", "stand-in policy"),
    ("collector_service", "collector service"),
    (" eval run", "collector process (gym eval run)"),
    ("ng_collect_rollouts", "collector process (ng_collect_rollouts)"),
    ("SHARDRUN_REDACT", "log redaction pipe"),
    (" env start", "Gym head (gym env start)"),
    ("ng_run", "Gym head (ng_run)"),
    ("responses_api_agents", "Gym agent server"),
    ("responses_api_models", "Gym model server"),
    ("resources_servers", "Gym resources server"),
    ("/ray/", "Ray (started by Gym)"),
    ("ray::", "Ray (started by Gym)"),
    ("ray-dashboard", "Ray (started by Gym)"),
    ("shardrun", "shardrun worker"),
    ("submitit", "shardrun worker"),
)


class CpuWatch(threading.Thread):
    """Samples /proc every half second: the machine's busy share (timestamped, to cut it to the policy's span) and the
    CPU seconds of each process under the bench, by role, so the figures say where the cores went."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(daemon=True)
        self.tmp, self.stop = str(tmp), threading.Event()
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.samples: list[tuple[float, float, float]] = []  # (wall time, busy jiffies, total jiffies)
        self.by_pid: dict[int, tuple[str, float]] = {}

    def run(self) -> None:
        while not self.stop.wait(0.5):
            fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
            self.samples.append((time.time(), sum(fields) - idle, sum(fields)))
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                role = next((name for word, name in ROLES if word in cmd), None)
                if role is None or (self.tmp not in cmd and not self._ours(proc)):  # another run's: not counted
                    continue
                self.by_pid[int(proc.name)] = (role, (float(stat[11]) + float(stat[12])) / self.ticks)

    def _ours(self, proc: Path) -> bool:
        try:
            return self.tmp in (proc / "cwd").resolve().as_posix() or self.tmp in (proc / "environ").read_text(
                errors="replace"
            )
        except OSError:
            return False

    def busy_share(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        busy, total = inside[-1][1] - inside[0][1], inside[-1][2] - inside[0][2]
        return round(busy / total, 3) if total else None

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, seconds in self.by_pid.values():
            out[role] = round(out.get(role, 0.0) + seconds, 1)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def idle_slot_seconds(answered: list[dict], slots: int) -> dict[str, float]:
    """Where the empty slot-seconds of the span lie: before the slots first fill ("start"), after the last request
    started, when nothing is left to start ("end"), and in between ("middle": shard boundaries, the worker's own
    pauses, a stack that cannot keep up)."""
    events = sorted([(a["t0"], 1) for a in answered] + [(a["t1"], -1) for a in answered])
    first, last_start = events[0][0], max(a["t0"] for a in answered)
    steps = list(_steps(events))
    full = next((t for t, n in steps if n >= slots), last_start)
    idle = {"start": 0.0, "middle": 0.0, "end": 0.0}
    for (t, n), (t_next, _) in zip(steps, steps[1:]):
        for lo, hi, part in ((first, full, "start"), (full, last_start, "middle"), (last_start, t_next, "end")):
            a, b = max(t, lo), min(t_next, hi)
            if b > a:
                idle[part] += max(0, slots - n) * (b - a)
    return {k: round(v, 1) for k, v in idle.items()}


def _steps(events: list[tuple[float, int]]):
    """(time, requests in flight from then on) at each change."""
    n = 0
    for t, d in events:
        n += d
        yield t, n


def measure(tmp: Path, wall: float, slots: int, watch: CpuWatch) -> dict:
    answered = [json.loads(line) for line in (tmp / "answers.jsonl").read_text().splitlines() if line.strip()]
    busy = sum(a["t1"] - a["t0"] for a in answered)
    span = max(a["t1"] for a in answered) - min(a["t0"] for a in answered)
    bound = max(busy / slots, max(a["t1"] - a["t0"] for a in answered))
    [state] = records.read_worker_states(tmp / "run")
    held = state.holding_s or sum(state.collecting_s.values())
    return {
        "requests": len(answered),
        "occupancy": round(busy / (slots * span), 3),
        "span_s": round(span, 1),
        "lower_bound_s": round(bound, 1),
        "wall_s": round(wall, 1),
        "worker_occupancy": round(state.request_s / (slots * held), 3) if held > 0 else None,
        "idle_slot_s": idle_slot_seconds(answered, slots),
        "cpu_busy_in_span": watch.busy_share(min(a["t0"] for a in answered), max(a["t1"] for a in answered)),
        "cpu_s_by_role": watch.cpu_by_role(),
    }


def one_run(shards: int, depth: int, args: argparse.Namespace, gym_venv: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-occupancy-{shards}-{depth}-") as tmp:
        cfg = write_config(Path(tmp), shards, depth, args, gym_venv)
        env = {**os.environ, harness.API_KEY_ENV: harness.API_KEY}
        watch = CpuWatch(Path(tmp))
        watch.start()
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg)], cwd=tmp, env=env, capture_output=True, text=True
        )
        wall = time.monotonic() - t0
        watch.stop.set()
        watch.join()
        if done.returncode != 0:
            sys.exit(f"submit failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = {"shards": shards, "pipeline_shards": depth} | measure(Path(tmp), wall, args.slots, watch)
        print(result, flush=True)
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--rollouts", type=int, default=16, help="rollouts per shard (small case)")
    ap.add_argument("--slots", type=int, default=8, help="gym.num_samples_in_parallel")
    ap.add_argument("--delay-s", type=float, default=0.15, help="seconds per answer")
    ap.add_argument("--tail-share", type=float, default=0.125, help="share of answers that take --tail-s more")
    ap.add_argument("--tail-s", type=float, default=3.0)
    ap.add_argument(
        "--pipeline-shards",
        type=int,
        default=CollectorConfig().pipeline_shards,
        help="collector.pipeline_shards of the pipelined run (default: the config's)",
    )
    ap.add_argument(
        "--rollouts-per-slot",
        type=float,
        default=CollectorConfig().rollouts_per_slot,
        help="collector.rollouts_per_slot of the pipelined run (default: the config's; 1: a rollout holds its slot "
        "through its agent and verification steps)",
    )
    ap.add_argument("--case", choices=("small", "large", "both"), default="small")
    ap.add_argument("--only", choices=("pipeline", "baseline"), help="run only one of the two settings")
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs of each setting, alternated (the targets take the medians)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    gym_venv = Path(os.environ.get("SHARDRUN_GYM_VENV") or str(Path.home() / ".cache/shardrun/gym-venv"))
    if not (gym_venv / ".shardrun-ok").exists():
        sys.exit(f"no NeMo Gym venv at {gym_venv}; run ./scripts/setup.sh gym")
    load = os.getloadavg()[0]
    cases = {"small": [args.shards], "large": [1], "both": [args.shards, 1]}[args.case]
    depths = {"pipeline": [args.pipeline_shards], "baseline": [0], None: [args.pipeline_shards, 0]}[args.only]
    results = [one_run(n, d, args, gym_venv) for n in cases for _ in range(args.repeat) for d in depths]
    print(
        f"\none worker, {args.shards * args.rollouts} rollouts, {args.slots} slots; answers {args.delay_s:g} s, "
        f"1 in {1 / args.tail_share:g} takes {args.tail_s:g} s more; load average {load:.1f}; pipelined: "
        f"{args.rollouts_per_slot:g} rollouts in flight per slot"
    )
    print(f"{'shards':>7}{'pipeline':>9}{'occupancy':>11}{'span':>8}{'bound':>8}{'wall':>8}{'worker occ.':>13}")
    for r in results:
        print(
            f"{r['shards']:>7}{r['pipeline_shards']:>9}{r['occupancy']:>11.2f}{r['span_s']:>7.1f}s"
            f"{r['lower_bound_s']:>7.1f}s{r['wall_s']:>7.0f}s{r['worker_occupancy'] or 0:>13.2f}"
        )
    print("\nwhere the cores went (2 cores x span is the most there is; busy share of the whole machine in the span):")
    for r in results:
        roles = ", ".join(f"{k} {v:.0f} s" for k, v in r["cpu_s_by_role"].items())
        print(f"  {r['shards']} shard(s), pipeline {r['pipeline_shards']}: busy {r['cpu_busy_in_span']}; {roles}")
    print("\nempty slot-seconds in the span (before the slots first fill / between / after the last request started):")
    for r in results:
        i = r["idle_slot_s"]
        print(f"  {r['shards']} shard(s), pipeline {r['pipeline_shards']}: {i['start']} / {i['middle']} / {i['end']}")
    by: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        by.setdefault((r["shards"], r["pipeline_shards"]), []).append(r)

    def median(key: tuple[int, int], field: str) -> float:
        return statistics.median(r[field] for r in by[key])

    if args.repeat > 1:
        print(
            "\nmedians:",
            {f"{n} shard(s), pipeline {d}": {f: median((n, d), f) for f in ("occupancy", "span_s")} for n, d in by},
        )
    verdict = {}
    if (args.shards, args.pipeline_shards) in by:
        verdict["small_occupancy_ok"] = median((args.shards, args.pipeline_shards), "occupancy") >= 0.85
    if (1, args.pipeline_shards) in by and (1, 0) in by:
        verdict["large_no_worse_ok"] = median((1, args.pipeline_shards), "span_s") <= 1.05 * median((1, 0), "span_s")
    print("targets:", verdict)
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args), "load": load, "runs": results, "targets": verdict}, indent=2, default=str)
        )
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
