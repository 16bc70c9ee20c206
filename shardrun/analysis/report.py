"""`shardrun report`: merged/report.html (self-contained: inline CSS, no scripts, no network) and PNGs beside it.

`gather` reads the run directory (plan, reward profile, sealed markers, failures, Gym's aggregate metrics);
everything after it is pure (headline rows, figure data, HTML) except the figure files and the HTML written at
the end. With `embed`, the PNGs are also inlined as data URIs so the HTML alone can be mailed around.
"""

from __future__ import annotations

import base64
import html
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson

from shardrun.launch import scheduler
from shardrun.rundir import cost
from shardrun.rundir import records, seal
from shardrun.rundir import store
from shardrun.profile import taskstats
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.core.terminal import shown
from shardrun.plan.planner import Plan
from shardrun.rundir.records import LaunchRecord, Seal
from shardrun.profile.taskstats import AgentSummary, TaskStat

FIGURES = (  # (name, title) in report order; store.report_figure_path(run_dir, name) is the file
    ("mean_hist", "Per-task mean reward per agent"),
    ("mean_vs_std", "Per-task mean vs std"),
    ("pass_at_k", "pass@k per agent"),
    ("tokens_vs_reward", "Tokens vs reward"),
    ("shard_timeline", "Shard timeline, coloured by attempt"),
    ("throughput", "Throughput over time"),
)
TOKEN_FIELDS = ("output_tokens", "total_tokens")


@dataclass(frozen=True)
class ReportData:
    plan: Plan
    tasks: Sequence[TaskStat]
    shards: Sequence[cost.ShardCost]
    failures: int
    key_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # agent -> Gym key_metrics
    unsealed: int = 0
    worker_cost: dict[str, Any] = field(default_factory=dict)  # cost.workers_row of the run's warm workers
    skipped_decided: int = 0  # rollouts the seals record as skipped because their task was decided (adaptive)


# ---------------------------------------------------------------- reading (edge)


def sealed_markers(run_dir: Path, plan: Plan) -> tuple[list[Seal], int]:
    """The markers of the sealed shards, and how many shards are not sealed."""
    states = [seal.check(run_dir, plan, s.index) for s in plan.shards]
    return [st.marker for st in states if st.sealed and st.marker is not None], sum(not st.sealed for st in states)


def count_lines(path: Path) -> int:
    return sum(1 for _ in store.complete_lines(path))


def read_key_metrics(path: Path) -> dict[str, dict[str, Any]]:
    """Gym's `<stem>_aggregate_metrics.json` (a list, one entry per agent) -> {agent: key_metrics}."""
    if not path.is_file():
        return {}
    try:
        data = orjson.loads(store.read_regular(path))
    except orjson.JSONDecodeError as e:
        raise BadInput(
            f"{path}: not JSON ({e}); it was edited or damaged: run `shardrun merge-and-profile` again"
        ) from None
    out = {}
    for entry in data if isinstance(data, list) else []:
        name = ((entry.get("agent_ref") or {}).get("name")) if isinstance(entry, dict) else None
        if name and isinstance(entry.get("key_metrics"), dict):
            out[name] = entry["key_metrics"]
    return out


def slurm_job_ids(launches: Sequence[LaunchRecord], plan: Plan, shards: Sequence[cost.ShardCost]) -> list[str]:
    """The sealed shards' job ids that are Slurm jobs: per the launch records (launch.py), or, for a run launched
    without them, when the plan's cluster is Slurm. Local job ids (pids) never reach sacct."""
    if launches:
        known = {j for rec in launches if rec.executor == "slurm" for j in rec.shard_jobs.values()}
    elif (plan.config.get("cluster") or {}).get("executor") == "slurm":
        known = {s.job_id for s in shards if s.job_id}
    else:
        known = set()
    return sorted(s.job_id for s in shards if s.job_id in known)


def gather(run_dir: Path, use_sacct: bool = True) -> ReportData:
    plan = store.load_plan(run_dir)
    tasks = taskstats.load_profile(run_dir)
    markers, unsealed = sealed_markers(run_dir, plan)
    shards = cost.shard_costs(markers)
    if use_sacct:
        ids = slurm_job_ids(records.read_launches(run_dir), plan, shards)
        jobs = scheduler.query_sacct(ids)
        shards = cost.with_sacct(shards, {j: jobs[j].gpu_hours for j in ids if j in jobs})
    return ReportData(
        plan,
        tasks,
        shards,
        count_lines(store.merged_failures_path(run_dir)),
        read_key_metrics(store.merged_aggregate_metrics_path(run_dir)),
        unsealed,
        cost.worker_costs(run_dir, time.time()),
        sum(m.num_skipped_decided for m in markers),
    )


# ---------------------------------------------------------------- headline (pure)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}%"


