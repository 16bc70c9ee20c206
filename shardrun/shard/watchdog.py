"""The watchdog: a running collector is never left to hang.

NeMo Gym 0.4.0 retries a dead model endpoint forever and has no request timeouts, so while the collector runs
this loop health-checks the servers (each check returns a problem or None; a problem seen on two checks in a row
counts) and watches progress (the size of the files the collector appends to). A dead server, or no progress for
`stall_timeout_s`, stops the collector and raises with a clear message.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from shardrun.core.errors import ServerFailure, ShardFailed

STRIKES = 2


class Watched(Protocol):
    """A running collector: a process (processes.Proc) or a round in a worker's collector service."""

    log_path: Path

    def wait(self, timeout: float | None = None) -> int: ...

    def alive(self) -> bool: ...

    def stop(self, grace: float = 10.0) -> int | None: ...


@dataclass(frozen=True)
class Check:
    name: str
    problem: Callable[[], str | None]


def watch(
    proc: Watched,
    *,
    checks: Sequence[Check],
    progress: Callable[[], object],
    stall_timeout_s: float,
    interval_s: float,
    log: Callable[[str], None] = lambda _m: None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Wait for `proc` (a collector) to exit and return its exit code, or stop it and raise ServerFailure / ShardFailed."""
    interval = max(0.2, min(interval_s, stall_timeout_s / 4))
    last = progress()
    last_change = clock()
    strikes = {c.name: 0 for c in checks}
    try:
        while True:
            try:
                return proc.wait(timeout=interval)
            except subprocess.TimeoutExpired:
                pass
            now_progress = progress()
            if now_progress != last:
                last, last_change = now_progress, clock()
            for c in checks:
                problem = c.problem()
                strikes[c.name] = strikes[c.name] + 1 if problem else 0
                if problem and strikes[c.name] >= STRIKES:
                    raise ServerFailure(
                        f"{c.name}: {problem}; stopped the collector (Gym would wait for it forever)", check=c.name
                    )
            idle = clock() - last_change
            if idle >= stall_timeout_s:
                raise ShardFailed(
                    f"stalled: no rollout landed for {idle:.0f} s (gym.stall_timeout_s = "
                    f"{stall_timeout_s:g}) although the servers answer health checks; stopped the "
                    f"collector. The model may hang on some requests; see {proc.log_path}"
                )
    except BaseException as e:
        if proc.alive():
            log(f"stopping the collector: {e}")
            proc.stop(grace=5.0)
        raise
