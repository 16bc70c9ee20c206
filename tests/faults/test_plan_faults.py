"""Faults while planning: SIGKILL at random points of `plan --write`, disk full, read-only, permission denied.

After each fault the normal command (`shardrun plan --write` again) must produce a run directory byte-identical
to an uninterrupted one, and nothing left by the fault (temp files, a held lock) may get in the way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import store
from tests.faults import faultkit
from tests.planning_helpers import row

SHARDRUN = [sys.executable, "-m", "shardrun.cli"]
KILLS = 20


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".shardrun.lock"
    }


def setup(tmp_path: Path, tasks: int, run_dir: Path | None = None) -> Path:
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(row(i, agent="a" if i % 3 else "b")) + b"\n" for i in range(tasks)))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"input_jsonl: {inp}\nrun_dir: {run_dir or tmp_path / 'run'}\n"
        f"num_repeats: {{a: 8, b: 4}}\nsharding: {{num_shards: 16, slicing: round_robin}}\n"
    )
    return cfg


def plan_write(cfg: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(SHARDRUN + ["plan", str(cfg), "--write"], capture_output=True, text=True, timeout=120, **kw)


# where a kill landed, seen in the run directory of the frozen `plan --write` (plan.json is written last)
BEFORE_SHARDS, WRITING_SHARDS, SHARDS_IN_PLACE, PLAN_WRITTEN = (
    "before the shard files",
    "writing the shard files",
    "shards in place, no plan.json",
    "plan.json written",
)


def plan_write_stage(run_dir: Path) -> str:
    if (run_dir / "plan.json").exists():
        return PLAN_WRITTEN
    if list(run_dir.glob(f"shards/*/{store.materialized_path(run_dir, 0).name}")):
        return SHARDS_IN_PLACE
    if list(run_dir.glob("shards/*/.tmp-*")):
        return WRITING_SHARDS
    return BEFORE_SHARDS


def bytes_read(pid: int) -> int:
    """What `pid` has read so far (the kernel's rchar): while it writes the shard files, that is the input."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("rchar:"))


@pytest.mark.slow  # a fault-injection loop: not in --fast
def test_sigkill_anywhere_in_plan_write_then_rerun_gives_identical_run_dir(tmp_path):
    """Each kill is placed by what `plan --write` has done, not by the clock: the process is frozen (SIGSTOP) at a
    seeded target seen in its run directory and in what it has read, then SIGKILLed: early on (the n-th frozen
    look before any shard file); while it writes the shard files, once it has read a seeded share of the input
    again; or once a shard file is in place but plan.json is not yet. Kills go on, within a bounded count, until
    each stage has been hit often enough; a kill that missed its target counts as the stage it landed in."""
    cfg = setup(tmp_path, tasks=20000)
    run_dir = tmp_path / "run"
    input_size = (tmp_path / "input.jsonl").stat().st_size
    assert plan_write(cfg).returncode == 0
    reference = snapshot(run_dir)
    assert str(store.materialized_path(run_dir, 0).relative_to(run_dir)) in reference, sorted(reference)
    rng = faultkit.seeded(1234)
    landed: Counter = Counter()
    kills = 0
    stages = (BEFORE_SHARDS, WRITING_SHARDS, SHARDS_IN_PLACE)
    for attempt in range(6 * KILLS):
        if kills >= KILLS and all(landed[s] >= KILLS // 5 for s in stages):
            break
        shutil.rmtree(run_dir, ignore_errors=True)
        target = stages[attempt % len(stages)]
        looks, share = rng.randint(1, 100), rng.uniform(0.0, 1.0)
        seen: Counter = Counter()
        proc = subprocess.Popen(
            SHARDRUN + ["plan", str(cfg), "--write"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        base = 0  # bytes read when the shard files' temps appeared

        def at_target() -> bool:
            stage = plan_write_stage(run_dir)
            seen[stage] += 1
            if target == BEFORE_SHARDS:  # the n-th frozen look (the interpreter starting, the input scanned ...)
                return stage != BEFORE_SHARDS or seen[stage] >= looks
            if target == WRITING_SHARDS:
                return stage not in (BEFORE_SHARDS, WRITING_SHARDS) or bytes_read(proc.pid) - base >= share * input_size
            return stage not in (BEFORE_SHARDS, WRITING_SHARDS)

        if target != BEFORE_SHARDS:  # run freely up to the shard files' temps (and most of the input for the
            # shards-in-place target), then step in short slices
            faultkit.wait_for(
                lambda: plan_write_stage(run_dir) != BEFORE_SHARDS or proc.poll() is not None,
                120,
                "plan --write to start writing the shard files",
                interval=0.001,
            )
            base = bytes_read(proc.pid)
            if target == SHARDS_IN_PLACE:
                faultkit.wait_for(
                    lambda: bytes_read(proc.pid) - base >= 0.8 * input_size or proc.poll() is not None,
                    120,
                    "plan --write to read most of its input again",
                    interval=0.001,
                )
        if faultkit.freeze(proc.pid) and faultkit.step_until(proc.pid, at_target):
            stage = plan_write_stage(run_dir)
            os.killpg(proc.pid, signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
            kills += 1
            landed[stage] += 1
            landed["left a temp file"] += bool(list(run_dir.rglob(".tmp-*")))
        else:
            assert proc.wait() == 0
            landed["finished before the kill"] += 1
        if (run_dir / "plan.json").exists():  # plan.json is written last: if it is there, all shards are too
            assert snapshot(run_dir) == reference
        rerun = plan_write(cfg)
        assert rerun.returncode == 0, rerun.stderr
        assert snapshot(run_dir) == reference
        assert not list(run_dir.rglob(".tmp-*"))
    assert kills >= KILLS and all(landed[s] >= KILLS // 5 for s in stages), landed
    faultkit.counts_line("plan --write", kills=kills, **{k.replace(" ", "_"): v for k, v in sorted(landed.items())})


def test_disk_full_while_writing_is_a_clear_error_and_rerun_recovers(tmp_path, mounts):
    small = tmp_path / "small"
    faultkit.mount_tmpfs(small, "size=256k", mounts)
    cfg = setup(tmp_path, tasks=2000, run_dir=small / "run")
    res = plan_write(cfg)
    assert res.returncode == 2
    assert "no space left" in res.stderr and "free space and rerun" in res.stderr
    assert not (small / "run" / "plan.json").exists()
    assert "Traceback" not in res.stderr
    subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
    res = plan_write(cfg)
    assert res.returncode == 0, res.stderr
    assert (small / "run" / "plan.json").exists()
    assert not list((small / "run").rglob(".tmp-*"))


def test_read_only_run_dir_is_a_clear_error(tmp_path, mounts):
    ro = tmp_path / "ro"
    faultkit.mount_tmpfs(ro, "ro,size=1m", mounts)
    res = plan_write(setup(tmp_path, tasks=10, run_dir=ro / "run"))
    assert res.returncode == 2 and "read-only" in res.stderr and "Traceback" not in res.stderr


NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_permission_denied_on_run_dir_is_a_clear_error(tmp_path):
    """Root ignores file modes; shardrun runs without CAP_DAC_OVERRIDE so a 0555 run dir really refuses writes."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop the capability that lets root ignore file modes")
    run_dir = tmp_path / "locked"
    run_dir.mkdir()
    cfg = setup(tmp_path, tasks=10, run_dir=run_dir)
    run_dir.chmod(0o555)
    try:
        res = subprocess.run(
            NO_DAC + SHARDRUN + ["plan", str(cfg), "--write"], capture_output=True, text=True, timeout=120
        )
    finally:
        run_dir.chmod(0o755)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "permission denied" in res.stderr and "Traceback" not in res.stderr
    assert not (run_dir / "plan.json").exists()


def test_permission_denied_inside_shards_is_a_clear_error(tmp_path):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop the capability that lets root ignore file modes")
    run_dir = tmp_path / "run"
    (run_dir / "shards" / "00003").mkdir(parents=True)
    (run_dir / "shards" / "00003").chmod(0o555)
    cfg = setup(tmp_path, tasks=10, run_dir=run_dir)
    try:
        res = subprocess.run(
            NO_DAC + SHARDRUN + ["plan", str(cfg), "--write"], capture_output=True, text=True, timeout=120
        )
    finally:
        (run_dir / "shards" / "00003").chmod(0o755)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "permission denied" in res.stderr and "00003" in res.stderr and "Traceback" not in res.stderr
    assert not (run_dir / "plan.json").exists()
    assert plan_write(cfg).returncode == 0
