"""The reward profile's maths, as NeMo Gym's `ng_reward_profile` defines it (pure: arrays in, numbers out).

Gym builds one DataFrame of numeric rollout fields and, per group (a task, or an agent), describes every
column with pandas: mean, max, min, median and sample std (ddof 1), all skipping missing values. When every
std of a group is undefined (a group of one rollout) the std of the columns present in all its rows becomes 0.
Stats that are NaN are dropped from the row. max and min keep the integer type only when every column of the
whole frame is an integer column (no float value, no missing value anywhere); everything else is a float.
Columns keep the order in which they first appear in the rows sorted by (task, rollout).

Here a group is a contiguous segment of rows sorted by group. Segments are described in buckets of similar
size laid out as padded 2-D arrays, so a task with 16 rollouts and an agent with ten million cost the same
vectorised code, and nothing loops over tasks in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import orjson

STATS = ("mean", "max", "min", "median", "std")
COUNT, MEAN, MAX, MIN, MEDIAN, STD = range(6)
INT_STATS = frozenset(("max", "min"))


def size_buckets(sizes: np.ndarray) -> list[np.ndarray]:
    """Segment numbers grouped so that a bucket's widest segment is at most twice its narrowest."""
    if len(sizes) == 0:
        return []
    cls = np.ceil(np.log2(np.maximum(sizes, 1))).astype(np.int64)
    order = np.argsort(cls, kind="stable")
    bounds = np.flatnonzero(np.r_[True, cls[order][1:] != cls[order][:-1], True])
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def padded(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Segments as the rows of a 2-D array, padded with NaN on the right."""
    width = int(sizes.max())
    col = np.arange(width)
    inside = col[None, :] < sizes[:, None]
    idx = np.where(inside, starts[:, None] + col[None, :], 0)
    return np.where(inside, values[idx], np.nan)


def describe(m: np.ndarray) -> np.ndarray:
    """(6, rows) stats of each row of a NaN-padded 2-D array: count, mean, max, min, median, std (ddof 1)."""
    present = ~np.isnan(m)
    count = present.sum(axis=1)
    out = np.full((6, m.shape[0]), np.nan)
    out[COUNT] = count
    has = count > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        zeroed = np.where(present, m, 0.0)
        mean = zeroed.sum(axis=1) / count
        out[MEAN] = np.where(has, mean, np.nan)
        out[MAX] = np.fmax.reduce(m, axis=1) if m.shape[1] else np.nan
        out[MIN] = np.fmin.reduce(m, axis=1) if m.shape[1] else np.nan
        sq = np.where(present, (mean[:, None] - m) ** 2, 0.0)
        out[STD] = np.where(count > 1, np.sqrt(sq.sum(axis=1) / (count - 1)), np.nan)
    srt = np.sort(m, axis=1)  # NaN last
    rows = np.flatnonzero(has)
    c = count[rows]
    out[MEDIAN, rows] = (srt[rows, (c - 1) // 2] + srt[rows, c // 2]) / 2
    return out


def segment_stats(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(6, segments) stats of one column over contiguous segments of rows."""
    out = np.full((6, len(sizes)), np.nan)
    for bucket in size_buckets(sizes):
        if len(bucket) == 1:  # one segment (an agent's rollouts): a view, no padding
            s, n = int(starts[bucket[0]]), int(sizes[bucket[0]])
            out[:, bucket] = describe(values[s : s + n][None, :])
        else:
            out[:, bucket] = describe(padded(values, starts[bucket], sizes[bucket]))
    return out


def group_stats(columns: Iterable[np.ndarray], starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(6, columns, segments) stats of every column (one at a time), with Gym's rule for groups of a single
    rollout: when every std of a segment is undefined, the std of the columns present in all its rows is 0."""
    per_column = [segment_stats(c, starts, sizes) for c in columns]
    out = np.stack(per_column, axis=1) if per_column else np.full((6, 0, len(sizes)), np.nan)
    std = out[STD]
    all_undefined = np.isnan(std).all(axis=0)
    complete = out[COUNT] == sizes[None, :]
    std[all_undefined[None, :] & complete] = 0.0
    return out


@dataclass(frozen=True)
class Layout:
    """How a group's stats are written: which columns in which order, and whether max/min are integers."""

    names: tuple[str, ...]
    order: tuple[int, ...]  # column numbers into the stats array, in output order
    all_int: bool


def stat_items(layout: Layout, stats: np.ndarray, g: int) -> dict[str, Any]:
    """`{stat}/{column}` -> value for segment g of a (6, columns, segments) stats array, NaN dropped."""
    return stat_rows(layout, stats[:, :, g : g + 1])[0]


def stat_rows(layout: Layout, stats: np.ndarray) -> list[dict[str, Any]]:
    """stat_items of every segment of a (6, columns, segments) stats array (one numpy reshape, then dicts)."""
    keys = [f"{name}/{layout.names[c]}" for name in STATS for c in layout.order]
    block = stats[1:][:, list(layout.order), :].reshape(len(keys), stats.shape[2]).T
    if not layout.all_int:
        return [{k: v for k, v in zip(keys, row) if v == v} for row in block.tolist()]
    width = len(layout.order)  # max and min (stats 1 and 2) are integers
    is_int = [STATS[i // width] in INT_STATS for i in range(len(keys))]
    return [{k: int(v) if i else v for k, v, i in zip(keys, row, is_int) if v == v} for row in block.tolist()]


def task_profile_row(
    task_index: int,
    items: dict[str, Any],
    sample: dict[str, Any],
    num_rollouts: int,
    expected: int,
    infos: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """One `_reward_profiling.jsonl` row, keys in Gym's order."""
    row: dict[str, Any] = {"_ng_task_index": task_index}
    row.update(items)
    row["sample"] = sample
    row["num_rollouts"] = num_rollouts
    row["expected_num_rollouts"] = expected
    row["missing_num_rollouts"] = expected - num_rollouts
    row["reward_profile_completion_pct"] = 100.0 if expected == 0 else 100.0 * num_rollouts / expected
    row["rollout_infos"] = list(infos)
    return row


RAW_REWARDS_AND_LENGTHS = "raw_rewards_and_lengths"
"""The opt-in per-rollout field of a profile row (NeMo Gym pull request 2771's name and shape)."""
LENGTH_KEYS = ("input_tokens", "output_tokens", "total_tokens")


def raw_rewards_and_lengths(infos: Sequence[bytes]) -> bytes:
    """A task's `raw_rewards_and_lengths` as JSON, from its `rollout_infos` entries (JSON, in rollout-index order):
    one entry per rollout, `_ng_rollout_index`, `reward` (null for a rollout without one) and those of
    `input_tokens`, `output_tokens`, `total_tokens` the rollout's infos have (the numeric `response.usage` fields
    Gym flattens into them); a rollout without usage has no token keys."""
    out = []
    for raw in infos:
        info = orjson.loads(raw)
        entry = {"_ng_rollout_index": info.get("_ng_rollout_index"), "reward": info.get("reward")}
        entry.update((k, info[k]) for k in LENGTH_KEYS if k in info)
        out.append(entry)
    return orjson.dumps(out)


def task_profile_row_json(
    task_index: int, items_json: bytes, sample_json: bytes, num_rollouts: int, expected: int, infos_json: bytes
) -> bytes:
    """orjson.dumps(task_profile_row(...)) from its parts already serialised (items as one JSON object, sample,
    rollout_infos as a JSON list): the same bytes, without building and walking the dict again."""
    pct = 100.0 if expected == 0 else 100.0 * num_rollouts / expected
    items = b"," + items_json[1:-1] if len(items_json) > 2 else b""
    tail = (
        b',"num_rollouts":%d,"expected_num_rollouts":%d,"missing_num_rollouts":%d,"reward_profile_completion_pct":'
        % (num_rollouts, expected, expected - num_rollouts)
    )
    return b"".join(
        (
            b'{"_ng_task_index":%d' % task_index,
            items,
            b',"sample":',
            sample_json,
            tail,
            orjson.dumps(pct),
            b',"rollout_infos":',
            infos_json,
            b"}",
        )
    )


def sample_of(materialized_row: dict[str, Any]) -> dict[str, Any]:
    """Gym's `sample`: the materialized row of the lowest completed rollout without its two identity keys."""
    row = dict(materialized_row)
    row.pop("_ng_task_index", None)
    row.pop("_ng_rollout_index", None)
    return row
