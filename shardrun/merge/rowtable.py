"""The compact numeric table of one shard's rollout rows: what the profile needs of a row, without its text.

For every rollout row the table keeps the numeric values Gym's `ng_reward_profile` looks at, in Gym's own
terms: the stats columns are `result | response.usage` restricted to int/float/bool values (bools as 0/1), and
the row's `rollout_infos` entry is `reward` (raw), then the numeric usage fields, then the other numeric
top-level fields. Rows with the same field names and kinds share a `Schema`; while a shard is read a schema's
values are one flat float64 buffer (rows x fields); `finish` then keeps them column by column in the narrowest
dtype that holds them exactly (uint8 for 0/1 rewards and bools, float32 for token counts), so a row costs a few
bytes per numeric field plus 8 bytes of bookkeeping.

Rows where the two orders cannot be derived from the schema (a usage key that also exists at top level, a
non-numeric `reward`, integers beyond 2**53) are "irregular": their stats go through the same buffers, and
their exact `rollout_infos` tail is kept as a dict beside them (rare by construction).

With a `mask_key` (the Gym release's mask flag, `mask_sample` under 0.7) that top-level field is never a stats
column, and the rows whose flag is truthy are recorded (`masked_array`), so the profile can leave them out.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable

import numpy as np
import orjson

from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY

KIND = {int: "i", float: "f", bool: "b"}
IDENTITY = frozenset((TASK_KEY, ROLLOUT_KEY))
INFO_SKIP = frozenset((TASK_KEY, ROLLOUT_KEY, "reward", "response"))
EXACT_INT = 2**53
INT64_MAX = 2**63 - 1
MAX_SHAPES = 10_000  # row shapes remembered per shard (a file of ever-new keys stays correct, just slower)
NO_ANSWER = 0


@dataclass(frozen=True)
class Schema:
    """Field names and kinds shared by some rows. `names` are the stats columns in Gym's column order."""

    names: tuple[str, ...]
    kinds: str  # one letter per name: i int, f float, b bool
    info: tuple[tuple[str, int, str], ...] | None  # rollout_info fields: (name, value position, output kind)

    @property
    def all_int(self) -> bool:
        return all(k in "ib" for k in self.kinds)


def regular_schema(top: list[str], top_kinds: str, usage: list[str], usage_kinds: str) -> Schema:
    """Schema of a row whose usage keys do not collide with its top-level keys."""
    info: list[tuple[str, int, str]] = []
    if "reward" in top:
        j = top.index("reward")
        info.append(("reward", j, "B" if top_kinds[j] == "b" else top_kinds[j]))
    info += [(n, len(top) + j, _info_kind(k)) for j, (n, k) in enumerate(zip(usage, usage_kinds))]
    info += [(n, j, _info_kind(k)) for j, (n, k) in enumerate(zip(top, top_kinds)) if n != "reward"]
    return Schema(tuple(top) + tuple(usage), top_kinds + usage_kinds, tuple(info))


def _info_kind(kind: str) -> str:
    return "i" if kind == "b" else kind


def answer_code(value: Any) -> int:
    """A 64-bit code equal for answers Python considers equal (1 == 1.0 == True); NO_ANSWER for None."""
    if value is None:
        return NO_ANSWER
    if isinstance(value, (bool, int, float)):
        canon = (
            b"f" + repr(value).encode()
            if isinstance(value, float) and not value.is_integer()
            else b"i" + str(int(value)).encode()
        )
    elif isinstance(value, str):
        canon = b"s" + value.encode("utf-8", "surrogatepass")
    else:
        canon = b"j" + orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    code = int.from_bytes(hashlib.blake2b(canon, digest_size=8).digest(), "little", signed=True)
    return code or 1


@dataclass(frozen=True)
class RowShape:
    """What rows of one shape (keys and value types, at top level and in response.usage) contribute."""

    task_at: int | None  # position of an integer _ng_task_index among the row's values (None: no identity)
    rollout_at: int | None
    sid: int | None  # their schema; None: irregular rows (slow path)
    numbers: Callable[[list], tuple]  # the numeric values (top level, then usage) from values + usage values
    check_big: bool  # has integer fields (which must stay below 2**53 to be exact in float64)
    positions: tuple[int, ...] = ()  # where `numbers` takes its values from


