"""`shardrun status`: what every shard of a run is doing, read from the run directory plus one `squeue` call.

Per shard: sealed (a valid `.done`), running / pending (a live job: Slurm's queue, or for the local executor a
recorded pid that is still alive), failed (launched, no live job, not sealed; with the reason and the log), or
never started (never launched). Rollouts done are counted from the rollouts files (a torn last line is not
counted; sealed shards use their marker). Which job ran which shard comes from the launch records that launch.py
appends to RUN_DIR/launches.jsonl, never from submitit's pickles.

`collect` does the reading; `render`, `render_json` and `progress_bar` are pure.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar

import orjson

from shardrun.rundir import cost, env_manifest, ledger, records
from shardrun.rundir import seal
from shardrun.rundir.shard_status import (  # noqa: F401  (status.SEALED and the rest: the names its readers use)
    DAMAGED,
    FAILED,
    LIVE_STATES,
    NEVER_STARTED,
    PENDING,
    RUNNING,
    SEALED,
    STATES,
    ShardStatus,
)
from shardrun.rundir.records import LaunchBase, LaunchRecord, Seal, ShardFailure
from shardrun.launch import backends, label_progress, scheduler, slurm
from shardrun.launch.launcher import Live
from shardrun.workers import worker_view
from shardrun.rundir import store
from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY
from shardrun.core.terminal import shown
from shardrun.plan.planner import Plan

MAX_LISTED = 40
R = TypeVar("R", bound=LaunchBase)


@dataclass(frozen=True)
class RunStatus:
    run_dir: str
    fingerprint: str
    checked_at: float
    shards: list[ShardStatus]
    planned: int
    done: int
    failed_rollouts: int
    counts: dict[str, int]
    gave_up: int
    throughput_per_min: float | None
    eta_s: float | None
    gpu_hours: float
    live_source: str  # how live jobs were found
    warnings: list[str] = field(default_factory=list)
    sealed_cost: dict = field(default_factory=dict)  # cost.run_row over the sealed shards' markers
    merge_jobs: list[dict] = field(default_factory=list)  # the run's merge jobs still queued or running
    failed: list[ledger.FailedRollout] = field(default_factory=list)  # rollouts recorded as failed (first MAX_FAILED)
    failed_listed_of: int = 0  # how many there are in all
    gym_version: str | None = None  # the run's nemo-gym release (the plan's, else its sealed shards')
    workers: list[worker_view.WorkerRow] = field(default_factory=list)  # warm workers (workers/worker_view.py)
    stale_claims: list[worker_view.StaleClaim] = field(default_factory=list)  # claims not renewed within the lease
    worker_cost: dict = field(default_factory=dict)  # cost.workers_row: start-up, collecting, idle GPU-hours
    skipped_decided: int = 0  # rollouts never run because their task was decided (adaptive sampling)
    saved_gpu_hours: float | None = None  # what they would have cost at the sealed shards' GPU-hours per rollout
    labels: list[dict] = field(default_factory=list)  # a blend: progress per label (launch/label_progress.py)
    failures: dict = field(default_factory=dict)  # records.FailureTally's JSON: failed rollouts per label and class
    launched: bool = True  # a launch saved its settings here (resume has something to resume); False: planned only

    @property
    def complete(self) -> bool:
        return self.counts[SEALED] == len(self.shards)

    def indices(self, *states: str) -> list[int]:
        return [s.index for s in self.shards if s.state in states]


# ---------------------------------------------------------------- launch records (pure)


@dataclass
class Launches:
    """The launch records folded per shard (its latest launch, attempts), and the records themselves for the backends
    (launcher.Launched: each reads its own model's records), with what the run-wide views need of them."""

    last_job: dict[int, str] = field(default_factory=dict)
    last_launch: dict[int, LaunchRecord] = field(default_factory=dict)  # the record of each shard's latest launch
    last_submitted: dict[int, float] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    records: list[tuple[int, LaunchRecord]] = field(default_factory=list)  # (line in launches.jsonl, record)
    slurm_names: set[str] = field(default_factory=set)  # Slurm job names of this run (shards and merge jobs)
    local_pids: set[str] = field(default_factory=set)  # local processes the launches recorded
    merge_jobs: list[str] = field(default_factory=list)
    latest: LaunchRecord | None = None
    worker_shards: set[int] = field(default_factory=set)  # shards launched for warm workers (cluster.workers)
    worker_jobs: set[str] = field(default_factory=set)  # the warm workers' jobs
    local_worker_jobs: set[str] = field(default_factory=set)  # those that are processes (pids), not Slurm jobs

    def of(self, kind: type[R]) -> list[tuple[int, R]]:
        """The records of one model (one backend's), with their line numbers."""
        return [(line, rec) for line, rec in self.records if isinstance(rec, kind)]


def fold_launches(launches: Iterable[LaunchRecord]) -> Launches:
    out = Launches()
    for line, rec in enumerate(launches, 1):
        out.records.append((line, rec))
        for i, job_id in rec.shard_jobs.items():
            out.last_job[i] = job_id
            out.last_launch[i] = rec
            out.last_submitted[i] = rec.submitted_at or 0.0
            out.attempts[i] = out.attempts.get(i, 0) + 1
        out.slurm_names |= rec.slurm_names
        out.local_pids.update(rec.local_pids)
        if rec.merge_job:
            out.merge_jobs.append(rec.merge_job)
        out.worker_jobs.update(rec.worker_jobs)
        out.local_worker_jobs.update(rec.local_worker_jobs)
        out.worker_shards.update(rec.shards_for_workers)
        out.latest = rec
    return out


# ---------------------------------------------------------------- live jobs (each backend says which of its jobs are: backends.live)


# ---------------------------------------------------------------- one shard (pure)


def classify(
    index: int,
    planned: int,
    seal_state: seal.SealState,
    launches: Launches,
    live: Mapping[str, Live],
    failure: ShardFailure | None,
    ended: Mapping[str, scheduler.SacctJob],
    counts: tuple[int, int],
    *,
    max_attempts: int,
    gpus_per_shard: int,
    now: float,
    run_dir: Path,
    queued_locally: bool = False,
) -> ShardStatus:
    job_id = launches.last_job.get(index)
    attempts = launches.attempts.get(index, 0)
    log = str(store.job_log_path(run_dir, job_id)) if job_id else None
    marker = seal_state.marker
    if seal_state.sealed and marker is not None:
        return ShardStatus(
            index,
            SEALED,
            planned,
            marker.num_rollouts,
            marker.num_failed,
            attempts,
            job_id,
            "",
            log,
            cost.shard_cost(marker).gpu_hours,  # 0 for a marker whose times go backwards (unknown)
            False,
            marker.num_skipped_decided,
        )
    rollouts, failed = counts
    ignored = "" if seal_state.reason == "no marker" else seal_state.reason
    if job_id is not None and job_id in live:
        job = live[job_id]
        state = RUNNING if job.state == "RUNNING" and not queued_locally else PENDING
        gpu_h = gpus_per_shard * max(0.0, now - job.started_at) / 3600 if job.started_at else 0.0
        reason = job.reason if state == PENDING and job.reason not in ("", "None") else ignored
        if queued_locally:
            reason = f"waiting for its local worker (job {job_id}) to finish the shards before it"
        return ShardStatus(index, state, planned, rollouts, failed, attempts, job_id, reason, log, gpu_h, False)
    if seal_state.damaged:
        return ShardStatus(index, DAMAGED, planned, rollouts, failed, attempts, job_id, ignored, log, 0.0, False)
    if job_id is None:
        return ShardStatus(index, NEVER_STARTED, planned, rollouts, failed, 0, None, ignored, None, 0.0, False)
    reason = failure_reason(job_id, failure, ended)
    if ignored:
        reason = f"{reason}; {ignored}"
    return ShardStatus(
        index, FAILED, planned, rollouts, failed, attempts, job_id, reason, log, 0.0, attempts >= max_attempts
    )


def failure_reason(job_id: str, failure: ShardFailure | None, ended: Mapping[str, scheduler.SacctJob]) -> str:
    """The shard job's own error record for that job if there is one, else what Slurm accounting says."""
    if failure and failure.job_id == job_id and failure.error:
        return failure.error
    if job_id in ended:
        return scheduler.describe_ended(ended[job_id])
    if failure and failure.error:
        return f"job {job_id} ended without sealing the shard (an earlier attempt failed: {failure.error})"
    return f"job {job_id} ended without sealing the shard"


# ---------------------------------------------------------------- rollouts recorded as failed

MAX_FAILED = 200


def failed_rollouts(run_dir: Path, plan: Plan) -> list[ledger.FailedRollout]:
    """Every identity a shard's failure sidecar records as failed for good (ledger.failed_rollouts, the one
    definition): a terminal row (shardrun's, after gym.max_rollout_attempts) or as many rows as attempts (Gym's own;
    its resume skips them). Rollouts are not read here, so the gate alone decides (see ledger.failed_for_good)."""
    max_attempts = ledger.launched_max_attempts(run_dir)
    roles = env_manifest.server_roles(run_dir)
    out = []
    for spec in plan.shards:
        path = store.failures_path(run_dir, spec.index)
        try:
            if path.stat().st_size == 0:
                continue
        except FileNotFoundError:
            continue
        rows: dict[tuple[int, int], list[dict]] = {}
        for row in store.iter_jsonl_objects(path):
            if isinstance(row, dict) and isinstance(row.get(TASK_KEY), int) and isinstance(row.get(ROLLOUT_KEY), int):
                rows.setdefault((row[TASK_KEY], row[ROLLOUT_KEY]), []).append(row)
        out += ledger.failed_rollouts(spec.index, rows, max_attempts, roles=roles)
    return out


# ---------------------------------------------------------------- the run


def run_gym_version(plan: Plan, markers: Iterable[Seal | None]) -> str | None:
    """The nemo-gym release of the run: the plan's, else the one its sealed shards ran with (all of them, when a run
    planned without a Gym venv was sealed under several)."""
    if plan.gym_version:
        return plan.gym_version
    found = sorted({m.gym_version for m in markers if m and m.gym_version})
    return ", ".join(found) or None


def collect(
    run_dir: Path,
    *,
    now: float | None = None,
    plan: Plan | None = None,
    query_live: Callable[[Iterable[str]], dict[str, scheduler.LiveJob]] = scheduler.query_live_jobs,
    query_ended: Callable[[Iterable[str]], dict[str, scheduler.SacctJob]] = scheduler.query_sacct,
) -> RunStatus:
    """Read the run directory, ask Slurm once for the run's live jobs, and classify every shard: observe (seals,
    live jobs, how ended jobs ended, lines recorded), classify_shards, the warm workers' view (worker_view), then
    the run's totals."""
    run_dir = Path(run_dir)
    plan = plan or store.load_plan(run_dir)
    now = time.time() if now is None else now
    launches = fold_launches(records.read_launches(run_dir))
    latest = launches.latest
    max_attempts = (latest.max_attempts if latest else None) or 3
    seen = observe(run_dir, plan, launches, query_live, query_ended)
    shards = classify_shards(run_dir, plan, launches, seen, now=now, max_attempts=max_attempts)
    workers: list[worker_view.WorkerRow] = []
    stale: list[worker_view.StaleClaim] = []
    if launches.worker_shards or launches.worker_jobs:  # warm workers: shards are held by claims, not jobs
        shards, workers, stale = worker_view.view(
            run_dir,
            shards,
            live_jobs=seen.live.keys(),
            local_jobs=launches.local_worker_jobs,
            launched=launches.worker_shards,
            worker_jobs=launches.worker_jobs,
            now=now,
            max_attempts=max_attempts,
        )
    failed = failed_rollouts(run_dir, plan)
    counts = {state: sum(1 for s in shards if s.state == state) for state in STATES}
    rate, eta = throughput(latest, plan, shards, counts, now)
    sealed = {i: st.marker for i, st in seen.seals.items() if st.sealed and st.marker is not None}
    return RunStatus(
        run_dir=str(run_dir),
        fingerprint=plan.fingerprint,
        checked_at=now,
        shards=shards,
        planned=plan.num_rollouts,
        done=sum(s.done for s in shards),
        failed_rollouts=sum(s.failed_rollouts for s in shards),
        counts=counts,
        gave_up=sum(1 for s in shards if s.gave_up),
        throughput_per_min=rate,
        eta_s=eta,
        gpu_hours=sum(s.gpu_hours for s in shards),
        live_source=live_source(launches, seen.live),
        warnings=seen.warnings,
        merge_jobs=merge_job_rows(launches, seen.live),
        failed=failed[:MAX_FAILED],
        failed_listed_of=len(failed),
        gym_version=run_gym_version(plan, sealed.values()),
        workers=workers,
        stale_claims=stale,
        worker_cost=cost.worker_costs(run_dir, now) if launches.worker_shards or launches.worker_jobs else {},
        launched=bool(launches.records) or store.launch_settings_path(run_dir).is_file(),
        sealed_cost=cost.run_row(cost.run_costs(cost.shard_costs(sealed.values()))),
        skipped_decided=sum(s.skipped_decided for s in shards),
        saved_gpu_hours=saved_gpu_hours(shards),
        labels=label_progress.label_rows(run_dir, plan, [(f.task, f.failure_class) for f in failed], sealed),
        failures=ledger.failure_tally(failed, plan, ledger.launched_unreliable_rate(run_dir)).to_json(),
    )


@dataclass
class Observed:
    """What `observe` read of the run: each shard's seal, the live jobs (and what could not be found out), the error
    records of unsealed shards whose job is gone, the lines of unsealed shards' files, and how ended Slurm jobs
    ended (sacct)."""

    seals: dict[int, seal.SealState]
    live: dict[str, Live]
    warnings: list[str]
    failures: dict[int, ShardFailure | None]
    lines: dict[int, tuple[int, int]]  # unsealed shard -> (rollout lines, failure lines)
    ended: dict[str, scheduler.SacctJob]


def observe(
    run_dir: Path,
    plan: Plan,
    launches: Launches,
    query_live: Callable[[Iterable[str]], dict[str, scheduler.LiveJob]],
    query_ended: Callable[[Iterable[str]], dict[str, scheduler.SacctJob]],
) -> Observed:
    """Every backend says which of its jobs are live (backends.live); Slurm answers in tens of milliseconds, so it
    is asked while the run directory is read (threads wait on the commands), and sacct likewise."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        asking = pool.submit(backends.live, launches, query_live)
        seals = {spec.index: seal.check(run_dir, plan, spec.index) for spec in plan.shards}
        answer = asking.result()
        gone = [
            i
            for i, s in seals.items()
            if not s.sealed and i in launches.last_job and launches.last_job[i] not in answer.jobs
        ]
        failures = {i: records.read_failure(run_dir, i) for i in gone}
        to_ask = ended_jobs_to_ask(launches, gone, failures)
        ending = pool.submit(query_ended, to_ask) if to_ask else None
        lines = {
            i: (
                store.count_complete_lines(store.rollouts_path(run_dir, i)),
                store.count_complete_lines(store.failures_path(run_dir, i)),
            )
            for i, st in seals.items()
            if not st.sealed
        }
        ended: dict[str, scheduler.SacctJob] = ending.result() if ending else {}
    return Observed(seals, answer.jobs, list(answer.warnings), failures, lines, ended)


def ended_jobs_to_ask(launches: Launches, gone: Iterable[int], failures: Mapping[int, ShardFailure | None]) -> set[str]:
    """The jobs (arrays) to ask sacct how they ended: those of shards whose job is gone without an error record of
    that job, launched by a backend whose shard jobs Slurm accounts for."""
    out = set()
    for i in gone:
        job, failure = launches.last_job[i], failures.get(i)
        if backends.for_record(launches.last_launch[i]).accounted_by_slurm and (
            failure is None or failure.job_id != job
        ):
            out.add(job.split("_", 1)[0])
    return out


def waiting_in_turn(run_dir: Path, launches: Launches, seen: Observed) -> set[int]:
    """Unsealed shards whose live job runs its shards one after another and has not started them since the launch
    (their log is older than it): they wait for the shards before them."""
    return {
        i
        for i, j in launches.last_job.items()
        if backends.for_record(launches.last_launch[i]).runs_shards_in_turn
        and j in seen.live
        and not seen.seals[i].sealed
        and _mtime(store.shard_log_path(run_dir, i)) < launches.last_submitted.get(i, 0.0)
    }


def classify_shards(
    run_dir: Path, plan: Plan, launches: Launches, seen: Observed, *, now: float, max_attempts: int
) -> list[ShardStatus]:
    """Every shard's status from what was observed (`classify`, one shard); a running job's GPU-hours at the latest
    launch's GPUs per shard."""
    in_turn = waiting_in_turn(run_dir, launches, seen)
    gpus = (launches.latest.gpus_per_shard or 0) if launches.latest else 0
    return [
        classify(
            spec.index,
            spec.num_rollouts,
            seen.seals[spec.index],
            launches,
            seen.live,
            seen.failures.get(spec.index),
            seen.ended,
            seen.lines.get(spec.index, (0, 0)),
            max_attempts=max_attempts,
            gpus_per_shard=gpus,
            now=now,
            run_dir=run_dir,
            queued_locally=spec.index in in_turn,
        )
        for spec in plan.shards
    ]


def merge_job_rows(launches: Launches, live: Mapping[str, Live]) -> list[dict]:
    """The run's merge jobs (and jobs after the workers) still queued or running."""
    return [{"job_id": j, "state": live[j].state, "reason": live[j].reason} for j in launches.merge_jobs if j in live]


def live_source(launches: Launches, live: Mapping[str, Live]) -> str:
    """How the live jobs were found: squeue by the run's job names, the recorded local pids."""
    sources = []
    if launches.slurm_names:
        slurm_live = sum(1 for j in live.values() if j.on_slurm)
        sources.append(f"squeue --name={','.join(sorted(launches.slurm_names))}: {slurm_live} live")
    if launches.local_pids:
        sources.append(f"local pids: {sum(1 for p in launches.local_pids if p in live)} live")
    return "; ".join(sources) or "nothing launched yet"


def throughput(
    latest: LaunchRecord | None, plan: Plan, shards: list[ShardStatus], counts: Mapping[str, int], now: float
) -> tuple[float | None, float | None]:
    """(rollouts per minute since the latest launch, seconds left at that rate while jobs are live), or None."""
    if latest is None or latest.submitted_at is None:
        return None, None
    elapsed = now - latest.submitted_at
    gained = sum(s.done for s in shards) - (latest.done_at_submit or 0)
    if elapsed <= 0 or gained <= 0:
        return None, None
    rate = gained / elapsed * 60
    remaining = plan.num_rollouts - sum(s.done for s in shards) - sum(s.skipped_decided for s in shards)
    if counts[RUNNING] + counts[PENDING] > 0 and remaining > 0:
        return rate, remaining / (rate / 60)
    return rate, None


# ---------------------------------------------------------------- warm workers


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


# ---------------------------------------------------------------- rendering (pure)


def progress_bar(done: int, total: int, width: int = 30) -> str:
    frac = 1.0 if total <= 0 else min(1.0, done / total)
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}%"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d {h:02d}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s:02d}s"


