#!/usr/bin/env python
"""Benchmark `shardrun merge-and-profile` against NeMo Gym's `ng_reward_profile`, and print the targets of #11.

    .venv/bin/python scripts/bench_profile.py             # 20,000 tasks x 16 repeats (320k rollouts), 40 shards, + Gym
    .venv/bin/python scripts/bench_profile.py --scaling   # the same, then 1M, 3M and 10M rollouts (shardrun only)

Writes a planned run directory in a temp dir (removed at the end, also on failure): the input, the planner's
shard files, and for every shard a rollouts.jsonl of realistic rows (reward, a bool, a few numeric fields, a
`response` with ~200 characters of text and usage) in shuffled completion order, sealed. Then it times, each in
its own process (wall time, CPU time of the process and its workers from wait4, and peak memory): a raw orjson
parse of every shard file (the floor for any tool that reads them), `shardrun merge-and-profile`, and, when the
Gym venv exists, `ng_reward_profile` on the merged files, and checks that the two profiles are equal.

Targets (PASS/FAIL each): at 320k rollouts shardrun is at least 10x faster than Gym, by wall time and by CPU
time (shardrun's CPU time counts every worker process), with at most 1/5 of Gym's peak memory; with --scaling,
peak memory stays under 2 GiB at the largest size (10M), and time grows linearly: the CPU seconds per million
rollouts at the largest size are at most 1.25x those at the smallest (CPU time, not wall time, because the
machine may be shared; wall seconds are printed beside them). The exit status is 2 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from shardrun.core import config
from shardrun.plan import planner
from shardrun.rundir import store
from tests import builders

GYM_VENV = Path(os.environ.get("SHARDRUN_GYM_VENV", Path.home() / ".cache" / "shardrun" / "gym-venv"))
TEXT = (
    "Let me work through this step by step. First we restate the problem, then we compute each part and "
    "check it against the constraints given in the question before committing to a final answer. "
) * 40
ROW = (
    b'{"responses_create_params":{"input":[{"role":"user","content":"Compute %d + %d and give the answer '
    b'in a box."}],"metadata":{"extra_body":"{\\"seed\\": %d}"},"temperature":null,"max_output_tokens":null},'
    b'"response":{"id":"resp_%d_%d","object":"response","model":"policy","status":"completed","output":[{"type":'
    b'"message","role":"assistant","id":"msg_%d_%d","status":"completed","content":[{"type":"output_text","text":'
    b'"%s \\\\boxed{%d}","annotations":[]}]}],"usage":{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},'
    b'"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}},"reward":%s,'
    b'"expected_answer":"%d","extracted_answer":"%d","library_reward":%s,"is_correct":%s,"num_turns":%d,'
    b'"latency_s":%s,"judge_score":%s,"_ng_task_index":%d,"_ng_rollout_index":%d,'
    b'"agent_ref":{"name":"math_agent"}}\n'
)


def write_input(path: Path, tasks: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, tasks, 100_000):
            f.write(
                b"".join(
                    b'{"responses_create_params":{"input":[{"role":"user","content":"Compute %d + %d and give the '
                    b'answer in a box."}]},"question":"%d + %d","expected_answer":"%d","agent_ref":{"name":"math_agent"}}\n'
                    % (i, i, i, i, 2 * i)
                    for i in range(start, min(tasks, start + 100_000))
                )
            )


def identities(spec: planner.ShardSpec, repeats: int) -> np.ndarray:
    ordinals = (
        np.arange(spec.start, spec.stop)
        if spec.kind == "range"
        else np.arange(spec.offset, spec.offset + spec.step * spec.num_rollouts, spec.step)
    )
    return ordinals


def write_rollouts(path: Path, ordinals: np.ndarray, repeats: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ordinals = rng.permutation(ordinals)  # completion order
    n = len(ordinals)
    correct = rng.random(n) < 0.5
    cols = (
        rng.integers(20, 120, n),
        rng.integers(30, 800, n),
        rng.integers(1, 4, n),
        np.round(rng.uniform(0.3, 30, n), 3),
        np.round(rng.random(n), 4),
        rng.integers(0, 2000, n),
    )
    with open(path, "wb") as f:
        buf = []
        for o, ok, inp, out, turns, lat, judge, off in zip(
            ordinals.tolist(), correct.tolist(), *(c.tolist() for c in cols)
        ):
            t, r = divmod(o, repeats)
            reward = b"1.0" if ok else b"0.0"
            answer = 2 * t if ok else 2 * t + 1
            buf.append(
                ROW
                % (
                    t,
                    t,
                    r,
                    t,
                    r,
                    t,
                    r,
                    TEXT[off : off + 200].encode(),
                    answer,
                    inp,
                    out,
                    inp + out,
                    reward,
                    2 * t,
                    answer,
                    reward,
                    b"true" if ok else b"false",
                    turns,
                    repr(lat).encode(),
                    repr(judge).encode(),
                    t,
                    r,
                )
            )
            if len(buf) >= 20_000:
                f.write(b"".join(buf))
                buf.clear()
        f.write(b"".join(buf))


def seal_all(plan: planner.Plan, run_dir: Path) -> None:
    for spec in plan.shards:  # the tests' one writer of seals, an hour's collection each
        builders.seal_shard(
            run_dir,
            spec.index,
            plan=plan,
            started_at=0.0,
            finished_at=3600.0,
            host="bench",
            server_wait_s=0.0,
            collect_s=3600.0,
        )


def build(tmp: Path, rollouts: int, repeats: int, shards: int, slicing: str) -> Path:
    tasks = rollouts // repeats
    src = tmp / "input.jsonl"
    write_input(src, tasks)
    cfg = config.validate(
        {
            "input_jsonl": str(src),
            "run_dir": str(tmp / "run"),
            "num_repeats": repeats,
            "sharding": {"num_shards": shards, "slicing": slicing},
        }
    )
    plan, _ = store.write_plan(cfg)
    for spec in plan.shards:
        write_rollouts(store.rollouts_path(cfg.run_dir, spec.index), identities(spec, repeats), repeats, spec.index)
    seal_all(plan, cfg.run_dir)
    return cfg.run_dir


class Measured:
    """One command run in its own process: wall seconds, CPU seconds (user + system, its worker processes
    included), exit status, and peak memory in MiB: the larger of the biggest single process's peak RSS
    (getrusage) and the peak of the process tree's summed PSS (sampled every 100 ms from /proc)."""

    def __init__(self, cmd: list[str], cwd: Path | None = None):
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tree = 0.0
        while True:  # wait4 with WNOHANG: sample the tree while it runs, keep the child's own rusage at the end
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            self.tree = max(self.tree, _tree_pss_mib(proc.pid))
            time.sleep(0.1)
        self.wall = time.monotonic() - start
        proc.returncode = self.rc = os.waitstatus_to_exitcode(status)
        err = proc.stderr.read().decode() if proc.stderr else ""
        if self.rc != 0:
            print(err[-3000:], file=sys.stderr)
        self.cpu = usage.ru_utime + usage.ru_stime
        self.rss = max(usage.ru_maxrss / 1024, self.tree)

    def line(self, name: str) -> str:
        return f"{name:38s} {self.wall:8.1f} s wall  {self.cpu:8.1f} s CPU  {self.rss:8.0f} MiB peak RSS"


