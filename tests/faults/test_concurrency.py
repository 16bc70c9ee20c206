"""Races on one run directory: two `submit`s, two `resume`s, a `submit` and a `resume` (the run lock: every shard is
launched once, none runs twice); `merge-and-profile` while a late shard is still being written and then sealed
(the merge sees the sealed shard or not, never half of it); two merges at once (the merge lock).

Real commands on real run directories whose shards seal without servers (tests/faults/synthetic.py).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from shardrun.shard import runtime
from shardrun.rundir import store
from tests.faults import faultkit, synthetic
from tests.machine_env import without_machine_gym_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # fault-injection loops: not in --fast
SHARDS = 6


@pytest.fixture(scope="session")  # once per xdist worker, however its tests interleave with others
def reference(tmp_path_factory) -> dict:
    with without_machine_gym_venv():  # as the tests that compare with it (tests/machine_env.py)
        run = faultkit.sealed_and_merged(tmp_path_factory.mktemp("race-reference"), tasks=600, shards=SHARDS)
    return {
        "shards": synthetic.shard_files(run.run_dir, SHARDS),
        "merged": faultkit.merged_outputs(run.run_dir),
        "files": {n: (store.merged_dir(run.run_dir) / n).read_bytes() for n in faultkit.MERGED_FILES},
    }


def launches_per_shard(run_dir: Path) -> Counter:
    return Counter(int(i) for rec in store.read_launches(run_dir) for i in rec.jobs)


@pytest.mark.parametrize("pair", [("submit", "submit"), ("resume", "resume"), ("submit", "resume")])
def test_two_commands_racing_on_one_run_launch_every_shard_once(tmp_path: Path, pair, reference):
    rng = faultkit.seeded(hash(pair) % 1000)
    rounds = 2
    for r in range(rounds):
        run = synthetic.make(tmp_path / f"r{r}", tasks=600, shards=SHARDS, seal=False)
        cfg = synthetic.launch_config_file(run, tmp_path / f"r{r}.yaml")
        procs = []
        for k, command in enumerate(pair):
            if k:
                time.sleep(rng.uniform(0, 0.4))
            args = ("submit", cfg) if command == "submit" else ("resume", run.run_dir)
            procs.append(
                subprocess.Popen(
                    faultkit.SHARDRUN + [str(a) for a in args],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=300)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out
        assert launches_per_shard(run.run_dir) == Counter(range(SHARDS)), (launches_per_shard(run.run_dir), outs)
        assert not [i for i in range(SHARDS) if store.shard_failure_path(run.run_dir, i).exists()], outs
        logs = "".join(store.shard_log_path(run.run_dir, i).read_text() for i in range(SHARDS))
        assert "already running" not in logs and logs.count("start: attempt") == SHARDS
        assert synthetic.shard_files(run.run_dir, SHARDS) == reference["shards"]
        assert faultkit.cli("merge-and-profile", run.run_dir).returncode == 0
        assert faultkit.merged_outputs(run.run_dir) == reference["merged"]
    faultkit.counts_line(f"race {pair[0]}+{pair[1]}", rounds=rounds, shards_launched_once=rounds * SHARDS)


LATE = 3  # the late shard: no torn tail, no duplicate in synthetic.make


def test_merge_racing_a_late_shard_sees_it_sealed_or_not_never_half(tmp_path: Path, reference):
    run = synthetic.make(tmp_path, tasks=600, shards=SHARDS, seal=False)
    run_dir = run.run_dir
    for i in range(SHARDS):
        if i != LATE:
            runtime.run_shard(run_dir, i)
    late_rows = store.rollouts_path(run_dir, LATE).read_bytes().splitlines(keepends=True)
    store.rollouts_path(run_dir, LATE).write_bytes(b"")
    planned_late = set(run.identities(LATE))
    full_late = {(r["_ng_task_index"], r["_ng_rollout_index"]) for r in map(orjson.loads, late_rows)}

    def late_shard() -> None:
        """Gym's collector appending one rollout at a time (a half-written line now and then), then the seal."""
        rng = faultkit.seeded(7)
        with open(store.rollouts_path(run_dir, LATE), "ab", buffering=0) as f:
            for line in late_rows:
                cut = rng.randrange(1, len(line)) if rng.random() < 0.2 else len(line)
                f.write(line[:cut])
                if cut < len(line):
                    time.sleep(0.003)
                    f.write(line[cut:])
                time.sleep(0.002)
        res = faultkit.cli("run-shard", run_dir, LATE)
        os._exit(res.returncode)

    # a separate process (forked while this one has no other thread), so the merges below can be forked safely
    pid = os.fork()
    if pid == 0:
        try:
            late_shard()
        finally:
            os._exit(1)
    writer = faultkit.Forked(pid)
    seen: Counter = Counter()
    try:
        after_seal = 0
        while after_seal < 3:
            sealed_now = writer.poll() is not None
            for partial in (False, True):
                before = faultkit.tree_bytes(store.merged_dir(run_dir), skip=lambda p: p.name.startswith("."))
                args = ["merge-and-profile", run_dir, "--json"] + (["--allow-partial"] if partial else [])
                proc = faultkit.fork_cli(*args, log=tmp_path / "merge.out")
                code = proc.wait(120)
                summary = orjson.loads(store.merged_summary_path(run_dir).read_bytes()) if code == 0 else None
                late = next((s for s in (summary or {}).get("shards", []) if s.get("index") == LATE), None)
                if code == 5:  # refused: the late shard is not sealed; nothing was written
                    assert not partial
                    assert (
                        faultkit.tree_bytes(store.merged_dir(run_dir), skip=lambda p: p.name.startswith(".")) == before
                    )
                    seen["refused (not sealed)"] += 1
                    continue
                assert code == 0, (tmp_path / "merge.out").read_text()[-3000:]
                got = faultkit.identities(store.merged_rollouts_path(run_dir))
                assert len(got) == len(set(got)), "an identity twice in the merged rollouts"
                from_late = set(got) & planned_late
                if late is not None and late.get("sealed"):
                    assert from_late == full_late
                    got_all = faultkit.merged_outputs(run_dir)
                    if partial:  # the summary records --allow-partial; the files are the same
                        got_all.pop("merge_summary (without timings)")
                    assert got_all == {k: v for k, v in reference["merged"].items() if k in got_all}
                    seen["merged it sealed"] += 1
                else:
                    assert partial and from_late <= full_late  # complete rows only, never a torn one
                    seen["merged its complete rows (--allow-partial)"] += 1
                    seen["rows of the late shard seen partially"] += len(from_late)
            after_seal += sealed_now
    finally:
        assert writer.wait(300) == 0, "the late shard did not seal"
    assert seen["refused (not sealed)"] >= 1 and seen["merged it sealed"] >= 3, seen
    assert store.merged_dir(run_dir).exists() and not synthetic.temps(store.merged_dir(run_dir))
    faultkit.counts_line("merge vs late shard", **{k.replace(" ", "_"): v for k, v in seen.items()})