def saved_gpu_hours(shards: list[ShardStatus]) -> float | None:
    """GPU-hours the skipped rollouts would have cost, at the sealed shards' GPU-hours per rollout run (None when
    nothing was skipped or no sealed shard ran a rollout)."""
    sealed = [s for s in shards if s.state == SEALED]
    skipped = sum(s.skipped_decided for s in sealed)
    ran = sum(s.done for s in sealed)
    if not skipped or not ran:
        return None
    return skipped * sum(s.gpu_hours for s in sealed) / ran


_LABEL = {
    SEALED: "sealed",
    RUNNING: "running",
    PENDING: "pending",
    FAILED: "failed",
    DAMAGED: "damaged",
    NEVER_STARTED: "never started",
}


def render(st: RunStatus, *, show_all: bool = False) -> str:
    """`shardrun status` as text: the summary table, the shards per state, the unsealed shards, the rollouts
    recorded as failed, what to do next, a blend's labels, the warm workers and the warnings."""
    from shardrun.plan.render import table

    out = [table(summary_rows(st)), ""]
    out += state_lines(st)
    out += unsealed_lines(st, show_all=show_all)
    out += failed_rollout_lines(st)
    out += failure_class_lines(st)
    out += advice_lines(st)
    out += label_lines(st)
    out += render_workers(st)
    out += [f"warning: {shown(w)}" for w in st.warnings]
    return "\n".join(out)


