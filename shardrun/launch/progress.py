"""The live progress view of a run: `shardrun status --watch` (`watch`) and a waiting local `shardrun submit`.

One line of facts from `status.collect`: rollouts done of planned, rate, ETA, shards sealed / running / failed /
pending, and the warm workers. On a terminal it is drawn with `rich` (a progress bar and a small table of the
workers, redrawn in place); otherwise it is printed as a plain line each time it changes, so logs stay readable.

`line` and `view` are pure; `follow` and `Ticker` read the run directory.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from shardrun.core.errors import BadInput
from shardrun.core.terminal import shown
from shardrun.launch import status
from shardrun.workers import worker_view
from shardrun.plan.planner import Plan


def rate_text(st: status.RunStatus) -> str:
    return f"{st.throughput_per_min:,.1f}/min" if st.throughput_per_min else "-/min"


def eta_text(st: status.RunStatus) -> str:
    if st.complete:
        return "done"
    return status.duration(st.eta_s) if st.eta_s is not None else "-"


def live_workers(st: status.RunStatus) -> list[worker_view.WorkerRow]:
    return [w for w in st.workers if w.live]


def line(st: status.RunStatus) -> str:
    """The progress as one plain line (pure)."""
    c = st.counts
    text = (
        f"rollouts {st.done:,}/{st.planned:,} {status.progress_bar(st.done, st.planned)} · {rate_text(st)} · "
        f"ETA {eta_text(st)} · shards sealed {c[status.SEALED]:,} running {c[status.RUNNING]:,} "
        f"failed {c[status.FAILED]:,} pending {c[status.PENDING] + c[status.NEVER_STARTED]:,}"
    )
    if st.workers:
        busy = [w for w in live_workers(st) if w.current_shards]
        text += f" · workers {len(live_workers(st))} live ({len(busy)} collecting)"
    return text


def view(st: status.RunStatus) -> Any:
    """The progress as a rich renderable: a bar with the counts, and the workers when there are any (pure)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    c = st.counts
    head = Table.grid(padding=(0, 1))
    head.add_row(
        "rollouts",
        ProgressBar(total=max(1, st.planned), completed=st.done, width=30),
        f"{st.done:,}/{st.planned:,}",
        rate_text(st),
        f"ETA {eta_text(st)}",
    )
    head.add_row(
        "shards",
        f"sealed {c[status.SEALED]:,}",
        f"running {c[status.RUNNING]:,}",
        f"failed {c[status.FAILED]:,}",
        f"pending {c[status.PENDING] + c[status.NEVER_STARTED]:,}",
    )
    parts: list[Any] = [head]
    if st.workers:
        table = Table("worker", "job", "host", "state", "shard", "sealed", box=None, pad_edge=False)
        for w in st.workers:
            cells = (w.worker_id, w.job_id or "-", w.host, w.state, w.holding, str(w.sealed))
            table.add_row(*(Text(shown(c)) for c in cells))  # Text: data is never read as rich markup
        parts.append(table)
    return Group(*parts)


def finished(st: status.RunStatus) -> bool:
    return st.complete or not (st.counts[status.RUNNING] + st.counts[status.PENDING])


MAX_INTERVAL_S = 86400.0


def check_interval(interval_s: float) -> None:
    """BadInput unless the seconds between updates are a positive, finite number of at most a day."""
    if not (math.isfinite(interval_s) and 0 < interval_s <= MAX_INTERVAL_S):
        raise BadInput(
            f"--interval: {interval_s:g} seconds; the interval between updates must be a positive, finite number "
            f"of seconds, at most {MAX_INTERVAL_S:g}"
        )


def watch(
    run_dir: Path,
    interval_s: float = 5.0,
    echo: Callable[[str], None] = print,
    clear: bool | None = None,
    max_updates: int | None = None,
) -> status.RunStatus:
    """`shardrun status --watch`: the progress until every shard is sealed or nothing is live any more: rich on a
    terminal (`clear`), plain lines otherwise."""
    return follow(run_dir, interval_s, echo, tty=clear, max_updates=max_updates)


def follow(
    run_dir: Path,
    interval_s: float = 5.0,
    echo: Callable[[str], None] = print,
    *,
    tty: bool | None = None,
    max_updates: int | None = None,
) -> status.RunStatus:
    """Show the progress until every shard is sealed or nothing is live any more; returns the last status."""
    from shardrun.rundir import store

    check_interval(interval_s)
    plan = store.load_plan(run_dir)
    tty = sys.stdout.isatty() if tty is None else tty
    ticker = Ticker(run_dir, plan, echo, tty=tty, every_s=0.0)
    updates = 0
    try:
        while True:
            st = ticker.tick()
            updates += 1
            if finished(st) or (max_updates is not None and updates >= max_updates):
                return st
            time.sleep(interval_s)
    finally:
        ticker.close()


class Ticker:
    """Progress while something else waits (a local submit): `tick()` at most every `every_s` seconds redraws the
    rich view on a terminal, or prints the plain line when it changed."""

    def __init__(self, run_dir: Path, plan: Plan, echo: Callable[[str], None], *, tty: bool, every_s: float = 5.0):
        self.run_dir, self.plan, self.echo, self.tty, self.every_s = run_dir, plan, echo, tty, every_s
        self.last_at = float("-inf")
        self.last_line = ""
        self.last: status.RunStatus | None = None
        self.live: Any = None

    def tick(self) -> status.RunStatus:
        now = time.monotonic()
        if self.last is not None and now - self.last_at < self.every_s:
            return self.last
        self.last_at = now
        st = status.collect(self.run_dir, plan=self.plan)
        self.last = st
        if self.tty:
            if self.live is None:
                from rich.live import Live

                self.live = Live(view(st), auto_refresh=False, transient=False)
                self.live.start()
            self.live.update(view(st), refresh=True)
        else:
            text = line(st)
            if text != self.last_line:
                self.echo(f"[{time.strftime('%H:%M:%S')}] {text}")
                self.last_line = text
        return st

    def safe_tick(self) -> None:
        """tick(), for a waiting submit: a run directory it cannot read right now (a shard mid-write, a full disk)
        costs one update, never the wait."""
        from shardrun.core.errors import ShardrunError

        try:
            self.tick()
        except (ShardrunError, OSError, ValueError):
            pass

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