def _getter(positions: list[int]) -> Callable[[list], tuple]:
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda values: (values[i],)
    return itemgetter(*positions)


def _beyond_exact(values: tuple) -> bool:
    return bool(values) and (max(values) >= EXACT_INT or min(values) <= -EXACT_INT)


@dataclass
class RowTable:
    """Identity and numeric values of rows, added in file order; row n is (task[n], rollout[n]) and its numbers
    are row pos[n] of schema schema_of[n]."""

    answer_key: str | None = None
    exact_ints: bool = False  # check every row for integers beyond 2**53 (see needs_exact_ints)
    mask_key: str | None = None  # the release's mask flag (mask_sample): not a stats column; truthy rows recorded
    schemas: list[Schema] = field(default_factory=list)
    values: list[array] = field(default_factory=list)
    irregular_infos: list[list[dict] | None] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # rows per schema (after finish)
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (after finish)
    task: array = field(default_factory=lambda: array("q"))
    rollout: array = field(default_factory=lambda: array("q"))
    schema_of: array = field(default_factory=lambda: array("i"))
    answers: array = field(default_factory=lambda: array("q"))
    masked: array = field(default_factory=lambda: array("q"))  # row numbers whose mask flag is truthy
    columns: list[list[np.ndarray]] = field(default_factory=list)  # per schema, per field (after finish)
    _index: dict[tuple, int] = field(default_factory=dict)
    _shapes: dict[tuple, RowShape] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.schema_of)

    def adder(self) -> Callable[[dict[str, Any]], bool]:
        """add(row): add a parsed rollout row, False (nothing added) when it has no valid identity; a closure
        over the table's buffers (the hot loop of a merge calls it once per row)."""
        shapes, buffers, schema_of = self._shapes, self.values, self.schema_of
        task, rollout, answers, answer_key = self.task.append, self.rollout.append, self.answers, self.answer_key
        new_shape, irregular, exact = self._new_shape, self._add_irregular, self.exact_ints
        mask_key, masked, rows = self.mask_key, self.masked.append, self.task

        def add(row: dict[str, Any]) -> bool:
            values = list(row.values())
            response = row.get("response")
            usage = response.get("usage") if type(response) is dict else None
            if type(usage) is dict:
                values += usage.values()
                key: tuple = (*row, *map(type, values), *usage)
            else:
                usage = None
                key = (*row, *map(type, values))
            shape = shapes.get(key) or new_shape(row, usage, key)
            if shape.task_at is None:
                return False
            t, r = values[shape.task_at], values[shape.rollout_at]  # type: ignore[index]
            if t < 0 or r < 0 or t > INT64_MAX or r > INT64_MAX:
                return False
            sid = shape.sid
            if sid is None or (exact and shape.check_big and _beyond_exact(shape.numbers(values))):
                irregular(row, usage or {})
            else:
                buffers[sid].extend(shape.numbers(values))
                schema_of.append(sid)
            task(t)
            rollout(r)
            if answer_key is not None:
                answers.append(answer_code(row.get(answer_key)))
            if mask_key is not None and row.get(mask_key):  # Gym's test: the value's truthiness
                masked(len(rows) - 1)
            return True

        return add

    def _new_shape(self, row: dict[str, Any], usage: dict[str, Any] | None, key: tuple | None) -> RowShape:
        keys = list(row)
        ident = [keys.index(k) if type(row.get(k)) is int else None for k in (TASK_KEY, ROLLOUT_KEY)]
        if None in ident:
            ident = [None, None]
        top = [i for i, k in enumerate(keys) if type(row[k]) in KIND and k not in IDENTITY and k != self.mask_key]
        ukeys = list(usage or {})
        low = [i for i, k in enumerate(ukeys) if type(usage[k]) in KIND]  # type: ignore[index]
        regular = not any(k in row for k in ukeys) and ("reward" not in row or type(row["reward"]) in KIND)
        kinds = "".join(KIND[type(row[keys[i]])] for i in top) + "".join(KIND[type(usage[ukeys[i]])] for i in low)  # type: ignore[index]
        sid = None
        if regular:
            names, unames = [keys[i] for i in top], [ukeys[i] for i in low]
            skey = (tuple(names), tuple(unames), kinds)
            sid = self._index.get(skey)
            if sid is None:
                sid = self._new(skey, regular_schema(names, kinds[: len(names)], unames, kinds[len(names) :]))
        positions = top + [len(keys) + i for i in low]
        shape = RowShape(ident[0], ident[1], sid, _getter(positions), "i" in kinds, tuple(positions))
        if key is not None and len(self._shapes) < MAX_SHAPES:
            self._shapes[key] = shape
        return shape

    def _add_irregular(self, row: dict[str, Any], usage: dict[str, Any]) -> None:
        row = {k: v for k, v in row.items() if k != self.mask_key}
        merged = row | usage  # Gym's `result | response.usage`
        stats = [(k, KIND[type(v)], v) for k, v in merged.items() if type(v) in KIND and k not in IDENTITY]
        key = ("irregular", tuple(k for k, _, _ in stats), "".join(c for _, c, _ in stats))
        sid = self._index.get(key)
        if sid is None:
            sid = self._new(key, Schema(key[1], key[2], None))
        self.values[sid].extend([float(v) for _, _, v in stats])
        self.schema_of.append(sid)
        self.irregular_infos[sid].append(irregular_info(row, usage))  # type: ignore[union-attr]

    def _new(self, key: tuple, schema: Schema) -> int:
        self._index[key] = len(self.schemas)
        self.schemas.append(schema)
        self.values.append(array("d"))
        self.irregular_infos.append([] if schema.info is None else None)
        return len(self.schemas) - 1

    def needs_exact_ints(self) -> bool:
        """True when a regular row held an integer beyond 2**53 (float64 cannot hold it exactly): the shard
        must be read again with exact_ints=True, which sends such rows down the exact (irregular) path.
        Checked per buffer after reading, so the common case pays nothing per row."""
        if self.exact_ints:
            return False
        for schema, buf in zip(self.schemas, self.values):
            if schema.info is not None and "i" in schema.kinds and len(buf):
                ints = np.frombuffer(buf, dtype=np.float64).reshape(-1, len(schema.kinds))[
                    :, [j for j, k in enumerate(schema.kinds) if k == "i"]
                ]
                if (np.abs(ints) >= EXACT_INT).any():
                    return True
        return False

    def finish(self) -> None:
        """Number each row within its schema, and keep each schema's values column by column in the narrowest
        exact dtype; frees the row buffers."""
        self._renumber_schemas()
        schema = self.schema_array()
        order = np.argsort(schema, kind="stable")
        self.counts = np.bincount(schema, minlength=len(self.schemas)).tolist()
        self.pos = np.empty(len(schema), np.int32)
        counts = np.array(self.counts, np.int64)
        self.pos[order] = np.arange(len(schema)) - np.repeat(np.cumsum(counts) - counts, counts)
        for sid, buf in enumerate(self.values):
            width, n = len(self.schemas[sid].names), self.counts[sid]
            flat = np.frombuffer(buf, dtype=np.float64) if n * width else np.zeros(n * width)
            matrix = flat.reshape(n, width)
            self.columns.append([narrow(matrix[:, j]) for j in range(width)])
        self.values = []
        self._shapes = {}  # getters are not picklable, and no more rows come

    def _renumber_schemas(self) -> None:
        """Schemas numbered by their first row in file order, those without rows dropped (a schema is made
        before its first row is known to have an identity)."""
        schema = self.schema_array()
        used, first = np.unique(schema, return_index=True)
        keep = used[np.argsort(first)]
        if np.array_equal(keep, np.arange(len(self.schemas))):
            return
        new_of = np.zeros(len(self.schemas), np.int32)
        new_of[keep] = np.arange(len(keep), dtype=np.int32)
        self.schema_of = array("i", new_of[schema].tobytes()) if len(schema) else array("i")
        order = keep.tolist()
        self.schemas = [self.schemas[i] for i in order]
        self.values = [self.values[i] for i in order]
        self.irregular_infos = [self.irregular_infos[i] for i in order]
        self._index = {}  # no more rows come

    def schema_array(self) -> np.ndarray:
        return np.frombuffer(self.schema_of, dtype=np.int32) if len(self) else np.zeros(0, np.int32)

    def pos_array(self) -> np.ndarray:
        """Each row's position among the rows of its schema (after finish)."""
        return self.pos

    def task_array(self) -> np.ndarray:
        return np.frombuffer(self.task, dtype=np.int64) if len(self) else np.zeros(0, np.int64)

    def rollout_array(self) -> np.ndarray:
        return np.frombuffer(self.rollout, dtype=np.int64) if len(self) else np.zeros(0, np.int64)

    def masked_array(self) -> np.ndarray:
        """Per row: whether its mask flag is truthy (all False without a mask_key)."""
        out = np.zeros(len(self), bool)
        if len(self.masked):
            out[np.frombuffer(self.masked, dtype=np.int64)] = True
        return out

    def answer_array(self) -> np.ndarray | None:
        if self.answer_key is None:
            return None
        return np.frombuffer(self.answers, dtype=np.int64) if len(self) else np.zeros(0, np.int64)


