"""Faults while planning: SIGKILL at random points of `plan --write`, disk full, read-only, permission denied.

After each fault the normal command (`shardrun plan --write` again) must produce a run directory byte-identical
to an uninterrupted one, and nothing left by the fault (temp files, a held lock) may get in the way.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

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


def test_sigkill_anywhere_in_plan_write_then_rerun_gives_identical_run_dir(tmp_path):
    cfg = setup(tmp_path, tasks=20000)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    assert plan_write(cfg).returncode == 0
    duration = time.monotonic() - t0
    reference = snapshot(run_dir)
    rng = random.Random(1234)
    outcomes = {"killed": 0, "finished": 0}
    for _ in range(KILLS):
        shutil.rmtree(run_dir)
        proc = subprocess.Popen(
            SHARDRUN + ["plan", str(cfg), "--write"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(rng.uniform(0.05, duration))
        os.killpg(proc.pid, signal.SIGKILL)
        outcomes["killed" if proc.wait() == -signal.SIGKILL else "finished"] += 1
        if (run_dir / "plan.json").exists():  # plan.json is written last: if it is there, all shards are too
            assert snapshot(run_dir) == reference
        rerun = plan_write(cfg)
        assert rerun.returncode == 0, rerun.stderr
        assert snapshot(run_dir) == reference
        assert not list(run_dir.rglob(".tmp-*"))
    assert outcomes["killed"] >= KILLS // 2, outcomes  # most kills really landed mid-run


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
