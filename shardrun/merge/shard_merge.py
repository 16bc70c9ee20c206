"""Sealed shards -> the merged row files one unsharded NeMo Gym run would have written, and the merged table.

    merged/rollouts.jsonl                        every kept rollout once, sorted by (task, rollout), raw bytes
    merged/rollouts_materialized_inputs.jsonl    every planned row, sorted by (task, rollout), raw bytes
    merged/rollouts_failures.jsonl               the shards' failure sidecars, sorted by identity

Steps: refuse unsealed shards (unless allow_partial); read every shard once (shard_reader, over one process
pool), resolving its rows to planned identities (identity) and adding it to the table sorted by identity
(merged_table); copy the rows into the merged files in identity order (row_copier); write the failure rows and
name the failed rollouts (rundir.ledger's definition). The caller owns the output files (written atomically,
renamed together) and goes on to profile the table (profile.merge_and_profile).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from shardrun.core.errors import IncompleteRun
from shardrun.core.failure_classes import DEFAULT_ROLES, ServerRoles
from shardrun.merge import row_copier, shard_reader
from shardrun.merge.merged_table import MergedTable, TableBuilder
from shardrun.merge.outcome import MAX_LISTED_FAILED, MergeSummary, MergedShard
from shardrun.merge.shard_reader import FailureRow, ShardReadJob, ShardRead
from shardrun.plan.planner import Plan
from shardrun.rundir import env_manifest, ledger, seal, store
from shardrun.rundir.ledger import FailedRollout


@dataclass(frozen=True)
class RowFiles:
    """Where the merged row files go (open, empty, owned by the caller)."""

    rollouts: IO[bytes]
    materialized: IO[bytes]
    failures: IO[bytes]


def check_seals(run_dir: Path, plan: Plan, allow_partial: bool) -> list[seal.SealState]:
    """Every shard's seal; IncompleteRun if one is unsealed and not allow_partial."""
    states = [seal.check(run_dir, plan, s.index) for s in plan.shards]
    unsealed = [(i, s.reason) for i, s in enumerate(states) if not s.sealed]
    if unsealed and not allow_partial:
        raise IncompleteRun(shard_reader.unsealed_message(run_dir, unsealed, len(states)))
    return states


def merge_shards(
    run_dir: Path,
    plan: Plan,
    states: list[seal.SealState],
    files: RowFiles,
    *,
    allow_partial: bool,
    answer_field: str | None,
    workers: int,
    mask_field: str | None = None,
) -> tuple[MergedTable, MergeSummary]:
    """Read the shards, write the merged row files; the table (planned rows and row locations still held, for
    the caller to take what it needs and release) and the summary of what the merge saw. `mask_field`: the Gym
    release's mask flag (its truthy rows are marked in the table; merged/rollouts.jsonl keeps them)."""
    tick = time.monotonic()
    jobs = [
        ShardReadJob(run_dir, spec.index, spec.num_rollouts, state, allow_partial, answer_field, mask_field)
        for spec, state in zip(plan.shards, states)
    ]
    builder = TableBuilder(plan.num_rollouts, answers=answer_field is not None)
    shards, failures, sources = [], [], []
    for read in shard_reader.read_shards(jobs, workers):
        builder.add(read.index, read.planned, read.rollouts, read.resolution)
        failures += [(read.index, f) for f in read.failures]
        shards.append(merged_shard(read))
        sources.append(read.rollouts.source)
    table = builder.finish()
    summary = MergeSummary(
        str(run_dir), plan.fingerprint, allow_partial, shards=shards, warnings=shard_warnings(shards)
    )
    summary.timings["read_s"] = time.monotonic() - tick
    tick = time.monotonic()
    copy_planned(files.materialized, table, [store.materialized_path(run_dir, s.index) for s in plan.shards])
    copy_rollouts(files.rollouts, table, sources)
    summary.timings["copy_s"] = time.monotonic() - tick
    failed = write_failures(
        files.failures,
        table,
        failures,
        summary,
        ledger.launched_max_attempts(run_dir),
        env_manifest.server_roles(run_dir),
    )
    summary.tally = ledger.failure_tally(failed, plan, ledger.launched_unreliable_rate(run_dir))
    return table, summary


