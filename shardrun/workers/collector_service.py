"""A warm worker's collector service: one long-lived Gym collector that takes shard after shard.

Per shard, `ng_collect_rollouts` is a new process that imports NeMo Gym, reads its inputs and exits; on short
shards that start-up is most of the shard, and the policy's slots sit empty meanwhile. A warm worker instead starts
`collector_service_gym.py` with its servers, under the Gym venv's Python and with the collector's own overrides,
and hands it each shard round through a spool directory. The service runs every round through Gym's own
`run_from_config` (the same rows, resume and failures sidecar as the command) and gives all of them one budget of
rollouts in flight (`budget`: gym.num_samples_in_parallel x collector.rollouts_per_slot), so a shard's rollouts start
while the one before it drains. The policy still sees at most gym.num_samples_in_parallel requests at once (the
worker's slot gate); the rollouts beyond that run their agent and verification steps, or wait at the gate, so a slot
is not left empty while its last rollout finishes those steps.

`Round` has what the watchdog needs of a collector (`wait`, `alive`, `stop`, `log_path`): a shard's round is
watched, stalled, stopped and retried exactly as a collector process is.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


from shardrun.core.config import GymConfig
from shardrun.core.gym_adapter import GymAdapter
from shardrun.core.gym_names import MATERIALIZED, ROLLOUTS
from shardrun.rundir import store
from shardrun.shard import collector, processes
from shardrun.shard.gym_stack import GymStack
from shardrun.workers import spool

PROGRAM = Path(__file__).with_name("collector_service_gym.py")
POLL_S = 0.05
LEND_WAIT_S = 5.0  # how long a shard waits for the service to answer a request to lend rows
CANCELLED_RC = -15
UNLIMITED = "unlimited"  # the service's budget argument when gym.num_samples_in_parallel is unset
STOP_GRACE_S = (
    10.0  # a cancelled round unwinds within the service's LEFTOVER_S (3 s); past this, the service is stopped
)
_names = itertools.count()


@dataclass(frozen=True)
class BudgetLook:
    """The service's budget as a worker reads it before claiming a further shard."""

    idle_s: float  # seconds a slot has been free with no rollout waiting for one (0 while none is)
    drained_s: float  # seconds no rollout has waited for a slot (0 while one waits)
    started: set[int]  # the shards whose rounds' rollouts have asked for a slot


@dataclass
class Round:
    """One shard round in the service (what a collector process is for a shard run on its own)."""

    service: "CollectorService"
    name: str
    log_path: Path
    rc: int | None = None

    def path(self, suffix: str) -> Path:
        return self.service.spool / f"{self.name}{suffix}"

    def poll(self) -> int | None:
        if self.rc is None:
            try:
                done = spool.read(self.path(spool.EXIT), spool.RoundExit)
            except spool.Garbled as e:  # the round is over, how is not known: a failed round (the shard retries)
                with contextlib.suppress(OSError), open(self.log_path, "a") as log:
                    log.write(f"[shardrun] round {self.name}: its exit record is unreadable ({e}); taken as failed\n")
                done = spool.RoundExit(rc=1)
            if done is not None:
                self.rc = done.rc
            elif not self.service.alive():  # the service died under this round: it ends with it
                self.rc = self.service.proc.returncode or 1
            if self.rc is not None:
                self._clear()
        return self.rc

    def _clear(self) -> None:
        for suffix in spool.ROUND_FILES:
            self.path(suffix).unlink(missing_ok=True)

    def alive(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"collector service round {self.name}", timeout or 0)
            time.sleep(POLL_S)
        return rc

    def lend(self, fraction: float, timeout: float = LEND_WAIT_S) -> list[tuple[int, int]]:
        """Lend `fraction` of this round's rollouts still waiting for a slot (the last ones in input order): the
        service will not run them, and the round ends once the rest are done. Returns their identities (none when
        fewer than two wait, the round has ended, or the service does not answer within `timeout`)."""
        answer = self.path(spool.LENT)
        answer.unlink(missing_ok=True)
        spool.write(self.path(spool.LEND), spool.LendAsk(fraction=fraction))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.poll() is None:
            try:
                lent = spool.read(answer, spool.LentRows)
            except spool.Garbled:  # not trusted: nothing is taken as lent (its rows park; the next round runs them)
                return []
            if lent is None:
                time.sleep(POLL_S)
                continue
            answer.unlink(missing_ok=True)
            return [(t, r) for t, r in lent.rows]
        # no answer: the request is withdrawn. Had the service answered just now, its rows are lent to no one: the
        # round parks them and ends without them, and the shard's next round runs them
        self.path(spool.LEND).unlink(missing_ok=True)
        return []

    def stop(self, grace: float = 10.0) -> int | None:
        """Cancel the round (its rows already written stay); if the service does not report it within `grace` (at
        least STOP_GRACE_S), the service is stopped, which ends every round in it."""
        if self.poll() is not None:
            return self.rc
        self.path(spool.CANCEL).touch()
        try:
            return self.wait(max(grace, STOP_GRACE_S))
        except subprocess.TimeoutExpired:
            self.service.stop()
            return self.poll()


