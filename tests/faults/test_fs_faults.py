"""File-system faults after planning (planning's own: test_plan_faults.py): disk full while sealing, resuming and
merging (a real small tmpfs), permission denied on the run directory (shardrun without the capability that lets
root ignore file modes), the run directory moved, `.done` edited or copied from another run, plan.json edited.
Each gives one clear message (no traceback) and a documented exit code; nothing already sealed is lost, and once
the fault is gone the normal command gives the same outputs as a run that never saw it.

The run directories are real plans with shard outputs in Gym's formats (tests/faults/synthetic.py); their shards
seal without servers, so `resume` and `run-shard` run for real.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import seal
from shardrun.rundir import store
from tests.faults import faultkit, synthetic
from tests.machine_env import without_machine_gym_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # fault-injection loops: not in --fast
SHARDS = 4


def sealed(run_dir: Path) -> set[int]:
    plan = store.load_plan(run_dir)
    return {i for i in range(len(plan.shards)) if seal.check(run_dir, plan, i, deep=True).sealed}


def clear_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    text = res.stdout + res.stderr
    assert res.returncode == code, (res.returncode, text)
    assert "Traceback" not in text and "╭" not in text, text  # no traceback, not even typer's pretty one
    for n in needles:
        assert n in text, (n, text)
    return text


@pytest.fixture(scope="session")  # once per xdist worker, however its tests interleave with others
def reference(tmp_path_factory) -> dict:
    """The same run, never faulted: sealed by `resume`, merged."""
    with without_machine_gym_venv():  # as the tests that compare with it (tests/machine_env.py)
        run = faultkit.sealed_and_merged(tmp_path_factory.mktemp("fs-reference"), tasks=300, shards=SHARDS)
    return {"shards": synthetic.shard_files(run.run_dir, SHARDS), "merged": faultkit.merged_outputs(run.run_dir)}


def recovered_like_reference(run_dir: Path, reference: dict) -> None:
    res = faultkit.cli("resume", run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sealed(run_dir) == set(range(SHARDS))
    assert synthetic.shard_files(run_dir, SHARDS) == reference["shards"]
    res = faultkit.cli("merge-and-profile", run_dir)
    assert res.returncode == 0, res.stderr
    assert faultkit.merged_outputs(run_dir) == reference["merged"]
    assert not synthetic.temps(run_dir)


def half_sealed(tmp: Path, keep_run: list | None = None) -> tuple[Path, dict[str, bytes]]:
    """A run with shards 0 and 1 sealed (by the shard job itself), 2 and 3 not yet."""
    run = synthetic.make(tmp, tasks=300, shards=SHARDS, seal=False)
    if keep_run is not None:
        keep_run.append(run)
    for i in (0, 1):
        assert faultkit.cli("run-shard", run.run_dir, i).returncode == 0
    kept = {
        p: data
        for p, data in faultkit.tree_bytes(run.run_dir).items()
        if p.startswith(("shards/00000/", "shards/00001/")) and "/logs/" not in p and ".lock" not in p
    }
    return run.run_dir, kept


def assert_kept(run_dir: Path, kept: dict[str, bytes]) -> None:
    """What was sealed before the fault is still there, byte for byte, and still sealed."""
    assert {p: (run_dir / p).read_bytes() for p in kept} == kept
    assert {0, 1} <= sealed(run_dir)


# ---------------------------------------------------------------- disk full


def test_disk_full_while_sealing_resuming_and_merging_is_a_clear_error_and_nothing_sealed_is_lost(
    tmp_path: Path, mounts, reference
):
    disk = faultkit.mount_tmpfs(tmp_path / "disk", "size=24m", mounts)
    run_dir, kept = half_sealed(disk)
    filler = faultkit.fill(disk)
    for args, code in (
        (("run-shard", run_dir, 2), 2),
        (("resume", run_dir), 2),
        (("merge-and-profile", run_dir, "--allow-partial"), 2),
    ):
        clear_error(faultkit.cli(*args), code, "no space left")
        assert_kept(run_dir, kept)
        assert sealed(run_dir) == {0, 1}
    st = faultkit.cli("status", run_dir)  # reading needs no space
    assert st.returncode == 0 and "sealed 2" in st.stdout, st.stdout + st.stderr
    filler.unlink()
    recovered_like_reference(run_dir, reference)


def test_disk_full_while_writing_merged_outputs_keeps_the_previous_ones(tmp_path: Path, mounts, reference):
    disk = faultkit.mount_tmpfs(tmp_path / "disk", "size=24m", mounts)
    run = synthetic.make(disk, tasks=300, shards=SHARDS, seal=False)
    assert faultkit.cli("resume", run.run_dir).returncode == 0
    assert faultkit.cli("merge-and-profile", run.run_dir).returncode == 0
    before = faultkit.tree_bytes(store.merged_dir(run.run_dir), skip=lambda p: p.name.endswith(".lock"))
    filler = faultkit.fill(disk)
    clear_error(faultkit.cli("merge-and-profile", run.run_dir), 2, "no space left", "free space and rerun")
    assert faultkit.tree_bytes(store.merged_dir(run.run_dir), skip=lambda p: p.name.endswith(".lock")) == before
    filler.unlink()
    recovered_like_reference(run.run_dir, reference)


# ---------------------------------------------------------------- permission denied


def test_permission_denied_on_the_run_directory_is_a_clear_error(tmp_path: Path, reference):
    faultkit.need_setpriv()
    run_dir, kept = half_sealed(tmp_path)
    locked = [run_dir, run_dir / "shards" / "00002", run_dir / "shards" / "00003"]
    for d in locked:
        d.chmod(0o555)
    try:
        for args, code in (
            (("run-shard", run_dir, 2), 2),
            (("resume", run_dir), 2),
            (("merge-and-profile", run_dir, "--allow-partial"), 2),
        ):
            clear_error(faultkit.cli(*args, prefix=faultkit.NO_DAC), code, "permission denied")
        st = faultkit.cli("status", run_dir, prefix=faultkit.NO_DAC)
        assert st.returncode == 0 and "sealed 2" in st.stdout, st.stdout + st.stderr
    finally:
        for d in locked:
            d.chmod(0o755)
    assert_kept(run_dir, kept)
    recovered_like_reference(run_dir, reference)


# ---------------------------------------------------------------- the run directory moved


def test_moved_run_directory_works_from_its_new_place_and_the_old_path_is_a_clear_error(tmp_path: Path, reference):
    run_dir, kept = half_sealed(tmp_path / "old")
    moved = tmp_path / "new" / "run"
    moved.parent.mkdir()
    shutil.move(str(run_dir), str(moved))
    for args in (("status", run_dir), ("resume", run_dir), ("merge-and-profile", run_dir), ("run-shard", run_dir, 2)):
        clear_error(faultkit.cli(*args), 2, "run directory not found", str(run_dir))
    assert_kept(moved, kept)
    st = faultkit.cli("status", moved)
    assert st.returncode == 0 and "sealed 2" in st.stdout, st.stdout + st.stderr
    recovered_like_reference(moved, reference)


# ---------------------------------------------------------------- .done edited or copied, plan.json edited


def test_edited_or_foreign_done_markers_are_ignored_named_and_resealed(tmp_path: Path, reference):
    run = synthetic.make(tmp_path / "a", tasks=300, shards=SHARDS, seal=False)
    other = synthetic.make(tmp_path / "b", tasks=301, shards=SHARDS, seal=False)  # another plan
    run_dir = run.run_dir
    assert faultkit.cli("resume", run_dir).returncode == 0
    assert faultkit.cli("resume", other.run_dir).returncode == 0
    marker = lambda i: orjson.loads(store.done_path(run_dir, i).read_bytes())  # noqa: E731
    # 0: copied from another run; 1: counts edited; 2: not JSON any more; 3: rollouts.jsonl edited after sealing
    shutil.copy(store.done_path(other.run_dir, 0), store.done_path(run_dir, 0))
    m1 = marker(1)
    m1["num_rollouts"] += 1
    store.done_path(run_dir, 1).write_bytes(orjson.dumps(m1))
    store.done_path(run_dir, 2).write_bytes(b'{"plan_fingerprint": "')
    data = store.rollouts_path(run_dir, 3).read_bytes()
    store.rollouts_path(run_dir, 3).write_bytes(data.replace(b'"reward":1.0', b'"reward":0.0', 1))
    reasons = ["marker belongs to another plan", "accounts for", "unreadable marker", "content changed after sealing"]

    st = faultkit.cli("status", run_dir, "--all")
    assert st.returncode == 0
    for needle in reasons[:3]:
        assert needle in st.stdout, (needle, st.stdout)
    merged = faultkit.cli("merge-and-profile", run_dir)
    text = clear_error(merged, 5, "shards are not sealed", "shardrun resume")
    for needle in reasons[:3]:
        assert needle in text, (needle, text)
    assert not store.merged_rollouts_path(run_dir).exists()
    # resume re-seals 0-2 from their files without servers; 3 holds what is on disk now (someone edited it)
    res = faultkit.cli("resume", run_dir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sealed(run_dir) == set(range(SHARDS))
    assert "content changed after sealing" in store.shard_log_path(run_dir, 3).read_text()
    store.rollouts_path(run_dir, 3).write_bytes(data)  # put the edited row back: the reference bytes again
    res = faultkit.cli("resume", run_dir)
    assert res.returncode == 0 and sealed(run_dir) == set(range(SHARDS))
    recovered_like_reference(run_dir, reference)


def test_a_seal_only_the_merge_can_refute_is_set_aside_and_resume_seals_the_shard_again(tmp_path: Path, reference):
    """A seal counting one rollout fewer than its file holds (and one more failed), its bytes and hash those of the
    file: `resume`'s check (the hash) cannot see it; the merge, which reads every row, can. It sets the seal aside
    (`.done.damaged`), so `resume` collects the shard again (every row is there: it seals without servers), that
    seal removes the one set aside, and the merge equals the reference."""
    run = synthetic.make(tmp_path, tasks=300, shards=SHARDS, seal=False)
    run_dir = run.run_dir
    assert faultkit.cli("resume", run_dir).returncode == 0
    marker = orjson.loads(store.done_path(run_dir, 1).read_bytes())
    marker.update(num_rollouts=marker["num_rollouts"] - 1, num_failed=marker["num_failed"] + 1)
    store.done_path(run_dir, 1).write_bytes(orjson.dumps(marker))
    assert sealed(run_dir) == set(range(SHARDS))
    merged = faultkit.cli("merge-and-profile", run_dir)
    clear_error(merged, 5, "shard 00001", "damaged seal", "set aside as .done.damaged", "shardrun resume")
    assert store.damaged_seal_path(run_dir, 1).exists() and sealed(run_dir) == set(range(SHARDS)) - {1}
    recovered_like_reference(run_dir, reference)
    assert not store.damaged_seal_path(run_dir, 1).exists()


@pytest.mark.parametrize("edit", ["shard table", "truncated"])
def test_hand_edited_plan_json_is_refused_by_every_command(tmp_path: Path, edit: str, reference):
    runs: list = []
    run_dir, kept = half_sealed(tmp_path, runs)
    cfg = synthetic.launch_config_file(runs[0], tmp_path / "run.yaml")
    original = store.plan_path(run_dir).read_bytes()
    plan = orjson.loads(original)
    if edit == "shard table":
        plan["shards"][0]["num_rollouts"] -= 1
        plan["shards"][1]["num_rollouts"] += 1
    data = original[: len(original) // 2] if edit == "truncated" else orjson.dumps(plan)
    store.plan_path(run_dir).write_bytes(data)
    before = faultkit.tree_bytes(run_dir, skip=lambda p: "/logs/" in str(p) or p.name.endswith(".lock"))
    needle = "unreadable plan" if edit == "truncated" else "edited by hand"
    for args in (
        ("status", run_dir),
        ("resume", run_dir),
        ("merge-and-profile", run_dir),
        ("run-shard", run_dir, 2),
        ("submit", cfg),
        ("plan", cfg, "--write"),
    ):
        clear_error(faultkit.cli(*args), 2, needle, "plan.json")
    assert faultkit.tree_bytes(run_dir, skip=lambda p: "/logs/" in str(p) or p.name.endswith(".lock")) == before
    store.plan_path(run_dir).write_bytes(original)  # restored: everything works again
    recovered_like_reference(run_dir, reference)
