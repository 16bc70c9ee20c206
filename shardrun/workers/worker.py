"""A warm worker: start the policy and the Gym stack once, then claim shards and collect them until none are left.

`run_worker(run_dir, worker_id)` is what a worker job does (docs/workers.md):

1. Start the servers (`runtime.start_servers` in `RUN_DIR/workers/<id>/`: a self-hosted vLLM or a checked
   endpoint, and ng_run), once.
2. Pick the next shard: not sealed, not claimed by a live claim, not given up (its `.failed` records
   `cluster.max_attempts` attempts); partial progress first, then the longest expected first (rate of the sealed
   shards); never one it cannot expect to finish before its job's time limit. Claim it (workers/claims.py) and
   collect it with `runtime.run_shard` against the running servers: the same rounds, retry ledger, failures sidecar
   and seal as a shard job, with two more watchdog checks: the claim is still ours (a heartbeat thread renews it
   every `cluster.claim_heartbeat_s`) and the time limit is not near. Release the claim; go on. A worker holds up
   to `collector.pipeline_shards` shards at once, each in its own thread and all in one collector service: it claims
   a further one when those it holds no longer fill the service's budget of slots (`room_for_another`).
3. When nothing is left to claim, tear down and return (exit 0). A shard held by a claim whose worker died on this
   host is waited for until its lease runs out, then taken over.

A re-score (`shardrun rescore`, shard/rescoring.py) starts no servers in the worker: it claims one shard at a time
and `runtime.run_shard` re-verifies it (Gym's re-verification starts its servers per shard), with the claim check.

A server that dies fails the shard's attempt as usual (`.failed`); the worker restarts its servers at most
`cluster.max_server_restarts` times, then raises ServerFailure (exit non-zero), its claim released. Near the time
limit (or when the claim is lost) the collector is stopped with `ShardReleased` (a BaseException: not a failure of
the shard, nothing recorded in `.failed`): completed rollouts stay, the claim is released.

The worker's state is in `RUN_DIR/workers/<id>/worker.json` (read by `shardrun status` and cost accounting):
its job, host, pid, state, current shard, shards sealed, servers up since, server starts, start-up seconds,
collecting seconds per shard, and the process groups of its running servers (a worker on the same host kills what
is left of them once that worker is gone: `reap_leftovers`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


from shardrun.core.config import RunConfig
from shardrun.core.errors import ServerFailure, ShardFailed, ShardrunError
from shardrun.plan import planner
from shardrun.plan.planner import Plan
from shardrun.rundir import decided, records, seal, store
from shardrun.rundir.records import COLLECTING, DRAINING, FAILED, IDLE, STARTING, STOPPED, Seal, SealWorker, WorkerState
from shardrun.shard import gym_stack, processes, runtime, watchdog
from shardrun.workers import claims, lending, lent_share, warm_servers

WAIT_POLL_S = 2.0
SETTLE_S = 0.25  # a further shard is claimed once the budget has gone unfilled this long
RECORD_SERVERS_S = 30.0  # how often a save records the servers' processes again (the children they started since)


class ShardReleased(BaseException):
    """Stop collecting the current shard without failing it: the claim was lost, or the job's time limit is near.
    A BaseException so that the runtime neither records it in `.failed` nor as failed rollouts; the completed
    rollouts stay in rollouts.jsonl."""


def gone(state: WorkerState) -> bool:
    """The worker's process is no longer running (on its host: only meaningful there)."""
    ticks = processes.start_ticks(state.pid)
    return ticks is None or (state.pid_start is not None and ticks != state.pid_start)


