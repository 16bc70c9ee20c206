"""JSON lines read in blocks by the optional C scanner (`shardrun.merge._jsonlscan`), for the merge's hot loops.

The scanner validates every line as one JSON object and gives, per line, where it starts, a signature id (its
keys and value types, see the C source), and its numbers (top-level numbers and bools in key order, then those
of `response.usage`) as doubles; it leaves to the caller every line it does not take on with certainty (id -1).
A `Scanner` turns signature ids into the caller's own meanings: the first line of each new signature is parsed
with orjson, checked against what the scanner saw (same keys, same value types), and handed to the caller's
`learn(row)`, which returns an index into its own list of shapes, or -1 to parse such rows itself.

Without a C compiler at install time the module is missing; `AVAILABLE` is then False and callers take their
pure-Python path (same results, slower).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson

try:
    from shardrun.merge import _jsonlscan
except ImportError:  # built without a C compiler
    _jsonlscan = None

AVAILABLE = _jsonlscan is not None
SLOW = -1  # a line the caller parses itself
MAX_SIGNATURES = 10_000  # remembered per scanner; past that they are forgotten and learned again
MAX_KEY_VALUES = 1_000_000  # distinct `key` values remembered per scanner, likewise
TYPE_CODE = {type(None): "n", bool: "b", int: "i", float: "f", str: "s", list: "a", dict: "o"}


@dataclass
class Block:
    """One block's lines: `shape[i]` is the caller's shape index of line i (SLOW: parse it yourself); its
    numbers are values[vstart[i]:...]; `key_code[i]` is the caller's code of the line's `key` value."""

    lines: int
    starts: np.ndarray
    lengths: np.ndarray
    shape: np.ndarray
    vstart: np.ndarray
    values: np.ndarray
    key_code: np.ndarray | None

    def line(self, data: bytes | bytearray, i: int) -> tuple[bytes | bytearray, int]:
        """Line i of the block `data` it was scanned from, without its newline, and where it starts."""
        start = int(self.starts[i])
        return data[start : start + int(self.lengths[i]) - 1], start


def scatter(dst: memoryview, src: bytes, at: np.ndarray, length: np.ndarray, dest: np.ndarray) -> None:
    """dst[dest[i]:dest[i] + length[i]] = src[at[i]:at[i] + length[i]] for every i, in C (GIL released)."""
    as64 = [np.ascontiguousarray(a, np.int64) for a in (at, length, dest)]
    _jsonlscan.scatter(dst, src, *as64)


def plain_key(key: str) -> bytes | None:
    """The key as raw JSON bytes, or None when JSON writes it with an escape (the scanner cannot match it)."""
    raw = orjson.dumps(key)[1:-1]
    return raw if raw == key.encode() and b"\\" not in raw else None


class Scanner:
    """Signature ids -> the caller's shapes (`learn`), and `key` values -> the caller's codes (`decode`)."""

    def __init__(
        self,
        learn: Callable[[dict[str, Any]], int],
        key: bytes | None = None,
        decode: Callable[[bytes], int] | None = None,
        missing: int = 0,
    ):
        assert AVAILABLE, "the C scanner was not built"
        self.learn, self.key, self.decode, self.missing = learn, key, decode, missing
        self._sigs: dict[bytes, int] = {}
        self._interned: dict[bytes, int] = {}
        self._shape_of_sig = np.full(1, SLOW, np.int64)  # index sig + 1 (sig -1 -> SLOW)
        self._codes: list[int] = []
        self._code_array = np.zeros(0, np.int64)

    def scan(self, data: bytes, end: int) -> Block:
        """The complete lines in data[:end] (which ends with a newline, or is empty)."""
        if len(self._sigs) > MAX_SIGNATURES:
            self._sigs.clear()
            self._shape_of_sig = np.full(1, SLOW, np.int64)
        if len(self._interned) > MAX_KEY_VALUES:
            self._interned.clear()
            self._codes.clear()
        new: list[tuple[int, int]] = []
        known_sigs, known_keys = len(self._sigs), len(self._interned)
        lines, starts, sig, vstart, values, kid = _jsonlscan.scan(data, end, self._sigs, new, self.key, self._interned)
        starts = np.frombuffer(starts, np.int64)
        if new:
            self._learn_new(data, end, starts, known_sigs, new)
        if self.key is not None and len(self._interned) > known_keys:
            self._codes += [self.decode(raw) for raw in itertools.islice(self._interned, known_keys, None)]
            self._code_array = np.array(self._codes, np.int64)
        sig = np.frombuffer(sig, np.int32)
        key_code = None
        if kid is not None:
            kid = np.frombuffer(kid, np.int32)
            key_code = np.where(
                kid >= 0, self._code_array[np.maximum(kid, 0)] if len(self._code_array) else 0, self.missing
            )
        return Block(
            lines,
            starts,
            np.diff(np.r_[starts, end]),
            self._shape_of_sig[sig + 1],
            np.frombuffer(vstart, np.int64),
            np.frombuffer(values, np.float64),
            key_code,
        )

    def _learn_new(self, data: bytes, end: int, starts: np.ndarray, known: int, new: list[tuple[int, int]]) -> None:
        sig_bytes = list(itertools.islice(self._sigs, known, None))
        grown = np.full(len(self._sigs) + 1, SLOW, np.int64)
        grown[: len(self._shape_of_sig)] = self._shape_of_sig
        for sid, line in new:
            stop = int(starts[line + 1]) if line + 1 < len(starts) else end
            row = orjson.loads(data[int(starts[line]) : stop])
            grown[sid + 1] = self.learn(row) if _matches(row, sig_bytes[sid - known]) else SLOW
        self._shape_of_sig = grown


def _matches(row: Any, sig: bytes) -> bool:
    """Does the scanner's signature describe this parsed row: the same top-level keys in the same order (no key
    given twice), the same value types, and the same response.usage value types?"""
    top, _, usage = sig.partition(b"\x01")
    fields = [(part[:-2], part[-1:]) for part in _fields(top)]
    if type(row) is not dict or len(row) != len(fields):
        return False
    if [k.encode() for k in row] != [k for k, _ in fields]:
        return False
    types = "".join(TYPE_CODE.get(type(v), "?") for v in row.values())
    response = row.get("response")
    used = response.get("usage") if type(response) is dict else None
    if type(used) is dict:
        if not sig.count(b"\x01") or len(used) != len(list(_fields(usage))):
            return False
        types += "".join(TYPE_CODE.get(type(v), "?") for v in used.values())
        want = "".join(t.decode() for _, t in fields) + "".join(p[-1:].decode() for p in _fields(usage))
    else:
        if b"\x01" in sig:
            return False
        want = "".join(t.decode() for _, t in fields)
    return types == want


def _fields(part: bytes) -> list[bytes]:
    """'key\\0t' items of a signature part (keys never hold a NUL: JSON escapes control characters)."""
    out, i = [], 0
    while i < len(part):
        j = part.index(b"\x00", i)
        out.append(part[i : j + 2])
        i = j + 2
    return out
