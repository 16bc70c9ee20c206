"""Cost accounting: GPU-hours, rollouts per GPU-hour and tokens per second, per shard and per run.

Pure functions over sealed `.done` markers (seal.make_marker) and, on Slurm, the GPU-hours sacct reports for the
markers' jobs (asked by launch/scheduler.py). Token counts come from the marker's optional `extra`
(`output_tokens`, `input_tokens`, `total_tokens`). Markers describe the attempt that sealed each shard, so
GPU-hours from markers leave out failed attempts; `sacct` reports what the scheduler allocated for the jobs the
markers name (elapsed x allocated GPUs), including start-up.

    costs = cost.shard_costs(markers)                 # markers: records.Seal, e.g. seal.check(...).marker
    total = cost.run_costs(costs)                     # or cost.run_costs(cost.with_sacct(costs, gpu_hours))
    print(render.table(cost.cost_rows(total)))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from shardrun.rundir import records
from shardrun.rundir.records import Seal, WorkerState

TOKEN_KEYS = ("input_tokens", "output_tokens", "total_tokens")


@dataclass(frozen=True)
class ShardCost:
    shard_index: int
    attempt: int
    job_id: str | None
    host: str | None
    started_at: float
    finished_at: float
    gpus: int
    gpu_hours: float
    num_rollouts: int
    num_failed: int
    collect_s: float | None
    server_wait_s: float | None
    tokens: Mapping[str, int]
    sacct_gpu_hours: float | None = None
    unknown_duration: bool = False  # the marker's times go backwards (a clock step): no wall time, no GPU-hours

    @property
    def wall_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)

    @property
    def rollouts_per_gpu_hour(self) -> float | None:
        return self.num_rollouts / self.gpu_hours if self.gpu_hours > 0 else None

    @property
    def output_tokens_per_s(self) -> float | None:
        """Generated tokens per second of collection (collect_s; the wall time when it is missing)."""
        seconds = self.collect_s if self.collect_s else self.wall_s
        out = self.tokens.get("output_tokens")
        return out / seconds if out is not None and seconds > 0 else None


def _num(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else default


MAX_TOKENS = 2**53
"""The most tokens a seal's count may say (9e15: more than any run generates, and exact as a float); a larger,
negative or non-finite count (`1e308`) is damage and counts as unknown, so no sum or rate overflows."""


def token_count(v: Any) -> int | None:
    """A seal's token count as an int, or None when it is missing or not a sane count (MAX_TOKENS)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return int(v) if 0 <= v <= MAX_TOKENS else None


def shard_cost(marker: Seal) -> ShardCost:
    """One marker -> ShardCost. gpu_hours is the marker's, or gpus x (finished - started) when absent."""
    started, finished = marker.started_at or 0.0, marker.finished_at or 0.0
    gpus = marker.gpus or 0
    gpu_hours = marker.gpu_hours
    unknown = finished < started or (gpu_hours is not None and gpu_hours < 0)
    if unknown:  # finished before it started: the clock stepped back; its duration (and GPU-hours) are unknown
        finished, gpu_hours = started, 0.0
    extra = marker.extra or {}
    tokens = {k: n for k in TOKEN_KEYS if (n := token_count(extra.get(k))) is not None}
    return ShardCost(
        shard_index=marker.shard_index,
        attempt=1 if marker.attempt is None else marker.attempt,
        job_id=marker.job_id,
        host=marker.host,
        started_at=started,
        finished_at=finished,
        gpus=gpus,
        gpu_hours=gpu_hours if gpu_hours is not None else gpus * max(0.0, finished - started) / 3600.0,
        num_rollouts=marker.num_rollouts,
        num_failed=marker.num_failed,
        collect_s=marker.collect_s,
        server_wait_s=marker.server_wait_s,
        tokens=tokens,
        unknown_duration=unknown,
    )


def shard_costs(markers: Iterable[Seal | None]) -> list[ShardCost]:
    """Markers (None entries skipped) -> ShardCosts sorted by shard index."""
    return sorted((shard_cost(m) for m in markers if m), key=lambda c: c.shard_index)