def summary_rows(st: RunStatus) -> list[tuple[str, str]]:
    """The summary table's rows: the run, shards and rollouts, throughput and ETA, cost, jobs, merge jobs."""
    rows = [
        ("run", f"{shown(st.run_dir)} ({len(st.shards):,} shards, plan {st.fingerprint[:12]}…)"),
        ("shards", " · ".join(f"{_LABEL[k]} {st.counts[k]:,}" for k in STATES if k != DAMAGED or st.counts[k])),
        (
            "rollouts",
            f"{st.done:,} / {st.planned:,} {progress_bar(st.done + st.skipped_decided, st.planned)}"
            + (f" ({st.failed_rollouts:,} recorded as failed)" if st.failed_rollouts else ""),
        ),
        *skipped_rows(st),
        ("throughput", f"{st.throughput_per_min:,.1f} rollouts/min" if st.throughput_per_min else "-"),
        ("ETA", duration(st.eta_s) if st.eta_s is not None else ("done" if st.complete else "-")),
        ("GPU-hours", f"{st.gpu_hours:,.2f} (sealed shards + running jobs)"),
        ("sealed cost", cost.sealed_cost_text(st.sealed_cost)),
        *cost.workers_rows(st.worker_cost),
        ("jobs", st.live_source),
    ]
    if st.gym_version:
        rows.insert(1, ("Gym", f"nemo-gym {st.gym_version}"))
    for m in st.merge_jobs:
        why = f" ({m['reason']})" if m["reason"] not in ("", "None") else ""
        rows.append(("merge job", f"{m['job_id']} {m['state'].lower()}{why}"))
    return rows