@dataclass
class CollectorService:
    proc: processes.Proc
    spool: Path

    def alive(self) -> bool:
        return self.proc.alive()

    def problem(self) -> str | None:
        return None if self.alive() else f"the collector service {self.proc.describe_exit()}"

    def budget(self) -> BudgetLook:
        """What the service's slots.json says (nothing yet, or garbled: nothing known to be free)."""
        try:
            report = spool.read(self.spool / spool.SLOTS, spool.SlotsReport)
        except spool.Garbled:
            report = None
        if report is None:
            return BudgetLook(0.0, 0.0, set())
        now = time.time()
        idle, drained = (0.0 if t is None else max(0.0, now - t) for t in (report.idle_since, report.drained_since))
        return BudgetLook(idle, drained, report.shards_started())

    def submit(self, run_dir: Path, index: int, view: Path | None = None, log_path: Path | None = None) -> Round:
        """Start a round of shard `index` (`view`: collector.skipping_view, when rows are skipped, or a helper's
        share of the shard; `log_path`: in place of the shard's collector log)."""
        where = (view or store.shard_dir(run_dir, index)).resolve()
        log_path = (log_path or store.collector_log_path(run_dir, index)).resolve()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        name = f"shard-{index}-{next(_names)}"
        with open(log_path, "ab") as log:
            log.write(
                f"[shardrun] {time.strftime('%Y-%m-%d %H:%M:%S')} round {name} in the collector service\n".encode()
            )
        job = spool.RoundJob(input=str(where / MATERIALIZED), output=str(where / ROLLOUTS), log=str(log_path))
        spool.write(self.spool / f"{name}{spool.RUN}", job)
        return Round(self, name, log_path)

    def stop(self, grace: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            (self.spool / spool.STOP).touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.popen.wait(grace)
        processes.stop(self.proc, grace=grace)
        shutil.rmtree(self.spool, ignore_errors=True)


def budget(slots: int | None, rollouts_per_slot: float) -> int | None:
    """Rollouts the service keeps in flight for `slots` policy slots (gym.num_samples_in_parallel; None: no limit)."""
    return None if slots is None else math.ceil(slots * rollouts_per_slot)


def start(
    adapter: GymAdapter,
    venv: Path,
    stack: GymStack,
    gym: GymConfig,
    home: Path,
    env: Mapping[str, str] | None = None,
    rollouts_per_slot: float = 1.0,
) -> CollectorService:
    """Start the service for a worker's stack, its files under `home` (the worker's own Gym directory), with a
    budget of `budget(gym.num_samples_in_parallel, rollouts_per_slot)` rollouts in flight."""
    spool = home / "collector-service"
    shutil.rmtree(spool, ignore_errors=True)  # a killed worker's leftovers
    spool.mkdir(parents=True)
    cwd = spool / "cwd"  # an empty working directory, as a shard's collector has
    cwd.mkdir()
    base = dict(os.environ if env is None else env)
    limit = budget(gym.num_samples_in_parallel, rollouts_per_slot)
    cmd = [
        str(venv / "bin" / "python"),
        str(PROGRAM),
        str(spool),
        UNLIMITED if limit is None else str(limit),
        *collector.overrides(adapter, stack.port, gym),
    ]
    return CollectorService(
        processes.start(
            cmd,
            home / "collector-service.log",
            name="collector service",
            cwd=cwd,
            env=collector.environment(base, venv, stack, gym),
        ),
        spool,
    )
