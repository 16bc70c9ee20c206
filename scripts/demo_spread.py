"""Print the per-task mean rewards of a merged reward profile and say whether they have a spread (scripts/demo.sh).

A spread, as issue #23 asks of the demo: at least three distinct per-task means, at least one task above 0 and at
least one below 1. Usage: demo_spread.py PROFILE.jsonl; exit 0 with a spread, 1 without one, 2 on unreadable input.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def task_means(path: Path) -> list[float]:
    """The `mean/reward` of every task row of a `_reward_profiling.jsonl` (tasks without rollouts have none)."""
    means = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "mean/reward" in row:
                means.append(float(row["mean/reward"]))
    return means


def has_spread(means: list[float]) -> bool:
    return len({round(m, 9) for m in means}) >= 3 and any(m > 0 for m in means) and any(m < 1 for m in means)


def summary(means: list[float]) -> str:
    counts = Counter(round(m, 4) for m in means)
    parts = ", ".join(f"{m:g} x{n}" for m, n in sorted(counts.items()))
    verdict = "a spread" if has_spread(means) else "NO spread (want >= 3 distinct means, one > 0, one < 1)"
    return f"per-task mean rewards of {len(means)} tasks: {len(counts)} distinct ({parts}): {verdict}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: demo_spread.py PROFILE.jsonl", file=sys.stderr)
        return 2
    try:
        means = task_means(Path(argv[0]))
    except (OSError, ValueError) as e:
        print(f"{argv[0]}: cannot read the profile: {e}", file=sys.stderr)
        return 2
    print(summary(means))
    return 0 if has_spread(means) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
