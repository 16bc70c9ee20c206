"""The run directory: the plan read, checked and written, the run's locks, the launch settings, and every other
record read and written through its model (rundir/records.py).

Where everything lies is rundir/paths.py and how files are read and written is rundir/fileio.py; this module keeps
their names (store.rollouts_path, store.atomic_writer) for the stages above rundir, which reach the run directory
through it. The dependency goes one way: store imports records, records imports paths and fileio, never store.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson
from filelock import FileLock
from pydantic import ValidationError

from shardrun.core import gym_adapter, gym_version
from shardrun.core.config import RunConfig
from shardrun.core.errors import BadInput, PlanMismatch, RunDirError
from shardrun.plan import planner
from shardrun.plan.planner import Plan
from shardrun.rundir import blend_input, records, safepaths
from shardrun.rundir.fileio import *  # noqa: F403  (store.atomic_writer, store.complete_lines, ...)
from shardrun.rundir.fileio import TMP_PREFIX, atomic_write_json, atomic_writer, read_lines, read_regular
from shardrun.rundir.fileio import remove_stale_temps
from shardrun.rundir.paths import *  # noqa: F403  (store.rollouts_path, store.shard_dir, ...)
from shardrun.rundir.paths import (
    BLEND_INPUT,
    JOBS_DIR,
    LAUNCHES_FILE,
    LAUNCH_SETTINGS,
    LOCK_FILE,
    MERGED_DIR,
    PLAN_FILE,
    ROLLOUTS,
    SHARD_LOCK,
    SHARDS_DIR,
    blend_input_path,
    launch_settings_path,
    logs_dir,
    materialized_path,
    merged_dir,
    plan_path,
    shard_dir,
)

MAX_OPEN_SHARD_FILES = 256


def merge_lock(run_dir: Path, timeout: float = -1) -> FileLock:
    """Held while merge-and-profile writes merged/ (one merge at a time; flock, never stale)."""
    merged_dir(run_dir).mkdir(parents=True, exist_ok=True)
    return FileLock(str(merged_dir(run_dir) / ".merge.lock"), timeout=timeout)


def run_lock(run_dir: Path, timeout: float = -1) -> FileLock:
    """The run directory's lock (flock based: a killed holder releases it, so it is never stale)."""
    return FileLock(str(Path(run_dir) / LOCK_FILE), timeout=timeout)


def shard_lock(run_dir: Path, index: int, timeout: float = 0) -> FileLock:
    """Held while a shard runs, so two attempts of one shard never run at once (flock: never stale)."""
    return FileLock(str(shard_dir(run_dir, index) / SHARD_LOCK), timeout=timeout)


# ---------------------------------------------------------------- plan


def load_plan(run_dir: Path) -> Plan:
    """Read plan.json (the one reader; its shape is planner.Plan's) and check it was not edited since it was
    written (and that no link at the top of the run directory or in merged/ leads out of it; a shard's own links are
    refused by seal.check)."""
    path = plan_path(run_dir)
    if not Path(run_dir).is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    if not os.path.lexists(path):
        raise RunDirError(f"{path}: no plan here; run `shardrun plan CONFIG --write` or `shardrun submit`")
    refuse_links(run_dir)
    try:
        plan = Plan.from_json(orjson.loads(read_regular(path)))
    except FileNotFoundError:
        raise RunDirError(f"{path}: no plan here; run `shardrun plan CONFIG --write` or `shardrun submit`") from None
    except IsADirectoryError:
        raise RunDirError(f"{path}: a directory, not a plan; the run directory is damaged") from None
    except ValidationError as e:  # not the plan's shape (planner.Plan): the field at fault
        raise PlanMismatch(
            f"{path}: unreadable plan ({records.problem(e)}); it was edited or damaged. Re-plan into a new run directory"
        ) from None
    except orjson.JSONDecodeError as e:
        raise PlanMismatch(
            f"{path}: unreadable plan ({e}); it was edited or damaged. Re-plan into a new run directory"
        ) from None
    if planner.fingerprint(plan) != plan.fingerprint:
        raise PlanMismatch(
            f"{path}: content does not match its fingerprint {plan.fingerprint[:12]}…; plan.json "
            f"was edited by hand. Restore it or plan into a new run directory"
        )
    return plan


def check_run_dir(run_dir: Path) -> None:
    """BadInput unless run_dir is absent, empty or a run directory (never /, the home directory, a file)."""
    own = (SHARDS_DIR, MERGED_DIR, JOBS_DIR, LAUNCHES_FILE, LAUNCH_SETTINGS, LOCK_FILE, BLEND_INPUT)
    safepaths.check_run_root(run_dir, PLAN_FILE, own, TMP_PREFIX)


