"""`shardrun compare`'s figures: plain data in, one PNG out per function, drawn with the report's set-up
(figures.py: size, resolution, atomic save, the note on an empty figure, the thinning of large scatters)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.figure import Figure

from shardrun.analysis.figures import SIZE, _note, _save, _thin


def means_scatter(
    points: Mapping[str, Sequence[tuple[float, float]]], path: Path, base: str, cand: str, metric: str = "reward"
) -> Path:
    """Per-task mean of the base (x) against the candidate (y), one colour per agent, with the diagonal: a task
    above it gained."""
    fig = Figure(figsize=(SIZE[1] + 1.2, SIZE[1]))
    ax = fig.add_subplot()
    values = [v for ps in points.values() for p in ps for v in p]
    if values:
        lo, hi = min(0.0, *values), max(1.0, *values)
        ax.plot([lo, hi], [lo, hi], color="0.5", linewidth=1, linestyle="--", label="no change")
        for agent, ps in points.items():
            ps = _thin(ps)
            ax.scatter([p[0] for p in ps], [p[1] for p in ps], s=12, alpha=0.5, label=agent, rasterized=True)
        pad = 0.03 * (hi - lo)
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_aspect("equal")
        ax.legend(fontsize=7)
    else:
        _note(ax, "no task with a full mean in both runs")
    ax.set_xlabel(f"base mean {metric}\n{_tail(base)}", fontsize=8)
    ax.set_ylabel(f"candidate mean {metric}\n{_tail(cand)}", fontsize=8)
    ax.set_title(f"Per-task mean {metric}")
    return _save(fig, path)


def delta_histogram(deltas: Mapping[str, Sequence[float]], path: Path, metric: str = "reward") -> Path:
    """Histogram of per-task deltas (candidate - base), stacked by agent, with zero marked."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    shown = {a: list(d) for a, d in deltas.items() if d}
    if shown:
        values = [v for d in shown.values() for v in d]
        lo, hi = min(values), max(values)
        span = max(abs(lo), abs(hi), 1e-9)
        ax.hist(
            list(shown.values()),
            bins=21,
            range=(-span, span),
            stacked=True,
            label=[f"{a} ({len(d):,} tasks)" for a, d in shown.items()],
        )
        ax.axvline(0.0, color="0.3", linewidth=1, linestyle="--")
        ax.legend(fontsize=8)
    else:
        _note(ax, "no task with a full mean in both runs")
    ax.set_xlabel(f"per-task delta of mean {metric} (candidate - base)")
    ax.set_ylabel("tasks")
    ax.set_title(f"Per-task delta of mean {metric}")
    return _save(fig, path)


def flip_matrices(matrices: Mapping[str, Mapping[str, Mapping[str, int]]], buckets: Sequence[str], path: Path) -> Path:
    """One 3x3 panel per agent: tasks by base bucket (rows) and candidate bucket (columns), counts written in."""
    n = max(1, len(matrices))
    fig = Figure(figsize=(min(4.0 * n, 16.0), 3.8))
    if not matrices:
        _note(fig.add_subplot(), "no paired task")
        return _save(fig, path)
    for i, (agent, m) in enumerate(matrices.items(), 1):
        ax = fig.add_subplot(1, n, i)
        grid = [[m[b][c] for c in buckets] for b in buckets]
        ax.imshow(grid, cmap="Blues")
        top = max(max(r) for r in grid) or 1
        for r, row in enumerate(grid):
            for c, v in enumerate(row):
                ax.text(c, r, f"{v:,}", ha="center", va="center", color="white" if v > top / 2 else "black")
        ax.set_xticks(range(len(buckets)), buckets, fontsize=8)
        ax.set_yticks(range(len(buckets)), buckets, fontsize=8)
        ax.set_xlabel("candidate")
        ax.set_ylabel("base")
        ax.set_title(agent, fontsize=9)
    return _save(fig, path)


def _tail(name: str, width: int = 40) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]