def _tree_pss_mib(pid: int) -> float:
    """Summed proportional set size (PSS) of a process and its descendants: memory the tree really uses, with
    pages shared between a forked worker and its parent counted once."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
    return total / 2**20


RAW_PARSE = """
import sys, orjson
n = 0
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        for line in f:
            orjson.loads(line)
            n += 1
print(n)
"""


SPEEDUP_TARGET = 10.0  # x Gym's wall time at 320k
MEMORY_TARGET = 0.2  # of Gym's peak memory at 320k
PEAK_TARGET_GIB = 2.0  # at the largest --scaling size
LINEAR_TARGET = 1.25  # CPU s per million rollouts, largest size / smallest size


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--slicing", choices=("contiguous", "round_robin"), default="contiguous")
    ap.add_argument("--no-gym", action="store_true", help="skip Gym's ng_reward_profile")
    ap.add_argument("--scaling", action="store_true", help="also time 1M, 3M and 10M rollouts (see --sizes)")
    ap.add_argument("--sizes", default="1000000,3000000,10000000", help="rollouts per --scaling run, comma-separated")
    ap.add_argument("--keep", type=Path, default=None, help="build under this directory and keep it")
    args = ap.parse_args()
    results: list[tuple[str, bool]] = []
    rollouts = args.tasks * args.repeats
    print(f"load average at the start: {os.getloadavg()[1]:.1f} (5 min) on {os.cpu_count()} CPUs")
    with bench_dir(args.keep) as tmp:
        run_dir, size, ours = build_and_merge(tmp, rollouts, args.repeats, args.shards, args.slicing, raw=True)
        if ours is None:
            return 1
        gym = GYM_VENV / "bin" / "ng_reward_profile"
        if args.no_gym or not gym.exists():
            print(f"Gym ng_reward_profile: skipped ({'--no-gym' if args.no_gym else f'{gym} not found'})")
        else:
            theirs = run_gym(gym, tmp, run_dir)
            if theirs.rc != 0:
                return 1
            speedup, cpu_speedup, memory = theirs.wall / ours.wall, theirs.cpu / ours.cpu, ours.rss / theirs.rss
            print(
                f"  shardrun / Gym: {ours.wall:.1f} / {theirs.wall:.1f} s wall, {ours.cpu:.1f} / {theirs.cpu:.1f} s CPU, "
                f"{ours.rss:.0f} / {theirs.rss:.0f} MiB peak memory"
            )
            results.append(
                (
                    f"at {rollouts:,} rollouts: {speedup:.1f}x faster than Gym by wall time and {cpu_speedup:.1f}x by "
                    f"CPU time (target >= {SPEEDUP_TARGET:.0f}x, both)",
                    min(speedup, cpu_speedup) >= SPEEDUP_TARGET,
                )
            )
            results.append(
                (
                    f"at {rollouts:,} rollouts: {memory:.3f} of Gym's peak memory (target <= {MEMORY_TARGET})",
                    memory <= MEMORY_TARGET,
                )
            )
            same = _same_profile(
                store.merged_reward_profiling_path(run_dir), tmp / "gym" / "rollouts_reward_profiling.jsonl"
            )
            results.append(("the two profiles are equal row by row", same))
    if args.scaling:
        sizes = [int(x) for x in args.sizes.split(",")]
        per_shard = rollouts // args.shards
        runs = []
        for n in sizes:
            with bench_dir(args.keep) as tmp:
                _, _, m = build_and_merge(tmp, n, args.repeats, max(1, n // per_shard), args.slicing, raw=False)
                if m is None:
                    return 1
                runs.append((n, m))
        print("scaling (shardrun merge-and-profile):")
        for n, m in runs:
            print(
                f"  {n:>12,} rollouts: {m.wall / n * 1e6:6.1f} s wall and {m.cpu / n * 1e6:6.1f} s CPU per million "
                f"rollouts, peak {m.rss / 1024:.2f} GiB"
            )
        (n0, m0), (n1, m1) = runs[0], runs[-1]
        ratio = (m1.cpu / n1) / (m0.cpu / n0)
        wall_ratio = (m1.wall / n1) / (m0.wall / n0)
        results.append(
            (
                f"at {n1:,} rollouts: peak memory {m1.rss / 1024:.2f} GiB (target < {PEAK_TARGET_GIB:g} GiB)",
                m1.rss / 1024 < PEAK_TARGET_GIB,
            )
        )
        results.append(
            (
                f"linear from {n0:,} to {n1:,}: {ratio:.2f}x the CPU seconds per million rollouts (wall: "
                f"{wall_ratio:.2f}x; target <= {LINEAR_TARGET})",
                ratio <= LINEAR_TARGET,
            )
        )
    print(f"load average at the end: {os.getloadavg()[1]:.1f} (5 min) on {os.cpu_count()} CPUs")
    print("targets:")
    for text, ok in results:
        print(f"  {verdict(ok)}  {text}")
    return 0 if all(ok for _, ok in results) else 2


@contextlib.contextmanager
def bench_dir(keep: Path | None) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-profile-", dir=keep))
    try:
        yield tmp
    finally:
        if keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


def build_and_merge(
    tmp: Path, rollouts: int, repeats: int, shards: int, slicing: str, raw: bool
) -> tuple[Path, int, Measured | None]:
    """Build a sealed run of `rollouts` and time merge-and-profile on it (and, with `raw`, a raw orjson parse)."""
    t0 = time.monotonic()
    run_dir = build(tmp, rollouts, repeats, shards, slicing)
    files = [p for i in range(shards) for p in (store.rollouts_path(run_dir, i), store.materialized_path(run_dir, i))]
    size = sum(p.stat().st_size for p in files)
    print(
        f"input: {rollouts // repeats:,} tasks x {repeats} repeats = {rollouts:,} rollouts, {shards} shards "
        f"({slicing}), {size / 2**30:.2f} GiB of shard files (built in {time.monotonic() - t0:.0f} s)"
    )
    if raw:
        parse = Measured([sys.executable, "-c", RAW_PARSE, *map(str, files)])
        print(parse.line("raw orjson parse of the shard files:") + f"  ({size / 2**20 / parse.wall:.0f} MiB/s)")
    ours = Measured([sys.executable, "-m", "shardrun.cli", "merge-and-profile", str(run_dir)], cwd=REPO)
    if ours.rc != 0:
        print("shardrun merge-and-profile failed", file=sys.stderr)
        return run_dir, size, None
    phases = orjson.loads(store.merged_summary_path(run_dir).read_bytes())["timings"]
    print(
        ours.line("shardrun merge-and-profile:") + f"  (read {phases['read_s']:.1f} s, copy {phases['copy_s']:.1f} s, "
        f"profile {phases['profile_s']:.1f} s)"
    )
    return run_dir, size, ours


def run_gym(gym: Path, tmp: Path, run_dir: Path) -> Measured:
    """Gym's ng_reward_profile on the merged files (hard links into tmp/gym)."""
    work = tmp / "gym"
    work.mkdir()
    for name in ("rollouts.jsonl", "rollouts_materialized_inputs.jsonl"):
        os.link(store.merged_dir(run_dir) / name, work / name)
    theirs = Measured(
        [
            str(gym),
            f"+materialized_inputs_jsonl_fpath={work}/rollouts_materialized_inputs.jsonl",
            f"+rollouts_jsonl_fpath={work}/rollouts.jsonl",
        ],
        cwd=work,
    )
    print(theirs.line("Gym ng_reward_profile:") + ("" if theirs.rc == 0 else f"  (FAILED, exit {theirs.rc})"))
    return theirs


def _same_profile(ours: Path, gyms: Path) -> bool:
    with open(ours, "rb") as a, open(gyms, "rb") as b:
        for x, y in zip(a, b, strict=True):
            if x != y and not _close(orjson.loads(x), orjson.loads(y)):
                return False
    return True


def _close(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return a == b and type(a) is type(b)


if __name__ == "__main__":
    sys.exit(main())