def refuse_links(run_dir: Path, shards: Iterable[int] = ()) -> None:
    """RunDirError naming a symlink at the top of the run directory, in merged/, or (for `shards`) in shards/, a
    shard directory or its logs/: shardrun never reads or writes through a link out of a run directory (submitit
    keeps its own links inside jobs/)."""
    for directory in (run_dir, merged_dir(run_dir)):
        safepaths.refuse_links_in(directory, run_dir)
    for i in shards:
        safepaths.refuse_links((shard_dir(run_dir, i),), run_dir)
        safepaths.refuse_links_in(shard_dir(run_dir, i), run_dir)
        safepaths.refuse_links_in(logs_dir(run_dir, i), run_dir)


def prepare_run_dir(run_dir: Path) -> None:
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX + "probe.", dir=run_dir)  # own name: two submits may probe
        os.close(fd)
        os.unlink(probe)
    except PermissionError:
        raise RunDirError(f"run_dir: {run_dir} is not writable (permission denied)") from None
    except OSError as e:
        if e.errno == errno.EROFS:
            raise RunDirError(f"run_dir: {run_dir} is on a read-only file system") from None
        if e.errno == errno.ENOSPC:
            raise RunDirError(f"run_dir: no space left on the device holding {run_dir}") from None
        raise RunDirError(f"run_dir: cannot use {run_dir}: {e}") from None


def scan_input(cfg: RunConfig) -> Plan:
    """Validation pass over the input (streamed) -> the plan. Writes nothing. A blend's input is its entries'
    rows (rundir/blend_input.py); its plan names RUN_DIR/input.jsonl, which write_plan writes."""
    hasher = hashlib.sha256()
    version = gym_version.of_settings(cfg.gym.venv if cfg.gym else None, os.environ)
    try:
        overrides = gym_adapter.for_version(version).agent_name_overrides if version else False
    except BadInput as e:  # the venv the config names (or the environment's) holds a release shardrun cannot run
        raise BadInput(f"gym.venv: {e}") from None
    if cfg.entries is not None:
        layout = blend_input.layout(cfg)
        summary = planner.scan(blend_input.lines(layout, hasher), cfg, blend_input.BLEND_SOURCE, overrides, layout)
        info = planner.InputInfo(
            path=str(blend_input_path(cfg.run_dir)), sha256=hasher.hexdigest(), num_lines=summary.num_lines
        )
        return planner.make_plan(cfg, info, summary, version, overrides, layout)
    assert cfg.input_jsonl is not None  # the config holds one of input_jsonl and entries
    src = cfg.input_jsonl
    summary = planner.scan(read_lines(src, hasher), cfg, str(src), overrides)
    info = planner.InputInfo(path=str(src), sha256=hasher.hexdigest(), num_lines=summary.num_lines)
    return planner.make_plan(cfg, info, summary, gym_version=version, agent_name_overrides=overrides)


def existing_plan_matches(run_dir: Path, plan: Plan) -> bool:
    """True if RUN_DIR already holds a plan of the same rollouts (planner.same_rollouts); PlanMismatch if it holds
    another; False if none."""
    if not plan_path(run_dir).exists():
        return False
    old = load_plan(run_dir)
    if planner.same_rollouts(old, plan):
        return True
    raise plan_mismatch(
        old,
        plan,
        f"{run_dir} holds a plan made with other settings",
        "Use a new run_dir, or restore the original input and settings.",
    )


def plan_mismatch(old: Plan, new: Plan, headline: str, advice: str) -> PlanMismatch:
    """The one plan-mismatch error: what differs between the run's plan and the one planned now, and what to do."""
    diffs = planner.plan_differences(old, new)
    return PlanMismatch(
        f"{headline} (fingerprint {old.fingerprint[:12]}…, now {new.fingerprint[:12]}…):\n"
        + "\n".join(f"  - {d}" for d in diffs)
        + f"\n{advice}"
    )


def write_plan(cfg: RunConfig, plan: Plan | None = None) -> tuple[Plan, bool]:
    """Materialize the run directory for `cfg`. Returns (plan, written); an identical plan is a no-op."""
    plan = plan or scan_input(cfg)
    run_dir = cfg.run_dir
    check_run_dir(run_dir)
    refuse_links(run_dir, (s.index for s in plan.shards))
    prepare_run_dir(run_dir)
    with run_lock(run_dir):
        if existing_plan_matches(run_dir, plan):
            return load_plan(run_dir), False  # the plan as recorded (its input path, Gym release, config)
        _refuse_orphan_outputs(run_dir)
        with os_errors_as_domain_errors(f"writing the plan into {run_dir}"):
            _write_shards(plan, cfg)
            atomic_write_json(plan_path(run_dir), plan.to_json())
    return plan, True


@contextlib.contextmanager
def os_errors_as_domain_errors(doing: str) -> Iterator[None]:
    """Turn disk-full / permission / missing-directory errors into RunDirError with what to do next."""
    try:
        yield
    except OSError as e:
        raise os_error(e, doing) from None


