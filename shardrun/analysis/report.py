"""`shardrun report`: merged/report.html (self-contained: inline CSS, no scripts, no network) and PNGs beside it.

`gather` reads the run directory (plan, reward profile, sealed markers, failures, Gym's aggregate metrics);
everything after it is pure (headline rows, figure data, HTML) except the figure files and the HTML written at
the end. With `embed`, the PNGs are also inlined as data URIs so the HTML alone can be mailed around.
"""

from __future__ import annotations

import base64
import html
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson
from pydantic import ValidationError

from shardrun.analysis import selection
from shardrun.launch import backends, scheduler
from shardrun.rundir import cost
from shardrun.rundir import ledger, records, seal
from shardrun.rundir import store
from shardrun.profile import intervals, taskstats
from shardrun.core import task_rules
from shardrun.core.config import ClusterConfig
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.core.terminal import shown, shown_lines
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
    stopped: frozenset[int] = frozenset()  # tasks adaptive sampling stopped early (selection.stopped_tasks)
    run_dir: str = "RUN_DIR"  # as the commands the report suggests name it
    tally: records.FailureTally | None = None  # failures per label and class (merged/failures_by_class.json)


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
    """The sealed shards' job ids that are Slurm jobs: per the launch records (those of a backend whose shard jobs
    Slurm accounts for), or, for a run launched without them, when the plan's cluster runs on Slurm. Local job ids
    (pids) never reach sacct."""
    if launches:
        known = {j for rec in launches if backends.for_record(rec).accounted_by_slurm for j in rec.shard_jobs.values()}
    elif planned_on_slurm(plan):
        known = {s.job_id for s in shards if s.job_id}
    else:
        known = set()
    return sorted(s.job_id for s in shards if s.job_id in known)


def planned_on_slurm(plan: Plan) -> bool:
    """Does the plan's cluster config run its jobs on Slurm (the backend it selects says)? A cluster section this
    release does not take is no Slurm run: its job ids are not asked of sacct."""
    try:
        cluster = ClusterConfig.model_validate(plan.config.get("cluster") or {})
        return backends.for_cluster(cluster).runs_on_slurm(cluster)
    except (ValidationError, BadInput):
        return False


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
        frozenset(selection.stopped_tasks(run_dir, plan)),
        str(run_dir),
        _current_tally(records.read_failure_tally(run_dir), plan),
    )


def _current_tally(tally: records.FailureTally | None, plan: Plan) -> records.FailureTally | None:
    """The merge's failure tally when it is this plan's (None: merged before failures had classes, or another
    plan's file left behind)."""
    return tally if tally is not None and tally.fingerprint == plan.fingerprint else None


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
            f"{data.plan.num_rollouts - completed - data.skipped_decided:,} planned rollouts without a result"
            + (
                f"; failed for good: {ledger.class_text(data.tally.by_class)} (failures, never scores)"
                if data.tally is not None and data.tally.by_class
                else ""
            ),
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
    """One row per agent: its tasks and rollouts, mean reward, pass@1 and pass@k with their 95% intervals
    (profile/intervals.py), how many tasks are never / sometimes / always solved (and their share of the tasks
    bucketed), and its coverage: completed rollouts of all it planned (`planned`: the plan's rollouts per agent,
    tasks without any result included)."""
    return [
        [
            s.agent,
            f"{s.tasks:,}",
            f"{s.rollouts:,} / {s.expected_rollouts:,}",
            _num(s.mean_reward),
            _with_interval(s.pass_at_1, s.pass_at_1_ci),
            f"{_with_interval(s.pass_at_k, s.pass_at_k_ci)} (k={s.k})" if s.k else "—",
            *bucket_cells(s.buckets),
            _coverage(s.rollouts, (planned or {}).get(s.agent, s.expected_rollouts)),
        ]
        for s in summaries
    ]


def _with_interval(value: float | None, ci: intervals.Interval | None) -> str:
    """`62.5% [41.7–79.2]`: a percentage and its 95% interval."""
    if value is None:
        return "—"
    return _pct(value) + (f"\u00a0[{ci.low:.1f}–{ci.high:.1f}]" if ci is not None else "")


def bucket_cells(counts: Mapping[str, int]) -> list[str]:
    """`count (share%)` for never, sometimes and always solved, shares of the tasks bucketed."""
    total = sum(counts.values())
    return [
        f"{counts.get(b, 0):,}\u00a0({100.0 * counts.get(b, 0) / total:.0f}%)" if total else "—"
        for b in task_rules.BUCKETS
    ]


