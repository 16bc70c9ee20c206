"""SIGKILL at seeded random points of the stages that need no servers: sealing `.done` (inside `shardrun resume`,
whose shard jobs seal shards whose rollouts are all there), mid-merge and mid-profile (`shardrun
merge-and-profile`). The whole process tree dies at once (frozen with SIGSTOP, then SIGKILLed); the normal command
is run again; every planned identity must then appear exactly once, nothing invented, and the outputs must be
byte-identical to an uninterrupted run (merge_summary.json: except its timings).

The killed commands run in children forked from the test process (the CLI's own code path, without paying the
interpreter start-up for every kill); the recovery runs are the real `shardrun` executable.

The sealing kills are placed by what the shard worker has done, not by the clock: the worker is frozen (SIGSTOP,
and the kernel shows it stopped) and let run in short slices, and the kill comes at the first frozen look that
shows the seeded target (a chosen shard mid-seal, or just sealed), so each kill's category is what the frozen
state showed, and a loaded machine only makes the slices do less.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pytest

from shardrun.shard import runtime
from shardrun.rundir import seal
from shardrun.rundir import store
from tests.faults import faultkit, synthetic

KILLS = 20  # per stage, at least
MID_SHARD = "mid-shard (started, not sealed)"
SEALED_SOME = "sealed some shards before the kill"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # fault-injection loops: not in --fast
SHARDS = 16


def shard_log_sizes(run_dir: Path, n: int) -> list[int]:
    out = []
    for i in range(n):
        try:
            out.append(store.shard_log_path(run_dir, i).stat().st_size)
        except FileNotFoundError:
            out.append(0)
    return out


def sealed(run_dir: Path, n: int) -> set[int]:
    plan = store.load_plan(run_dir)
    return {i for i in range(n) if seal.check(run_dir, plan, i, deep=True).sealed}


def new_log(run_dir: Path, index: int, since: int) -> bytes:
    """What shard `index` logged after its log had `since` bytes."""
    try:
        with open(store.shard_log_path(run_dir, index), "rb") as f:
            f.seek(since)
            return f.read()
    except FileNotFoundError:
        return b""


def worker_pid(run_dir: Path, todo: list[int], sizes: list[int]) -> int | None:
    """The pid of the shard worker, from the first `start:` line this run logged (runtime.py logs its pid)."""
    for i in todo:
        m = re.search(rb"start: attempt \d+, .*, pid (\d+)", new_log(run_dir, i, sizes[i]))
        if m:
            return int(m.group(1))
    return None


@pytest.fixture
def tagged(monkeypatch) -> str:
    tag = uuid.uuid4().hex
    from tests.fakes import harness

    monkeypatch.setenv(harness.TAG_ENV, tag)
    return tag


def test_sigkill_while_sealing_then_resume_seals_byte_identically(tmp_path: Path, tagged: str):
    run = synthetic.make(tmp_path / "w", tasks=3000, shards=SHARDS, seal=False)
    run_dir = run.run_dir
    pristine = tmp_path / "pristine"
    synthetic.restore(run_dir, pristine)
    planned = [k for i in range(SHARDS) for k in run.identities(i)]

    # the uninterrupted run: `shardrun resume` seals every shard without starting servers
    proc = faultkit.fork_cli("resume", run_dir, log=tmp_path / "reference.log")
    first = faultkit.wait_for(lambda: any(shard_log_sizes(run_dir, SHARDS)), 300, "the first shard to start", proc=proc)
    faultkit.wait_for(
        lambda: (
            all(
                b"sealed:" in store.shard_log_path(run_dir, i).read_bytes()
                for i in range(SHARDS)
                if store.shard_log_path(run_dir, i).exists()
            )
            and all(shard_log_sizes(run_dir, SHARDS))
        ),
        300,
        "every shard to seal",
        proc=proc,
    )
    assert first and proc.wait(300) == 0, (tmp_path / "reference.log").read_text()
    assert sealed(run_dir, SHARDS) == set(range(SHARDS))
    reference = synthetic.shard_files(run_dir, SHARDS)
    assert faultkit.cli("merge-and-profile", run_dir).returncode == 0
    reference_merged = faultkit.merged_outputs(run_dir)
    failed = {k for i in range(SHARDS) for k in faultkit.identities(store.failures_path(run_dir, i))}
    faultkit.assert_exactly_once(run_dir, planned, failed)
    reference_markers = {
        i: {
            k: v
            for k, v in seal.check(run_dir, run.plan, i).marker.to_json().items()
            if k in ("num_rollouts", "num_failed", "rollouts_sha256", "rollouts_bytes")
        }
        for i in range(SHARDS)
    }

    # Each kill has a seeded target among the shards this resume seals: a shard mid-seal (started, no `.done`
    # yet), at the first to third frozen look that shows it there, or the same shard just sealed (its `.done` in
    # place). Kills go on until both kinds have landed often enough; a look that missed its target (the shard
    # sealed within one slice) still kills and counts as what it was, so the loop only needs more turns.
    rng = faultkit.seeded(4242)
    synthetic.restore(pristine, run_dir)
    landed: Counter = Counter()
    kills = chains = 0
    for attempt in range(6 * KILLS):
        if kills >= KILLS and landed[MID_SHARD] >= KILLS // 2 and landed[SEALED_SOME] >= KILLS // 2:
            break
        before = sealed(run_dir, SHARDS)
        todo = sorted(set(range(SHARDS)) - before)
        sizes = shard_log_sizes(run_dir, SHARDS)
        target = rng.choice(todo)
        looks = rng.randint(1, 3) if attempt % 2 == 0 else None  # None: kill once the target is sealed
        seen: Counter = Counter()

        def at_target() -> bool:
            if store.done_path(run_dir, target).exists():
                return True
            if looks is None or b"start:" not in new_log(run_dir, target, sizes[target]):
                return False
            seen["mid-shard looks"] += 1
            return seen["mid-shard looks"] >= looks

        proc = faultkit.fork_cli("resume", run_dir, log=tmp_path / "chaos.log")
        pid = faultkit.wait_for(lambda: worker_pid(run_dir, todo, sizes), 300, "the shard worker to start", proc=proc)
        if pid and faultkit.freeze(pid):
            faultkit.step_until(pid, at_target)
        if proc.poll() is None:
            faultkit.kill_tree(proc, tag=tagged)
            kills += 1
            now = sealed(run_dir, SHARDS)
            landed[SEALED_SOME] += bool(now - before)
            landed["left a temp file"] += bool(synthetic.temps(run_dir / "shards"))
            landed[MID_SHARD] += any(i not in now and b"start:" in new_log(run_dir, i, sizes[i]) for i in range(SHARDS))
            landed["killed at the target, mid-shard"] += looks is not None and target not in now
            landed["killed at the target, just sealed"] += looks is None and target in now
            assert faultkit.leftovers(tagged, also=run_dir) == []
        else:
            assert proc.returncode == 0, (tmp_path / "chaos.log").read_text()[-3000:]
            now = sealed(run_dir, SHARDS)
        # a valid seal always describes exactly the bytes an uninterrupted run seals
        for i in now:
            marker = seal.check(run_dir, run.plan, i).marker.to_json()
            assert {k: marker[k] for k in reference_markers[i]} == reference_markers[i]
            assert (
                store.rollouts_path(run_dir, i).read_bytes()
                == reference[str(store.rollouts_path(run_dir, i).relative_to(run_dir))]
            )
        if now == set(range(SHARDS)):  # this chain of kills is recovered: check it, start another
            assert synthetic.shard_files(run_dir, SHARDS) == reference
            chains += 1
            synthetic.restore(pristine, run_dir)

    # the normal recovery command, uninterrupted
    res = faultkit.cli("resume", run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sealed(run_dir, SHARDS) == set(range(SHARDS))
    assert synthetic.shard_files(run_dir, SHARDS) == reference
    assert not synthetic.temps(run_dir / "shards")
    assert faultkit.cli("merge-and-profile", run_dir).returncode == 0
    assert faultkit.merged_outputs(run_dir) == reference_merged
    checked = faultkit.assert_exactly_once(run_dir, planned, failed)
    st = faultkit.cli("status", run_dir, "--json")  # the failed rollouts are listed, with their reasons
    assert {(f["task"], f["rollout"]) for f in orjson.loads(st.stdout)["failed"]} == failed
    assert kills >= KILLS, (kills, landed)
    assert landed[MID_SHARD] >= KILLS // 2 and landed[SEALED_SOME] >= KILLS // 2, landed
    faultkit.counts_line(
        "sealing",
        kills=kills,
        recovered_chains=chains + 1,
        identities_checked=checked,
        **{k.replace(" ", "_"): v for k, v in landed.items()},
    )


def merged_temps(run_dir: Path) -> dict[str, int]:
    """Temp files of a merge in progress: output (or scratch) name -> bytes written so far."""
    out = {}
    for p in synthetic.temps(store.merged_dir(run_dir)):
        prefix = store.MERGE_TMP_PREFIX if p.name.startswith(store.MERGE_TMP_PREFIX) else store.TMP_PREFIX
        name = p.name[len(prefix) :]  # the merge's own temps carry its prefix (only it removes them)
        try:
            size = p.stat().st_size
        except FileNotFoundError:  # renamed into place (or removed) since it was listed
            continue
        out[name if name.startswith(("groups-", "snapshot-")) else name.rsplit(".", 1)[0]] = size
    return out


def merge_phase(run_dir: Path) -> str:
    """Where a merge is, from what it has on disk: reading + copying rows ("mid-merge": lock taken, nothing of the
    profile yet), profiling ("mid-profile": its scratch or profile output begun), or renaming its outputs."""
    tmp = merged_temps(run_dir)
    outputs = [n for n in faultkit.MERGED_FILES + ("merge_summary.json",) if n in tmp]
    if tmp and len(outputs) < len(faultkit.MERGED_FILES) + 1 and not any(k.startswith("groups-") for k in tmp):
        return "while renaming outputs"
    if any(k.startswith("groups-") for k in tmp) or tmp.get("rollouts_reward_profiling.jsonl", 0) > 0:
        return "mid-profile"
    return "mid-merge"


def phase_starts(run_dir: Path, log: Path) -> dict[str, float]:
    """Seconds after the merge takes its lock at which it starts profiling and renaming (one watched run)."""
    lock = store.merged_dir(run_dir) / ".merge.lock"
    lock.unlink(missing_ok=True)
    proc = faultkit.fork_cli("merge-and-profile", run_dir, log=log)
    faultkit.wait_for(lock.exists, 60, "the merge to take its lock", interval=0.001, proc=proc)
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    while proc.poll() is None:
        phase = merge_phase(run_dir)
        seen.setdefault(phase, time.monotonic() - t0)
        time.sleep(0.001)
    assert proc.returncode == 0
    seen["end"] = time.monotonic() - t0
    return seen


def test_sigkill_mid_merge_and_mid_profile_then_rerun_is_byte_identical(tmp_path: Path, tagged: str):
    run = synthetic.make(tmp_path, tasks=2500, shards=SHARDS, seal=True)
    run_dir = run.run_dir
    planned = [k for i in range(SHARDS) for k in run.identities(i)]
    res = faultkit.cli("merge-and-profile", run_dir)
    assert res.returncode == 0, res.stderr
    reference = faultkit.merged_outputs(run_dir)
    reference_files = {n: (store.merged_dir(run_dir) / n).read_bytes() for n in faultkit.MERGED_FILES}
    failed = {k for k in faultkit.identities(store.merged_failures_path(run_dir))} - set(
        faultkit.identities(store.merged_rollouts_path(run_dir))
    )
    phases = phase_starts(run_dir, tmp_path / "watched.log")
    profile_at = phases.get("mid-profile", phases["end"] / 2)
    lock = store.merged_dir(run_dir) / ".merge.lock"

    rng = faultkit.seeded(606)
    max_looks = 40  # frozen looks into profiling a kill may wait for (halved whenever one overshoots it)
    landed: Counter = Counter()
    recoveries = kills = 0
    for it in range(8 * KILLS):
        if landed["mid-merge"] >= KILLS and landed["mid-profile"] >= KILLS:
            break
        if it % 2 == 0:  # half the kills hit a first merge, half a re-merge over complete earlier outputs
            for name in faultkit.MERGED_FILES + ("merge_summary.json",):
                (store.merged_dir(run_dir) / name).unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
        had_outputs = all((store.merged_dir(run_dir) / n).exists() for n in reference_files)
        target = "mid-merge" if landed["mid-merge"] <= landed["mid-profile"] else "mid-profile"
        proc = faultkit.fork_cli("merge-and-profile", run_dir, log=tmp_path / "chaos.log")
        faultkit.wait_for(lock.exists, 60, "the merge to take its lock", interval=0.001, proc=proc)
        if target == "mid-merge":
            time.sleep(rng.uniform(0, profile_at))
        elif faultkit.freeze(proc.pid):
            # profiling is a fraction of a second: step the frozen merge in short slices and kill it at a seeded
            # frozen look among those showing it profiling, so where the kill lands does not hang on the load
            looks = rng.randint(1, max_looks)
            seen: Counter = Counter()

            def at_target() -> bool:
                phase = merge_phase(run_dir)
                if not seen["mid-merge"] and phase != "mid-merge":  # a killed merge's temps, not yet cleared
                    return False
                seen[phase] += 1
                return phase == "while renaming outputs" or seen["mid-profile"] >= looks

            faultkit.step_until(proc.pid, at_target)
            if merge_phase(run_dir) != "mid-profile":  # stepped past profiling: aim earlier next time
                max_looks = max(1, max_looks // 2)
        if proc.poll() is not None:
            assert proc.returncode == 0, (tmp_path / "chaos.log").read_text()[-3000:]
            landed["finished before the kill"] += 1
            continue
        faultkit.kill_tree(proc, tag=tagged)
        kills += 1
        landed[merge_phase(run_dir)] += 1
        # nothing half-written under an output's name: each is absent (first merge) or complete
        for name, data in reference_files.items():
            path = store.merged_dir(run_dir) / name
            if had_outputs:
                assert path.read_bytes() == data, f"a killed re-merge damaged {name}"
            else:
                assert not path.exists() or path.read_bytes() == data, name
        landed["of which re-merges over complete outputs"] += had_outputs
        assert faultkit.leftovers(tagged, also=run_dir) == []
        if kills % 5 == 0:  # the normal recovery: merge-and-profile again (a stale lock file and temps are there)
            res = faultkit.cli("merge-and-profile", run_dir, timeout=120)
            assert res.returncode == 0, res.stderr
            assert faultkit.merged_outputs(run_dir) == reference
            assert not synthetic.temps(store.merged_dir(run_dir))
            recoveries += 1
    res = faultkit.cli("merge-and-profile", run_dir, timeout=120)
    assert res.returncode == 0, res.stderr
    assert faultkit.merged_outputs(run_dir) == reference and not synthetic.temps(store.merged_dir(run_dir))
    checked = faultkit.assert_exactly_once(run_dir, planned, failed)
    assert landed["mid-merge"] >= KILLS and landed["mid-profile"] >= KILLS, landed
    faultkit.counts_line(
        "merge-and-profile",
        kills=kills,
        recoveries=recoveries + 1,
        identities_checked=checked,
        **{k.replace(" ", "_").replace("-", "_"): v for k, v in landed.items()},
    )


def test_merge_killed_while_renaming_its_outputs_never_leaves_a_summary_ahead_of_them(tmp_path: Path, tagged: str):
    """The outputs are renamed into place one by one; merge_summary.json goes last, so a summary of this merge in
    place means every output beside it is this merge's too (killed right after the first rename, 10 times)."""
    run = synthetic.make(tmp_path, tasks=2500, shards=SHARDS, seal=False)
    run_dir = run.run_dir
    for i in range(SHARDS - 1):
        runtime.run_shard(run_dir, i)
    last = store.rollouts_path(run_dir, SHARDS - 1)
    full = last.read_bytes()
    last.write_bytes(full[: full.index(b"\n", len(full) // 2) + 1])  # the last shard half collected
    assert faultkit.cli("merge-and-profile", run_dir, "--allow-partial").returncode == 0  # the earlier outputs
    names = faultkit.MERGED_FILES + ("merge_summary.json",)
    old = {n: (store.merged_dir(run_dir) / n).read_bytes() for n in names}
    last.write_bytes(full)
    runtime.run_shard(run_dir, SHARDS - 1)
    assert faultkit.cli("merge-and-profile", run_dir).returncode == 0
    new = {n: (store.merged_dir(run_dir) / n).read_bytes() for n in names}
    assert all(old[n] != new[n] for n in ("rollouts.jsonl", "rollouts_reward_profiling.jsonl", "merge_summary.json"))
    landed = Counter()
    for _ in range(10):
        for n in names:
            store.atomic_write_bytes(store.merged_dir(run_dir) / n, old[n])
        inodes = {n: (store.merged_dir(run_dir) / n).stat().st_ino for n in names}

        def renamed() -> bool:
            for n in names:
                try:
                    if (store.merged_dir(run_dir) / n).stat().st_ino != inodes[n]:
                        return True
                except FileNotFoundError:
                    pass
            return False

        proc = faultkit.fork_cli("merge-and-profile", run_dir, log=tmp_path / "renames.log")
        faultkit.wait_for(renamed, 120, "the first output renamed", interval=0.0005, proc=proc)
        if proc.poll() is not None:
            landed["finished first"] += 1
            continue
        faultkit.kill_tree(proc, tag=tagged)
        now = {n: (store.merged_dir(run_dir) / n).read_bytes() for n in names}
        if now["merge_summary.json"] != old["merge_summary.json"]:  # new, with this run's timings
            assert faultkit.essentials_of(now["merge_summary.json"]) == faultkit.essentials_of(
                new["merge_summary.json"]
            )
            now["merge_summary.json"] = new["merge_summary.json"]
        assert all(now[n] in (old[n], new[n]) for n in names)  # each output whole, old or new
        replaced = sorted(n for n in names if now[n] == new[n] != old[n])
        landed["killed mid-rename" if len(replaced) < len(names) else "killed after the renames"] += 1
        if now["merge_summary.json"] == new["merge_summary.json"]:
            assert all(now[n] == new[n] for n in names), f"the summary is new but not {set(names) - set(replaced)}"
    res = faultkit.cli("merge-and-profile", run_dir)
    assert res.returncode == 0 and {n: (store.merged_dir(run_dir) / n).read_bytes() for n in faultkit.MERGED_FILES} == {
        n: new[n] for n in faultkit.MERGED_FILES
    }
    assert landed["killed mid-rename"] >= 3, landed
    faultkit.counts_line("merge renames", **{k.replace(" ", "_"): v for k, v in landed.items()})
