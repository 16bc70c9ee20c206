"""The collector service's own program, run by the Gym venv's Python (never imported by shardrun).

A warm worker starts it once, beside its servers, instead of one `ng_collect_rollouts` process per shard:

    GYM_PYTHON collector_service_gym.py SPOOL BUDGET HYDRA_OVERRIDE...

It builds NeMo Gym's global config from the overrides exactly as Gym's collector command does (the same
`sys.argv`, the same `get_global_config_dict`), then collects shard after shard, several at once, each through
Gym's own `RolloutCollectionHelper.run_from_config` with the shard's `input_jsonl_fpath` and
`output_jsonl_fpath`: the rows it writes, its resume from the materialized file, its failures sidecar and its
retries are Gym's, byte for byte as with the command. What the service adds:

- one process for all shards, so a shard no longer pays for starting Python and importing Gym;
- one budget of BUDGET rollouts in flight (an integer, or `unlimited`: Gym's `num_samples_in_parallel` is unset)
  shared by every shard it runs (Gym makes its semaphore with `Semaphore(num_samples_in_parallel)` in
  `run_from_config`; the service hands every shard the same one), so the next shard's rollouts take the slots that
  the draining one frees. shardrun sets BUDGET to num_samples_in_parallel x collector.rollouts_per_slot: the policy's
  slots are num_samples_in_parallel, kept by the worker's slot gate, and the rollouts beyond them run their agent
  and verification steps meanwhile;
- each shard's output (Gym's prints, tracebacks) in that shard's own collector log, as the command's would be.

The spool directory is the whole protocol (files written whole by rename):
  NAME.run.json    {"input": ..., "output": ..., "log": ...}: collect one shard round (shardrun writes it)
  NAME.cancel      stop that round: its tasks are cancelled, its rows already written stay
  NAME.exit.json   {"rc": N}: the round is over (0: Gym returned, or every row but the lent ones is done; 1: it
                   raised, traceback in the log; -15: cancelled)
  NAME.lend.json   {"fraction": F}: lend that share of the round's rollouts still waiting for a slot to another
                   worker (an idle one helping with the end of a run); the service answers
  NAME.lent.json   {"rows": [[TASK, ROLLOUT], ...]}: the identities lent, the last ones waiting in input order. A
                   lent row is never run here: when its turn for a slot comes it gives the slot back and parks; once
                   every row of the round but the parked ones is done, the round ends with rc 0
  slots.json       {"budget": N, "held": N, "idle_since": T, "drained_since": T, "started": [NAME...]} (written
                   when it changes): the rollouts holding a slot of the budget now (null: no budget), since when (time.time()) a slot of the budget has been free with no rollout waiting for
                   one (null while all are taken or one waits), since when no rollout has waited for a slot (null
                   while one waits), and the rounds whose rollouts have asked for a slot; from it the worker knows
                   when the shards it holds will not keep the slots full, and claims another
  stop             end the service
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Literal

POLL_S = 0.05
CANCELLED_RC = -15
LEFTOVER_S = 3.0  # how long a round's cancelled rollouts may take to unwind before its end is reported
SETTLED_POLLS = 3  # a round with lent rows ends once only they are left, seen on this many polls in a row
TASK_KEY, ROLLOUT_KEY = "_ng_task_index", "_ng_rollout_index"  # a materialized row's identity (Gym's names)
_log: contextvars.ContextVar[Any] = contextvars.ContextVar("shard_log", default=None)
_round: contextvars.ContextVar[str | None] = contextvars.ContextVar("shard_round", default=None)
_tasks: contextvars.ContextVar[set | None] = contextvars.ContextVar("shard_tasks", default=None)


class Routed:
    """sys.stdout / sys.stderr: what a shard's code writes goes to that shard's log; the rest to the service's."""

    def __init__(self, default: Any):
        self._default = default

    def _target(self) -> Any:
        return _log.get() or self._default

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._default, name)


def identity() -> tuple[int, int] | None:
    """The identity of the row whose rollout the current task runs: Gym runs each row in a task of its own
    `_post_subroutine(row)` (0.4 and 0.7), which is the coroutine asking the budget for a slot. None when it is not
    such a task (then its row is never lent)."""
    task = asyncio.current_task()
    frame = getattr(task.get_coro(), "cr_frame", None) if task is not None else None
    row = frame.f_locals.get("row") if frame is not None else None
    if not isinstance(row, dict):
        return None
    t, r = row.get(TASK_KEY), row.get(ROLLOUT_KEY)
    return (t, r) if isinstance(t, int) and isinstance(r, int) else None