@dataclass(frozen=True)
class RunCost:
    shards: int
    gpu_hours: float
    sacct_gpu_hours: float | None  # None when no shard has a sacct record
    rollouts: int
    failed: int
    started_at: float | None
    finished_at: float | None
    tokens: Mapping[str, int]
    collect_s: float
    unknown_durations: int = 0  # shards whose times go backwards: the run's wall time is unknown with them

    @property
    def wall_s(self) -> float:
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return max(0.0, self.finished_at - self.started_at)

    @property
    def rollouts_per_gpu_hour(self) -> float | None:
        return self.rollouts / self.gpu_hours if self.gpu_hours > 0 else None

    @property
    def output_tokens_per_s(self) -> float | None:
        """Whole-run generation throughput: output tokens over the run's wall time (first start to last end); None
        when that time is unknown (a shard's times go backwards)."""
        if self.unknown_durations:
            return None
        out = self.tokens.get("output_tokens")
        return out / self.wall_s if out is not None and self.wall_s > 0 else None


def run_costs(shards: Sequence[ShardCost]) -> RunCost:
    tokens: dict[str, int] = {}
    for key in TOKEN_KEYS:
        if shards and all(key in s.tokens for s in shards):
            tokens[key] = sum(s.tokens[key] for s in shards)
    sacct = [s.sacct_gpu_hours for s in shards if s.sacct_gpu_hours is not None]
    return RunCost(
        shards=len(shards),
        gpu_hours=sum(s.gpu_hours for s in shards),
        sacct_gpu_hours=sum(sacct) if sacct else None,
        rollouts=sum(s.num_rollouts for s in shards),
        failed=sum(s.num_failed for s in shards),
        started_at=min((s.started_at for s in shards), default=None),
        finished_at=max((s.finished_at for s in shards), default=None),
        tokens=tokens,
        collect_s=sum(s.collect_s or 0.0 for s in shards),
        unknown_durations=sum(s.unknown_duration for s in shards),
    )


# ---------------------------------------------------------------- throughput over time


@dataclass(frozen=True)
class Throughput:
    edges_s: tuple[float, ...]  # bin edges, seconds since the first shard started
    rollouts_per_min: tuple[float, ...]  # one per bin
    sealed: tuple[int, ...]  # rollouts in shards sealed by each bin's end


def throughput(shards: Sequence[ShardCost], bins: int = 60) -> Throughput:
    """Rollouts per minute over the run, each shard's rollouts spread evenly over its start..finish."""
    shards = [s for s in shards if not s.unknown_duration]  # a shard with backward times has no place in time
    if not shards:
        return Throughput((), (), ())
    t0 = min(s.started_at for s in shards)
    span = max(max(s.finished_at for s in shards) - t0, 1.0)
    rel = [span * i / bins for i in range(bins + 1)]
    done = [0.0] * bins
    for s in shards:
        overlaps = [
            (i, min(t0 + hi, s.finished_at) - max(t0 + lo, s.started_at))
            for i, (lo, hi) in enumerate(zip(rel, rel[1:]))
        ]
        overlaps = [(i, o) for i, o in overlaps if o > 0]
        covered = sum(o for _, o in overlaps)
        if s.wall_s <= 0 or covered <= 0:  # an instant shard: all its rollouts land in the bin of its finish time
            done[min(bins - 1, int((s.finished_at - t0) / span * bins))] += s.num_rollouts
            continue
        # shares of the overlaps themselves (not of wall_s): for a shard far shorter than the clock's magnitude the
        # differences of absolute times lose digits, and the shares must still add up to all of its rollouts
        for i, o in overlaps:
            done[i] += s.num_rollouts * o / covered
    rate = [d / ((hi - lo) / 60.0) for d, lo, hi in zip(done, rel, rel[1:])]
    sealed = [sum(s.num_rollouts for s in shards if s.finished_at - t0 <= hi + 1e-9) for hi in rel[1:]]
    return Throughput(tuple(rel), tuple(rate), tuple(sealed))


# ---------------------------------------------------------------- sacct


def with_sacct(shards: Sequence[ShardCost], gpu_hours: Mapping[str, float]) -> list[ShardCost]:
    """Attach sacct's GPU-hours (elapsed x allocated GPUs, by job id) to the shards whose job sacct knows."""
    return [
        replace(s, sacct_gpu_hours=gpu_hours[s.job_id]) if s.job_id is not None and s.job_id in gpu_hours else s
        for s in shards
    ]


# ---------------------------------------------------------------- warm workers


