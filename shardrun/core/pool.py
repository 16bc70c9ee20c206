"""Run a function over items in forked worker processes; results come back in item order, few in flight.

Workers are forked, so they see what the parent had built before the pool started (the merged table, a
context set in a module) without copying it; only the items and the results travel through pipes. With one
worker, or one item, everything runs in this process.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")
MAX_WORKERS = 8


def available() -> int:
    """The CPUs this process may use, at most MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def ordered_map(fn: Callable[[T], R], items: Sequence[T], workers: int, ahead: int = 2) -> Iterator[R]:
    """fn over items, in order; at most `ahead` x workers items submitted and not yet consumed."""
    if workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    pool = ProcessPoolExecutor(min(workers, len(items)), mp_context=multiprocessing.get_context("fork"))
    try:
        todo = iter(items)
        pending: deque[Future[R]] = deque(pool.submit(fn, x) for x in itertools.islice(todo, ahead * workers))
        while pending:
            result = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
