"""All shards' rows as one table sorted by identity: where each row's bytes are and what its numbers are (pure).

Identities become one sortable int64 key: the task's rank among the planned task indices times a stride
(> every planned rollout index) plus the rollout index, so (task, rollout) order is key order. The table holds
per planned row: key, shard, byte range, agent; per kept rollout row: key, shard, byte range, whether it is
masked (the Gym release's mask flag), and where its numbers are (block = one schema of one shard's RowTable, and
the row's position in it). Row text stays in the files. Shards are added one at a time into arrays sized from the
plan, so a shard's own arrays can be dropped as soon as it is added. `measured` is the table without the masked
rollouts and their planned rows: what Gym 0.7 computes quality statistics from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from shardrun.core.errors import PlanMismatch
from shardrun.merge.identity import Resolution
from shardrun.merge.rowtable import RowTable, Schema, rollout_infos
from shardrun.merge.shard_reader import Planned, Rollouts


def segments(group_of_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, sizes) of the runs of equal values in a sorted array (the table's tasks, agents, blocks)."""
    if len(group_of_row) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, group_of_row[1:] != group_of_row[:-1]])
    sizes = np.diff(np.r_[starts, len(group_of_row)])
    return starts, sizes


@dataclass(frozen=True)
class Block:
    schema: Schema
    values: list[np.ndarray]  # one array per field
    irregular: list[dict] | None
    columns: np.ndarray  # column number of each field (-1: a column no kept row has)


class TableBuilder:
    """Collects shards into arrays sized by the plan's number of rollouts."""

    def __init__(self, num_planned: int, answers: bool):
        n = num_planned
        self.p_task, self.p_rollout = np.empty(n, np.int64), np.empty(n, np.int64)
        self.p_shard, self.p_offset = np.empty(n, np.int32), np.empty(n, np.int64)
        self.p_length, self.p_agent = np.empty(n, np.int32), np.empty(n, np.int32)
        self.r_task, self.r_rollout = np.empty(n, np.int64), np.empty(n, np.int64)
        self.r_shard, self.r_offset = np.empty(n, np.int32), np.empty(n, np.int64)
        self.r_length, self.r_block = np.empty(n, np.int32), np.empty(n, np.int32)
        self.r_pos, self.r_renumbered = np.empty(n, np.int32), np.empty(n, bool)
        self.r_answers = np.empty(n, np.int64) if answers else None
        self.r_masked = np.empty(n, bool)
        self.np = self.nr = 0
        self.blocks: list[Block] = []
        self.columns: dict[str, int] = {}
        self.agents: dict[str, int] = {}

    def add(self, index: int, planned: Planned, rollouts: Rollouts, resolution: Resolution) -> None:
        a, b = self.np, self.np + len(planned.task)
        if b > len(self.p_task):
            raise PlanMismatch(f"shard {index:05d}: more materialized rows than plan.json plans")
        codes = np.array([self.agents.setdefault(n, len(self.agents)) for n in planned.agents], np.int32)
        self.p_task[a:b], self.p_rollout[a:b], self.p_shard[a:b] = planned.task, planned.rollout, index
        self.p_offset[a:b], self.p_length[a:b] = planned.offset, planned.length
        self.p_agent[a:b] = codes[planned.agent] if len(codes) else planned.agent
        self.np = b
        keep, table = resolution.keep, rollouts.table
        a, b = self.nr, self.nr + len(keep)
        self.r_task[a:b], self.r_rollout[a:b], self.r_shard[a:b] = rollouts.task[keep], resolution.rollout, index
        self.r_offset[a:b], self.r_length[a:b] = rollouts.offset[keep], rollouts.length[keep]
        self.r_block[a:b] = table.schema_array()[keep] + len(self.blocks)
        self.r_pos[a:b] = table.pos_array()[keep]
        self.r_renumbered[a:b] = resolution.rollout != rollouts.rollout[keep]
        self.r_masked[a:b] = table.masked_array()[keep]
        answers = table.answer_array()
        if self.r_answers is not None and answers is not None:
            self.r_answers[a:b] = answers[keep]
        self.nr = b
        self._add_blocks(table)

    def _add_blocks(self, table: RowTable) -> None:
        for sid, schema in enumerate(table.schemas):
            cols = np.array([self.columns.setdefault(n, len(self.columns)) for n in schema.names], np.int64)
            self.blocks.append(Block(schema, table.columns[sid], table.irregular_infos[sid], cols))

    def finish(self) -> "MergedTable":
        """Sort everything by identity. PlanMismatch if two shards plan one identity."""
        if self.np != len(self.p_task):
            raise PlanMismatch(
                f"the shards' materialized files hold {self.np:,} rows, plan.json plans "
                f"{len(self.p_task):,}; the run directory is damaged"
            )
        tasks = np.unique(self.p_task)
        stride = int(self.p_rollout.max()) + 1 if self.np else 1
        p_key = np.searchsorted(tasks, self.p_task) * stride + self.p_rollout
        self.p_task = self.p_rollout = None  # type: ignore[assignment]
        order = np.argsort(p_key, kind="stable")
        p_key = p_key[order]
        _refuse_twice_planned(p_key, tasks, stride)
        p_shard, p_offset, p_length, p_agent = (
            self._take(f, order) for f in ("p_shard", "p_offset", "p_length", "p_agent")
        )
        del order
        n = self.nr
        r_key = np.searchsorted(tasks, self.r_task[:n]) * stride + self.r_rollout[:n]
        self.r_task = self.r_rollout = None  # type: ignore[assignment]
        order = np.argsort(r_key, kind="stable")
        fields = ("r_shard", "r_offset", "r_length", "r_block", "r_pos", "r_renumbered", "r_masked")
        r_shard, r_offset, r_length, r_block, r_pos, r_renumbered, r_masked = (self._take(f, order, n) for f in fields)
        answers = self._take("r_answers", order, n) if self.r_answers is not None else None
        table = MergedTable(
            tasks,
            stride,
            list(self.agents),
            p_key,
            p_shard,
            p_offset,
            p_length,
            p_agent,
            r_key[order],
            r_shard,
            r_offset,
            r_length,
            r_block,
            r_pos,
            r_renumbered,
            answers,
            r_masked,
            self.blocks,
            list(self.columns),
        )
        table.columns, table.blocks = _reorder_columns(table)
        return table

    def _take(self, name: str, order: np.ndarray, n: int | None = None) -> np.ndarray:
        """The field reordered; the builder lets go of its copy (one array's worth of extra memory at a time)."""
        values = getattr(self, name)
        setattr(self, name, None)
        return values[:n][order] if n is not None else values[order]