@dataclass(frozen=True)
class WorkerCost:
    """One warm worker's allocation split three ways: starting servers, collecting shards (claim to release, every
    shard it held), idle (waiting for a claim, tearing down). The GPU-hours of the shards it sealed are in their
    markers (gpus x collecting time), so they add up to its collecting share less its failed attempts."""

    worker_id: str
    job_id: str | None
    gpus: int
    wall_s: float
    startup_s: float
    collecting_s: float
    sealed: int
    server_starts: int
    slots: int | None = None  # gym.num_samples_in_parallel: its slot gate's limit
    request_s: float = 0.0  # policy request-seconds through its slot gate

    @property
    def occupancy(self) -> float | None:
        """Slot occupancy: request-seconds in flight / (slots x collecting time); None when unknown."""
        if not self.slots or self.collecting_s <= 0 or not self.request_s:
            return None
        return self.request_s / (self.slots * self.collecting_s)

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.wall_s / 3600.0

    @property
    def startup_gpu_hours(self) -> float:
        return self.gpus * self.startup_s / 3600.0

    @property
    def collecting_gpu_hours(self) -> float:
        return self.gpus * self.collecting_s / 3600.0

    @property
    def idle_gpu_hours(self) -> float:
        return max(0.0, self.gpu_hours - self.startup_gpu_hours - self.collecting_gpu_hours)


def worker_cost(state: WorkerState, now: float) -> WorkerCost:
    """A worker's record (RUN_DIR/workers/<id>/worker.json) -> WorkerCost; a running worker counts up to `now`."""
    ended = state.ended_at
    return WorkerCost(
        worker_id=state.worker_id,
        job_id=state.job_id,
        gpus=state.gpus,
        wall_s=max(0.0, (ended if ended is not None else now) - state.started_at),
        startup_s=state.startup_s,
        # the time with a shard held: shards held at once (collector.pipeline_shards) overlap; older records have
        # only the per-shard times
        collecting_s=state.holding_s or sum(state.collecting_s.values()),
        sealed=len(state.sealed),
        server_starts=state.server_starts,
        slots=state.slots,
        request_s=state.request_s,
    )


def worker_costs(run_dir: Path, now: float) -> dict[str, Any]:
    """Start-up, collecting and idle GPU-hours of the run's warm workers (workers_row; empty when it ran one job
    per shard): the one worker-cost line of `status` and the report."""
    return workers_row([worker_cost(w, now) for w in records.read_worker_states(run_dir)])


def workers_row(workers: Sequence[WorkerCost]) -> dict[str, Any]:
    """The run's workers together (for --json, status and the report); empty when the run had none."""
    if not workers:
        return {}
    wall = sum(w.wall_s for w in workers)
    return {
        "workers": len(workers),
        "server_starts": sum(w.server_starts for w in workers),
        "gpu_hours": sum(w.gpu_hours for w in workers),
        "startup_gpu_hours": sum(w.startup_gpu_hours for w in workers),
        "collecting_gpu_hours": sum(w.collecting_gpu_hours for w in workers),
        "idle_gpu_hours": sum(w.idle_gpu_hours for w in workers),
        "job_s": wall,
        "startup_s": sum(w.startup_s for w in workers),
        "collecting_s": sum(w.collecting_s for w in workers),
        "utilization": sum(w.collecting_s for w in workers) / wall if wall > 0 else None,
        "occupancy": run_occupancy(workers),
        "worker_occupancy": {w.worker_id: w.occupancy for w in workers},
    }


def run_occupancy(workers: Sequence[WorkerCost]) -> float | None:
    """The run's slot occupancy: its workers' request-seconds over their slot-seconds of collecting."""
    known = [w for w in workers if w.occupancy is not None]
    slot_s = sum((w.slots or 0) * w.collecting_s for w in known)
    return sum(w.request_s for w in known) / slot_s if slot_s > 0 else None