def skipped_rows(st: RunStatus) -> list[tuple[str, str]]:
    """Adaptive sampling: the rollouts skipped as decided, and the GPU-hours that saved (none skipped: no row)."""
    if not st.skipped_decided:
        return []
    saved = f", about {st.saved_gpu_hours:,.2f} GPU-hours saved" if st.saved_gpu_hours is not None else ""
    return [
        (
            "skipped (decided)",
            f"{st.skipped_decided:,} rollouts ({100 * st.skipped_decided / st.planned:.0f}% of planned){saved}",
        )
    ]


def state_lines(st: RunStatus) -> list[str]:
    """The shards in each state, as ranges."""
    return [f"{_LABEL[k]:>13}: {slurm.format_ranges(idx)}" for k in STATES if (idx := st.indices(k))]


def unsealed_lines(st: RunStatus, *, show_all: bool) -> list[str]:
    """A table of the shards not sealed (the first MAX_LISTED unless `show_all`): state, rollouts, attempts, job,
    and why (a failed shard: its reason and log)."""
    not_sealed = [s for s in st.shards if s.state != SEALED]
    if not not_sealed:
        return []
    out = ["", f"{'shard':>5}  {'state':<13} {'rollouts':>15}  {'attempts':>8}  {'job':<14} reason / log"]
    listed = not_sealed if show_all else not_sealed[:MAX_LISTED]
    for s in listed:
        detail = shown(s.reason)
        if s.state == FAILED:
            detail = f"{shown(s.reason)}{' [gave up]' if s.gave_up else ''}; log {shown(s.log)}"
        out.append(
            f"{s.index:>5}  {_LABEL[s.state]:<13} {f'{s.done:,}/{s.planned:,}':>15}  {s.attempts:>8}  "
            f"{s.job_id or '-':<14} {detail}".rstrip()
        )
    if len(listed) < len(not_sealed):
        out.append(f"... {len(not_sealed) - len(listed)} more (--all to list every shard, --json for machines)")
    return out


