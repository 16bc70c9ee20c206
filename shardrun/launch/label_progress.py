"""A blend's progress per label for `shardrun status`: rollouts collected and failed per label, while the run goes on,
so that a lane collecting nothing is seen before the merge (docs/blends.md, "Per-label outputs").

Planned rollouts per label are the plan's (Plan.blend). Collected ones of a sealed shard are its seal's
(`label_rollouts`, counted when it sealed; `status` has checked the seal against its file), so `status` parses no
sealed shard's rows. Those of any other shard (and of a seal written before seals counted labels) are counted from
its rollouts file: each complete line's `_ng_task_index` (read with a byte search, the line parsed only where the
key is not found exactly once), its label from the plan's task ranges. A resumed shard's rollouts file may hold a
rollout twice until the merge drops the copy; such lines count twice here, as the shard's own count does. Failed
rollouts are the ones `status` lists (failed for good in the failure sidecars).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import orjson

from shardrun.core.failure_classes import CLASSES
from shardrun.core.gym_names import TASK_KEY
from shardrun.plan.planner import Plan
from shardrun.rundir import store
from shardrun.rundir.records import Seal

_TASK = re.compile(rb'"' + TASK_KEY.encode() + rb'"\s*:\s*(-?\d+)')
SILENT = "nothing collected while other labels progress: is this lane failing?"


def task_indices(path: Path) -> np.ndarray:
    """The `_ng_task_index` of each complete line of a rollouts file (-1 where a line has none)."""
    out: list[int] = []
    try:
        for line in store.complete_lines(path):
            found = _TASK.findall(line)
            if len(found) == 1:
                out.append(int(found[0]))
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                out.append(-1)
                continue
            task = row.get(TASK_KEY) if isinstance(row, dict) else None
            out.append(task if isinstance(task, int) and not isinstance(task, bool) else -1)
    except FileNotFoundError:
        pass
    return np.array(out, np.int64)


def label_rows(
    run_dir: Path, plan: Plan, failed: Sequence[tuple[int, str]], sealed: Mapping[int, Seal] | None = None
) -> list[dict[str, Any]]:
    """Per label (config order): agent, planned, collected, failed (and by failure class: `failed` holds each
    failed rollout's task and class), and whether it is silent (nothing collected while another label has).
    `sealed`: the seals of the shards found sealed, by shard index. Empty for a plan without a blend."""
    if not plan.blend:
        return []
    n = len(plan.blend)
    collected = np.zeros(n, np.int64)
    for spec in plan.shards:
        marker = (sealed or {}).get(spec.index)
        if marker is not None and marker.label_rollouts is not None and len(marker.label_rollouts) == n:
            collected += np.array(marker.label_rollouts, np.int64)
        else:
            collected += plan.label_counts(task_indices(store.rollouts_path(run_dir, spec.index)))
    codes = plan.label_codes(np.fromiter((t for t, _ in failed), np.int64, len(failed)))
    by_class: list[dict[str, int]] = [{} for _ in plan.blend]
    for (_, klass), code in zip(failed, codes.tolist()):
        by_class[code][klass] = by_class[code].get(klass, 0) + 1
    anyone = bool(collected.sum())
    return [
        {
            "label": e.label,
            "agent": e.agent,
            "planned": e.num_rollouts,
            "collected": int(collected[i]),
            "failed": sum(by_class[i].values()),
            "failed_by_class": {k: by_class[i][k] for k in CLASSES if k in by_class[i]},
            "silent": anyone and not collected[i],
        }
        for i, e in enumerate(plan.blend)
    ]


def render_rows(rows: Sequence[dict[str, Any]], bar: Any) -> list[str]:
    """The labels section of `status` (`bar(done, total)`: the progress bar)."""
    from shardrun.core.terminal import shown

    if not rows:
        return []
    width = max(len(shown(r["label"])) for r in rows)
    out = ["", f"{'label':<{width}}  {'collected':>15}  {'failed':>7}"]
    for r in rows:
        done = f"{r['collected']:,}/{r['planned']:,}"
        classes = ", ".join(f"{k} {n:,}" for k, n in r.get("failed_by_class", {}).items())
        out.append(
            f"{shown(r['label']):<{width}}  {done:>15}  {r['failed']:>7,}  "
            f"{bar(r['collected'] + r['failed'], r['planned'])}"
            + (f"  failed: {classes}" if classes else "")
            + (f"  {SILENT}" if r["silent"] else "")
        )
    return out
