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
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from shardrun.planner import ROLLOUT_KEY, TASK_KEY

KIND = {int: "i", float: "f", bool: "b"}
IDENTITY = frozenset((TASK_KEY, ROLLOUT_KEY))
INFO_SKIP = frozenset((TASK_KEY, ROLLOUT_KEY, "reward", "response"))
EXACT_INT = 2 ** 53
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
        canon = b"f" + repr(value).encode() if isinstance(value, float) and not value.is_integer() \
            else b"i" + str(int(value)).encode()
    elif isinstance(value, str):
        canon = b"s" + value.encode("utf-8", "surrogatepass")
    else:
        canon = b"j" + orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    code = int.from_bytes(hashlib.blake2b(canon, digest_size=8).digest(), "little", signed=True)
    return code or 1


@dataclass
class RowTable:
    """Numeric values of rows, added in file order; row n is described by (schema_of[n], pos_of[n])."""

    answer_key: str | None = None
    schemas: list[Schema] = field(default_factory=list)
    values: list[array] = field(default_factory=list)
    irregular_infos: list[list[dict] | None] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    schema_of: array = field(default_factory=lambda: array("i"))
    pos_of: array = field(default_factory=lambda: array("i"))
    answers: array = field(default_factory=lambda: array("q"))
    columns: list[list[np.ndarray]] = field(default_factory=list)  # per schema, per field (after finish)
    _index: dict[tuple, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.schema_of)

    def add(self, row: dict[str, Any]) -> None:
        names: list[str] = []
        kinds: list[str] = []
        vals: list[Any] = []
        for k, v in row.items():
            c = KIND.get(type(v))
            if c is not None and k not in IDENTITY:
                names.append(k)
                kinds.append(c)
                vals.append(v)
        response = row.get("response")
        usage = response.get("usage") if type(response) is dict else None
        regular = type(usage) is dict or usage is None
        unames: list[str] = []
        if usage and regular:
            for k, v in usage.items():
                if k in row:
                    regular = False
                c = KIND.get(type(v))
                if c is not None:
                    unames.append(k)
                    kinds.append(c)
                    vals.append(v)
        if "reward" in row and type(row["reward"]) not in KIND:
            regular = False
        if vals and (max(vals) >= EXACT_INT or min(vals) <= -EXACT_INT):
            regular = False
        if regular:
            key = (tuple(names), tuple(unames), "".join(kinds))
            sid = self._index.get(key)
            if sid is None:
                sid = self._new(key, regular_schema(names, key[2][:len(names)], unames, key[2][len(names):]))
            self._append(sid, vals)
        else:
            self._add_irregular(row, usage if type(usage) is dict else {})
        if self.answer_key is not None:
            self.answers.append(answer_code(row.get(self.answer_key)))

    def _add_irregular(self, row: dict[str, Any], usage: dict[str, Any]) -> None:
        merged = row | usage  # Gym's `result | response.usage`
        stats = [(k, KIND[type(v)], v) for k, v in merged.items() if type(v) in KIND and k not in IDENTITY]
        key = ("irregular", tuple(k for k, _, _ in stats), "".join(c for _, c, _ in stats))
        sid = self._index.get(key)
        if sid is None:
            sid = self._new(key, Schema(key[1], key[2], None))
        self._append(sid, [float(v) for _, _, v in stats])
        self.irregular_infos[sid].append(irregular_info(row, usage))

    def _new(self, key: tuple, schema: Schema) -> int:
        self._index[key] = len(self.schemas)
        self.schemas.append(schema)
        self.values.append(array("d"))
        self.counts.append(0)
        self.irregular_infos.append([] if schema.info is None else None)
        return len(self.schemas) - 1

    def _append(self, sid: int, vals: list[Any]) -> None:
        self.values[sid].extend(vals)
        self.schema_of.append(sid)
        self.pos_of.append(self.counts[sid])
        self.counts[sid] += 1

    def finish(self) -> None:
        """Keep each schema's values column by column in the narrowest exact dtype; frees the row buffers."""
        for sid, buf in enumerate(self.values):
            width, n = len(self.schemas[sid].names), self.counts[sid]
            flat = np.frombuffer(buf, dtype=np.float64) if n * width else np.zeros(n * width)
            matrix = flat.reshape(n, width)
            self.columns.append([narrow(matrix[:, j]) for j in range(width)])
        self.values = []

    def schema_array(self) -> np.ndarray:
        return np.frombuffer(self.schema_of, dtype=np.int32) if len(self) else np.zeros(0, np.int32)

    def pos_array(self) -> np.ndarray:
        return np.frombuffer(self.pos_of, dtype=np.int32) if len(self) else np.zeros(0, np.int32)

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
    if len(column) and (column >= 0).all() and (column <= 255).all() and (column == np.floor(column)).all() \
            and not np.signbit(column).any():
        return column.astype(np.uint8)
    as32 = column.astype(np.float32)
    if (as32 == column).all() and (np.signbit(as32) == np.signbit(column)).all():
        return as32
    return column.copy()


def rollout_infos(schema: Schema, values: list[np.ndarray], tasks: list[int], rollouts: list[int],
                  irregular: list[dict] | None = None) -> list[dict[str, Any]]:
    """`rollout_infos` entries for rows of one schema (values: one array per field; irregular: stored tails)."""
    head = [{"rollout_id": f"{t}:{r}", TASK_KEY: t, ROLLOUT_KEY: r} for t, r in zip(tasks, rollouts)]
    if schema.info is None:
        for d, tail in zip(head, irregular or []):
            d.update(tail)
        return head
    names = [n for n, _, _ in schema.info]
    columns = [_typed(values[j], kind) for _, j, kind in schema.info]
    for d, vals in zip(head, zip(*columns)) if columns else ():
        d.update(zip(names, vals))
    return head


def _typed(column: np.ndarray, kind: str) -> list[Any]:
    if kind == "i":
        return column.astype(np.int64).tolist()
    if kind == "B":
        return (column != 0).tolist()
    return column.astype(np.float64).tolist()
