"""One shard on one node: policy server -> Gym stack -> collector rounds under the watchdog -> seal -> teardown.

`run_shard(run_dir, index)` is everything a shard job does. All state is in the run directory: a valid `.done`
means the shard is never run again; otherwise the shard resumes from its files (a torn last line is cut first),
so a rerun after a crash, a kill or a walltime runs only the identities still missing.

Rounds. Each round is one `ng_collect_rollouts` resume over the shard's materialized rows. A round that exits 0
with nothing pending ends collection. A round that exits non-zero because a /run failed (Gym 0.4.0 aborts the
whole collector on one failed row) gets the failed identities recorded in the retry ledger; an identity that
failed `gym.max_rollout_attempts` times is written to rollouts_failures.jsonl (terminal, with its reason, never
as reward 0) and the next round runs the rest. Anything else fails the shard with the collector's log tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from shardrun.shard import collector
from shardrun.core import gym_adapter
from shardrun.shard import gym_stack
from shardrun.rundir import decided
from shardrun.rundir import ledger
from shardrun.shard import collector_service, policy, slot_gate
from shardrun.rundir import records, seal
from shardrun.rundir import store, tail_help
from shardrun.shard import watchdog
from shardrun.core.config import GymConfig, PolicyConfig, RunConfig
from shardrun.core.errors import BadInput, ServerFailure, ShardFailed, ShardrunError
from shardrun.plan.planner import Plan
from shardrun.rundir.records import Seal


HELP_POLL_S = 0.5  # how often a shard waiting for its helpers looks at their shares


@dataclass(frozen=True)
class ShardResult:
    index: int
    state: str  # "sealed" (by this call) or "already_sealed"
    marker: Seal | None


class ShardLog:
    """shardrun's own lines for one shard: logs/shard.log, and stderr (the job log)."""

    def __init__(self, path: Path, index: int):
        self.path = path
        self.index = index
        with contextlib.suppress(OSError):  # an unwritable run directory is reported by the shard itself
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, message: str) -> None:
        line = f"[shardrun {time.strftime('%Y-%m-%d %H:%M:%S')} shard {self.index:05d}] {message}"
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # disk full, permission denied: the line still reaches the job log
            line += f" (not in {self.path.name}: {e.strerror})"
        print(line, flush=True)


class ShardInterrupted(ShardFailed):
    """The shard process got SIGTERM/SIGINT (cancel, walltime): it tears down and exits non-zero."""


def run_shard(
    run_dir: Path | str,
    index: int,
    *,
    job_id: str | None = None,
    plan: Plan | None = None,
    attempt: int | None = None,
    **warm: Any,
) -> ShardResult:
    """Run shard `index` of the plan in `run_dir` to a seal, or raise a ShardrunError (recorded in `.failed`).

    A shard job starts and stops its own servers; a warm worker (shard/worker.py) passes its running ones and
    what it adds (`servers`, `worker`, `checks`, `known`: see Shard), so both run exactly this per-shard work."""
    run_dir = Path(run_dir)
    plan = plan or store.load_plan(run_dir)
    if not 0 <= index < len(plan.shards):
        raise BadInput(
            f"INDEX {index}: no such shard; the plan has {len(plan.shards)} shards (0 to {len(plan.shards) - 1})"
        )
    log = ShardLog(store.shard_log_path(run_dir, index), index)
    state = seal.check(run_dir, plan, index, deep=True)
    if state.sealed:
        log("already sealed; nothing to do")
        return ShardResult(index, "already_sealed", state.marker)
    if state.reason != "no marker":
        log(f"marker ignored: {state.reason}")
    cfg = launch_config(run_dir, plan)
    attempt = attempt or shard_attempt(run_dir, index)
    with holding_shard_lock(run_dir, index):
        marker = run_locked(run_dir, index, plan, cfg, log, job_id, attempt, **warm)
    log(
        f"sealed: {marker.num_rollouts} rollouts, {marker.num_failed} failed, "
        f"servers {marker.server_wait_s or 0.0:.1f} s, collecting {marker.collect_s or 0.0:.1f} s"
    )
    return ShardResult(index, "sealed", marker)


