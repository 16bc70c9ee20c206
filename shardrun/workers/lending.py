"""A shard holder's side of the end of a run: lend part of the shard to idle workers that ask, fold their rows in.

The warm worker gives each shard it collects a `HolderLending` (the shard runtime's `Lending` hook,
shard/runtime.py): while a round runs in the collector service, every ask (workers/tail_help.py) gets half of the
rollouts still waiting for a slot there; the rows lent are not run here; before the seal, every share has settled
(finished, or its helper fell silent for the claim lease and it was taken back) and its rows are folded in, each
lent identity once. The helper's side is workers/lent_share.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from shardrun.core.errors import ShardFailed
from shardrun.rundir import store
from shardrun.shard import runtime, watchdog
from shardrun.workers import collector_service, tail_help

HELP_POLL_S = 0.5  # how often a shard waiting for its helpers looks at their shares


class HolderLending:
    """Shard `index`'s shares lent to helping workers by `holder` (a worker id), not folded in yet."""

    def __init__(self, run_dir: Path, index: int, holder: str, lease_s: float):
        self.run_dir, self.index, self.holder = run_dir, index, holder
        self.lease_s = lease_s  # a helper silent this long has given its share up
        self.lent: dict[str, tail_help.Grant] = {}
        self.log = runtime.ShardLog(store.shard_log_path(run_dir, index), index)

    def rows(self) -> set[runtime.Key]:
        return {k for g in self.lent.values() for k in g.rows}

    def take_back(self) -> None:
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

    def wait(self, checks: Sequence[watchdog.Check]) -> None:
        """Everything else is done: wait for the lent shares to settle and fold them in (the rows a helper did not
        finish are pending again). The worker's checks (its claim, its time limit) keep running meanwhile."""
        if self.lent:
            self.log(f"waiting for {len(self.lent)} helper(s) with {len(self.rows())} lent rollouts")
        while True:
            self.fold_settled()
            if not self.lent:
                return
            self.lend(None)  # nothing waits for a slot here any more: no help wanted
            for c in checks:
                problem = c.problem()
                if problem:
                    raise ShardFailed(f"{c.name}: {problem}; while waiting for the helpers")
            time.sleep(HELP_POLL_S)

    def answer(self, running: watchdog.Watched) -> str | None:
        """A watchdog check, run while a round collects: lend half of what still waits for a slot to each worker
        that asked for help (nothing when the round is not in a collector service: nothing to lend from)."""
        self.lend(running if isinstance(running, collector_service.Round) else None)
        return None

    def lend(self, round_: collector_service.Round | None) -> None:
        for token, helper in tail_help.asks(self.run_dir, self.index):
            rows = round_.lend(0.5) if round_ is not None else []
            g = tail_help.grant(self.run_dir, self.index, token, self.holder, rows)
            if rows:
                self.lent[token] = g
                self.log(f"help {token}: lent {len(rows)} rollouts still waiting for a slot to worker {helper}")

    def sealed(self) -> None:
        tail_help.clear_all(self.run_dir, self.index)  # every share is folded in; asks left unanswered are moot