class Budget(asyncio.Semaphore):
    """The one budget of `num_samples_in_parallel` slots that every round's rollouts take (Gym's own semaphore,
    shared), counting the rollouts holding a slot and those waiting for one, and the rounds that have asked. It
    also knows which rows of each round wait (`queued`), so it can lend the last of them away (`lend`): a lent row
    that gets a slot gives it back at once and parks, never to run here."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n, self.held, self.waiting = n, 0, 0
        self.asked: set[str] = set()
        self.queued: dict[str, dict[tuple[int, int], None]] = {}  # round -> its rows waiting, in arrival order
        self.lent: dict[str, set[tuple[int, int]]] = {}  # round -> its rows lent away
        self.parked: dict[str, int] = {}  # round -> its lent rows that reached a slot and parked
        self.holding: dict[str, int] = {}  # round -> its rows holding a slot

    async def acquire(self) -> Literal[True]:
        name, key = _round.get(), identity()
        if name is not None:
            self.asked.add(name)
        queued = self.queued.setdefault(name or "", {})
        if key is not None:
            queued[key] = None
        self.waiting += 1
        try:
            await super().acquire()
        finally:
            self.waiting -= 1
            queued.pop(key, None)  # type: ignore[arg-type]
        if key is not None and key in self.lent.get(name or "", ()):
            super().release()  # lent away: the slot goes to the next rollout, this one waits for its cancel
            self.parked[name or ""] = self.parked.get(name or "", 0) + 1
            await asyncio.get_running_loop().create_future()
        self.held += 1
        self.holding[name or ""] = self.holding.get(name or "", 0) + 1
        return True

    def release(self) -> None:
        self.held -= 1
        name = _round.get() or ""
        self.holding[name] = self.holding.get(name, 1) - 1
        super().release()

    def busy(self) -> bool:
        """Every slot taken, or a rollout waiting for one: the rounds in the service fill the budget."""
        return self.waiting > 0 or self.held >= self.n

    def lend(self, name: str, fraction: float) -> list[tuple[int, int]]:
        """Lend `fraction` of round `name`'s rows waiting for a slot (rounded down; one when two or more wait):
        the last ones, which would run last here."""
        waiting = [k for k in self.queued.get(name, {}) if k not in self.lent.get(name, ())]
        count = min(len(waiting) - 1, max(1, int(len(waiting) * fraction))) if len(waiting) >= 2 else 0
        out = waiting[len(waiting) - count :] if count > 0 else []
        self.lent.setdefault(name, set()).update(out)
        return out

    def only_lent_left(self, name: str) -> bool:
        """Round `name` lent rows away and has nothing else left: every lent row parked, none of its rows holds a
        slot or waits for one."""
        lent = self.lent.get(name) or set()
        return (
            bool(lent)
            and self.parked.get(name, 0) >= len(lent)
            and self.holding.get(name, 0) <= 0
            and not self.queued.get(name)
        )

    def forget(self, name: str) -> None:
        for book in (self.queued, self.lent, self.parked, self.holding):
            book.pop(name, None)


def write_whole(path: Path, data: dict) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w") as f:
        f.write(json.dumps(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
    """Every task remembers the shard that made it (its context's task set), so cancelling a shard cancels all
    of its rollouts in flight."""
    task = asyncio.Task(coro, loop=loop, **kwargs)
    owned = _tasks.get()
    if owned is not None:
        owned.add(task)
    return task


async def collect(rc: Any, base: Any, name: str, job: dict) -> int:
    from omegaconf import OmegaConf, open_dict

    code = 0
    try:
        cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=False))
        with open_dict(cfg):
            cfg.input_jsonl_fpath = job["input"]
            cfg.output_jsonl_fpath = job["output"]
        config = rc.RolloutCollectionConfig.model_validate(cfg)
        await rc.RolloutCollectionHelper().run_from_config(config)
    except asyncio.CancelledError:
        print(f"[collector service] {name}: cancelled; the rows already written stay", file=sys.stderr)
        code = CANCELLED_RC
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    return code


async def run_round(rc: Any, base: Any, name: str, job: dict, spool: Path, inner: dict, ended: set) -> None:
    owned: set = _tasks.get() or set()
    this = asyncio.current_task()
    inner[name] = asyncio.ensure_future(collect(rc, base, name, job))  # what a cancel stops
    try:
        code = await inner[name]
    except asyncio.CancelledError:  # cancelled before it began
        code = CANCELLED_RC
    if code == CANCELLED_RC and name in ended:
        print(f"[collector service] {name}: every row but the lent ones is done; the round ends", file=sys.stderr)
        code = 0
    left = [t for t in owned if t is not this and not t.done()]
    for t in left:  # what Gym started for this shard and left running (a raised /run leaves the others in flight)
        t.cancel()
    if left:
        await asyncio.wait(left, timeout=LEFTOVER_S)
    log = _log.get()
    if log is not None:
        log.flush()
        log.close()
    write_whole(spool / f"{name}.exit.json", {"rc": code})


async def serve(spool: Path, budget: int | None) -> None:
    from nemo_gym import rollout_collection as rc
    from nemo_gym.global_config import get_global_config_dict

    base = get_global_config_dict()
    loop = asyncio.get_running_loop()
    loop.set_task_factory(task_factory)
    if budget:
        if not hasattr(rc, "Semaphore"):
            print("[collector service] this nemo-gym has no rollout_collection.Semaphore", file=sys.stderr)
            sys.exit(3)
        shared: Budget | None = Budget(budget)
        rc.Semaphore = lambda _n: shared  # every shard's run_from_config takes its slots from one budget
    else:
        shared = None
    print(f"[collector service] ready: {budget or 'unlimited'} rollout(s) in flight across shards", flush=True)
    write_whole(spool / "ready.json", {"pid": os.getpid(), "budget": budget})
    running: dict[str, asyncio.Task] = {}  # round name -> the task that runs and reports it
    inner: dict[str, asyncio.Future] = {}  # round name -> its collection (Gym's run_from_config), what cancel stops
    cancelled: set[str] = set()
    ended: set[str] = set()  # rounds ended because only their lent rows were left
    settled: dict[str, int] = {}  # round -> polls in a row on which only its lent rows were left
    idle_since: float | None = time.time()
    drained_since: float | None = idle_since
    told: dict | None = None
    while not (spool / "stop").exists():
        for path in sorted(spool.glob("*.run.json")):
            name = path.name[: -len(".run.json")]
            if name in running or (spool / f"{name}.exit.json").exists():
                continue
            job = json.loads(path.read_text())
            ctx = contextvars.copy_context()
            ctx.run(_log.set, open(job["log"], "a", buffering=1))
            ctx.run(_tasks.set, set())
            ctx.run(_round.set, name)
            running[name] = loop.create_task(run_round(rc, base, name, job, spool, inner, ended), context=ctx)
        for name, task in list(running.items()):
            if task.done():
                running.pop(name)
                inner.pop(name, None)
                cancelled.discard(name)
                ended.discard(name)
                settled.pop(name, None)
                if shared is not None:
                    shared.forget(name)
                task.result()  # run_round reports every failure in its exit file; anything else is a bug: raise it
            elif name not in cancelled and name in inner and (spool / f"{name}.cancel").exists():
                cancelled.add(name)
                inner[name].cancel()
            elif shared is not None and name in inner and name not in cancelled:
                lend_if_asked(spool, name, shared)
                settled[name] = settled.get(name, 0) + 1 if shared.only_lent_left(name) else 0
                if settled[name] >= SETTLED_POLLS:
                    ended.add(name)
                    cancelled.add(name)
                    inner[name].cancel()
        if shared is not None:
            now = time.time()
            idle_since = None if shared.busy() else idle_since or now
            drained_since = None if shared.waiting else drained_since or now
            shared.asked &= set(running)
        asked = sorted(shared.asked) if shared is not None else sorted(running)
        held = shared.held if shared is not None else None
        news = {
            "budget": budget,
            "held": held,
            "idle_since": idle_since,
            "drained_since": drained_since,
            "started": asked,
        }
        if news != told:
            write_whole(spool / "slots.json", news)
            told = news
        await asyncio.sleep(POLL_S)
    for name in running:
        if name in inner:
            inner[name].cancel()
    if running:
        await asyncio.wait(list(running.values()), timeout=30)


def lend_if_asked(spool: Path, name: str, shared: Budget) -> None:
    """Answer NAME.lend.json with NAME.lent.json (a garbled request lends nothing)."""
    ask = spool / f"{name}.lend.json"
    if not ask.exists():
        return
    try:
        fraction = float(json.loads(ask.read_text())["fraction"])
    except (OSError, ValueError, KeyError, TypeError):
        fraction = 0.0
    rows = shared.lend(name, min(max(fraction, 0.0), 1.0))
    write_whole(spool / f"{name}.lent.json", {"rows": [list(k) for k in rows]})
    ask.unlink(missing_ok=True)


def main() -> None:
    spool, limit = Path(sys.argv[1]), sys.argv[2]
    budget = None if limit == "unlimited" else int(limit)
    sys.argv = [sys.argv[0], *sys.argv[3:]]  # what Gym's own collector command hands its config parser
    sys.stdout = Routed(sys.stdout)
    sys.stderr = Routed(sys.stderr)
    asyncio.run(serve(spool, budget))


if __name__ == "__main__":
    main()
