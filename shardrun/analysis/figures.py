"""The report's figures: plain data in, one PNG file out per function (matplotlib, Agg, no pyplot state).

The report (report.py `nothing_to_show`) says in a sentence why a panel with nothing to show is left out; a figure
drawn here with empty data anyway gets a note saying what is missing, never a broken image. An axis that counts
things (tasks, k, shards, rollouts) has integer ticks only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

from shardrun.core.terminal import shown
from shardrun.rundir import store
from shardrun.rundir.cost import ShardCost, Throughput

SIZE = (7.0, 4.2)
DPI = 100
MAX_POINTS = 50_000  # per agent in a scatter; beyond that a deterministic stride keeps the file small


def _save(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    with store.atomic_writer(Path(path)) as f:
        fig.savefig(f, format="png", dpi=DPI)
    return Path(path)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=11, color="0.35")


def _integer_ticks(axis: Any) -> None:
    """Ticks only at whole numbers (an axis that counts things)."""
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # one whole number is enough (one shard)


def _thin(points: Sequence) -> Sequence:
    step = max(1, -(-len(points) // MAX_POINTS))
    return points[::step]


def mean_histogram(means: Mapping[str, Sequence[float]], path: Path, metric: str = "reward") -> Path:
    """Histogram of per-task mean <metric>, one outline per agent."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    values = [v for vs in means.values() for v in vs]
    if values:
        lo, hi = min(values), max(values)
        bins = 20 if hi > lo else 1
        for agent, vs in means.items():
            ax.hist(
                vs,
                bins=bins,
                range=(lo, hi) if hi > lo else None,
                histtype="step",
                linewidth=1.6,
                label=f"{shown(agent)} ({len(vs):,} tasks)",
            )
        ax.legend(fontsize=8)
    else:
        _note(ax, "no profiled tasks")
    _integer_ticks(ax.yaxis)
    ax.set_xlabel(f"per-task mean {metric}")
    ax.set_ylabel("tasks")
    ax.set_title(f"Per-task mean {metric}")
    return _save(fig, path)


def mean_vs_std(points: Mapping[str, Sequence[tuple[float, float]]], path: Path, metric: str = "reward") -> Path:
    """Scatter of per-task mean vs std, one colour per agent."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    if any(points.values()):
        for agent, ps in points.items():
            ps = _thin(ps)
            ax.scatter([p[0] for p in ps], [p[1] for p in ps], s=10, alpha=0.5, label=shown(agent), rasterized=True)
        ax.legend(fontsize=8)
    else:
        _note(ax, "no profiled tasks")
    ax.set_xlabel(f"mean {metric}")
    ax.set_ylabel(f"std {metric}")
    ax.set_title(f"Per-task mean vs std of {metric}")
    return _save(fig, path)


def pass_at_k(
    curves: Mapping[str, Mapping[int, float]], path: Path, bands: Mapping[str, Mapping[int, Any]] | None = None
) -> Path:
    """pass@k (percent) against k, one line per agent with its 95% interval shaded (`bands`: {agent: {k: an
    interval with .low and .high}}); log2 x axis when k goes past 8. Ticks only at whole k."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    drawn = False
    for i, (agent, curve) in enumerate(curves.items()):
        if curve:
            ks = sorted(curve)
            ax.plot(ks, [curve[k] for k in ks], marker="o", markersize=3, label=shown(agent), color=f"C{i % 10}")
            band = (bands or {}).get(agent) or {}
            bk = [k for k in ks if k in band]
            if bk:
                ax.fill_between(
                    bk, [band[k].low for k in bk], [band[k].high for k in bk], color=f"C{i % 10}", alpha=0.15, lw=0
                )
            drawn = True
    if drawn:
        if max(max(c) for c in curves.values() if c) > 8:
            ax.set_xscale("log", base=2)  # major ticks at powers of 2: whole k
            ax.xaxis.set_major_locator(LogLocator(base=2))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        else:
            _integer_ticks(ax.xaxis)
        ax.legend(fontsize=8, title="shaded: 95% interval" if bands else None, title_fontsize=8)
        ax.set_ylim(bottom=0)
    else:
        _note(ax, "no rollout rewards in the profile")
    ax.set_xlabel("k (rollouts per task)")
    ax.set_ylabel("pass@k (%)")
    ax.set_title("pass@k per agent")
    return _save(fig, path)


def tokens_vs_reward(
    points: Mapping[str, Sequence[tuple[float, float]]], path: Path, token_field: str | None, metric: str = "reward"
) -> Path:
    """Per-task mean tokens vs mean <metric>, one colour per agent."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    if token_field and any(points.values()):
        for agent, ps in points.items():
            ps = _thin(ps)
            ax.scatter([p[0] for p in ps], [p[1] for p in ps], s=10, alpha=0.5, label=shown(agent), rasterized=True)
        ax.legend(fontsize=8)
    else:
        _note(ax, "the rollouts carry no token usage (response.usage)")
    ax.set_xlabel(f"per-task mean {token_field or 'tokens'}")
    ax.set_ylabel(f"per-task mean {metric}")
    ax.set_title(f"Tokens vs {metric}")
    return _save(fig, path)


def shard_timeline(shards: Sequence[ShardCost], path: Path) -> Path:
    """One bar per sealed shard from its start to its end (hours since the first start), coloured by attempt."""
    fig = Figure(figsize=(SIZE[0], max(SIZE[1], min(12.0, 1.5 + 0.12 * len(shards)))))
    ax = fig.add_subplot()
    if shards:
        t0 = min(s.started_at for s in shards)
        attempts = sorted({s.attempt for s in shards})
        colours = {a: f"C{i % 10}" for i, a in enumerate(attempts)}
        for a in attempts:
            mine = [s for s in shards if s.attempt == a]
            ax.barh(
                [s.shard_index for s in mine],
                [s.wall_s / 3600 for s in mine],
                left=[(s.started_at - t0) / 3600 for s in mine],
                height=0.8,
                color=colours[a],
                label=f"attempt {a}",
            )
        ax.legend(fontsize=8)
        ax.invert_yaxis()
        _integer_ticks(ax.yaxis)
    else:
        _note(ax, "no sealed shards")
    ax.set_xlabel("hours since the first shard started")
    ax.set_ylabel("shard")
    ax.set_title("Shard timeline (sealed attempt)")
    return _save(fig, path)


def throughput(series: Throughput, path: Path) -> Path:
    """Rollouts per minute over time, and rollouts in sealed shards (second axis)."""
    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    if series.rollouts_per_min:
        mids = [(a + b) / 2 / 3600 for a, b in zip(series.edges_s, series.edges_s[1:])]
        ax.plot(mids, series.rollouts_per_min, color="C0", label="rollouts / min")
        ax.set_ylabel("rollouts per minute", color="C0")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.step([e / 3600 for e in series.edges_s[1:]], series.sealed, where="post", color="C1")
        ax2.set_ylabel("rollouts in sealed shards", color="C1")
        _integer_ticks(ax2.yaxis)
    else:
        _note(ax, "no sealed shards")
    ax.set_xlabel("hours since the first shard started")
    ax.set_title("Throughput over time")
    return _save(fig, path)
