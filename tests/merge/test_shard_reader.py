"""Reading one shard's files (merge.shard_reader): damaged planned rows named by file and line, lines longer than
a read block, a torn last line, and a snapshot whose offsets equal the file's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from shardrun.core.errors import PlanMismatch
from shardrun.merge import shard_reader
from shardrun.rundir import fileio


@pytest.mark.parametrize(
    "bad",
    [
        b'{"_ng_task_index": 1, "agent_ref": {"name": "a"}}',
        b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "agent_ref": {"nom": "a"}}',
        b'{"_ng_task_index": -1, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}}',
        b'{"_ng_task_index": 1, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}',
    ],
)
def test_a_damaged_planned_row_is_named_by_file_and_line(tmp_path: Path, bad: bytes) -> None:
    good = b'{"_ng_task_index": 0, "_ng_rollout_index": %d, "agent_ref": {"name": "a"}}'
    path = tmp_path / "rollouts_materialized_inputs.jsonl"
    path.write_bytes(b"\n".join([good % 0, good % 1, b"", bad, good % 2]) + b"\n")
    with pytest.raises(PlanMismatch, match=f"{path}:4: "):
        shard_reader.scan_planned(path)


@pytest.mark.parametrize("block", [64, 1 << 20])
def test_lines_longer_than_a_block_and_a_torn_tail(tmp_path: Path, monkeypatch, block: int) -> None:
    monkeypatch.setattr(fileio, "LINE_BLOCK", block)
    rows = [
        orjson.dumps({"_ng_task_index": i, "_ng_rollout_index": 0, "reward": 1.0, "text": "x" * (i * 97)})
        for i in range(12)
    ]
    rows.insert(3, b"not json")
    rows.insert(5, b'{"reward": 0.5}')
    path = tmp_path / "rollouts.jsonl"
    torn = b'{"_ng_task_index": 99, "text": "' + b"y" * 300
    data = b"\n".join(rows) + b"\n"
    path.write_bytes(data + torn)
    snapshot = tmp_path / "snapshot.jsonl"
    got = shard_reader.scan_rollouts(path, limit=None, snapshot=snapshot, answer_key=None)
    assert (got.lines, got.unreadable, got.no_identity, got.torn_bytes) == (14, 1, 1, len(torn))
    assert got.task.tolist() == list(range(12)) and got.source == snapshot
    assert snapshot.read_bytes() == data
    lines = [snapshot.read_bytes()[o : o + n] for o, n in zip(got.offset.tolist(), got.length.tolist())]
    assert [orjson.loads(x)["_ng_task_index"] for x in lines] == list(range(12)) and all(
        x.endswith(b"\n") for x in lines
    )


def test_a_sealed_shard_is_read_up_to_its_sealed_size_and_hashed(tmp_path: Path) -> None:
    sealed = b"".join(orjson.dumps({"_ng_task_index": i, "_ng_rollout_index": 0}) + b"\n" for i in range(3))
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(sealed + b'{"_ng_task_index": 7, "_ng_rollout_index": 0}\n')  # appended after sealing
    got = shard_reader.scan_rollouts(path, limit=len(sealed), snapshot=None, answer_key=None)
    assert got.task.tolist() == [0, 1, 2] and got.sha256 == hashlib.sha256(sealed).hexdigest()


def test_the_mask_flag_is_read_by_its_truthiness_and_is_never_a_stats_column(tmp_path: Path) -> None:
    """Gym 0.7's `mask_sample` test is Python truthiness: true, 1, 2.5, "no", [0] mask; false, 0, 0.0, null, "",
    [] and a missing field do not. Without a mask key (0.4) nothing is masked and the flag is a number."""
    flags: list = [True, 1, 2.5, "no", [0], False, 0, 0.0, None, "", []]
    rows = [{"_ng_task_index": i, "_ng_rollout_index": 0, "reward": 1.0, "mask_sample": f} for i, f in enumerate(flags)]
    rows.append({"_ng_task_index": len(flags), "_ng_rollout_index": 0, "reward": 0.0})
    rows.append({"_ng_task_index": 99, "_ng_rollout_index": 0, "mask_sample": True})  # an irregular row (reward)
    rows[-1]["reward"] = "bad"
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    got = shard_reader.scan_rollouts(path, limit=None, snapshot=None, answer_key=None, mask_key="mask_sample")
    assert got.table.masked_array().tolist() == [True] * 5 + [False] * 7 + [True]
    assert not any("mask_sample" in s.names for s in got.table.schemas)
    plain = shard_reader.scan_rollouts(path, limit=None, snapshot=None, answer_key=None)
    assert not plain.table.masked_array().any() and any("mask_sample" in s.names for s in plain.table.schemas)
