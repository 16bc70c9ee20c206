"""One shard on one node: policy server -> Gym stack -> collector rounds under the watchdog -> seal -> teardown.

`run_shard(run_dir, index)` is everything a shard job does. All state is in the run directory: a valid `.done`
means the shard is never run again; otherwise the shard resumes from its files (a torn last line is cut first),
so a rerun after a crash, a kill or a walltime runs only the identities still missing.

Rounds. Each round is one `ng_collect_rollouts` resume over the shard's materialized rows. A round that exits 0
with nothing pending ends collection. A round that exits non-zero because a /run failed (Gym 0.4.0 aborts the
whole collector on one failed row) gets the failed identities recorded in the retry ledger; an identity that
failed `gym.max_rollout_attempts` times is written to rollouts_failures.jsonl (terminal, with its reason, never
as reward 0) and the next round runs the rest. A round whose every rollout failed (Gym 0.7 exits 1: "no result to
report") ended as planned: its failures are in the sidecar. Anything else fails the shard with the collector's log
tail.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from shardrun.core import gym_adapter
from shardrun.core.config import ClusterConfig, GymConfig, JudgeConfig, PolicyConfig, RunConfig, SandboxConfig
from shardrun.core.errors import BadInput, ServerFailure, ShardFailed, ShardrunError
from shardrun.plan.planner import Plan
from shardrun.rundir import decided, ledger, records, seal, store
from shardrun.rundir.records import Seal, SealWorker
from shardrun.shard import collector, gym_stack, judges as judge_servers, policy, rescoring, watchdog
from shardrun.shard import sandbox as sandboxes

Key = tuple[int, int]  # (task index, rollout index): a rollout's identity
SANDBOX_CHECK = "sandbox"  # the watchdog check that watches the job's sandbox


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

    A shard job starts and stops its own servers; a runner with servers of its own (a warm worker,
    workers/worker.py) passes them and its hooks (`servers`, `collector`, `lending`, `checks`, `known`, `worker`:
    see Shard), so every launch mode runs exactly this per-shard work."""
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
            if cfg.rescore is not None:  # a re-score: the shard's stored rollouts verified again (rescoring.py);
                # a warm worker passes only its checks and its record (Gym's re-verification starts its own servers)
                marker = rescoring.Rescore(run_dir, index, plan, cfg, log, job_id, attempt, **warm).run()
            else:
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
    return policy.gpus_visible(os.environ)


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


class Front(Protocol):
    """Something the Gym stack reaches the policy through instead of its own addresses (a warm worker's slot gate,
    shard/slot_gate.py): it listens at `urls` and forwards to the policy's."""

    urls: list[str]

    def describe(self) -> str: ...

    def problem(self) -> str | None: ...

    def stop(self) -> None: ...


@dataclass
class Servers:
    """A running policy endpoint and Gym stack: a shard job's own, or a warm worker's (started once)."""

    endpoint: policy.PolicyEndpoint
    stack: gym_stack.GymStack
    ready_s: float  # seconds from the start to both being ready
    up_since: float  # Unix time they became ready
    front: Front | None = None  # what the stack talks to the policy through, if not the policy itself
    judges: list[judge_servers.Judge] = field(default_factory=list)  # the job's judges (docs/judges.md)
    sandbox: sandboxes.Sandbox | None = None  # the job's code-execution sandbox (the `sandbox:` section)

    def problem(self) -> str | None:
        return (
            self.endpoint.problem()
            or judge_servers.problem(self.judges)
            or (self.front.problem() if self.front else None)
            or self.stack.problem()
            or (self.sandbox.problem() if self.sandbox else None)
        )

    def checks(self) -> list[watchdog.Check]:
        """The watchdog's checks while collecting: the policy, each judge, the Gym stack (the sandbox's check is
        added by Shard.collect, which guards the rows it may break)."""
        return [
            watchdog.Check("policy server", self.endpoint.problem),
            *(watchdog.Check(f"judge {j.name}", j.endpoint.problem) for j in self.judges),
            watchdog.Check("Gym stack", self.stack.problem),
        ]

    def procs(self) -> list[Any]:
        """The server processes started here (processes.Proc)."""
        servers = [self.endpoint.server, *(j.endpoint.server for j in self.judges)]
        return (
            [self.stack.proc]
            + [s.proc for s in servers if s is not None]
            + ([self.sandbox.proc] if self.sandbox is not None else [])
        )

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            try:
                if self.front is not None:
                    self.front.stop()
            finally:
                try:
                    self.endpoint.stop()
                finally:
                    try:
                        judge_servers.stop_all(self.judges)
                    finally:
                        if self.sandbox is not None:
                            self.sandbox.stop()