def _refuse_twice_planned(p_key: np.ndarray, tasks: np.ndarray, stride: int) -> None:
    dup = np.flatnonzero(p_key[1:] == p_key[:-1])
    if len(dup):
        k = int(p_key[dup[0]])
        raise PlanMismatch(
            f"identity ({tasks[k // stride]}, {k % stride}) is planned in two shards; the run "
            f"directory is damaged (re-plan into a new run_dir)"
        )


@dataclass
class MergedTable:
    tasks: np.ndarray  # planned task indices, ascending (key // stride indexes this)
    stride: int
    agents: list[str]  # agent code -> name
    # planned rows, sorted by key (dropped by release_planned once written)
    p_key: np.ndarray
    p_shard: np.ndarray
    p_offset: np.ndarray
    p_length: np.ndarray
    p_agent: np.ndarray
    # kept rollout rows, sorted by key
    r_key: np.ndarray
    r_shard: np.ndarray
    r_offset: np.ndarray
    r_length: np.ndarray
    r_block: np.ndarray
    r_pos: np.ndarray
    r_renumbered: np.ndarray  # the row's own _ng_rollout_index differs from its planned one
    r_answers: np.ndarray | None
    r_masked: np.ndarray  # the row's mask flag is truthy (never, without a mask field)
    blocks: list[Block]
    columns: list[str]  # every stats column, in Gym's order (first appearance in sorted rows)
    _whole: list[tuple[Block, np.ndarray, np.ndarray]] | None = None  # _by_block of all rows, computed once

    # ---------------------------------------------------------------- identities and tasks

    def task_of_key(self, key: np.ndarray) -> np.ndarray:
        return self.tasks[key // self.stride]

    def rollout_of_key(self, key: np.ndarray) -> np.ndarray:
        return key % self.stride

    def planned_per_task(self) -> np.ndarray:
        return np.bincount(self.p_key // self.stride, minlength=len(self.tasks))

    def done_per_task(self) -> np.ndarray:
        return np.bincount(self.r_key // self.stride, minlength=len(self.tasks))

    def agent_of_task(self) -> np.ndarray:
        """The agent code of each task's first planned row (-1 for a task without planned rows: measured)."""
        rank = self.p_key // self.stride
        starts, _ = segments(rank)
        agent = np.full(len(self.tasks), -1, np.int32)
        agent[rank[starts]] = self.p_agent[starts]
        return agent

    def planned_rows_of(self, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, offset, length) of the materialized rows of these identities."""
        pos = np.searchsorted(self.p_key, key)
        return self.p_shard[pos], self.p_offset[pos], self.p_length[pos]

    def release_planned(self) -> None:
        """Drop the planned rows (after the merged materialized file is written and TaskInfo taken)."""
        self.p_key = self.p_shard = self.p_offset = self.p_length = self.p_agent = None  # type: ignore

    def release_locations(self) -> None:
        """Drop where the rollout rows' bytes are (after the merged rollouts file is written)."""
        self.r_shard = self.r_offset = self.r_length = self.r_renumbered = None  # type: ignore

    def measured(self) -> "MergedTable":
        """The table without its masked rollouts and without their planned rows (Gym 0.7's `select_measured`):
        what quality statistics are computed from. Columns no measured row has are dropped, the rest keep their
        order of first appearance. The table itself when nothing is masked. Call before release_planned."""
        if not self.r_masked.any():
            return self
        keep = ~self.r_masked
        masked_keys = self.r_key[self.r_masked]
        p_keep = np.ones(len(self.p_key), bool)
        p_keep[np.searchsorted(self.p_key, masked_keys)] = False  # every kept rollout's key is planned

        def rows(a: np.ndarray | None, which: np.ndarray) -> np.ndarray | None:
            return None if a is None else a[which]

        table = MergedTable(
            self.tasks,
            self.stride,
            self.agents,
            self.p_key[p_keep],
            self.p_shard[p_keep],
            self.p_offset[p_keep],
            self.p_length[p_keep],
            self.p_agent[p_keep],
            self.r_key[keep],
            rows(self.r_shard, keep),  # type: ignore[arg-type]
            rows(self.r_offset, keep),  # type: ignore[arg-type]
            rows(self.r_length, keep),  # type: ignore[arg-type]
            self.r_block[keep],
            self.r_pos[keep],
            rows(self.r_renumbered, keep),  # type: ignore[arg-type]
            rows(self.r_answers, keep),
            np.zeros(int(keep.sum()), bool),
            self.blocks,
            self.columns,
        )
        table.columns, table.blocks = _reorder_columns(table)
        return table

    def subset(self, ranks: np.ndarray) -> "MergedTable":
        """The table of some tasks only (`ranks`: positions in `tasks`, ascending), as if only their rows had been
        merged: their planned and kept rows, keys renumbered over the tasks kept, columns in the order of first
        appearance among their rows (a blend's label: profile/blend_labels.py). Call before release_planned."""
        ranks = np.asarray(ranks, np.int64)
        inside = np.zeros(len(self.tasks), bool)
        inside[ranks] = True
        new_rank = np.full(len(self.tasks), -1, np.int64)
        new_rank[ranks] = np.arange(len(ranks))
        p_keep, r_keep = inside[self.p_key // self.stride], inside[self.r_key // self.stride]

        def rekey(keys: np.ndarray) -> np.ndarray:
            return new_rank[keys // self.stride] * self.stride + keys % self.stride

        def rows(a: np.ndarray | None, which: np.ndarray) -> np.ndarray | None:
            return None if a is None else a[which]

        table = MergedTable(
            self.tasks[ranks],
            self.stride,
            self.agents,
            rekey(self.p_key[p_keep]),
            self.p_shard[p_keep],
            self.p_offset[p_keep],
            self.p_length[p_keep],
            self.p_agent[p_keep],
            rekey(self.r_key[r_keep]),
            rows(self.r_shard, r_keep),  # type: ignore[arg-type]
            rows(self.r_offset, r_keep),  # type: ignore[arg-type]
            rows(self.r_length, r_keep),  # type: ignore[arg-type]
            self.r_block[r_keep],
            self.r_pos[r_keep],
            rows(self.r_renumbered, r_keep),  # type: ignore[arg-type]
            rows(self.r_answers, r_keep),
            self.r_masked[r_keep],
            self.blocks,
            self.columns,
        )
        table.columns, table.blocks = _reorder_columns(table)
        return table

    def has_rollout(self, key: np.ndarray) -> np.ndarray:
        if not len(self.r_key):
            return np.zeros(len(key), bool)
        pos = np.minimum(np.searchsorted(self.r_key, key), len(self.r_key) - 1)
        return self.r_key[pos] == key

    # ---------------------------------------------------------------- numbers

    def _by_block(self, a: int, b: int) -> Iterator[tuple[Block, np.ndarray, np.ndarray]]:
        """(block, row numbers relative to a, positions in the block) for rows a..b, block by block."""
        if (a, b) == (0, len(self.r_key)):
            if self._whole is None:
                self._whole = list(self._split(a, b))
            return iter(self._whole)
        return self._split(a, b)

    def _split(self, a: int, b: int) -> Iterator[tuple[Block, np.ndarray, np.ndarray]]:
        blk = self.r_block[a:b]
        order = np.argsort(blk, kind="stable")
        starts, sizes = segments(blk[order])
        pos = self.r_pos[a:b]
        for s, n in zip(starts.tolist(), sizes.tolist()):
            rows = order[s : s + n]
            yield self.blocks[int(blk[rows[0]])], rows, pos[rows]

    def gather(self, a: int, b: int, columns: Sequence[int] | None = None) -> np.ndarray:
        """(columns, rows a..b) of stats values as float64; NaN where a row lacks the field."""
        wanted = list(range(len(self.columns))) if columns is None else list(columns)
        slot = {c: i for i, c in enumerate(wanted)}
        out = np.full((len(wanted), b - a), np.nan)
        for block, rows, pos in self._by_block(a, b):
            for j, c in enumerate(block.columns.tolist()):
                if c in slot:
                    out[slot[c], rows] = block.values[j][pos]
        return out

    def column(self, name: str) -> np.ndarray:
        """One stats column over all kept rows (NaN where absent)."""
        if name not in self.columns:
            return np.full(len(self.r_key), np.nan)
        return self.gather(0, len(self.r_key), [self.columns.index(name)])[0]

    def infos(self, a: int, b: int) -> list[bytes]:
        """Gym's rollout_infos entries of rows a..b as JSON, in row order."""
        out: list[Any] = [None] * (b - a)
        tasks = self.task_of_key(self.r_key[a:b])
        rollouts = self.rollout_of_key(self.r_key[a:b])
        for block, rows, pos in self._by_block(a, b):
            irregular = [block.irregular[p] for p in pos.tolist()] if block.irregular is not None else None
            made = rollout_infos(
                block.schema, [v[pos] for v in block.values], tasks[rows].tolist(), rollouts[rows].tolist(), irregular
            )
            for i, d in zip(rows.tolist(), made):
                out[i] = d
        return out

    # ---------------------------------------------------------------- column order

    def column_order(self, rows: np.ndarray | None = None) -> tuple[tuple[int, ...], bool]:
        """(the columns of these rows in order of first appearance, whether all of them are integer columns
        in every row): the column order and integer rule of the frame Gym would build from these rows (all kept
        rows if None)."""
        blk = self.r_block if rows is None else self.r_block[rows]
        used, first = np.unique(blk, return_index=True)
        order: list[int] = []
        seen: set[int] = set()
        for b in used[np.argsort(first)].tolist():
            for c in self.blocks[b].columns.tolist():
                if c not in seen:
                    seen.add(c)
                    order.append(c)
        all_int = bool(len(used)) and all(
            self.blocks[b].schema.all_int and len(self.blocks[b].columns) == len(order) for b in used.tolist()
        )
        return tuple(order), all_int


def _reorder_columns(table: MergedTable) -> tuple[list[str], list[Block]]:
    """Renumber columns so that column order is Gym's (first appearance in sorted rows); unused ones dropped."""
    order = table.column_order()[0]
    new = {old: i for i, old in enumerate(order)}
    names = [table.columns[c] for c in order]
    blocks = [
        Block(b.schema, b.values, b.irregular, np.array([new.get(c, -1) for c in b.columns.tolist()], np.int64))
        for b in table.blocks
    ]
    return names, blocks