def os_error(e: OSError, doing: str = "") -> RunDirError:
    """The RunDirError for an OSError met while `doing` something in a run directory (what happened, what to do)."""
    at = f" {doing}" if doing else ""
    where = f": {e.filename}" if e.filename else ""
    if isinstance(e, PermissionError) or e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return RunDirError(
            f"permission denied{at}{where or f': {e}'}; fix the permissions and rerun (nothing already written is lost)"
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunDirError(
            f"no space left on the device{at}{f' ({e.filename})' if e.filename else ''}; free "
            f"space and rerun (nothing already sealed is lost)"
        )
    if e.errno == errno.ENOENT:
        return RunDirError(f"a path vanished{at}{where}; was the run directory moved or deleted?")
    return RunDirError(f"I/O error{at}: {e}")


def _refuse_orphan_outputs(run_dir: Path) -> None:
    shards = Path(run_dir) / SHARDS_DIR
    if not shards.is_dir():
        return
    for p in shards.glob(f"*/{ROLLOUTS}"):
        if p.stat().st_size > 0:
            raise RunDirError(
                f"{run_dir} has shard outputs ({p}) but no plan.json; refusing to overwrite them. "
                f"Restore plan.json or use a new run_dir"
            )


def _write_shards(plan: Plan, cfg: RunConfig) -> None:
    layout = _write_blend_input(plan, cfg) if cfg.entries is not None else None
    indices = [s.index for s in plan.shards]
    for i in indices:
        shard_dir(cfg.run_dir, i).mkdir(parents=True, exist_ok=True)
        remove_stale_temps(shard_dir(cfg.run_dir, i))
    for g in range(0, len(indices), MAX_OPEN_SHARD_FILES):
        group = indices[g : g + MAX_OPEN_SHARD_FILES]
        _write_shard_group(plan, cfg, group, layout)


def _write_blend_input(plan: Plan, cfg: RunConfig) -> planner.BlendLayout:
    """Write a blend's rows into RUN_DIR/input.jsonl (atomically), checked against the plan's input hash."""
    layout = blend_input.layout(cfg)
    hasher = hashlib.sha256()
    path = blend_input_path(cfg.run_dir)
    with atomic_writer(path) as out:
        for _, row in blend_input.lines(layout, hasher):
            out.write(row + b"\n")
        if hasher.hexdigest() != plan.input.sha256:
            raise BadInput("the blend's entries changed while they were being planned; plan again")
    return layout


def _write_shard_group(plan: Plan, cfg: RunConfig, group: list[int], layout: planner.BlendLayout | None) -> None:
    with contextlib.ExitStack() as stack:
        buffering = max(1 << 14, (64 << 20) // len(group))  # at most ~64 MiB buffered over all open shards
        writers = {i: stack.enter_context(atomic_writer(materialized_path(cfg.run_dir, i), buffering)) for i in group}
        hasher = hashlib.sha256()
        source = Path(plan.input.path) if layout is not None else cfg.input_jsonl
        assert source is not None
        lines = read_lines(source, hasher)
        only = set(group) if len(group) < len(plan.shards) else None
        for shard_index, chunk in planner.materialize(plan, cfg, lines, str(source), only, layout):
            writers[shard_index].write(chunk)
        if hasher.hexdigest() != plan.input.sha256:
            raise BadInput(f"{source}: the input changed while it was being planned; plan again")


# ---------------------------------------------------------------- launch records and counting


def append_launch(run_dir: Path, record: Any) -> None:
    """Append one launch record (a records.LaunchRecord, or its JSON: checked against its model): records.append_launch
    (the one writer). Callers hold run_lock."""
    records.append_launch(run_dir, record)


def read_launches(run_dir: Path) -> list:
    """Every launch record as a records.LaunchRecord, oldest first (records.read_launches, the one reader)."""
    return records.read_launches(run_dir)


def write_launch_settings(run_dir: Path, cfg: RunConfig) -> None:
    """Save the validated config of a launch (config files name env vars only; no secret values exist in it)."""
    atomic_write_json(launch_settings_path(run_dir), {"config": planner.public_config(cfg)})


def read_launch_settings(run_dir: Path) -> RunConfig | None:
    """The config the latest launch saved, or None when nothing was launched yet."""
    try:
        data = orjson.loads(read_regular(launch_settings_path(run_dir)))
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as e:
        raise RunDirError(f"{launch_settings_path(run_dir)}: unreadable ({e}); submit again with the config") from None
    try:
        return RunConfig.model_validate(data["config"])
    except ValidationError as e:
        detail = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        raise RunDirError(
            f"{launch_settings_path(run_dir)}: invalid launch settings ({detail}); resume with --config CONFIG"
        ) from None
    except (KeyError, TypeError):
        raise RunDirError(
            f"{launch_settings_path(run_dir)}: no launch settings in it; resume with --config CONFIG"
        ) from None
