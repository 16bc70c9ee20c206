"""A warm worker's collector service: one long-lived Gym collector that takes shard after shard.

Per shard, `ng_collect_rollouts` is a new process that imports NeMo Gym, reads its inputs and exits; on short
shards that start-up is most of the shard, and the policy's slots sit empty meanwhile. A warm worker instead starts
`collector_service_gym.py` with its servers, under the Gym venv's Python and with the collector's own overrides,
and hands it each shard round through a spool directory. The service runs every round through Gym's own
`run_from_config` (the same rows, resume and failures sidecar as the command) and gives all of them one budget of
rollouts in flight (`budget`: gym.num_samples_in_parallel x cluster.rollouts_per_slot), so a shard's rollouts start
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

import orjson

from shardrun.core.config import GymConfig
from shardrun.core.gym_adapter import GymAdapter
from shardrun.core.gym_names import MATERIALIZED, ROLLOUTS
from shardrun.rundir import store
from shardrun.shard import collector, processes
from shardrun.shard.gym_stack import GymStack

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

    def _exit_path(self) -> Path:
        return self.service.spool / f"{self.name}.exit.json"

    def poll(self) -> int | None:
        if self.rc is None:
            try:
                self.rc = int(orjson.loads(self._exit_path().read_bytes())["rc"])
            except FileNotFoundError:
                if not self.service.alive():  # the service died under this round: it ends with it
                    self.rc = self.service.proc.returncode or 1
            if self.rc is not None:
                self._clear()
        return self.rc

    def _clear(self) -> None:
        for suffix in (".run.json", ".cancel", ".exit.json", ".lend.json", ".lent.json"):
            (self.service.spool / f"{self.name}{suffix}").unlink(missing_ok=True)

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
        answer = self.service.spool / f"{self.name}.lent.json"
        answer.unlink(missing_ok=True)
        with store.atomic_writer(self.service.spool / f"{self.name}.lend.json") as f:
            f.write(orjson.dumps({"fraction": fraction}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.poll() is None:
            try:
                rows = orjson.loads(answer.read_bytes())["rows"]
            except FileNotFoundError:
                time.sleep(POLL_S)
                continue
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return []
            answer.unlink(missing_ok=True)
            return [(int(t), int(r)) for t, r in rows]
        # no answer: the request is withdrawn. Had the service answered just now, its rows are lent to no one: the
        # round parks them and ends without them, and the shard's next round runs them
        (self.service.spool / f"{self.name}.lend.json").unlink(missing_ok=True)
        return []

    def stop(self, grace: float = 10.0) -> int | None:
        """Cancel the round (its rows already written stay); if the service does not report it within `grace` (at
        least STOP_GRACE_S), the service is stopped, which ends every round in it."""
        if self.poll() is not None:
            return self.rc
        (self.service.spool / f"{self.name}.cancel").touch()
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
            data = orjson.loads((self.spool / "slots.json").read_bytes())
            now = time.time()
            idle, drained = (
                0.0 if t is None else max(0.0, now - float(t)) for t in (data["idle_since"], data["drained_since"])
            )
            shards = {int(name.split("-")[1]) for name in data["started"] if isinstance(name, str)}
        except (FileNotFoundError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
            return BudgetLook(0.0, 0.0, set())
        return BudgetLook(idle, drained, shards)

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
        job = {"input": str(where / MATERIALIZED), "output": str(where / ROLLOUTS), "log": str(log_path)}
        with store.atomic_writer(self.spool / f"{name}.run.json") as f:
            f.write(orjson.dumps(job))
        return Round(self, name, log_path)

    def stop(self, grace: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            (self.spool / "stop").touch()
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