def _coverage(done: int, planned: int) -> str:
    return f"{done:,} of {planned:,} ({100.0 * done / planned:.1f}%)" if planned else "—"


AGENT_HEADER = [
    "agent",
    "tasks",
    "rollouts (done / planned)",
    "mean reward",
    "pass@1 [95% CI]",
    "pass@k [95% CI]",
    "never solved",
    "sometimes solved",
    "always solved",
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


# ---------------------------------------------------------------- what select would keep (pure)

SELECT_OUTPUT = "curriculum.jsonl"


@dataclass(frozen=True)
class SelectPreview:
    """One common `shardrun select` filter on this run: the tasks it keeps per agent, and its command line."""

    title: str
    command: str
    kept: Mapping[str, int]
    undecided: int = 0  # tasks stopped early that these rules are not decided on (left out, as --undecided drop)
    error: str | None = None


def select_presets(num_tasks: int) -> list[tuple[str, selection.Rules, list[str]]]:
    """The common filters: drop what is never and always solved, a band of mean reward, the hardest quarter."""
    hardest = max(1, num_tasks // 4)
    return [
        (
            "drop never and always solved",
            selection.Rules(drop_solved=True, drop_unsolved=True),
            ["--drop-solved", "--drop-unsolved"],
        ),
        (
            "mean reward within 0.2–0.8",
            selection.Rules(min_mean=0.2, max_mean=0.8),
            ["--min-mean", "0.2", "--max-mean", "0.8"],
        ),
        (
            f"the {hardest:,} hardest (a quarter)",
            selection.Rules(top_k_hardest=hardest),
            ["--top-k-hardest", str(hardest)],
        ),
    ]


def select_previews(data: ReportData) -> list[SelectPreview]:
    """What `shardrun select` would keep with each preset, by select's own rules (selection.run_selection)."""
    out = []
    for title, rules, flags in select_presets(len(data.tasks)):
        try:
            chosen, open_tasks = selection.run_selection(data.tasks, rules, data.plan, set(data.stopped))
        except BadInput as e:
            out.append(SelectPreview(title, "", {}, error=str(e)))
            continue
        argv = ["shardrun", "select", data.run_dir, "-o", SELECT_OUTPUT, *flags]
        argv += ["--undecided", "drop"] if open_tasks else []
        kept = {a: 0 for a in taskstats.agents(data.tasks)}
        for t in chosen.kept:
            kept[t.agent] += 1
        out.append(SelectPreview(title, shlex.join(argv), kept, len(open_tasks)))
    return out


def select_rows(previews: Sequence[SelectPreview], agents: Sequence[str], totals: Mapping[str, int]) -> list[list[str]]:
    """One row per preset: tasks kept per agent (of its profiled tasks) and in all."""
    rows = []
    for p in previews:
        if p.error is not None:
            rows.append([p.title, *(["—"] * len(agents)), "—"])
            continue
        cells = [f"{p.kept.get(a, 0):,} of {totals.get(a, 0):,}" for a in agents]
        rows.append([p.title, *cells, f"{sum(p.kept.values()):,} of {sum(totals.values()):,}"])
    return rows


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
        "bands": {a: taskstats.pass_at_k_band(ts) for a, ts in groups.items()},
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


def _distinct(values: Sequence[Any]) -> int:
    return len(set(values))


def _value(v: float) -> str:
    return f"{v:.3g}"


def nothing_to_show(fd: Mapping[str, Any], shards: Sequence[cost.ShardCost]) -> dict[str, str]:
    """{figure name: the sentence shown instead of it} for the panels whose data would draw an empty or one-point
    frame: no task, every task with the same mean (and std), every rollout with the same reward, no sealed shard."""
    means = [m for ms in fd["means"].values() for m in ms]
    points = [p for ps in fd["mean_std"].values() for p in ps]
    curves = [c for c in fd["curves"].values() if c]
    tokens = [p for ps in fd["tokens"].values() for p in ps]
    notes: dict[str, str] = {}
    if not means:
        notes["mean_hist"] = notes["mean_vs_std"] = "No task has a mean reward yet: nothing to plot."
    elif _distinct(means) == 1:
        notes["mean_hist"] = f"Every one of the {len(means):,} tasks has the same mean reward, {_value(means[0])}."
    if means and _distinct(points) == 1:
        mean, std = points[0]
        notes["mean_vs_std"] = (
            f"All {len(points):,} tasks sit on one point: mean reward {_value(mean)}, std {_value(std)}."
            if len(points) > 1
            else f"One task: mean reward {_value(mean)}, std {_value(std)}."
        )
    if not curves:
        notes["pass_at_k"] = "No rollout rewards in the profile: no pass@k."
    elif all(len(c) == 1 for c in curves):
        shown = "; ".join(f"{a} {next(iter(c.values())):.1f}%" for a, c in fd["curves"].items() if c)
        notes["pass_at_k"] = f"Every task has a single rollout, so pass@k exists only at k = 1: {shown}."
    elif _distinct(points) == 1 and points[0][1] == 0:
        notes["pass_at_k"] = (
            f"Every rollout has the same reward, {_value(points[0][0])}: pass@k is "
            f"{next(iter(curves[0].values())):.1f}% at every k."
        )
    if not fd["token_field"] or not tokens:
        notes["tokens_vs_reward"] = "The rollouts carry no token usage (response.usage): no tokens vs reward."
    elif _distinct([t for t, _ in tokens]) == 1:
        notes["tokens_vs_reward"] = (
            f"Every task has the same mean {fd['token_field']}, {tokens[0][0]:,.4g}: tokens do not separate the "
            f"tasks (mean reward from {_value(min(r for _, r in tokens))} to {_value(max(r for _, r in tokens))})."
        )
    elif _distinct([r for _, r in tokens]) == 1:
        notes["tokens_vs_reward"] = (
            f"Every task has the same mean reward, {_value(tokens[0][1])}: tokens do not separate anything "
            f"(mean {fd['token_field']} per task from {min(t for t, _ in tokens):,.0f} to "
            f"{max(t for t, _ in tokens):,.0f})."
        )
    if not shards:
        notes["shard_timeline"] = notes["throughput"] = "No sealed shard yet: no timeline, no throughput."
    return notes


def draw_figures(run_dir: Path, data: ReportData) -> dict[str, Path | str]:
    """Write every figure that has something to show; returns {name: its path, or the sentence said instead}, in
    FIGURES order. A figure file left from an earlier report of a panel now empty is removed."""
    try:
        from shardrun.analysis import figures
    except ImportError as e:
        raise ShardrunError(
            f"the report needs matplotlib ({e}); install it with: pip install 'shardrun[report]'"
        ) from None
    fd = figure_data(data.tasks)
    notes = nothing_to_show(fd, data.shards)
    path = lambda name: store.report_figure_path(run_dir, name)  # noqa: E731
    draw = {
        "mean_hist": lambda p: figures.mean_histogram(fd["means"], p),
        "mean_vs_std": lambda p: figures.mean_vs_std(fd["mean_std"], p),
        "pass_at_k": lambda p: figures.pass_at_k(fd["curves"], p, fd["bands"]),
        "tokens_vs_reward": lambda p: figures.tokens_vs_reward(fd["tokens"], p, fd["token_field"]),
        "shard_timeline": lambda p: figures.shard_timeline(data.shards, p),
        "throughput": lambda p: figures.throughput(cost.throughput(data.shards), p),
    }
    out: dict[str, Path | str] = {}
    for name, _ in FIGURES:
        if name in notes:
            path(name).unlink(missing_ok=True)
            out[name] = notes[name]
        else:
            out[name] = draw[name](path(name))
    return out


# ---------------------------------------------------------------- HTML (pure)

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1180px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:.95em}td,th{border:1px solid #ccc;padding:.3em .5em;text-align:left}
th{background:#f2f2f2;vertical-align:bottom}table.metrics{font-size:.9em}
.wide{overflow-x:auto;max-width:100%}figure{display:inline-block;margin:.5em;vertical-align:top;max-width:560px}
img{max-width:100%;height:auto}code{background:#f4f4f4;padding:0 .2em;overflow-wrap:anywhere}
.warn{color:#a40}.note{color:#555;font-size:.92em}p.empty{width:480px;max-width:100%;padding:1em;border:1px dashed #bbb;
color:#555}"""


def _head(h: str) -> str:
    """A header cell that may break after each '/' or '_' (Gym's metric names are long)."""
    return "<th>" + html.escape(h).replace("/", "/<wbr>").replace("_", "_<wbr>") + "</th>"


def _table(header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> str:
    head = "<tr>" + "".join(_head(h) for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_text(shown(str(c)))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<div class='wide'><table>{head}{body}</table></div>"


def _text(c: str) -> str:
    """A cell's text; a long one may break after its underscores (agent names like math_with_judge_simple_agent)."""
    text = html.escape(c)
    return text.replace("_", "_<wbr>") if len(c) > 20 and " " not in c else text


def key_metrics_table(key_metrics: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Gym's key metrics pivoted: one row per agent, one column per metric (in Gym's order, as first seen)."""
    columns: list[str] = []
    for km in key_metrics.values():
        columns += [k for k in km if k not in columns]
    rows = [[agent, *(_metric(km.get(c)) for c in columns)] for agent, km in sorted(key_metrics.items())]
    return ["agent", *columns], rows


def _metric(v: Any) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def grouped_header(columns: Sequence[str]) -> tuple[list[tuple[str, int]], list[str]]:
    """Two header rows for metric names: the part before the first '/' once over the run of columns that share
    it (with its width), and the rest under it (`mean/reward`, `mean/output_tokens` -> `mean` over `reward`,
    `output_tokens`)."""
    top: list[tuple[str, int]] = []
    below = []
    for c in columns:
        group, _, rest = c.partition("/")
        if not rest:
            group, rest = "", c
        if top and top[-1][0] == group:
            top[-1] = (group, top[-1][1] + 1)
        else:
            top.append((group, 1))
        below.append(rest)
    return top, below


METRICS_PER_TABLE = 8  # Gym's key metrics beyond this many go on in another table below: the page never scrolls


def _key_metrics_html(key_metrics: Mapping[str, Mapping[str, Any]]) -> str:
    if not key_metrics:
        return ""
    header, rows = key_metrics_table(key_metrics)
    tables = []
    for start in range(1, len(header), METRICS_PER_TABLE):
        stop = start + METRICS_PER_TABLE
        top, below = grouped_header(header[start:stop])
        head = (
            "<tr><th rowspan='2'>agent</th>"
            + "".join(f"<th colspan='{n}'>{html.escape(g)}</th>" for g, n in top)
            + "</tr><tr>"
            + "".join(_head(b) for b in below)
            + "</tr>"
        )
        body = "".join("<tr>" + "".join(f"<td>{_text(c)}</td>" for c in [r[0], *r[start:stop]]) + "</tr>" for r in rows)
        tables.append(f"<div class='wide'><table class='metrics'>{head}{body}</table></div>")
    return (
        "<h2>Gym key metrics</h2><p class='note'>Gym's headline metrics of the merged rollouts, one row per agent "
        "(pass@k and majority@k in percent).</p>" + "".join(tables)
    )


def _agents_html(data: ReportData) -> str:
    """The per-agent table; when every agent has the same k, it is said once, in the pass@k header."""
    summaries = taskstats.agent_summaries(data.tasks)
    rows = agent_rows(summaries, {a: int(c["rollouts"]) for a, c in data.plan.agents.items()})
    header = list(AGENT_HEADER)
    ks = {s.k for s in summaries}
    if len(ks) == 1 and (k := ks.pop()):
        header[AGENT_HEADER.index("pass@k [95% CI]")] = f"pass@{k} [95% CI]"
        rows = [[c.removesuffix(f" (k={k})") for c in r] for r in rows]
    return _table(header, rows)


def label_summaries(plan: Plan, tasks: Sequence[TaskStat]) -> list[tuple[str, str, AgentSummary | None, int]]:
    """A blend's labels in config order: (label, agent, the summary of its profiled tasks as the per-agent table
    makes one, None when it has none, its planned rollouts). Empty for a run without a blend."""
    if not plan.blend:
        return []
    groups: dict[str, list[TaskStat]] = {}
    for t in tasks:
        label = plan.label_of(t.task_index)
        if label is not None:
            groups.setdefault(label, []).append(t)
    return [
        (
            e.label,
            e.agent,
            taskstats.agent_summary(e.label, groups[e.label]) if e.label in groups else None,
            e.num_rollouts,
        )
        for e in plan.blend
    ]


FAILED_LANE = "collected nothing: that lane failed"


def label_rows(plan: Plan, tasks: Sequence[TaskStat]) -> list[list[str]]:
    """One row per label: its agent, then the per-agent table's columns (agent_rows) over the label's tasks; a label
    with no profiled task is named as a failed lane."""
    rows = []
    for label, agent, summary, planned in label_summaries(plan, tasks):
        if summary is None:
            rows.append([label, agent, "0", f"0 / {planned:,}", FAILED_LANE, *["—"] * (len(AGENT_HEADER) - 4)])
        else:
            rows.append([label, agent, *agent_rows([summary], {label: planned})[0][1:]])
    return rows


LABEL_HEADER = ["label", *AGENT_HEADER]


def _labels_html(data: ReportData) -> str:
    """A blend's per-label table (none for a run without a blend)."""
    if not data.plan.blend:
        return ""
    return (
        "<h2>Per label</h2><p class='note'>A blend's entries (docs/blends.md): each label's tasks, from the plan's "
        "task ranges, with the per-agent table's columns; a label with no rollout is a failed lane.</p>"
        + _table(LABEL_HEADER, label_rows(data.plan, data.tasks))
    )


FAILURE_HEADER = ["", "planned", "failed", "failure rate", "by class", "verdict"]


def failure_rows(tally: records.FailureTally) -> list[list[str]]:
    """One row per label (or one for the run): planned and failed rollouts, the failed share, the failures by
    class, and whether the share is above the threshold (unreliable, not hard)."""
    return [
        [
            g.name,
            f"{g.planned:,}",
            f"{g.failed:,}",
            _pct(None if g.rate is None else 100 * g.rate),
            ledger.class_text(g.by_class) or "—",
            "unreliable" if g.unreliable else "ok",
        ]
        for g in tally.groups
    ]


def _failures_html(data: ReportData) -> str:
    """Failures per label (or for the run) and class, and the labels named unreliable (none without a tally)."""
    tally = data.tally
    if tally is None:
        return ""
    unreliable = [g.name for g in tally.unreliable]
    warn = (
        "<p class='warn'>Unreliable, not hard: "
        + html.escape(", ".join(unreliable) if tally.group == "label" else "the run")
        + f" (failed rollouts above report.unreliable_failure_rate {100 * tally.unreliable_failure_rate:g}% of "
        "planned): their rewards cover only the rollouts that did not fail.</p>"
        if unreliable
        else ""
    )
    return (
        "<h2>Failures per label and class</h2><p class='note'>A rollout that failed because the policy, a judge, a "
        "sandbox or the environment failed is a failure, never a reward (docs/failures.md); it is left out of "
        "the rewards above. A label whose failed share of its planned rollouts is above "
        f"{100 * tally.unreliable_failure_rate:g}% (report.unreliable_failure_rate) is unreliable.</p>"
        + warn
        + _table([tally.group, *FAILURE_HEADER[1:]], failure_rows(tally))
    )


def _select_html(data: ReportData) -> str:
    agents = taskstats.agents(data.tasks)
    if not agents:
        return ""
    previews = select_previews(data)
    totals = {a: len(ts) for a, ts in taskstats.by_agent(data.tasks).items()}
    commands = "".join(
        f"<li>{html.escape(p.title)}: "
        + (
            f"<span class='warn'>{html.escape(p.error)}</span>"
            if p.error is not None
            else f"<code>{html.escape(p.command)}</code>"
            + (
                f" <span class='note'>({p.undecided:,} task(s) stopped early by adaptive sampling are not decided "
                f"by these rules; <code>--undecided drop</code> leaves them out, or collect them with "
                f"<code>shardrun resume --fill</code>)</span>"
                if p.undecided
                else ""
            )
        )
        + "</li>"
        for p in previews
    )
    return (
        "<h2>What <code>select</code> would keep</h2>"
        "<p class='note'>Tasks kept per agent by common filters, counted by select's own rules; a task is solved by "
        "a rollout with reward &ge; 1 (<code>--solved-threshold</code>).</p>"
        + _table(["filter", *agents, "all agents"], select_rows(previews, agents, totals))
        + f"<ul>{commands}</ul>"
    )


def render_html(data: ReportData, figure_srcs: Sequence[tuple[str, str, str | None, str]], generated_at: str) -> str:
    """The whole page. figure_srcs: (name, title, src, note) where src is a relative file name or a data URI, or
    None for a panel with nothing to show, whose note is said instead."""
    warn = (
        f"<p class='warn'>{data.unsealed} shard(s) are not sealed: this report covers a partial run.</p>"
        if data.unsealed
        else ""
    )
    figs = "".join(
        f"<figure id='{html.escape(n)}'>"
        + (
            f"<img src='{html.escape(src)}' alt='{html.escape(t)}'>"
            if src is not None
            else f"<p class='empty'>{html.escape(note)}</p>"
        )
        + f"<figcaption>{html.escape(t)}</figcaption></figure>"
        for n, t, src, note in figure_srcs
    )
    return "".join(
        [
            "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            "<meta name='viewport' content='width=device-width, initial-scale=1'>",
            f"<title>shardrun report {html.escape(data.plan.fingerprint[:12])}</title><style>{CSS}</style></head><body>",
            "<h1>shardrun report</h1>",
            f"<p>plan <code>{html.escape(data.plan.fingerprint[:12])}</code> · input "
            f"<code>{html.escape(shown(data.plan.input.path))}</code> · generated {html.escape(generated_at)}</p>",
            warn,
            "<h2>Headline</h2>",
            _table(None, headline_rows(data)),
            "<h2>Per agent</h2>",
            _agents_html(data),
            "<p class='note'>pass@k at k = the most rollouts a task of the agent has, over the tasks with that many. "
            f"95% intervals (CI): {html.escape(intervals.METHOD)}. Never / sometimes / always solved: no rollout, "
            "some rollouts, every rollout of the task has reward &ge; 1; shares of the agent's tasks.</p>",
            _labels_html(data),
            _failures_html(data),
            _key_metrics_html(data.key_metrics),
            _select_html(data),
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
    figures: tuple[Path, ...]  # the figures drawn, in FIGURES order
    data: ReportData
    notes: Mapping[str, str] = field(default_factory=dict)  # figure name -> what the page says instead of it


def build_report(run_dir: Path, embed: bool = False, use_sacct: bool = True) -> ReportResult:
    """Write merged/report.html and its PNGs; returns their paths."""
    run_dir = Path(run_dir)
    data = gather(run_dir, use_sacct)
    drawn = draw_figures(run_dir, data)
    srcs: list[tuple[str, str, str | None, str]] = []
    for name, title in FIGURES:
        got = drawn[name]
        if isinstance(got, Path):
            srcs.append((name, title, data_uri(got.read_bytes()) if embed else got.name, ""))
        else:
            srcs.append((name, title, None, got))
    page = render_html(data, srcs, time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    out = store.report_path(run_dir)
    # every control character from data shown escaped, wherever on the page it lands (tabs and newlines kept)
    store.atomic_write_bytes(out, shown_lines(page).encode())
    paths = [p for p in drawn.values() if isinstance(p, Path)]
    shareable([out, *paths])
    return ReportResult(out, tuple(paths), data, {n: v for n, v in drawn.items() if isinstance(v, str)})


def shareable(paths: Sequence[Path]) -> None:
    """Atomic writes leave 0600 temp-file modes; a report is meant to be read by others: 0666 minus umask."""
    umask = os.umask(0)
    os.umask(umask)
    for p in paths:
        os.chmod(p, 0o666 & ~umask)


def summary_rows(result: ReportResult) -> list[tuple[str, str]]:
    rows = headline_rows(result.data)
    for s in taskstats.agent_summaries(result.data.tasks):
        never, sometimes, always = bucket_cells(s.buckets)
        rows.append(
            (
                f"  agent {s.agent}",
                f"mean reward {_num(s.mean_reward)}, pass@1 {_with_interval(s.pass_at_1, s.pass_at_1_ci)}, "
                f"pass@{s.k} {_with_interval(s.pass_at_k, s.pass_at_k_ci)}; solved never {never}, "
                f"sometimes {sometimes}, always {always}",
            )
        )
    for label, _, ls, _ in label_summaries(result.data.plan, result.data.tasks):
        if ls is None:
            rows.append((f"  label {label}", FAILED_LANE))
            continue
        never, sometimes, always = bucket_cells(ls.buckets)
        rows.append(
            (
                f"  label {label}",
                f"mean reward {_num(ls.mean_reward)}, pass@1 {_with_interval(ls.pass_at_1, ls.pass_at_1_ci)}, "
                f"pass@{ls.k} {_with_interval(ls.pass_at_k, ls.pass_at_k_ci)}; solved never {never}, "
                f"sometimes {sometimes}, always {always}",
            )
        )
    rows.append(("report", str(result.html)))
    return rows
