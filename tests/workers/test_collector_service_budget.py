"""The collector service's one budget (workers/collector_service_gym.py: Budget, the semaphore every round's Gym
`run_from_config` takes its slots from): it counts the rollouts holding a slot and those waiting, and says when the
rounds fill it, which is what a warm worker reads (slots.json) before it claims a further shard. The service's
program runs under the Gym venv's Python; its Budget is plain asyncio and is tested here directly."""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
from pathlib import Path

from shardrun.workers import collector_service


def service_program():
    spec = importlib.util.spec_from_file_location("collector_service_gym", collector_service.PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_budget_counts_held_and_waiting_slots_and_the_rounds_that_asked() -> None:
    gym = service_program()

    async def scenario() -> list:
        budget = gym.Budget(2)
        gate = asyncio.Event()
        seen = []

        async def rollout() -> None:
            async with budget:  # as Gym's run_from_config uses its semaphore
                await gate.wait()

        def start(name: str) -> asyncio.Task:
            ctx = contextvars.copy_context()
            ctx.run(gym._round.set, name)
            return asyncio.get_running_loop().create_task(rollout(), context=ctx)

        seen.append(("empty", budget.busy(), budget.held, budget.waiting))
        a = start("shard-4-0")
        await asyncio.sleep(0)
        seen.append(("one held", budget.busy(), budget.held, budget.waiting))
        b, c = start("shard-5-1"), start("shard-5-1")
        await asyncio.sleep(0)
        seen.append(("two held, one waits", budget.busy(), budget.held, budget.waiting))
        c.cancel()  # a cancelled waiter gives its place up
        await asyncio.sleep(0)
        seen.append(("two held", budget.busy(), budget.held, budget.waiting))
        gate.set()
        await asyncio.gather(a, b, return_exceptions=True)
        seen.append(("all done", budget.busy(), budget.held, budget.waiting))
        seen.append(sorted(budget.asked))
        return seen

    assert asyncio.run(scenario()) == [
        ("empty", False, 0, 0),
        ("one held", False, 1, 0),
        ("two held, one waits", True, 2, 1),
        ("two held", True, 2, 0),
        ("all done", False, 0, 0),
        ["shard-4-0", "shard-5-1"],
    ]


def test_the_worker_reads_the_service_s_slots_file(tmp_path: Path) -> None:
    service = collector_service.CollectorService(proc=None, spool=tmp_path)  # only its spool is read here
    nothing = collector_service.BudgetLook(0.0, 0.0, set())
    assert service.budget() == nothing  # nothing written yet: not known to be free
    (tmp_path / "slots.json").write_text(
        '{"budget": 2, "idle_since": null, "drained_since": null, "started": ["shard-3-0"]}'
    )
    assert service.budget() == collector_service.BudgetLook(0.0, 0.0, {3})
    (tmp_path / "slots.json").write_text(
        '{"budget": 2, "idle_since": null, "drained_since": 1.0, "started": ["shard-3-0", "shard-12-5"]}'
    )
    look = service.budget()
    assert look.idle_s == 0.0 and look.drained_s > 1000 and look.started == {3, 12}
    (tmp_path / "slots.json").write_text('{"budget": 2, "idle_since": "x", "drained_since": 1, "started": 7}')
    assert service.budget() == nothing  # a garbled file is not trusted


def test_the_budget_lends_the_last_waiting_rows_and_never_runs_them() -> None:
    """Lending (an idle worker helps with the end of a run): the last rows of a round still waiting for a slot are
    lent; when their turn comes they give the slot back and park; the round's other rows all run, and then the
    budget says only lent rows are left."""
    gym = service_program()

    async def scenario() -> tuple:
        budget = gym.Budget(1)
        gate = asyncio.Event()
        ran: list = []

        async def _post_subroutine(row: dict) -> None:  # as Gym runs a row: a task of its own, then the budget
            async with budget:
                ran.append((row["_ng_task_index"], row["_ng_rollout_index"]))
                await gate.wait()

        ctx = contextvars.copy_context()
        ctx.run(gym._round.set, "shard-0-0")
        rows = [{"_ng_task_index": 0, "_ng_rollout_index": r} for r in range(6)]
        tasks = [asyncio.get_running_loop().create_task(_post_subroutine(row), context=ctx) for row in rows]
        await asyncio.sleep(0)
        assert budget.lend("shard-9-9", 0.5) == []  # a round with nothing waiting lends nothing
        lent = budget.lend("shard-0-0", 0.5)
        more = budget.lend("shard-0-0", 0.5)  # what is left to lend: 3 waiting, one of them kept
        left_early = budget.only_lent_left("shard-0-0")
        gate.set()
        for _ in range(50):
            await asyncio.sleep(0)
        done = [t.done() for t in tasks]
        ended = budget.only_lent_left("shard-0-0")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return lent, more, left_early, ran, done, ended, budget.held

    lent, more, left_early, ran, done, ended, held = asyncio.run(scenario())
    assert lent == [(0, 4), (0, 5)] and more == [(0, 3)]  # row 0 holds the slot; of the 5 waiting the last go first
    assert not left_early
    assert ran == [(0, 0), (0, 1), (0, 2)]  # the lent rows never ran here
    assert done == [True, True, True, False, False, False]  # the lent rows parked
    assert ended and held == 0


def test_one_waiting_row_is_never_lent() -> None:
    gym = service_program()

    async def scenario() -> list:
        budget = gym.Budget(1)
        gate = asyncio.Event()

        async def _post_subroutine(row: dict) -> None:
            async with budget:
                await gate.wait()

        ctx = contextvars.copy_context()
        ctx.run(gym._round.set, "shard-1-0")
        rows = [{"_ng_task_index": 1, "_ng_rollout_index": r} for r in range(2)]
        tasks = [asyncio.get_running_loop().create_task(_post_subroutine(row), context=ctx) for row in rows]
        await asyncio.sleep(0)
        out = budget.lend("shard-1-0", 1.0)
        gate.set()
        await asyncio.gather(*tasks)
        return out

    assert asyncio.run(scenario()) == []  # it will have a slot before a helper could start it


def test_the_service_s_budget_is_the_policy_s_slots_times_rollouts_per_slot() -> None:
    assert collector_service.budget(8, 3.0) == 24
    assert collector_service.budget(3, 1.5) == 5  # rounded up: never fewer rollouts than asked for
    assert collector_service.budget(2, 1.0) == 2  # 1: a rollout per slot, as Gym's own collector runs
    assert collector_service.budget(None, 3.0) is None  # gym.num_samples_in_parallel unset: no limit