def start_servers(
    policy_cfg: PolicyConfig,
    gym: GymConfig,
    run_dir: Path,
    place: gym_stack.StackPlace,
    log: Callable[[str], None],
    front: Callable[[list[str]], Front] | None = None,
    cluster: ClusterConfig | None = None,
    judges: Mapping[str, JudgeConfig] | None = None,
    sandbox: SandboxConfig | None = None,
) -> Servers:
    """Start the sandbox (`sandbox`, if any), start (or check) the judges, then the policy, then the Gym stack at
    `place` with the sandbox's address in its environment; all ready, or none left running. `front` (a warm worker's
    slot gate): made from the policy's addresses; the stack reaches the policy through it. Self-hosted judges take
    GPUs of their own (judges.split_devices; the policy is started with the others), or the job's judge nodes
    (cluster.judge_nodes)."""
    t0 = time.monotonic()
    box = sandboxes.start(sandbox, place.home, cluster=cluster) if sandbox is not None else None
    if box is not None:
        log(f"{box.describe()} ready in {box.ready_s:.1f} s")
    started: list[judge_servers.Judge] = []

    def stop_first() -> None:
        try:
            judge_servers.stop_all(started)
        finally:
            if box is not None:
                box.stop()

    try:
        env = dict(os.environ)
        started, policy_devices = judge_servers.start_all(judges or {}, place.home, env, cluster)
        for judge in started:
            log(judge.describe())
        if policy_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = policy_devices
        endpoint = policy.open_policy(
            policy_cfg, place.home, env, cluster=cluster, concurrency=gym.num_samples_in_parallel
        )
    except BaseException:
        stop_first()
        raise
    before: Front | None = None
    try:
        for note in endpoint.notes:
            log(f"note: {note}")
        log(
            f"policy ready in {time.monotonic() - t0:.1f} s: {', '.join(endpoint.base_urls)} model {endpoint.model_name}"
        )
        urls = list(endpoint.base_urls)
        if front is not None:
            before = front(urls)
            urls = list(before.urls)
            log(before.describe())
        stack, waited = gym_stack.start_ready(
            run_dir,
            -1,
            gym,
            urls,
            endpoint.api_key,
            endpoint.model_name,
            place=place,
            judges=[j.binding for j in started],
            extra_env=box.gym_env if box is not None else None,
        )
    except BaseException:
        try:
            if before is not None:
                before.stop()
            endpoint.stop()
        finally:
            stop_first()
        raise
    log(f"Gym servers ready in {waited:.1f} s (head server port {stack.port}, {len(stack.instances)} servers)")
    return Servers(endpoint, stack, time.monotonic() - t0, time.time(), before, started, box)


class Collector(Protocol):
    """Starts one collector round over a shard's planned rows (`view`: those rows less the ones to skip, or None for
    all of them) and returns it running, for the watchdog."""

    def submit(self, run_dir: Path, index: int, view: Path | None) -> watchdog.Watched: ...


@dataclass
class CollectorProcess:
    """A shard job's collector: one `ng_collect_rollouts` process per round (shard/collector.py)."""

    adapter: gym_adapter.GymAdapter
    venv: Path
    stack: gym_stack.GymStack
    gym: GymConfig

    def submit(self, run_dir: Path, index: int, view: Path | None) -> watchdog.Watched:
        return collector.start(self.adapter, self.venv, self.stack, run_dir, index, self.gym, view=view)


class Lending(Protocol):
    """What the shard's holder lends to other runners while it collects (a warm worker's help with the end of a
    run: workers/lending.py); a shard job lends nothing (NoLending)."""

    def rows(self) -> set[Key]:
        """The identities lent and not folded back in: not run here."""
        ...

    def take_back(self) -> None:
        """At the start: fold in what was lent before and has settled since."""
        ...

    def wait(self, checks: Sequence[watchdog.Check]) -> None:
        """Nothing else is left: wait for what is lent to settle, fold it in (`checks` keep running)."""
        ...

    def answer(self, running: watchdog.Watched) -> str | None:
        """A watchdog check while a round runs: lend from it to whoever asked."""
        ...

    def sealed(self) -> None:
        """The shard is sealed: nothing lent is outstanding; clear what is left."""
        ...


class NoLending:
    """A shard job's: nothing is ever lent."""

    def rows(self) -> set[Key]:
        return set()

    def take_back(self) -> None:
        return None

    def wait(self, checks: Sequence[watchdog.Check]) -> None:
        return None

    def answer(self, running: watchdog.Watched) -> str | None:
        return None

    def sealed(self) -> None:
        return None