def reap_servers(state: WorkerState, host: str) -> int | None:
    """Kill what a worker gone from `host` left of its servers: each process its worker.json records with its start
    time (reap_recorded), and the groups whose recorded leader still runs (reap_group). A SIGKILLed worker's server
    leaders get SIGTERM from the kernel (processes.start: die_with_parent), but what they started lives on (Gym's
    servers, for one). A pid or group id that now names another process is never signalled. None when the worker
    is on another host, still runs, or recorded no servers; else how many processes were killed."""
    if state.host != host or not (state.server_groups or state.server_processes) or not gone(state):
        return None
    killed = processes.reap_recorded(state.server_processes)
    return killed + sum(processes.reap_group(g[0], g[1]) for g in state.server_groups if len(g) == 2)


def reap_gone_workers(run_dir: Path, host: str) -> int:
    """What every worker gone from `host` left of its servers (reap_servers), killed: for `shardrun cancel` and the
    job after the workers. Returns how many processes were killed."""
    return sum(reap_servers(st, host) or 0 for st in records.read_worker_states(run_dir))


def merge_recorded(recorded: list[list[int]], seen: list[tuple[int, int]]) -> list[list[int]]:
    """A worker's server processes: those `seen` now (processes.descendants of its leaders) and those recorded before
    that still run with their start time (a child whose parent died is no longer anyone's descendant)."""
    kept = {(p[0], p[1]) for p in recorded if len(p) == 2 and processes.start_ticks(p[0]) == p[1]}
    return [list(p) for p in sorted(kept | set(seen))]


def worker_id_for(job_id: str | None) -> str:
    """A worker's id: its job id (Slurm: "123_4"; a requeued task keeps it), else host and pid."""
    raw = job_id or f"{socket.gethostname()}-{os.getpid()}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


# ---------------------------------------------------------------- which shard next (pure)


@dataclass(frozen=True)
class Candidate:
    index: int
    planned: int
    done: int  # rollouts recorded (successful or failed for good)
    attempts: int  # failed attempts so far

    @property
    def pending(self) -> int:
        return max(0, self.planned - self.done)


def order(candidates: list[Candidate], by_wave: bool = False) -> list[Candidate]:
    """Partial progress first (a shard that was stopped or killed), then the longest expected first; `by_wave`
    (adaptive sampling, whose shards are cut wave-major): then in shard order, so earlier waves run first and
    later shards find more of their tasks decided."""
    if by_wave:
        return sorted(candidates, key=lambda c: (c.done == 0, c.index))
    return sorted(candidates, key=lambda c: (c.done == 0, -c.pending, c.index))


def room_for_another(held: int, depth: int, waited_s: float, look_due: bool) -> bool:
    """Does a worker holding `held` shards claim a further one? Always when it holds none. Otherwise while it holds
    fewer than `depth` (collector.pipeline_shards), once the held shards have left its collector service's budget
    unfilled for SETTLE_S (`waited_s`: no rollout waiting for a slot, or a slot free), when its next look is due."""
    if held == 0:
        return True
    return held < depth and look_due and waited_s >= SETTLE_S


def rate_per_s(markers: list[Seal]) -> float | None:
    """Rollouts per second of collection over the sealed shards (None before any sealed with collection)."""
    rollouts = sum(m.num_rollouts + m.num_failed for m in markers if m.collect_s)
    seconds = sum(m.collect_s or 0.0 for m in markers)
    return rollouts / seconds if rollouts and seconds > 0 else None


def fits(c: Candidate, rate: float | None, left_s: float | None) -> bool:
    """Can the shard be expected to finish in the time left? Unknown rate or no limit: yes."""
    return rate is None or left_s is None or c.pending / rate <= left_s


def failed_attempts(run_dir: Path, index: int) -> int:
    """The attempts the shard's `.failed` records (0 when it has none)."""
    failure = records.read_failure(run_dir, index)
    return failure.attempt if failure is not None else 0


# ---------------------------------------------------------------- the worker