def failed_rollout_lines(st: RunStatus) -> list[str]:
    """The rollouts recorded as failed (the first MAX_LISTED)."""
    if not st.failed:
        return []
    out = ["", "rollouts recorded as failed (task:rollout, shard, attempts, class, reason):"]
    out += [
        f"  {f.task}:{f.rollout}  shard {f.shard:05d}  {f.attempts}  {f.failure_class}  {shown(f.reason)}"
        for f in st.failed[:MAX_LISTED]
    ]
    if st.failed_listed_of > MAX_LISTED:
        out.append(f"  ... and {st.failed_listed_of - MAX_LISTED:,} more (--json, or the shards' {store.FAILURES})")
    return out


def failure_class_lines(st: RunStatus) -> list[str]:
    """The failed rollouts by class (all of them, not only those listed) and the labels (or the run) whose failures
    are above report.unreliable_failure_rate: unreliable, not hard."""
    if not st.failed_listed_of or not st.failures:
        return []
    tally = records.FailureTally.model_validate(st.failures)
    return ["", f"failed rollouts by class: {ledger.class_text(tally.by_class)} (failures, never scores)"] + [
        line.removeprefix("warning: ") for line in ledger.unreliable_lines(tally)
    ]


def advice_lines(st: RunStatus) -> list[str]:
    """What to do next: submit a run only planned, raise max_attempts for the shards given up on, or resume the
    others."""
    if not st.launched and not st.complete:
        return [
            "",
            "nothing was launched from this run directory yet (planned only): run `shardrun submit CONFIG` with the "
            "config it was planned from",
        ]
    if st.gave_up:
        return [
            "",
            f"{st.gave_up} shard(s) failed max_attempts times; resume will not retry them (see reasons "
            f"above; raise cluster.max_attempts to try again)",
        ]
    if st.counts[FAILED] or st.counts[NEVER_STARTED] or st.counts[DAMAGED]:
        return ["", "run `shardrun resume RUN_DIR` to resubmit the failed, damaged and never-started shards"]
    return []