def irregular_info(row: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """A rollout_infos entry after its identity, exactly as Gym builds it (reward raw, bools as ints)."""
    info: dict[str, Any] = {}
    if "reward" in row:
        info["reward"] = row.get("reward")
    for k, v in list(usage.items()) + [(k, v) for k, v in row.items() if k not in INFO_SKIP]:
        if type(v) in KIND:
            info[k] = int(v) if type(v) is bool else v
    return info


def narrow(column: np.ndarray) -> np.ndarray:
    """The column in uint8 or float32 when that holds every value exactly, else float64 (a copy)."""
    if (
        len(column)
        and (column >= 0).all()
        and (column <= 255).all()
        and (column == np.floor(column)).all()
        and not np.signbit(column).any()
    ):
        return column.astype(np.uint8)
    with np.errstate(over="ignore"):  # values beyond float32 become inf, and fail the test below
        as32 = column.astype(np.float32)
    if (as32 == column).all() and (np.signbit(as32) == np.signbit(column)).all():
        return as32
    return column.copy()


def rollout_infos(
    schema: Schema, values: list[np.ndarray], tasks: list[int], rollouts: list[int], irregular: list[dict] | None = None
) -> list[bytes]:
    """Rows' `rollout_infos` entries as JSON (orjson's bytes for Gym's dict), for rows of one schema.

    values: one array per field; irregular: the stored tails of irregular rows. Values are serialised a column
    at a time by orjson and put into a per-schema template, so a row costs one bytes formatting.
    """
    names = [n for n, _, _ in schema.info or ()]
    if schema.info is None or "rollout_id" in names:
        tails = (
            irregular
            if schema.info is None
            else [dict(zip(names, row)) for row in zip(*(_typed(values[j], k) for _, j, k in schema.info))]
        )
        return [
            orjson.dumps({"rollout_id": f"{t}:{r}", TASK_KEY: t, ROLLOUT_KEY: r, **tail})
            for t, r, tail in zip(tasks, rollouts, tails or [])
        ]
    fields = b"".join(b"," + orjson.dumps(n).replace(b"%", b"%%") + b":%s" for n in names)
    template = b'{"rollout_id":"%s:%s","_ng_task_index":%s,"_ng_rollout_index":%s' + fields + b"}"
    t, r = _json_items(tasks), _json_items(rollouts)
    columns = [_json_items(_typed(values[j], kind)) for _, j, kind in schema.info]
    return [template % row for row in zip(t, r, t, r, *columns)]


def _json_items(items: list[Any]) -> list[bytes]:
    """Each number or bool of a list as orjson writes it."""
    return orjson.dumps(items)[1:-1].split(b",") if items else []


def _typed(column: np.ndarray, kind: str) -> list[Any]:
    if kind == "i":
        return column.astype(np.int64).tolist()
    if kind == "B":
        return (column != 0).tolist()
    return column.astype(np.float64).tolist()