def test_three_plan_writes_at_once_write_one_plan(tmp_path: Path):
    run = synthetic.make(tmp_path / "a", tasks=600, shards=SHARDS, seal=False)
    cfg = synthetic.launch_config_file(run, tmp_path / "run.yaml")
    reference = faultkit.tree_bytes(run.run_dir / "shards") | {"plan.json": store.plan_path(run.run_dir).read_bytes()}
    fresh = tmp_path / "fresh"
    for _ in range(4):
        import shutil

        shutil.rmtree(fresh, ignore_errors=True)
        procs = [
            subprocess.Popen(
                faultkit.SHARDRUN + ["plan", str(cfg), f"run_dir={fresh}", "--write"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(3)
        ]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outs
        assert sum("(written)" in o for o in outs) == 1 and sum("nothing written" in o for o in outs) == 2, outs
        got = {k: v for k, v in faultkit.tree_bytes(fresh / "shards").items() if k.endswith("inputs.jsonl")}
        assert got == {k: v for k, v in reference.items() if k.endswith("inputs.jsonl")}


def test_two_merges_at_once_are_serialized_and_agree(tmp_path: Path, reference):
    run = synthetic.make(tmp_path, tasks=600, shards=SHARDS, seal=False)
    assert faultkit.cli("resume", run.run_dir).returncode == 0
    for _ in range(3):
        procs = [faultkit.fork_cli("merge-and-profile", run.run_dir, log=tmp_path / f"m{k}.out") for k in range(2)]
        assert [p.wait(120) for p in procs] == [0, 0]
        assert faultkit.merged_outputs(run.run_dir) == reference["merged"]
        assert not synthetic.temps(store.merged_dir(run.run_dir))
    assert os.path.exists(store.merged_dir(run.run_dir) / ".merge.lock")