def label_lines(st: RunStatus) -> list[str]:
    """A blend's progress per label, and the labels that collected nothing (a failing lane)."""
    out = label_progress.render_rows(st.labels, progress_bar)
    silent = [r["label"] for r in st.labels if r["silent"]]
    if silent:
        out.append(f"warning: label(s) {', '.join(shown(x) for x in silent)} collected nothing: that lane is failing")
    return out


def render_workers(st: RunStatus) -> list[str]:
    """The warm workers section and the stale claims (pure)."""
    out: list[str] = []
    if st.workers:
        out += [
            "",
            f"{'worker':<22} {'job':<14} {'host':<16} {'state':<11} {'shard':>5} {'sealed':>6}  servers up since",
        ]
        for w in st.workers:
            since = datetime.fromtimestamp(w.servers_up_since).strftime("%H:%M:%S") if w.servers_up_since else "-"
            out.append(
                f"{shown(w.worker_id):<22} {shown(w.job_id or '-'):<14} {shown(w.host):<16} "
                f"{shown(w.state):<11} {w.holding:>5} {w.sealed:>6}  {since}"
                + (
                    f" ({shown((w.exit_reason or '').splitlines()[0] if w.exit_reason else '')})"
                    if w.state == FAILED
                    else ""
                )
            )
        for w in st.workers:  # each failed worker's whole cause (a server's log lines included) and its log
            if w.state == FAILED and w.exit_reason:
                out += ["", f"worker {shown(w.worker_id)} failed: {shown(w.exit_reason)}"]
                log = store.worker_log_path(Path(st.run_dir), w.worker_id)
                if log.is_file():
                    out.append(f"  log: {shown(str(log))}")
    for c in st.stale_claims:
        out.append(
            f"stale claim: shard {c.shard} by worker {shown(c.worker_id)} (job {shown(c.job_id)}, host "
            f"{shown(c.host)}, pid {c.pid}): no heartbeat for {c.age_s:.0f} s; the next worker to look takes it over"
        )
    return out


def render_json(st: RunStatus) -> str:
    data = asdict(st)
    data["complete"] = st.complete
    if not st.labels:  # a run without a blend: the JSON as before blends
        del data["labels"]
    for s in data["shards"]:
        s["done"] = s["rollouts"] + s["failed_rollouts"]
    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode()