@contextlib.contextmanager
def holding_shard_lock(run_dir: Path, index: int) -> Iterator[None]:
    """The shard's lock, or ShardFailed at once when another process runs the shard (its state is left alone)."""
    from filelock import Timeout

    lock = store.shard_lock(run_dir, index, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ShardFailed(
            f"shard {index} is already running (its lock {lock.lock_file} is held by another process)"
        ) from None
    except OSError as e:
        raise store.os_error(e, f"locking shard {index}") from None
    try:
        yield
    finally:
        lock.release()


def run_locked(
    run_dir: Path,
    index: int,
    plan: Plan,
    cfg: RunConfig,
    log: ShardLog,
    job_id: str | None,
    attempt: int,
    **warm: Any,
) -> Seal:
    """One attempt; a failure is recorded in `.failed` (and the shard log) and re-raised as a domain error."""
    try:
        with interruptible():
            log(f"start: attempt {attempt}, job {job_id or '-'}, host {socket.gethostname()}, pid {os.getpid()}")
            marker = Shard(run_dir, index, plan, cfg, log, job_id, attempt, **warm).run()
    except Exception as exc:
        e = store.os_error(exc, f"running shard {index}") if isinstance(exc, OSError) else exc
        error = describe(e)
        log(f"FAILED: {error}")
        with contextlib.suppress(OSError):  # a full or unwritable disk must not hide the error itself
            records.write_failure(
                run_dir,
                index,
                records.ShardFailure(
                    job_id=job_id, error=error, attempt=attempt, at=time.time(), host=socket.gethostname()
                ),
            )
        if e is not exc:
            raise e from exc
        if isinstance(e, ShardrunError):
            raise
        raise ShardFailed(f"shard {index}: {error}") from e
    with contextlib.suppress(FileNotFoundError):
        store.shard_failure_path(run_dir, index).unlink()
    return marker


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def launch_config(run_dir: Path, plan: Plan) -> RunConfig:
    cfg = store.read_launch_settings(run_dir) or RunConfig.model_validate(plan.config)
    cfg.require("gym", "policy")
    return cfg


def shard_attempt(run_dir: Path, index: int) -> int:
    """How many launches included this shard, this one too (from the launch records; 1 when run by hand)."""
    launched = sum(1 for rec in records.read_launches(run_dir) if index in rec.shard_jobs)
    return max(1, launched)


def gpus_visible() -> int:
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([d for d in devices.split(",") if d.strip() and d.strip() != "-1"]) if devices else 0


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM/SIGINT become ShardInterrupted (so teardown runs); only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise ShardInterrupted(f"interrupted by {signal.Signals(signum).name}; servers stopped, progress kept")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@dataclass
class Servers:
    """A running policy endpoint and Gym stack: a shard job's own, or a warm worker's (started once)."""

    endpoint: policy.PolicyEndpoint
    stack: gym_stack.GymStack
    ready_s: float  # seconds from the start to both being ready
    up_since: float  # Unix time they became ready
    gate: slot_gate.Gate | None = None  # a warm worker's: the stack talks to the policy through it
    service: collector_service.CollectorService | None = None  # a warm worker's: collects shard after shard

    def problem(self) -> str | None:
        return (
            self.endpoint.problem()
            or (self.gate.problem() if self.gate else None)
            or self.stack.problem()
            or (self.service.problem() if self.service else None)
        )

    def groups(self) -> list[tuple[int, int]]:
        """The process groups of the servers started here (processes.Proc.group): a worker records them so that
        another worker on its host can reap them if it is SIGKILLed."""
        procs = [self.stack.proc] + ([self.endpoint.server.proc] if self.endpoint.server is not None else [])
        procs += [self.service.proc] if self.service is not None else []
        return [g for g in (p.group for p in procs) if g is not None]

    def stop(self) -> None:
        try:
            if self.service is not None:
                self.service.stop()
        finally:
            self._stop_servers()

    def _stop_servers(self) -> None:
        try:
            self.stack.stop()
        finally:
            try:
                if self.gate is not None:
                    self.gate.stop()
            finally:
                self.endpoint.stop()


def start_servers(
    policy_cfg: PolicyConfig,
    gym: GymConfig,
    run_dir: Path,
    place: gym_stack.StackPlace,
    log: Callable[[str], None],
    gated: bool = False,
    service: bool = False,
    rollouts_per_slot: float = 1.0,
) -> Servers:
    """Start (or check) the policy, then the Gym stack at `place`; both ready, or neither left running. `gated` (a
    warm worker): the stack reaches the policy through a slot gate admitting gym.num_samples_in_parallel requests at
    once (shard/slot_gate.py); `service` (a warm worker's, unless cluster.collector_service is off): a collector
    service (shard/collector_service.py) collects shard after shard, `rollouts_per_slot` rollouts in flight per slot of
    the gate."""
    t0 = time.monotonic()
    endpoint = policy.open_policy(policy_cfg, place.home)
    gate = None
    try:
        for note in endpoint.notes:
            log(f"note: {note}")
        log(
            f"policy ready in {time.monotonic() - t0:.1f} s: {', '.join(endpoint.base_urls)} model {endpoint.model_name}"
        )
        urls = list(endpoint.base_urls)
        if gated:
            gate = slot_gate.Gate(urls, gym.num_samples_in_parallel)
            urls = gate.urls
            log(f"slot gate at {', '.join(urls)}: {gym.num_samples_in_parallel or 'unlimited'} request(s) at once")
        stack, waited = gym_stack.start_ready(
            run_dir, -1, gym, urls, endpoint.api_key, endpoint.model_name, place=place
        )
    except BaseException:
        if gate is not None:
            gate.stop()
        endpoint.stop()
        raise
    log(f"Gym servers ready in {waited:.1f} s (head server port {stack.port}, {len(stack.instances)} servers)")
    servers = Servers(endpoint, stack, time.monotonic() - t0, time.time(), gate)
    if service:
        try:
            venv = gym_stack.gym_venv(gym, os.environ)
            servers.service = collector_service.start(
                gym_adapter.for_venv(venv), venv, stack, gym, place.home, rollouts_per_slot=rollouts_per_slot
            )
        except BaseException:
            servers.stop()
            raise
        limit = collector_service.budget(gym.num_samples_in_parallel, rollouts_per_slot)
        log(
            f"collector service started (pid {servers.service.proc.pid}): shard after shard, one budget of "
            f"{limit or 'unlimited'} rollout(s) in flight"
        )
    return servers


class Shard:
    """One attempt at one shard (holds the shard lock while it runs). A warm worker passes its running `servers`
    (started before this shard and stopped after it), `worker` (recorded in the seal: its id, whether its servers
    were already warm), extra watchdog `checks` (its claim, its time limit) and, with adaptive sampling, `known`:
    the run's rollouts it has read so far (rundir/decided.py), so that this start reads only what is new."""

    def __init__(
        self,
        run_dir: Path,
        index: int,
        plan: Plan,
        cfg: RunConfig,
        log: ShardLog,
        job_id: str | None,
        attempt: int,
        *,
        servers: Servers | None = None,
        worker: dict[str, Any] | None = None,
        checks: Sequence[watchdog.Check] = (),
        known: decided.RunRollouts | None = None,
    ):
        self.run_dir, self.index, self.plan, self.cfg, self.log = run_dir, index, plan, cfg, log
        self.job_id, self.attempt = job_id, attempt
        self.servers, self.worker, self.checks = servers, worker, list(checks)
        self.known = known
        if cfg.gym is None or cfg.policy is None:  # submit and resume refuse such a config before launching
            raise BadInput(f"shard {index}: the run config has no {'gym' if cfg.gym is None else 'policy'} section")
        self.gym: GymConfig = cfg.gym
        self.policy: PolicyConfig = cfg.policy
        self.started_at = time.time()
        self.server_wait_s = 0.0
        self.collect_s = 0.0
        self.teardown_started: float | None = None
        self.gym_version: str | None = plan.gym_version
        self.skipped: set[tuple[int, int]] = set()  # rows skipped because their task is decided (adaptive sampling)
        self.lent: dict[str, tail_help.Grant] = {}  # shares of the shard lent to helping workers, not folded in yet
        self.lease_s = cfg.cluster_or_default.claim_lease_s  # a helper silent this long has given its share up

    def run(self) -> Seal:
        """Seal first, then tear down: a walltime that hits during teardown cannot cost the seal."""
        self.prepare_files()
        self.decide()
        self.take_back_shares()
        book = self.ledger()
        if not book.pending:
            self.wait_for_shares(list(self.checks))
            book = self.ledger()
        if not book.pending:
            self.log("every planned rollout is already accounted for; sealing without starting servers")
            return self.seal()
        self.log(
            f"{len(book.pending)} of {len(book.planned)} planned rollouts to run "
            f"({len(book.done)} done, {book.num_failed} failed)"
        )
        adapter = self.gym_release()
        if self.servers is not None:  # a warm worker's servers: they run on after this shard
            store.gym_dir(self.run_dir, self.index).mkdir(parents=True, exist_ok=True)  # the collector's cwd
            self.collect(adapter, self.servers.endpoint, self.servers.stack)
            return self.seal()
        with contextlib.ExitStack() as teardown:
            teardown.callback(self.log_teardown, time.monotonic)
            endpoint, stack = self.start_servers(teardown)
            self.collect(adapter, endpoint, stack)
            # collection is over (the servers read env.yaml at start only); once sealed the shard never runs
            # again, so the key must not wait for a teardown that a kill can skip
            store.env_yaml_path(self.run_dir, self.index).unlink(missing_ok=True)
            marker = self.seal()
            self.log("sealed; stopping servers")
            self.teardown_started = time.monotonic()
        return marker

    def gym_release(self) -> gym_adapter.GymAdapter:
        """The adapter of the Gym venv this shard runs with; BadInput when its version is not the plan's (a run never
        mixes Gym releases)."""
        adapter = gym_adapter.for_venv(gym_stack.gym_venv(self.gym, os.environ))
        if self.plan.gym_version is not None and adapter.version != self.plan.gym_version:
            raise BadInput(
                f"shard {self.index}: the Gym venv holds nemo-gym {adapter.version}, but this run was planned with "
                f"{self.plan.gym_version}; a run never mixes Gym versions (point gym.venv at a {self.plan.gym_version} "
                f"venv, or plan a new run)"
            )
        self.gym_version = adapter.version
        self.log(f"nemo-gym {adapter.version} ({type(adapter).__name__})")
        return adapter

    def log_teardown(self, clock) -> None:
        if self.teardown_started is not None:
            self.log(f"servers stopped in {clock() - self.teardown_started:.1f} s")

    # ------------------------------------------------------------ files

    def prepare_files(self) -> None:
        shard = store.shard_dir(self.run_dir, self.index)
        store.remove_stale_temps(shard)
        for path in (
            store.rollouts_path(self.run_dir, self.index),
            store.failures_path(self.run_dir, self.index),
            store.rollout_attempts_path(self.run_dir, self.index),
        ):
            cut = store.repair_torn_tail(path)
            if cut:
                self.log(f"cut a torn last line ({cut} bytes) from {path.name}")
        store.rollouts_path(self.run_dir, self.index).touch()
        with contextlib.suppress(FileNotFoundError):
            store.env_yaml_path(self.run_dir, self.index).unlink()  # left by a killed attempt

    def decide(self) -> None:
        """Adaptive sampling: skip the rows of the tasks that the rollouts already on disk decide (rundir/decided.py).
        Each start decides afresh; a decision is monotone, so a row skipped once is skipped by every later start."""
        if self.plan.sampling is None or self.plan.sampling.stop_when_decided is None:
            return
        found = decided.decide_shard(self.run_dir, self.plan, self.index, self.gym.max_rollout_attempts, self.known)
        for e in found.errors[:10]:
            self.log(
                f"error: rollout {e.task}:{e.rollout} has {self.plan.sampling.stop_when_decided.metric} {e.value!r}, "
                f"outside sampling.metric_range {list(self.plan.sampling.metric_range)}: task {e.task} is not decided"
            )
        self.skipped = found.skip
        kept = sum(1 for t in found.skipped_tasks if found.verdicts[t])
        self.log(
            f"adaptive sampling: {len(found.verdicts)} of {found.tasks} tasks decided; skipping {len(found.skip)} "
            f"rollouts of {len(found.skipped_tasks)} tasks ({kept} kept, {len(found.skipped_tasks) - kept} dropped)"
        )

    def ledger(self) -> ledger.Ledger:
        book = ledger.load(self.run_dir, self.index, self.gym.max_rollout_attempts)
        book.skipped, book.lent = self.skipped, self.lent_rows()
        due = ledger.quarantine(
            self.run_dir, self.index, book, self.gym.max_rollout_attempts, ledger.last_reasons(self.run_dir, self.index)
        )
        if due:
            self.log(
                f"recorded {len(due)} rollout(s) as failed after {self.gym.max_rollout_attempts} attempts: "
                + ", ".join(f"{t}:{r}" for t, r in due[:10])
            )
            book = ledger.load(self.run_dir, self.index, self.gym.max_rollout_attempts)
            book.skipped, book.lent = self.skipped, self.lent_rows()
        return book

    # ------------------------------------------------------------ helpers with the end of a run (tail_help)

    def lent_rows(self) -> set[tuple[int, int]]:
        return {k for g in self.lent.values() for k in g.rows}

    def take_back_shares(self) -> None:
        """At the start: fold in the shares that helpers finished (or gave up) while no one held the shard; the
        shares still being collected stay lent, and are waited for once nothing else is left."""
        for g in tail_help.grants(self.run_dir, self.index):
            self.lent[g.token] = g
        self.fold_settled()

    def fold_settled(self) -> None:
        for token, g in list(self.lent.items()):
            if not tail_help.settled(self.run_dir, self.index, g, self.lease_s):
                continue
            if tail_help.lapsed(self.run_dir, self.index, g, self.lease_s):
                tail_help.revoke(self.run_dir, self.index, token)
                self.log(f"help {token}: its helper fell silent for {self.lease_s:g} s; its share is taken back")
            folded = tail_help.fold(self.run_dir, self.index, g)
            tail_help.clear(self.run_dir, self.index, token)
            del self.lent[token]
            self.log(f"help {token}: {folded} of {len(g.rows)} lent rollouts folded in from its helper")

    def wait_for_shares(self, checks: Sequence[watchdog.Check]) -> None:
        """Everything else is done: wait for the lent shares to settle and fold them in (the rows a helper did not
        finish are pending again). The worker's checks (its claim, its time limit) keep running meanwhile."""
        if self.lent:
            self.log(f"waiting for {len(self.lent)} helper(s) with {len(self.lent_rows())} lent rollouts")
        while True:
            self.fold_settled()
            if not self.lent:
                return
            self.answer_asks(None)  # nothing waits for a slot here any more: no help wanted
            for c in checks:
                problem = c.problem()
                if problem:
                    raise ShardFailed(f"{c.name}: {problem}; while waiting for the helpers")
            time.sleep(HELP_POLL_S)

    def answer_asks(self, round_: collector_service.Round | None) -> str | None:
        """A watchdog check, run while a round collects: lend half of what still waits for a slot to each worker
        that asked for help (none when the round is not in a collector service: nothing to lend from)."""
        holder = (self.worker or {}).get("id") or self.job_id or socket.gethostname()
        for token, helper in tail_help.asks(self.run_dir, self.index):
            rows = round_.lend(0.5) if round_ is not None else []
            g = tail_help.grant(self.run_dir, self.index, token, str(holder), rows)
            if rows:
                self.lent[token] = g
                self.log(f"help {token}: lent {len(rows)} rollouts still waiting for a slot to worker {helper}")
        return None

    # ------------------------------------------------------------ servers

    def start_servers(self, teardown: contextlib.ExitStack) -> tuple[policy.PolicyEndpoint, gym_stack.GymStack]:
        servers = start_servers(
            self.policy, self.gym, self.run_dir, gym_stack.shard_place(self.run_dir, self.index), self.log
        )
        teardown.callback(servers.stop)
        self.server_wait_s = servers.ready_s
        return servers.endpoint, servers.stack

    # ------------------------------------------------------------ collection

    def collect(
        self, adapter: gym_adapter.GymAdapter, endpoint: policy.PolicyEndpoint, stack: gym_stack.GymStack
    ) -> None:
        venv = gym_stack.gym_venv(self.gym, os.environ)
        checks = [watchdog.Check("policy server", endpoint.problem), watchdog.Check("Gym stack", stack.problem)]
        checks += self.checks
        max_rounds = self.gym.max_rollout_attempts * len(self.ledger().planned) + 2
        for round_no in range(1, max_rounds + 1):
            book = self.ledger()
            if not book.pending:
                self.wait_for_shares(self.checks)  # the servers are not needed meanwhile; the claim is
                book = self.ledger()
            if not book.pending:
                return
            before = progress_mark(book)
            rc, failed = self.collect_round(adapter, venv, stack, checks, round_no, len(book.pending))
            if failed:
                ledger.record_attempts(self.run_dir, self.index, failed, self.attempt)
                for (t, r), reason in failed.items():
                    self.log(f"rollout {t}:{r} failed: {reason}")
            book = self.ledger()
            if not book.pending and not self.lent:
                return
            after = progress_mark(book)
            if rc != 0 and not failed and book.pending:
                down = endpoint.problem() or stack.problem()
                if down:  # the collector gave up because a server died under it: the servers' failure, not Gym's
                    raise ServerFailure(f"{down}; the collector exited with code {rc}")
                raise ShardFailed(
                    f"ng_collect_rollouts exited with code {rc} and named no failed rollout; "
                    f"{len(book.pending)} rollouts still pending. Last lines of "
                    f"{store.collector_log_path(self.run_dir, self.index)}:\n"
                    f"{collector_tail(self.run_dir, self.index)}"
                )
            if after == before and book.pending:
                raise ShardFailed(
                    f"ng_collect_rollouts round {round_no} exited {rc} without progress; "
                    f"{len(book.pending)} rollouts still pending"
                )
        raise ShardFailed(f"gave up after {max_rounds} collector rounds")

    def collect_round(
        self,
        adapter: gym_adapter.GymAdapter,
        venv: Path,
        stack: gym_stack.GymStack,
        checks: list[watchdog.Check],
        round_no: int,
        pending: int,
    ) -> tuple[int, dict]:
        rollouts = store.rollouts_path(self.run_dir, self.index)
        failures = store.failures_path(self.run_dir, self.index)
        store.repair_torn_tail(rollouts)
        log_path = store.collector_log_path(self.run_dir, self.index)
        offset = collector.log_size(log_path)
        self.log(f"collector round {round_no}: {pending} rollouts")
        t0 = time.monotonic()
        skip = self.skipped | self.lent_rows()
        view = collector.skipping_view(self.run_dir, self.index, skip) if skip else None
        proc: watchdog.Watched
        if self.servers is not None and self.servers.service is not None:
            proc = self.servers.service.submit(self.run_dir, self.index, view)
        else:
            proc = collector.start(adapter, venv, stack, self.run_dir, self.index, self.gym, view=view)
        in_service = proc if isinstance(proc, collector_service.Round) else None
        lending = watchdog.Check("helpers' asks", lambda: self.answer_asks(in_service))
        try:
            rc = watchdog.watch(
                proc,
                checks=[*checks, lending],
                progress=lambda: (size(rollouts), size(failures)),
                stall_timeout_s=self.gym.stall_timeout_s,
                interval_s=self.gym.health_interval_s,
                log=self.log,
            )
        finally:
            self.collect_s += time.monotonic() - t0
        failed = collector.failed_identities(adapter, collector.read_from(log_path, offset)) if rc != 0 else {}
        self.log(f"collector round {round_no} exited {rc} after {time.monotonic() - t0:.1f} s")
        return rc, failed

    # ------------------------------------------------------------ seal

    def seal(self) -> Seal:
        book = self.ledger()
        if book.pending or self.lent:
            raise ShardFailed(f"{len(book.pending) + len(self.lent_rows())} planned rollouts are missing; not sealing")
        if book.duplicates:
            self.log(f"warning: {book.duplicates} duplicate rollout line(s) in rollouts.jsonl (merge dedupes)")
        rollouts = store.rollouts_path(self.run_dir, self.index)
        finished = time.time()
        marker = seal.make_marker(
            self.plan,
            self.index,
            num_rollouts=len(book.done),
            num_failed=book.num_failed,
            rollouts_sha256=store.sha256_file(rollouts),
            rollouts_bytes=rollouts.stat().st_size,
            started_at=self.started_at,
            finished_at=finished,
            host=socket.gethostname(),
            job_id=self.job_id,
            attempt=self.attempt,
            server_wait_s=round(self.server_wait_s, 3),
            collect_s=round(self.collect_s, 3),
            gpus=gpus_visible(),
            extra=dict(book.usage) or None,
            gym_version=self.gym_version,
            worker=self.worker,
            skipped_decided_tasks=sorted({t for t, _ in self.skipped}),
            num_skipped_decided=len(self.skipped),
            num_duplicate_lines=book.duplicates,
            label_rollouts=self.plan.label_counts([task for task, _ in book.done]) if self.plan.blend else None,
        )
        seal.write_marker(self.run_dir, self.index, marker)
        tail_help.clear_all(self.run_dir, self.index)  # every share is folded in; asks left unanswered are moot
        return marker


def progress_mark(book: ledger.Ledger) -> tuple[int, int, int, int]:
    """Changes whenever a round did anything: a rollout, a failed attempt (ours or an agent's), a failure."""
    return len(book.done), sum(book.attempts.values()), book.sidecar_rows, len(book.failed)


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def collector_tail(run_dir: Path, index: int, lines: int = 30) -> str:
    from shardrun.shard.processes import log_tail

    return log_tail(store.collector_log_path(run_dir, index), lines)