def workers_rows(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Label/value rows of workers_row for render.table (status and the report)."""
    if not row:
        return []
    return [
        ("workers", f"{row['workers']:,} ({row['server_starts']:,} server starts)"),
        (
            "worker GPU-hours",
            f"{_fmt(row['gpu_hours'], ',.2f')}: start-up {_fmt(row['startup_gpu_hours'], ',.2f')}, collecting "
            f"{_fmt(row['collecting_gpu_hours'], ',.2f')}, idle {_fmt(row['idle_gpu_hours'], ',.2f')}",
        ),
        (
            "worker time",
            f"{hours(row['job_s'])} in jobs: start-up {hours(row['startup_s'])}, collecting "
            f"{hours(row['collecting_s'])} (utilization {_fmt(row['utilization'], '.2f')})",
        ),
        *occupancy_rows(row),
    ]


def occupancy_rows(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Slot occupancy for the run and per worker (rows absent when no worker measured it)."""
    per = {w: o for w, o in (row.get("worker_occupancy") or {}).items() if o is not None}
    if row.get("occupancy") is None:
        return []
    occupancy = row["occupancy"]
    text = f"{share(occupancy)} of the policy's slots busy while collecting"
    if len(per) > 1:
        text += " (" + ", ".join(f"{w} {share(o)}" for w, o in sorted(per.items())) + ")"
    if occupancy < LOW_OCCUPANCY:
        text += "; the policy answered faster than the Gym stack asked: the environments set the pace, not the policy"
    return [("slot occupancy", text)]


LOW_OCCUPANCY = 0.1  # below this share of its slots busy, the policy is not what a run waits for


def share(value: float) -> str:
    """A share of the slots: two decimals, or two significant digits below 0.01 (never a bare 0.00 for a measured
    share)."""
    if 0 < value < 0.01:
        return f"{value:.2g}" if value >= 0.0001 else "<0.0001"
    return f"{value:.2f}"


# ---------------------------------------------------------------- text


def hours(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt(v: float | None, spec: str = ",.1f") -> str:
    return "—" if v is None else format(v, spec)


def cost_rows(run: RunCost) -> list[tuple[str, str]]:
    """Label/value rows for render.table: the run's cost block in `status`, the merge summary and the report."""
    rows = [
        ("sealed shards", f"{run.shards:,}"),
        ("GPU-hours (markers)", _fmt(run.gpu_hours, ",.2f")),
    ]
    if run.sacct_gpu_hours is not None:
        rows.append(("GPU-hours (sacct)", _fmt(run.sacct_gpu_hours, ",.2f")))
    rows += [
        ("rollouts per GPU-hour", _fmt(run.rollouts_per_gpu_hour)),
        ("wall time", unknown_text(run.unknown_durations) if run.unknown_durations else hours(run.wall_s)),
        ("output tokens per second", _fmt(run.output_tokens_per_s)),
    ]
    return rows


def unknown_text(shards: int) -> str:
    """What the text outputs say for durations that cannot be known."""
    return f"unknown ({shards:,} shard(s) finished before they started: the clock stepped back)"


def shard_row(s: ShardCost) -> dict[str, Any]:
    """One shard's cost as a flat dict (for tables and --json)."""
    return {
        "shard": s.shard_index,
        "attempt": s.attempt,
        "job_id": s.job_id,
        "host": s.host,
        "gpus": s.gpus,
        "wall_s": None if s.unknown_duration else round(s.wall_s, 3),
        "gpu_hours": s.gpu_hours,
        "sacct_gpu_hours": s.sacct_gpu_hours,
        "rollouts": s.num_rollouts,
        "failed": s.num_failed,
        "rollouts_per_gpu_hour": s.rollouts_per_gpu_hour,
        "output_tokens": s.tokens.get("output_tokens"),
        "output_tokens_per_s": s.output_tokens_per_s,
    }


def run_row(run: RunCost) -> dict[str, Any]:
    return {
        "shards": run.shards,
        "gpu_hours": run.gpu_hours,
        "sacct_gpu_hours": run.sacct_gpu_hours,
        "rollouts": run.rollouts,
        "failed": run.failed,
        "wall_s": None if run.unknown_durations else run.wall_s,
        "unknown_durations": run.unknown_durations,
        "rollouts_per_gpu_hour": run.rollouts_per_gpu_hour,
        "tokens": dict(run.tokens),
        "output_tokens_per_s": run.output_tokens_per_s,
    }


def sealed_cost_text(row: Mapping[str, Any]) -> str:
    """One line for `shardrun status` from run_row(...) of the sealed shards: throughput per GPU-hour and tokens/s."""
    if not row or not row.get("shards"):
        return "-"
    return (
        f"{_fmt(row.get('rollouts_per_gpu_hour'))} rollouts/GPU-hour, "
        f"{_fmt(row.get('output_tokens_per_s'))} output tokens/s over {row['shards']:,} sealed shard(s)"
    ) + (f"; duration {unknown_text(row['unknown_durations'])}" if row.get("unknown_durations") else "")
