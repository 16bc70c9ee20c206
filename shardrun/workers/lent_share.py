"""A helping worker's side of the end of a run (workers/tail_help.py has the protocol): ask a shard's holder for part
of what still waits for a slot, collect that share in this worker's collector service, say when done.

`ask_for_share` writes the ask and waits for the holder's grant (the holder answers from its watchdog, every
`gym.health_interval_s`); `collect_share` runs the share as one round in the service, into the share's own folder
and log, under the watchdog (servers, stall, the time limit, and the holder taking the share back), beating every
`cluster.claim_heartbeat_s` so the holder knows it is at it, and writes `done` whatever the end. A share the helper
could not finish is not lost: the holder folds in what it collected and runs the rest.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from shardrun.core.errors import ServerFailure, ShardFailed
from shardrun.core.gym_names import FAILURES, ROLLOUTS
from shardrun.plan.planner import Plan
from shardrun.rundir import seal, store
from shardrun.shard import sandbox as sandboxes
from shardrun.shard import watchdog
from shardrun.shard.runtime import SANDBOX_CHECK, size
from shardrun.workers import collector_service, tail_help

ASK_POLL_S = 0.25


def answer_wait_s(health_interval_s: float, stall_timeout_s: float) -> float:
    """How long a helper waits for an answer: two of the holder's watchdog looks, and the service's lending."""
    interval = max(0.2, min(health_interval_s, stall_timeout_s / 4))
    return 2 * interval + collector_service.LEND_WAIT_S + 1.0


def ask_for_share(run_dir: Path, plan: Plan, index: int, worker_id: str, wait_s: float) -> tail_help.Grant | None:
    """Ask the holder of shard `index` for a share; the grant (its rows may be empty: no help wanted), or None when
    no answer came in `wait_s` or the shard sealed meanwhile."""
    token = f"{worker_id}-{secrets.token_hex(4)}"
    if not tail_help.ask(run_dir, index, token, worker_id):
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        g = tail_help.read_grant(run_dir, index, token)
        if g is not None:
            return g
        if seal.check(run_dir, plan, index).sealed:
            break
        time.sleep(ASK_POLL_S)
    tail_help.withdraw(run_dir, index, token)
    return tail_help.read_grant(run_dir, index, token)  # answered just as the ask was withdrawn: it is ours


def collect_share(
    service: collector_service.CollectorService,
    run_dir: Path,
    index: int,
    g: tail_help.Grant,
    *,
    checks: Sequence[watchdog.Check],
    stall_timeout_s: float,
    interval_s: float,
    heartbeat_s: float,
    log: Callable[[str], None],
    sandbox: sandboxes.Sandbox | None = None,
) -> int:
    """Collect the share; returns how many of its rollouts landed. Raises what the checks raise (a released or
    draining worker); a stall or a server failure ends the share (the holder runs the rest) and is re-raised as
    ServerFailure only when the servers died. With the worker's `sandbox`: a sandbox found dead takes back the
    share's rows written since it last answered (the holder runs them again; shard/sandbox.py Guard)."""
    share = tail_help.share_dir(run_dir, index, g.token)
    for name in (ROLLOUTS, FAILURES):
        (share / name).touch()
    guard = sandboxes.Guard(sandbox, [share / ROLLOUTS, share / FAILURES]) if sandbox is not None else None
    extra = [watchdog.Check(SANDBOX_CHECK, guard.problem)] if guard is not None else []
    if guard is not None and guard.settle(interval_s) is not None:
        tail_help.finish(run_dir, index, g.token, 1)
        raise ServerFailure(f"shard {index}: the sandbox does not answer: {guard.tripped}")
    stop = threading.Event()

    def beat() -> None:
        while True:
            tail_help.beat(run_dir, index, g.token)
            if stop.wait(heartbeat_s):
                return

    def revoked() -> str | None:
        if tail_help.revoked(run_dir, index, g.token):
            raise ShardFailed(f"shard {index}: its holder took the share back")
        return None

    beating = threading.Thread(target=beat, name=f"help-beat-{index}", daemon=True)
    beating.start()
    rc = 1
    log(f"shard {index}: helping its holder {g.holder} with {len(g.rows)} rollouts (help {g.token})")
    try:
        round_ = service.submit(run_dir, index, share, tail_help.share_log_path(run_dir, index, g.token))
        rc = watchdog.watch(
            round_,
            checks=[*checks, *extra, watchdog.Check("the share", revoked)],
            progress=lambda: tuple(size(share / n) for n in (ROLLOUTS, FAILURES)),
            stall_timeout_s=stall_timeout_s,
            interval_s=interval_s,
            log=log,
        )
    except ShardFailed as e:
        log(f"shard {index}: help stopped: {e}")
    except ServerFailure as e:
        log(f"shard {index}: help stopped: {e}")
        if guard is not None and guard.box.problem() is not None:
            log(
                f"shard {index}: {guard.take_back()} bytes of the share written since the sandbox last answered taken back"
            )
        raise
    finally:
        stop.set()
        beating.join()
        tail_help.finish(run_dir, index, g.token, rc)
    if guard is not None and guard.settle(interval_s) is not None:  # it died as the round ended
        log(f"shard {index}: {guard.take_back()} bytes of the share written since the sandbox last answered taken back")
        raise ServerFailure(f"shard {index}: the sandbox died while helping")
    landed = store.count_complete_lines(share / ROLLOUTS)
    log(f"shard {index}: helped with {landed} of {len(g.rows)} rollouts (round exited {rc})")
    return landed