def _num(v: float | None, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def headline_rows(data: ReportData) -> list[tuple[str, str]]:
    run = cost.run_costs(data.shards)
    completed = sum(t.num_rollouts for t in data.tasks)
    rows = [
        ("tasks", f"{len(data.tasks):,} profiled of {data.plan.num_tasks:,} planned"),
        ("rollouts", f"{completed:,} completed of {data.plan.num_rollouts:,} planned"),
        (
            "failures",
            f"{data.failures:,} rows in the failures file; "
            f"{data.plan.num_rollouts - completed - data.skipped_decided:,} planned rollouts without a result",
        ),
        *([("skipped (decided)", skipped_text(data.skipped_decided, run, data.plan))] if data.skipped_decided else []),
        ("shards", f"{run.shards:,} sealed of {len(data.plan.shards):,}"),
        ("Gym", f"nemo-gym {data.plan.gym_version}" if data.plan.gym_version else "nemo-gym version not recorded"),
    ]
    rows += [r for r in cost.cost_rows(run) if r[0] != "sealed shards"]
    rows += cost.workers_rows(data.worker_cost)
    return rows


def skipped_text(skipped: int, run: cost.RunCost, plan: Plan) -> str:
    """The rollouts adaptive sampling did not run, and what they would have cost at this run's GPU-hours per
    rollout run."""
    ran = run.rollouts + run.failed
    saved = f"; about {skipped * run.gpu_hours / ran:,.2f} GPU-hours saved" if ran and run.gpu_hours else ""
    return (
        f"{skipped:,} rollouts never run because their task was decided "
        f"({100 * skipped / plan.num_rollouts:.0f}% of planned){saved}"
    )


def agent_rows(summaries: Sequence[AgentSummary], planned: Mapping[str, int] | None = None) -> list[list[str]]:
    """One row per agent; the last column is its coverage: completed rollouts of all it planned (`planned`: the
    plan's rollouts per agent, tasks without any result included)."""
    return [
        [
            s.agent,
            f"{s.tasks:,}",
            f"{s.rollouts:,} / {s.expected_rollouts:,}",
            _num(s.mean_reward),
            _pct(s.pass_at_1),
            f"{_pct(s.pass_at_k)} (k={s.k})" if s.k else "—",
            _coverage(s.rollouts, (planned or {}).get(s.agent, s.expected_rollouts)),
        ]
        for s in summaries
    ]


def _coverage(done: int, planned: int) -> str:
    return f"{done:,} of {planned:,} ({100.0 * done / planned:.1f}%)" if planned else "—"


AGENT_HEADER = [
    "agent",
    "tasks",
    "rollouts (done / planned)",
    "mean reward",
    "pass@1",
    "pass@k",
    "coverage (of planned)",
]
SHARD_HEADER = [
    "shard",
    "attempt",
    "host",
    "job",
    "GPUs",
    "wall",
    "GPU-hours",
    "rollouts",
    "rollouts/GPU-h",
    "output tok/s",
]


def shard_rows(shards: Sequence[cost.ShardCost]) -> list[list[str]]:
    return [
        [
            f"{s.shard_index:05d}",
            str(s.attempt),
            s.host or "—",
            s.job_id or "—",
            str(s.gpus),
            "unknown" if s.unknown_duration else cost.hours(s.wall_s),
            _num(s.gpu_hours),
            f"{s.num_rollouts:,}",
            _num(s.rollouts_per_gpu_hour, ",.1f"),
            _num(s.output_tokens_per_s, ",.1f"),
        ]
        for s in shards
    ]


# ---------------------------------------------------------------- figure data (pure)


def token_field(tasks: Sequence[TaskStat]) -> str | None:
    return next((f for f in TOKEN_FIELDS if any(t.stat("mean", f) is not None for t in tasks)), None)


def figure_data(tasks: Sequence[TaskStat]) -> dict[str, Any]:
    groups = taskstats.by_agent(tasks)
    tok = token_field(tasks)
    return {
        "means": {a: [m for t in ts if (m := t.stat("mean")) is not None] for a, ts in groups.items()},
        "mean_std": {
            a: [(t.stat("mean"), t.stat("std") or 0.0) for t in ts if t.stat("mean") is not None]
            for a, ts in groups.items()
        },
        "curves": {a: taskstats.pass_at_k_curve(ts) for a, ts in groups.items()},
        "tokens": {
            a: [
                (t.stat("mean", tok), t.stat("mean"))
                for t in ts
                if tok and t.stat("mean", tok) is not None and t.stat("mean") is not None
            ]
            for a, ts in groups.items()
        },
        "token_field": tok,
    }


def draw_figures(run_dir: Path, data: ReportData) -> list[Path]:
    """Write every figure; returns their paths in FIGURES order."""
    try:
        from shardrun.analysis import figures
    except ImportError as e:
        raise ShardrunError(
            f"the report needs matplotlib ({e}); install it with: pip install 'shardrun[report]'"
        ) from None
    fd = figure_data(data.tasks)
    path = lambda name: store.report_figure_path(run_dir, name)  # noqa: E731
    return [
        figures.mean_histogram(fd["means"], path("mean_hist")),
        figures.mean_vs_std(fd["mean_std"], path("mean_vs_std")),
        figures.pass_at_k(fd["curves"], path("pass_at_k")),
        figures.tokens_vs_reward(fd["tokens"], path("tokens_vs_reward"), fd["token_field"]),
        figures.shard_timeline(data.shards, path("shard_timeline")),
        figures.throughput(cost.throughput(data.shards), path("throughput")),
    ]


# ---------------------------------------------------------------- HTML (pure)

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}
th{background:#f2f2f2}figure{display:inline-block;margin:.5em;vertical-align:top}img{max-width:520px}
code{background:#f4f4f4;padding:0 .2em}.warn{color:#a40}"""


def _table(header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(shown(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def _key_metrics_html(key_metrics: dict[str, dict[str, Any]]) -> str:
    if not key_metrics:
        return ""
    rows = [
        [agent, k, f"{v:.4g}" if isinstance(v, (int, float)) else str(v)]
        for agent, km in sorted(key_metrics.items())
        for k, v in sorted(km.items())
    ]
    return "<h2>Gym key metrics</h2>" + _table(["agent", "metric", "value"], rows)


def render_html(data: ReportData, figure_srcs: Sequence[tuple[str, str, str]], generated_at: str) -> str:
    """The whole page. figure_srcs: (name, title, src) where src is a relative file name or a data URI."""
    warn = (
        f"<p class='warn'>{data.unsealed} shard(s) are not sealed: this report covers a partial run.</p>"
        if data.unsealed
        else ""
    )
    figs = "".join(
        f"<figure id='{html.escape(n)}'><img src='{html.escape(src)}' alt='{html.escape(t)}'>"
        f"<figcaption>{html.escape(t)}</figcaption></figure>"
        for n, t, src in figure_srcs
    )
    return "".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            f"<title>shardrun report {html.escape(data.plan.fingerprint[:12])}</title><style>{CSS}</style></head><body>",
            "<h1>shardrun report</h1>",
            f"<p>plan <code>{html.escape(data.plan.fingerprint[:12])}</code> · input "
            f"<code>{html.escape(shown(data.plan.input.path))}</code> · generated {html.escape(generated_at)}</p>",
            warn,
            "<h2>Headline</h2>",
            _table(None, headline_rows(data)),
            "<h2>Per agent</h2>",
            _table(
                AGENT_HEADER,
                agent_rows(
                    taskstats.agent_summaries(data.tasks), {a: int(c["rollouts"]) for a, c in data.plan.agents.items()}
                ),
            ),
            _key_metrics_html(data.key_metrics),
            "<h2>Figures</h2>",
            figs,
            "<h2>Shards</h2><details><summary>cost per sealed shard</summary>",
            _table(SHARD_HEADER, shard_rows(data.shards)),
            "</details>",
            "</body></html>\n",
        ]
    )


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


# ---------------------------------------------------------------- the command (edge)


@dataclass(frozen=True)
class ReportResult:
    html: Path
    figures: tuple[Path, ...]
    data: ReportData


def build_report(run_dir: Path, embed: bool = False, use_sacct: bool = True) -> ReportResult:
    """Write merged/report.html and its PNGs; returns their paths."""
    run_dir = Path(run_dir)
    data = gather(run_dir, use_sacct)
    paths = draw_figures(run_dir, data)
    srcs = [(name, title, data_uri(p.read_bytes()) if embed else p.name) for (name, title), p in zip(FIGURES, paths)]
    page = render_html(data, srcs, time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    out = store.report_path(run_dir)
    store.atomic_write_bytes(out, page.encode())
    _shareable([out, *paths])
    return ReportResult(out, tuple(paths), data)


def _shareable(paths: Sequence[Path]) -> None:
    """Atomic writes leave 0600 temp-file modes; a report is meant to be read by others: 0666 minus umask."""
    umask = os.umask(0)
    os.umask(umask)
    for p in paths:
        os.chmod(p, 0o666 & ~umask)


def summary_rows(result: ReportResult) -> list[tuple[str, str]]:
    rows = headline_rows(result.data)
    for s in taskstats.agent_summaries(result.data.tasks):
        rows.append(
            (
                f"  agent {s.agent}",
                f"mean reward {_num(s.mean_reward)}, pass@1 {_pct(s.pass_at_1)}, pass@{s.k} {_pct(s.pass_at_k)}",
            )
        )
    rows.append(("report", str(result.html)))
    return rows