class Shard:
    """One attempt at one shard (holds the shard lock while it runs), for any runner. A shard job passes nothing and
    starts its own servers and a collector process per round. A runner with servers of its own (a warm worker)
    passes its running `servers` (started before this shard and stopped after it), its `collector` (default: a
    process per round), its `lending` (default: nothing lent), extra watchdog `checks` (its claim, its time limit),
    `worker` (recorded in the seal) and, with adaptive sampling, `known`: the run's rollouts it has read so far
    (rundir/decided.py), so that this start reads only what is new."""

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
        collector: Collector | None = None,
        lending: Lending | None = None,
        checks: Sequence[watchdog.Check] = (),
        known: decided.RunRollouts | None = None,
        worker: SealWorker | None = None,
    ):
        self.run_dir, self.index, self.plan, self.cfg, self.log = run_dir, index, plan, cfg, log
        self.job_id, self.attempt = job_id, attempt
        self.servers, self.collector, self.checks = servers, collector, list(checks)
        self.lending: Lending = lending if lending is not None else NoLending()
        self.known, self.worker = known, worker
        if cfg.gym is None or cfg.policy is None:  # submit and resume refuse such a config before launching
            raise BadInput(f"shard {index}: the run config has no {'gym' if cfg.gym is None else 'policy'} section")
        self.gym: GymConfig = cfg.gym
        self.policy: PolicyConfig = cfg.policy
        self.started_at = time.time()
        self.server_wait_s = 0.0
        self.collect_s = 0.0
        self.teardown_started: float | None = None
        self.gym_version: str | None = plan.gym_version
        self.skipped: set[Key] = set()  # rows skipped because their task is decided (adaptive sampling)

    def run(self) -> Seal:
        """Seal first, then tear down: a walltime that hits during teardown cannot cost the seal."""
        self.prepare_files()
        self.decide()
        self.lending.take_back()
        book = self.ledger()
        if not book.pending:
            self.lending.wait(self.checks)
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
            self.collect(adapter, self.servers)
            return self.seal()
        with contextlib.ExitStack() as teardown:
            teardown.callback(self.log_teardown, time.monotonic)
            servers = self.start_servers(teardown)
            self.collect(adapter, servers)
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

    def log_cut(self, name: str, size: int) -> None:
        self.log(f"cut a torn last line ({size} bytes) from {name}")

    def prepare_files(self) -> None:
        shard = store.shard_dir(self.run_dir, self.index)
        store.remove_stale_temps(shard)
        for path in (
            store.rollouts_path(self.run_dir, self.index),
            store.failures_path(self.run_dir, self.index),
            store.rollout_attempts_path(self.run_dir, self.index),
        ):
            store.repair_torn_tail(path, announce=functools.partial(self.log_cut, path.name))
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
        book.skipped, book.lent = self.skipped, self.lending.rows()
        due = ledger.quarantine(
            self.run_dir, self.index, book, self.gym.max_rollout_attempts, ledger.last_reasons(self.run_dir, self.index)
        )
        if due:
            self.log(
                f"recorded {len(due)} rollout(s) as failed after {self.gym.max_rollout_attempts} attempts: "
                + ", ".join(f"{t}:{r}" for t, r in due[:10])
            )
            book = ledger.load(self.run_dir, self.index, self.gym.max_rollout_attempts)
            book.skipped, book.lent = self.skipped, self.lending.rows()
        return book

    # ------------------------------------------------------------ servers

    def start_servers(self, teardown: contextlib.ExitStack) -> Servers:
        servers = start_servers(
            self.policy,
            self.gym,
            self.run_dir,
            gym_stack.shard_place(self.run_dir, self.index),
            self.log,
            cluster=self.cfg.cluster_or_default,
            judges=self.cfg.judges,
            sandbox=self.cfg.sandbox,
        )
        teardown.callback(servers.stop)
        self.server_wait_s = servers.ready_s
        return servers

    # ------------------------------------------------------------ collection

    def collect(self, adapter: gym_adapter.GymAdapter, servers: Servers) -> None:
        stack = servers.stack
        rounds = self.collector or CollectorProcess(adapter, gym_stack.gym_venv(self.gym, os.environ), stack, self.gym)
        checks = servers.checks()
        guard = None
        if servers.sandbox is not None:
            files = [store.rollouts_path(self.run_dir, self.index), store.failures_path(self.run_dir, self.index)]
            guard = sandboxes.Guard(servers.sandbox, files)
            checks.append(watchdog.Check(SANDBOX_CHECK, guard.problem))
        checks += self.checks
        max_rounds = self.gym.max_rollout_attempts * len(self.ledger().planned) + 2
        if guard is not None:  # a round the sandbox died under is run again
            max_rounds += self.cfg.cluster_or_default.max_server_restarts
        for round_no in range(1, max_rounds + 1):
            book = self.ledger()
            if not book.pending:
                self.lending.wait(self.checks)  # the servers are not needed meanwhile; the runner's checks are
                book = self.ledger()
            if not book.pending:
                return
            if guard is not None:
                self.sandbox_ready(guard)
            before = progress_mark(book)
            failures = store.failures_path(self.run_dir, self.index)
            mark = size(failures)
            try:
                rc, failed = self.collect_round(adapter, rounds, checks, round_no, len(book.pending))
            except ServerFailure as e:
                if guard is None or guard.box.problem() is None:
                    raise
                if e.check == SANDBOX_CHECK:
                    self.sandbox_died(guard)  # the round was stopped; what the sandbox broke is taken back
                    continue
                cut = guard.take_back()  # another server failed too: still, nothing the sandbox broke stays
                self.log(f"the sandbox is down as well; {cut} bytes of rows written since it last answered taken back")
                raise
            if guard is not None and guard.settle(self.gym.health_interval_s) is not None:
                self.sandbox_died(guard)  # it died as the round ended: the round's last rows are not trusted
                continue
            down = servers.endpoint.problem() or judge_servers.problem(servers.judges) or stack.problem()
            if down:
                # a server died under the round: its failed rollouts are the servers' failure, not attempts of
                # theirs (a dead policy or judge fails every request at once, and would use up every attempt in
                # seconds)
                cut = store.cut_back(failures, mark)
                raise ServerFailure(
                    f"{down}; the round's failed rollouts are not counted as attempts"
                    + (f" ({cut} bytes of failure records taken back)" if cut else "")
                )
            if failed:
                ledger.record_attempts(self.run_dir, self.index, failed, self.attempt)
                for (t, r), reason in failed.items():
                    self.log(f"rollout {t}:{r} failed: {reason}")
            book = self.ledger()
            if not book.pending and not self.lending.rows():
                return
            after = progress_mark(book)
            if rc != 0 and not failed and book.pending:
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

    def sandbox_ready(self, guard: sandboxes.Guard) -> None:
        """Before a round: the sandbox answers (its mark is now), or it is restarted (counted)."""
        problem = guard.settle(self.gym.health_interval_s)
        if problem is not None:
            guard.box.restart(self.cfg.cluster_or_default.max_server_restarts, self.log)
            if guard.settle(self.gym.health_interval_s) is not None:
                raise ServerFailure(f"the sandbox did not answer after its restart: {guard.box.describe()}")

    def sandbox_died(self, guard: sandboxes.Guard) -> None:
        """The sandbox died under a round: the rows written since it last answered are taken back (to run again,
        never scored against a dead sandbox), and it is restarted in place, at most cluster.max_server_restarts
        times (then ServerFailure: a shard job fails and its resume runs the rest)."""
        reason = guard.tripped
        cut = guard.take_back()
        self.log(
            f"the sandbox died while collecting ({reason}); {cut} bytes of rows written since it last answered "
            f"taken back, to run again"
        )
        guard.box.restart(self.cfg.cluster_or_default.max_server_restarts, self.log)

    def collect_round(
        self,
        adapter: gym_adapter.GymAdapter,
        rounds: Collector,
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
        skip = self.skipped | self.lending.rows()
        view = collector.skipping_view(self.run_dir, self.index, skip) if skip else None
        proc = rounds.submit(self.run_dir, self.index, view)
        lending = watchdog.Check("lending", lambda: self.lending.answer(proc))
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
        said = collector.read_from(log_path, offset) if rc != 0 else ""
        failed = collector.failed_identities(adapter, said)
        self.log(f"collector round {round_no} exited {rc} after {time.monotonic() - t0:.1f} s")
        if rc != 0 and adapter.no_result_exit(said):
            # Gym's "no result to report": every rollout of the round failed, each recorded in the sidecar (the
            # progress check below still requires that); the next round retries what has attempts left
            self.log(f"collector round {round_no}: every rollout it ran failed (Gym had no result to report)")
            rc = 0
        return rc, failed

    # ------------------------------------------------------------ seal

    def seal(self) -> Seal:
        book = self.ledger()
        lent = self.lending.rows()
        if book.pending or lent:
            raise ShardFailed(f"{len(book.pending) + len(lent)} planned rollouts are missing; not sealing")
        if book.duplicates:
            self.log(f"warning: {book.duplicates} duplicate rollout line(s) in rollouts.jsonl (merge dedupes)")
        rollouts = store.rollouts_path(self.run_dir, self.index)
        finished = time.time()
        marker = seal.counted_marker(
            self.plan,
            self.index,
            book,
            rollouts,
            started_at=self.started_at,
            finished_at=finished,
            host=socket.gethostname(),
            job_id=self.job_id,
            attempt=self.attempt,
            server_wait_s=round(self.server_wait_s, 3),
            collect_s=round(self.collect_s, 3),
            gpus=gpus_visible(),
            gym_version=self.gym_version,
            worker=self.worker,
            skipped_decided_tasks=sorted({t for t, _ in self.skipped}),
            num_skipped_decided=len(self.skipped),
        )
        seal.write_marker(self.run_dir, self.index, marker)
        self.lending.sealed()
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