class Worker:
    def __init__(
        self,
        run_dir: Path,
        worker_id: str,
        *,
        job_id: str | None = None,
        deadline: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.run_dir = Path(run_dir)
        self.plan: Plan = store.load_plan(self.run_dir)
        self.cfg: RunConfig = runtime.launch_config(self.run_dir, self.plan)
        assert self.cfg.gym is not None and self.cfg.policy is not None  # launch_config requires both
        self.gym, self.policy = self.cfg.gym, self.cfg.policy
        self.cluster = self.cfg.cluster_or_default
        self.worker_id, self.job_id = worker_id, job_id
        self.deadline, self.clock = deadline, clock
        self.drain_s = float(self.cluster.signal_delay_s)
        self.book = claims.ClaimBook(self.run_dir, claims.Holder(worker_id, job_id), self.cluster.claim_lease_s)
        home = store.worker_dir(self.run_dir, worker_id)
        (home / store.LOGS).mkdir(parents=True, exist_ok=True)
        self.place = gym_stack.StackPlace(
            home, store.worker_gym_dir(self.run_dir, worker_id), store.worker_gym_log_path(self.run_dir, worker_id)
        )
        previous = records.read_worker_state(
            store.worker_state_path(self.run_dir, worker_id)
        )  # a requeued job keeps its record
        self.previous = previous
        self.state = WorkerState(
            worker_id=worker_id,
            job_id=job_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start=processes.start_ticks(os.getpid()),
            started_at=previous.started_at if previous else time.time(),
            gpus=runtime.gpus_visible(),
        )
        if previous:
            self.state.sealed, self.state.collecting_s = previous.sealed, previous.collecting_s
            self.state.server_starts, self.state.startup_s = previous.server_starts, previous.startup_s
        if previous:
            self.state.holding_s, self.state.request_s = previous.holding_s, previous.request_s
        # a re-score (shard/rescoring.py): no servers of the worker's own; each shard's re-verification starts
        # Gym's servers (and the run's judges and sandbox) itself, one shard at a time
        self.rescoring = self.cfg.rescore is not None
        self.depth = 1 if self.rescoring else self.cfg.collector.pipeline_shards
        self.state.slots = self.gym.num_samples_in_parallel
        self.lock = threading.RLock()  # the worker's record, written from the shards' threads
        self.running: dict[int, threading.Thread] = {}  # shard -> its thread
        self.finished = threading.Event()  # a shard's thread ended
        self.stopping = threading.Event()  # the worker stops: the shards in flight are released
        self.errors: list[BaseException] = []  # what a shard's thread raised that stops the worker
        self.held_since: float | None = None  # monotonic: since when at least one shard is held
        self.next_look = 0.0  # monotonic: not before then does the worker look for a further shard again
        self.plenty = True  # at the last look, more shards were left to claim than other workers to claim them
        self.seen_sealed: dict[int, Seal] = {}  # shards found sealed (checked once; merging checks them again)
        self.no_help: set[int] = set()  # shards whose holders wanted no help (or did not answer): not asked again
        self.gate_seen = 0.0  # the slot gate's request-seconds already in the record
        self.servers: warm_servers.WarmServers | None = None
        self.warm = False  # the servers have already collected a shard
        self.restarts = 0
        self.servers_came_up = False  # this worker's servers were up once (restarts are for servers that died)
        self.reaped: set[tuple[str, int]] = set()  # (worker id, pid) whose leftovers were reaped
        self._recorded_at = 0.0  # when the servers' processes were last recorded (time.monotonic)
        rules = self.plan.sampling.stop_when_decided if self.plan.sampling is not None else None
        # adaptive sampling: the run's rollouts read so far, so each shard start reads only what was appended since
        self.known = decided.RunRollouts(self.run_dir, self.plan, rules.metric) if rules is not None else None

    # ------------------------------------------------------------ bookkeeping

    def log(self, message: str) -> None:
        line = f"[shardrun {time.strftime('%Y-%m-%d %H:%M:%S')} worker {self.worker_id}] {message}"
        with contextlib.suppress(OSError):
            with open(store.worker_log_path(self.run_dir, self.worker_id), "a") as f:
                f.write(line + "\n")
        print(line, flush=True)

    def save(self, **changes: Any) -> None:
        with self.lock:
            for k, v in changes.items():
                setattr(self.state, k, v)
            held = sorted(self.running)
            self.state.current_shards = held
            self.state.current_shard = held[0] if held else None
            self.state.updated_at = time.time()
            if self.servers is not None and time.monotonic() - self._recorded_at >= RECORD_SERVERS_S:
                self._recorded_at = time.monotonic()
                with contextlib.suppress(OSError):
                    self.state.server_processes = merge_recorded(
                        self.state.server_processes, processes.descendants(self.servers.groups())
                    )
            with contextlib.suppress(OSError):
                records.write_worker_state(self.run_dir, self.state)

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    # ------------------------------------------------------------ the loop

    def run(self) -> WorkerState:
        self.log(
            f"start: job {self.job_id or '-'}, host {self.state.host}, pid {self.state.pid}, "
            f"{len(self.plan.shards)} shards in the plan"
        )
        self.reap_leftovers([self.previous] if self.previous else [])  # before this start overwrites its record
        self.reap_leftovers(records.read_worker_states(self.run_dir))
        self.save()
        try:
            with runtime.interruptible():
                self.loop()
        except ShardReleased as e:
            self.log(f"stopped: {e}")
            self.save(exit_reason=str(e))
        except BaseException as e:
            self.save(state=FAILED, exit_reason=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop_servers("tearing down")
            with contextlib.suppress(Exception):
                self.reap_leftovers(records.read_worker_states(self.run_dir))
            self.save(
                state=self.state.state if self.state.state == FAILED else STOPPED,
                current_shard=None,
                ended_at=time.time(),
            )
        return self.state

    def loop(self) -> None:
        """Claim and collect until nothing is left, the time limit is near, or the servers died too often. Up to
        `collector.pipeline_shards` shards at once, each in its own thread (their rounds share the collector service's
        budget of slots): a further one is claimed when the held ones no longer fill it (room_for_another), so the
        next shard's rollouts start while the current one drains."""
        try:
            self.pipeline()
        finally:
            self.stopping.set()  # a signal or an error in this thread: the shards in flight stop, claims released
            for t in list(self.running.values()):
                t.join()
            self.account()

    def pipeline(self) -> None:
        while True:
            self.reap_finished()
            left = self.time_left()
            if left is not None and left <= self.drain_s:
                self.log("the time limit is near: not claiming another shard")
                self.save(state=DRAINING, exit_reason="time limit")
                self.wait_all()
                break
            if self.running and not self.rescoring and (self.servers is None or self.servers.problem()):
                self.wait_all()  # the shards in flight end on their own watchdogs before the servers restart
            claim = None
            if self.room_for_another():
                found, _, dead = self.candidates()
                self.plenty = len(found) > self.other_live_workers()
                if found or dead:
                    if not self.rescoring:  # a re-score's shards start their own servers
                        self.ensure_servers()
                    claim = self.next_claim(wait=not self.running)  # servers first: a claim must not lapse
                # after a claim, look again once its rollouts have asked for slots; after finding none, later
                self.next_look = time.monotonic() + (SETTLE_S if claim is not None else WAIT_POLL_S)
            if claim is not None:
                self.start_collecting(claim)
                continue
            if not self.running:
                if self.help_with_the_tail():
                    continue
                self.log("nothing left to claim")
                self.save(exit_reason="nothing left")
                break
            # a shard ended, or look again: for free slots, or for a shard that became claimable
            self.finished.wait(SETTLE_S / 2 if len(self.running) < self.depth else WAIT_POLL_S)

    def other_live_workers(self) -> int:
        """The run's other workers that have not ended (a worker's pid is checked only on its own host)."""
        return sum(
            1
            for w in records.read_worker_states(self.run_dir)
            if w.worker_id != self.worker_id
            and w.state not in (STOPPED, FAILED)
            and not (w.host == self.state.host and gone(w))
        )

    def room_for_another(self) -> bool:
        service = self.servers.service if self.servers is not None else None
        with self.lock:
            held = set(self.running)
        if service is None:  # a collector process per shard: what it leaves free is not known; fill the pipeline
            return len(held) < self.depth
        look = service.budget()
        # plenty of shards left: queue the next one as soon as nothing waits for a slot, so that its rollouts take
        # the slots the held ones free; near the end, only once a slot is free (an idle worker may take it instead)
        waited = look.drained_s if self.plenty else look.idle_s
        return room_for_another(
            held=len(held),
            depth=self.depth,
            waited_s=waited if held <= look.started else 0.0,  # a held shard's rollouts have not asked yet
            look_due=time.monotonic() >= self.next_look,
        )

    def start_collecting(self, claim: claims.Claim) -> None:
        def run() -> None:
            try:
                self.collect(claim)
            except BaseException as e:  # collect handles a shard's failures; this is what must stop the worker
                self.errors.append(e)
            finally:
                self.finished.set()

        with self.lock:
            if not self.running:
                self.held_since = time.monotonic()
            t = threading.Thread(target=run, name=f"shard-{claim.index}", daemon=True)
            self.running[claim.index] = t
        t.start()

    def reap_finished(self) -> None:
        self.finished.clear()
        for index, t in list(self.running.items()):
            if not t.is_alive():
                t.join()
                with self.lock:
                    self.running.pop(index, None)
        self.account()
        if self.errors:
            raise self.errors[0]

    def wait_all(self) -> None:
        for t in list(self.running.values()):
            while t.is_alive():
                t.join(WAIT_POLL_S)
        self.reap_finished()

    def account(self) -> None:
        """Time with a shard held, and the slot gate's request-seconds, into the worker's record."""
        with self.lock:
            now = time.monotonic()
            if self.held_since is not None:
                self.state.holding_s += now - self.held_since
                self.held_since = now if self.running else None
            gate = self.servers.gate if self.servers is not None else None
            if gate is not None:
                busy = gate.slots.busy_s()
                self.state.request_s += busy - self.gate_seen
                self.gate_seen = busy
        self.save()

    def ensure_servers(self) -> None:
        """Servers up: started the first time; restarted when they died (or a restart failed), at most
        cluster.max_server_restarts times (then ServerFailure: the worker exits non-zero). Servers that never came
        up fail the worker at once (ServerFailure with the cause): a down endpoint or a config error is not fixed
        by waiting out the same timeout again."""
        if self.servers is not None and not self.servers.problem():
            return
        problem = None
        if self.servers is not None:
            problem = self.servers.problem() or "the servers stopped answering"
            self.stop_servers(problem)
        while True:
            if problem is not None:
                if self.restarts >= self.cluster.max_server_restarts:
                    raise ServerFailure(
                        f"worker {self.worker_id}: its servers died or failed to start {self.restarts + 1} time(s) "
                        f"(cluster.max_server_restarts = {self.cluster.max_server_restarts}): {problem}"
                    )
                self.restarts += 1
                self.log(f"restarting the servers ({self.restarts} of {self.cluster.max_server_restarts}): {problem}")
            try:
                self.start_servers()
                return
            except ServerFailure as e:
                if not self.servers_came_up:  # never up: a restart would wait the same timeout for the same cause
                    raise ServerFailure(f"worker {self.worker_id}: its servers did not come up: {e}") from None
                problem = f"start failed: {e}"

    def start_servers(self) -> None:
        self.save(state=STARTING)
        t0 = time.monotonic()
        self.servers = warm_servers.start(
            self.policy,
            self.gym,
            self.cfg.collector,
            self.run_dir,
            self.place,
            self.log,
            cluster=self.cluster,
            judges=self.cfg.judges,
            sandbox=self.cfg.sandbox,
        )
        self.gate_seen = 0.0
        self.warm = False
        self.servers_came_up = True
        self.save(
            server_starts=self.state.server_starts + 1,
            startup_s=self.state.startup_s + (time.monotonic() - t0),
            servers_up_since=self.servers.up_since,
            server_groups=[list(g) for g in self.servers.groups()],
            state=IDLE,
        )
        self.record_servers()

    def stop_servers(self, why: str) -> None:
        if self.servers is None:
            return
        self.log(f"stopping servers: {why}")
        self.account()
        servers, self.servers = self.servers, None
        servers.stop()
        self.save(servers_up_since=None, server_groups=[], server_processes=[])

    def reap_leftovers(self, states: list[WorkerState]) -> None:
        """Kill the servers that workers gone from this host left running (`reap_servers`)."""
        for st in states:
            key = (st.worker_id, st.pid)
            if key in self.reaped or (st.pid, st.pid_start) == (self.state.pid, self.state.pid_start):
                continue
            killed = reap_servers(st, self.state.host)
            if killed is None:
                continue
            self.reaped.add(key)
            if killed:
                self.log(f"killed {killed} process(es) that worker {st.worker_id} (pid {st.pid}, gone) left running")

    def record_servers(self) -> None:
        """Record every process of the servers now (their leaders and what they started: `merge_recorded`); save()
        does it again every RECORD_SERVERS_S while they run."""
        if self.servers is not None:
            self._recorded_at = time.monotonic()
            self.save(
                server_processes=merge_recorded(
                    self.state.server_processes, processes.descendants(self.servers.groups())
                )
            )

    # ------------------------------------------------------------ choosing and claiming

    def candidates(self) -> tuple[list[Candidate], list[Seal], list[claims.ClaimInfo]]:
        """(unsealed shards not given up, sealed markers, claims held by dead workers on this host)."""
        out: list[Candidate] = []
        markers: list[Seal] = []
        dead: list[claims.ClaimInfo] = []
        for spec in self.plan.shards:
            if spec.index in self.seen_sealed:
                markers.append(self.seen_sealed[spec.index])
                continue
            st = seal.check(self.run_dir, self.plan, spec.index)
            if st.sealed and st.marker is not None:
                self.seen_sealed[spec.index] = st.marker  # a seal is final: not read again at every look
                markers.append(st.marker)
                continue
            attempts = failed_attempts(self.run_dir, spec.index)
            if attempts >= self.cluster.max_attempts:
                continue
            info = self.book.read(spec.index)
            if info is not None and not self.book.stale(info):
                if info.host == self.state.host and info.worker_id != self.worker_id and not pid_alive(info.pid):
                    dead.append(info)
                continue
            done = store.count_complete_lines(store.rollouts_path(self.run_dir, spec.index)) + (
                store.count_complete_lines(store.failures_path(self.run_dir, spec.index))
            )
            out.append(Candidate(spec.index, spec.num_rollouts, min(done, spec.num_rollouts), attempts))
        return out, markers, dead

    def behind_a_wave(self, index: int) -> bool:
        """Adaptive sampling: shard `index` begins a later wave than a shard this worker still collects, so it must
        wait for that one to seal (its start decides from the earlier waves' rollouts on disk)."""
        waves = planner.WaveOrder(self.plan)
        mine = waves.waves_of(self.plan.shards[index])
        if mine is None:
            return False
        with self.lock:
            held = [i for i in self.running if i != index]
        return any((w := waves.waves_of(self.plan.shards[i])) is not None and w[1] < mine[0] for i in held)

    def next_claim(self, wait: bool = True) -> claims.Claim | None:
        """Claim the next shard; wait for claims of dead workers on this host to go stale (unless not `wait`: a
        worker with shards in flight polls again later); None when none is left."""
        while True:
            found, markers, dead = self.candidates()
            rate = rate_per_s(markers)
            left = self.time_left()
            room = None if left is None else left - self.drain_s
            adaptive = self.plan.sampling is not None and self.plan.sampling.stop_when_decided is not None
            for c in order(found, by_wave=adaptive):
                if adaptive and self.behind_a_wave(c.index):
                    continue
                if not fits(c, rate, room):
                    self.log(f"shard {c.index}: {c.pending} rollouts would not finish before the time limit; skipped")
                    continue
                self.book.sweep(c.index)
                claim = self.book.try_claim(c.index)
                if claim is not None:
                    if seal.check(self.run_dir, self.plan, c.index).sealed:  # sealed since we looked
                        self.book.release(claim)
                        continue
                    if claim.took_over is not None:
                        t = claim.took_over
                        self.log(
                            f"shard {c.index}: took over the stale claim of worker {t.worker_id} (job {t.job_id}, "
                            f"host {t.host}, last heartbeat {self.clock() - t.renewed_at:.0f} s ago)"
                        )
                    return claim
            if not dead or not wait:
                return None
            self.reap_leftovers(records.read_worker_states(self.run_dir))
            self.save(state=IDLE, current_shard=None)
            pause = min(max(0.0, self.book.lease_s - min(i.age(self.clock()) for i in dead)) + 0.5, WAIT_POLL_S)
            time.sleep(pause)

    # ------------------------------------------------------------ the end of a run

    def help_with_the_tail(self) -> bool:
        """Nothing left to claim: ask the holders of the shards still collected, longest first, for a share of what
        waits for a slot there (workers/tail_help.py), and collect the first share granted. False when no holder
        wants help (each is asked once), or this worker cannot help (no collector service, or the time limit)."""
        service = self.servers.service if self.servers is not None else None
        left = self.time_left()
        if (
            service is None
            or self.servers is None
            or self.servers.problem()
            or (left is not None and left <= 2 * self.drain_s)
        ):
            return False
        busy = []
        for spec in self.plan.shards:
            if spec.index in self.seen_sealed or spec.index in self.no_help:
                continue
            info = self.book.read(spec.index)
            if info is None or info.worker_id == self.worker_id or self.book.stale(info):
                continue
            done = store.count_complete_lines(store.rollouts_path(self.run_dir, spec.index))
            busy.append((spec.num_rollouts - done, spec.index))
        wait_s = lent_share.answer_wait_s(self.gym.health_interval_s, self.gym.stall_timeout_s)
        for _pending, index in sorted(busy, reverse=True):
            self.save(state=IDLE)
            g = lent_share.ask_for_share(self.run_dir, self.plan, index, self.worker_id, wait_s)
            if g is None or not g.rows:
                self.no_help.add(index)
                continue

            def time_limit() -> str | None:
                if self.stopping.is_set():
                    raise ShardReleased("the worker is stopping; the share goes back to its holder")
                left = self.time_left()
                if left is not None and left <= self.drain_s:
                    raise ShardReleased("the time limit is near; the share goes back to its holder")
                return None

            self.save(state=COLLECTING)
            t0 = time.monotonic()
            try:
                lent_share.collect_share(
                    service,
                    self.run_dir,
                    index,
                    g,
                    checks=[watchdog.Check("servers", self.servers.problem), watchdog.Check("time limit", time_limit)],
                    stall_timeout_s=self.gym.stall_timeout_s,
                    interval_s=self.gym.health_interval_s,
                    heartbeat_s=self.cluster.claim_heartbeat_s,
                    log=self.log,
                    sandbox=self.servers.sandbox,
                )
            except ServerFailure:
                pass  # the next look restarts the servers (ensure_servers) or gives up
            finally:
                with self.lock:
                    self.state.holding_s += time.monotonic() - t0  # collecting: the occupancy counts it
                self.save(state=IDLE)
            return True
        return False

    # ------------------------------------------------------------ one shard

    def collect(self, claim: claims.Claim) -> str:
        """Collect the claimed shard against the running servers (a re-score: re-verify it, rescoring.py); release
        the claim. Returns the outcome."""
        assert self.servers is not None or self.rescoring
        index = claim.index
        lost = threading.Event()
        stop_beat = threading.Event()

        def beat() -> None:
            while not stop_beat.wait(self.cluster.claim_heartbeat_s):
                if not self.book.renew(claim):
                    lost.set()
                    return

        def claim_check() -> str | None:
            if self.stopping.is_set():
                raise ShardReleased(f"shard {index}: the worker is stopping; completed rollouts kept")
            if lost.is_set() or not self.book.held(claim):
                raise ShardReleased(f"shard {index}: the claim was lost (not renewed within the lease)")
            left = self.time_left()
            if left is not None and left <= self.drain_s:
                self.save(state=DRAINING)
                raise ShardReleased(f"shard {index}: the time limit is near; stopped, completed rollouts kept")
            return None

        attempt = max(runtime.shard_attempt(self.run_dir, index), failed_attempts(self.run_dir, index) + 1)
        checks = [watchdog.Check("claim and time limit", claim_check)]
        if self.servers is None:  # a re-score
            warm: dict[str, Any] = {"checks": checks, "worker": SealWorker(id=self.worker_id, job_id=self.job_id)}
            said = "re-score: Gym's re-verification starts its servers"
        else:
            worker = SealWorker(
                id=self.worker_id, job_id=self.job_id, servers_warm=self.warm, servers_up_since=self.servers.up_since
            )
            warm = {
                "servers": self.servers.base,
                "collector": self.servers.service,
                "lending": lending.HolderLending(self.run_dir, index, self.worker_id, self.cluster.claim_lease_s),
                "checks": checks,
                "known": self.known,
                "worker": worker,
            }
            said = f"servers {'warm' if self.warm else 'just started'}"
        self.save(state=COLLECTING)
        self.log(f"shard {index}: claimed (attempt {attempt}, {said})")
        heart = threading.Thread(target=beat, name=f"claim-heartbeat-{index}", daemon=True)
        heart.start()
        t0 = time.monotonic()
        outcome = "sealed"
        try:
            result = runtime.run_shard(self.run_dir, index, job_id=self.job_id, plan=self.plan, attempt=attempt, **warm)
            if result.state == "sealed":
                self.warm = True
                with self.lock:
                    self.state.sealed.append(index)
            outcome = result.state
            self.log(f"shard {index}: {result.state}")
        except runtime.ShardInterrupted:
            raise  # SIGTERM/SIGINT: the worker stops (its claim is released below)
        except ShardReleased as e:
            outcome = "released"
            self.log(f"shard {index}: stopped: {e}")
            if self.state.state == DRAINING:
                raise
        except ServerFailure as e:
            outcome = "server_failure"
            self.state.failed_attempts += 1
            self.log(f"shard {index}: failed (servers): {e}")
        except ShardFailed as e:
            outcome = "failed"
            if "is already running" not in str(e):
                self.state.failed_attempts += 1
            self.log(f"shard {index}: failed: {e}")
        except ShardrunError as e:
            outcome = "failed"
            self.state.failed_attempts += 1
            self.log(f"shard {index}: failed: {e}")
        finally:
            stop_beat.set()
            heart.join()
            with self.lock:
                self.state.collecting_s[str(index)] = self.state.collecting_s.get(str(index), 0.0) + (
                    time.monotonic() - t0
                )
            if not self.book.release(claim):
                self.log(f"shard {index}: its claim was no longer ours to release")
            with self.lock:
                self.running.pop(index, None)
                self.save(state=COLLECTING if self.running else IDLE)
        return outcome


def pid_alive(pid: int) -> bool:
    return pid > 0 and processes.start_ticks(pid) is not None


def run_worker(
    run_dir: Path | str, worker_id: str | None = None, *, job_id: str | None = None, deadline: float | None = None
) -> WorkerState:
    """What a worker job runs; returns its final state (exit 0), raises ServerFailure when its servers kept dying."""
    return Worker(Path(run_dir), worker_id or worker_id_for(job_id), job_id=job_id, deadline=deadline).run()
