"""The C line scanner (shardrun.merge._jsonlscan via linescan) against the pure-Python read path it accelerates.

Both paths must build the same table from the same bytes: identity, numbers, schemas, offsets, answer codes and
counts of unreadable / identity-less lines. Hypothesis writes files of odd rows (escapes, non-ASCII, big and
negative integers, duplicate keys, usage that is not an object, broken lines) and compares the two.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardrun.merge import linescan
from shardrun.merge import shardscan
from shardrun.rundir import store
from shardrun.core.errors import PlanMismatch
from tests.builders import input_rows, make_run

pytestmark = pytest.mark.skipif(
    not linescan.AVAILABLE and shutil.which("cc") is None, reason="no C compiler here: the scanner cannot be built"
)


def test_the_scanner_is_built_where_a_compiler_is() -> None:
    assert linescan.AVAILABLE, (
        "shardrun.merge._jsonlscan is missing though a C compiler is installed: run ./scripts/setup.sh"
    )


@contextlib.contextmanager
def pure_python() -> Iterator[None]:
    saved = linescan.AVAILABLE
    linescan.AVAILABLE = False
    try:
        yield
    finally:
        linescan.AVAILABLE = saved


def snapshot(r: shardscan.Rollouts) -> dict[str, Any]:
    """Everything the merge takes from a scanned shard, in comparable form (arrays as dtype and bytes)."""
    t = r.table

    def arr(a: np.ndarray | None) -> Any:
        return None if a is None else (str(a.dtype), a.tobytes())

    return {
        "counts": (r.lines, r.unreadable, r.no_identity, r.torn_bytes, r.sha256),
        "rows": [arr(a) for a in (r.task, r.rollout, r.offset, r.length)],
        "schemas": t.schemas,
        "per_schema": t.counts,
        "schema_of": arr(t.schema_array()),
        "pos": arr(t.pos),
        "columns": [[arr(c) for c in cols] for cols in t.columns],
        "answers": arr(t.answer_array()),
        "irregular": t.irregular_infos,
    }


def both_paths(path: Path, answer_key: str | None) -> tuple[dict, dict]:
    fast = shardscan.scan_rollouts(path, limit=None, snapshot=None, answer_key=answer_key)
    with pure_python():
        slow = shardscan.scan_rollouts(path, limit=None, snapshot=None, answer_key=answer_key)
    return snapshot(fast), snapshot(slow)


# ---------------------------------------------------------------- odd rows

KEYS = ["reward", "a", "b", "input_tokens", "ans", "é", "_ng_task_index", "_ng_rollout_index"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.integers(-5, 300)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.5, -0.0, 1e-310, 1e300, 3.0])
    | st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(KEYS), kids, max_size=3),
    max_leaves=6,
)
usage = (
    st.dictionaries(
        st.sampled_from(["input_tokens", "output_tokens", "total_tokens", "reward", "a"]), scalars, max_size=4
    )
    | scalars
)
rows = st.fixed_dictionaries(
    {"_ng_task_index": st.integers(-1, 5) | st.just("3"), "_ng_rollout_index": st.integers(-1, 5)},
    optional={
        "response": st.fixed_dictionaries({}, optional={"usage": usage, "output": values}) | scalars,
        "reward": scalars,
        "a": values,
        "b": scalars,
        "input_tokens": scalars,
        "ans": values,
        "é": values,
    },
)


@st.composite
def lines(draw: Any) -> bytes:
    row = draw(st.permutations(list(draw(rows).items())))
    how = draw(st.sampled_from(["orjson", "ascii", "spaced", "duplicate", "escaped-key", "broken"]))
    if how == "orjson" or any(type(v) is int and not -(2**63) <= v < 2**64 for _, v in row):
        return orjson.dumps(dict(row))
    if how == "ascii":  # non-ASCII as \\u escapes (surrogate pairs beyond the BMP)
        return json.dumps(dict(row)).encode()
    if how == "spaced":
        return (
            b" \t" + json.dumps(dict(row), indent=None, separators=(" , ", " : "), ensure_ascii=False).encode() + b" \r"
        )
    members = [orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in row]
    if how == "duplicate" and members:
        members.append(members[draw(st.integers(0, len(members) - 1))])
    if how == "escaped-key":
        members.append(b'"\\u0061ns":1')
    line = b"{" + b",".join(members) + b"}"
    if how == "broken":
        cut = draw(st.integers(0, len(line)))
        line = line[:cut] + draw(st.sampled_from([b"", b"\xff", b"\xed\xa0\x80", b"}", b"\x01", b'"\\x"']))
    return line


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    file_lines=st.lists(lines() | st.sampled_from([b"", b"   ", b"[1,2]", b"7", b"null"]), max_size=30),
    torn=st.booleans(),
    answer_key=st.sampled_from([None, "ans", "é", "a\"b"]),
)
def test_the_scanner_builds_the_same_table_as_python(
    tmp_path_factory, file_lines: list[bytes], torn: bool, answer_key: str | None
) -> None:
    path = tmp_path_factory.mktemp("scan") / "rollouts.jsonl"
    path.write_bytes(b"".join(x + b"\n" for x in file_lines) + (b'{"_ng_task_index": 1' if torn else b""))
    fast, slow = both_paths(path, answer_key)
    assert fast == slow


def test_rows_of_many_shapes_across_blocks_match(tmp_path: Path, monkeypatch) -> None:
    """Several blocks (small BLOCK), shapes that share a schema, rows the scanner leaves to Python in between."""
    monkeypatch.setattr(shardscan, "BLOCK", 4096)
    out = []
    for i in range(3000):
        row: dict[str, Any] = {
            "_ng_task_index": i // 4,
            "_ng_rollout_index": i % 4,
            "reward": float(i % 2),
            "response": {"usage": {"input_tokens": i, "output_tokens": 2 * i}},
            "ans": [None, "x", i % 3, {"v": i % 2}][i % 4],
        }
        if i % 7 == 0:
            row = {"_ng_rollout_index": row.pop("_ng_rollout_index"), **row}  # same schema, other key order
        line = orjson.dumps(row)
        if i % 50 == 0:
            line = json.dumps(row).encode().replace(b'"ans"', b'"\\u0061ns"')  # escaped key: Python's
        if i % 333 == 0:
            line = line[:-5]  # unreadable
        out.append(line + b"\n")
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"".join(out))
    by_python = []
    real_line = shardscan._RolloutRows.line
    monkeypatch.setattr(shardscan._RolloutRows, "line", lambda self, *a: by_python.append(1) or real_line(self, *a))
    fast = snapshot(shardscan.scan_rollouts(path, limit=None, snapshot=None, answer_key="ans"))
    taken_by_python = len(by_python)
    with pure_python():
        slow = snapshot(shardscan.scan_rollouts(path, limit=None, snapshot=None, answer_key="ans"))
    assert fast == slow
    assert fast["counts"][:3] == (3000, 10, 0)
    assert taken_by_python == 60 + 10 - 1  # the escaped-key and broken lines only (one is both)


# ---------------------------------------------------------------- the scanner itself


def scan_one(line: bytes, key: bytes | None = None) -> tuple[int, list[float]]:
    sigs: dict[bytes, int] = {}
    n, _starts, sig, vstart, values, _kid = linescan._jsonlscan.scan(line + b"\n", len(line) + 1, sigs, [], key, {})
    assert n == 1
    return int(np.frombuffer(sig, np.int32)[0]), np.frombuffer(values, np.float64).tolist()


@pytest.mark.parametrize(
    "line",
    [
        b'{"\\u0061":1}',  # escaped top-level key
        b'{"a":"\\ud83d\\ude00"}',  # surrogate escapes: orjson decides
        b'{"a":12345678901234567}',  # more than 15 digits
        b'{"a":1e400}',
        b'{"a":1e-400}',  # over- and underflow
        b'{"a":01}',
        b'{"a":1.}',
        b'{"a":-}',
        b'{"a":.5}',
        b'{"a":NaN}',
        b'{"a":tru}',
        b'{"a":"\x01"}',
        b'{"a":"\xff"}',
        b'{"a":"\xed\xa0\x80"}',
        b'{"a":"\xc0\x80"}',
        b'{"a":"\\x"}',
        b'{"a":1}x',
        b'{"a":1',
        b'[1]',
        b'',
        b'  ',
        b'{"a":1,}',
        b'{,}',
        b'{"a" 1}',
        b'{"response":{"usage":{}},"response":1}',
        b'{"response":{"usage":{},"usage":{}}}',
        b'{"a":' + b"[" * 300 + b"]" * 300 + b"}",  # deeper than the scanner goes
    ],
)
def test_lines_the_scanner_leaves_to_python(line: bytes) -> None:
    assert scan_one(line)[0] == linescan.SLOW


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "-0",
        "-0.0",
        "0.1",
        "1e-7",
        "2.5E+3",
        "123456789012345",
        "-999999999999999",
        "0.30000000000000004",
        "1.7976931348623157e308",
        "4.9406564584124654e-300",
    ],
)
def test_numbers_are_parsed_exactly_as_orjson(text: str) -> None:
    sig, values = scan_one(b'{"x":' + text.encode() + b"}")
    want = float(orjson.loads(text))
    assert sig == 0 and len(values) == 1
    assert values[0] == want and np.signbit(values[0]) == np.signbit(want)


def test_numbers_come_in_key_order_then_usage() -> None:
    sig, values = scan_one(b'{"a":1,"s":"x","response":{"id":"r","usage":{"in":3,"d":{"q":9},"ok":false}},"b":true}')
    assert sig == 0 and values == [1.0, 1.0, 3.0, 0.0]


def test_key_values_are_interned_by_their_text() -> None:
    data = b'{"k":"x"}\n{"k":{"name":"a"}}\n{"j":1}\n{"k":"x"}\n'
    interned: dict[bytes, int] = {}
    *_, kid = linescan._jsonlscan.scan(data, len(data), {}, [], b"k", interned)
    assert np.frombuffer(kid, np.int32).tolist() == [0, 1, -1, 0]
    assert interned == {b'"x"': 0, b'{"name":"a"}': 1}


def test_scatter_copies_ranges_and_refuses_ranges_outside_a_buffer() -> None:
    dst = bytearray(8)
    linescan.scatter(memoryview(dst), b"abcdef", np.array([4, 0]), np.array([2, 3]), np.array([0, 5]))
    assert bytes(dst) == b"ef\0\0\0abc"
    with pytest.raises(ValueError, match="outside"):
        linescan.scatter(memoryview(dst), b"abc", np.array([2]), np.array([2]), np.array([0]))
    with pytest.raises(ValueError, match="outside"):
        linescan.scatter(memoryview(dst), b"abc", np.array([0]), np.array([3]), np.array([6]))


# ---------------------------------------------------------------- planned rows


def test_planned_rows_read_the_same_on_both_paths(tmp_path: Path, monkeypatch) -> None:
    run = make_run(
        tmp_path,
        input_rows(40, agents=("a", "b", "c")),
        num_repeats={"a": 3, "_default": 2},
        num_shards=3,
        slicing="round_robin",
    )
    for i in range(3):
        path = store.materialized_path(run.run_dir, i)
        by_python = []
        with monkeypatch.context() as m:
            real = shardscan._PlannedRows.add_line
            m.setattr(shardscan._PlannedRows, "add_line", lambda self, *a: by_python.append(1) or real(self, *a))
            fast = shardscan.scan_planned(path)
        assert by_python == []  # the scanner took every planned row
        with pure_python():
            slow = shardscan.scan_planned(path)
        got = [fast.task, fast.rollout, fast.offset, fast.length]
        assert all(np.array_equal(a, b) for a, b in zip(got, [slow.task, slow.rollout, slow.offset, slow.length]))
        assert [fast.agents[c] for c in fast.agent] == [slow.agents[c] for c in slow.agent]
        assert len(fast.task) == len(run.materialized(i))


@pytest.mark.parametrize(
    "bad",
    [
        b'{"_ng_task_index": 1, "agent_ref": {"name": "a"}}',
        b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "agent_ref": {"nom": "a"}}',
        b'{"_ng_task_index": -1, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}}',
        b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}',
    ],
)
def test_a_damaged_planned_row_is_named_by_line_on_both_paths(tmp_path: Path, bad: bytes) -> None:
    good = b'{"_ng_task_index": 0, "_ng_rollout_index": %d, "agent_ref": {"name": "a"}}'
    path = tmp_path / "rollouts_materialized_inputs.jsonl"
    path.write_bytes(b"\n".join([good % 0, good % 1, b"", bad, good % 2]) + b"\n")
    messages = []
    for context in (contextlib.nullcontext(), pure_python()):
        with context, pytest.raises(PlanMismatch) as e:
            shardscan.scan_planned(path)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and f"{path}:4:" in messages[0]


def test_lines_longer_than_a_block_and_a_torn_tail_read_the_same(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shardscan, "BLOCK", 64)
    rows = [
        orjson.dumps({"_ng_task_index": i, "_ng_rollout_index": 0, "reward": 1.0, "text": "x" * (i * 97)})
        for i in range(12)
    ]
    path = tmp_path / "rollouts.jsonl"
    torn = b'{"_ng_task_index": 99, "text": "' + b"y" * 300
    path.write_bytes(b"\n".join(rows) + b"\n" + torn)
    fast, slow = both_paths(path, None)
    assert fast == slow
    assert fast["counts"][:4] == (12, 0, 0, len(torn))
