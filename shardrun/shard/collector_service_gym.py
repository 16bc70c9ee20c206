"""The collector service's own program, run by the Gym venv's Python (never imported by shardrun).

A warm worker starts it once, beside its servers, instead of one `ng_collect_rollouts` process per shard:

    GYM_PYTHON collector_service_gym.py SPOOL HYDRA_OVERRIDE...

It builds NeMo Gym's global config from the overrides exactly as Gym's collector command does (the same
`sys.argv`, the same `get_global_config_dict`), then collects shard after shard, several at once, each through
Gym's own `RolloutCollectionHelper.run_from_config` with the shard's `input_jsonl_fpath` and
`output_jsonl_fpath`: the rows it writes, its resume from the materialized file, its failures sidecar and its
retries are Gym's, byte for byte as with the command. What the service adds:

- one process for all shards, so a shard no longer pays for starting Python and importing Gym;
- one budget of `num_samples_in_parallel` rollouts in flight shared by every shard it runs (Gym makes its
  semaphore with `Semaphore(n)` in `run_from_config`; the service hands every shard the same one), so the next
  shard's rollouts take the slots that the draining one frees;
- each shard's output (Gym's prints, tracebacks) in that shard's own collector log, as the command's would be.

The spool directory is the whole protocol (files written whole by rename):
  NAME.run.json    {"input": ..., "output": ..., "log": ...}: collect one shard round (shardrun writes it)
  NAME.cancel      stop that round: its tasks are cancelled, its rows already written stay
  NAME.exit.json   {"rc": N}: the round is over (0: Gym returned; 1: it raised, traceback in the log; -15: cancelled)
  slots.json       {"budget": N, "idle_since": T, "drained_since": T, "started": [NAME...]} (written when it
                   changes): since when (time.time()) a slot of the budget has been free with no rollout waiting for
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


class Budget(asyncio.Semaphore):
    """The one budget of `num_samples_in_parallel` slots that every round's rollouts take (Gym's own semaphore,
    shared), counting the rollouts holding a slot and those waiting for one, and the rounds that have asked."""

    def __init__(self, n: int):
        super().__init__(n)
        self.n, self.held, self.waiting = n, 0, 0
        self.asked: set[str] = set()

    async def acquire(self) -> Literal[True]:
        name = _round.get()
        if name is not None:
            self.asked.add(name)
        self.waiting += 1
        try:
            await super().acquire()
        finally:
            self.waiting -= 1
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
        super().release()

    def busy(self) -> bool:
        """Every slot taken, or a rollout waiting for one: the rounds in the service fill the budget."""
        return self.waiting > 0 or self.held >= self.n


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


async def run_round(rc: Any, base: Any, name: str, job: dict, spool: Path, inner: dict) -> None:
    owned: set = _tasks.get() or set()
    this = asyncio.current_task()
    inner[name] = asyncio.ensure_future(collect(rc, base, name, job))  # what a cancel stops
    try:
        code = await inner[name]
    except asyncio.CancelledError:  # cancelled before it began
        code = CANCELLED_RC
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


async def serve(spool: Path) -> None:
    from nemo_gym import rollout_collection as rc
    from nemo_gym.global_config import get_global_config_dict

    base = get_global_config_dict()
    budget = base.get("num_samples_in_parallel")
    loop = asyncio.get_running_loop()
    loop.set_task_factory(task_factory)
    if budget:
        if not hasattr(rc, "Semaphore"):
            print("[collector service] this nemo-gym has no rollout_collection.Semaphore", file=sys.stderr)
            sys.exit(3)
        shared: Budget | None = Budget(int(budget))
        rc.Semaphore = lambda _n: shared  # every shard's run_from_config takes its slots from one budget
    else:
        shared = None
    print(f"[collector service] ready: {budget or 'unlimited'} rollout(s) in flight across shards", flush=True)
    write_whole(spool / "ready.json", {"pid": os.getpid(), "budget": budget})
    running: dict[str, asyncio.Task] = {}  # round name -> the task that runs and reports it
    inner: dict[str, asyncio.Future] = {}  # round name -> its collection (Gym's run_from_config), what cancel stops
    cancelled: set[str] = set()
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
            running[name] = loop.create_task(run_round(rc, base, name, job, spool, inner), context=ctx)
        for name, task in list(running.items()):
            if task.done():
                running.pop(name)
                inner.pop(name, None)
                cancelled.discard(name)
                task.result()  # run_round reports every failure in its exit file; anything else is a bug: raise it
            elif name not in cancelled and name in inner and (spool / f"{name}.cancel").exists():
                cancelled.add(name)
                inner[name].cancel()
        if shared is not None:
            now = time.time()
            idle_since = None if shared.busy() else idle_since or now
            drained_since = None if shared.waiting else drained_since or now
            shared.asked &= set(running)
        asked = sorted(shared.asked) if shared is not None else sorted(running)
        news = {"budget": budget, "idle_since": idle_since, "drained_since": drained_since, "started": asked}
        if news != told:
            write_whole(spool / "slots.json", news)
            told = news
        await asyncio.sleep(POLL_S)
    for name in running:
        if name in inner:
            inner[name].cancel()
    if running:
        await asyncio.wait(list(running.values()), timeout=30)


def main() -> None:
    spool = Path(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:]]  # what Gym's own collector command hands its config parser
    sys.stdout = Routed(sys.stdout)
    sys.stderr = Routed(sys.stderr)
    asyncio.run(serve(spool))


if __name__ == "__main__":
    main()