def merged_shard(read: ShardRead) -> MergedShard:
    r, res, state = read.rollouts, read.resolution, read.state
    return MergedShard(
        read.index,
        state.sealed,
        state.reason,
        r.lines,
        len(res.keep),
        res.duplicates,
        res.foreign,
        r.no_identity,
        r.unreadable,
        r.torn_bytes,
        res.renumbered,
        len(read.failures),
        state.marker if state.sealed else None,
        read.failures_rejected,
    )


def shard_warnings(shards: list[MergedShard]) -> list[str]:
    """What the summary should point out about the shards (a seal that disagrees with its file is not trusted: the
    shard is unsealed, with the reason, by shard_reader.counted)."""
    out = []
    for s in shards:
        if s.failure_rows_rejected:
            out.append(
                f"shard {s.index:05d}: {s.failure_rows_rejected:,} failure-sidecar rows without a planned "
                f"identity were left out"
            )
    return out


# ---------------------------------------------------------------- row files


def copy_planned(out: IO[bytes], table: MergedTable, sources: list[Path]) -> None:
    """merged/rollouts_materialized_inputs.jsonl: every planned row, raw bytes, in identity order."""
    with _copy_errors(), row_copier.ByteSources(sources) as src:
        row_copier.copy_rows(out, src, table.p_shard, table.p_offset, table.p_length)


def copy_rollouts(out: IO[bytes], table: MergedTable, sources: list[Path]) -> None:
    """merged/rollouts.jsonl: every kept rollout row, raw bytes (renumbered rows with their planned rollout
    index), in identity order."""

    def renumber(position: int, line: bytes) -> bytes:
        return shard_reader.with_rollout(line, int(table.rollout_of_key(table.r_key[position])))

    with _copy_errors(), row_copier.ByteSources(sources) as src:
        row_copier.copy_rows(out, src, table.r_shard, table.r_offset, table.r_length, renumber, table.r_renumbered)


@contextlib.contextmanager
def _copy_errors() -> Iterator[None]:
    """An OSError while copying rows (a full disk) as the run directory's RunDirError (store's one conversion)."""
    try:
        yield
    except OSError as e:
        raise store.os_error(e, "copying the shards' rows into the merged files") from e


def write_failures(
    out: IO[bytes],
    table: MergedTable,
    failures: list[tuple[int, FailureRow]],
    summary: MergeSummary,
    max_attempts: int,
    roles: ServerRoles = DEFAULT_ROLES,
) -> list[FailedRollout]:
    """Sidecar rows sorted by identity (attempts keep their order); the identities without a rollout that
    failed for good (ledger.failed_rollouts; a shard counts as sealed as it was read, classed with `roles`) are
    the summary's failed rollouts (returned, all of them)."""
    failures.sort(key=lambda sf: (sf[1].task, sf[1].rollout, sf[0]))
    for _, f in failures:
        out.write(f.line)
    summary.failure_rows = len(failures)
    by_shard: dict[int, dict[tuple[int, int], list[dict]]] = {}
    for shard, f in failures:
        by_shard.setdefault(shard, {}).setdefault((f.task, f.rollout), []).append(f.row)
    ids = sorted({(f.task, f.rollout) for _, f in failures})
    if not ids:
        return []
    keys = np.searchsorted(table.tasks, [t for t, _ in ids]) * table.stride + np.array([r for _, r in ids])
    sealed = {s.index: s.sealed for s in summary.shards}
    done = {ident for ident, d in zip(ids, table.has_rollout(keys).tolist()) if d}
    failed = sorted(
        (
            f
            for shard, rows in by_shard.items()
            for f in ledger.failed_rollouts(
                shard, rows, max_attempts, sealed=sealed[shard], done=done.__contains__, roles=roles
            )
        ),
        key=lambda f: (f.task, f.rollout),
    )
    summary.failed_total = len(failed)
    summary.failed = failed[:MAX_LISTED_FAILED]
    summary.failed_ids = [(f.task, f.rollout) for f in failed]
    return failed
