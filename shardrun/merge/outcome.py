"""What a merge saw and did: per shard, per agent and for the run (data), and its text for the terminal (pure).

`MergeSummary` is returned by `profile.merge_and_profile` and saved as merged/merge_summary.json. Each shard
keeps its whole `.done` marker, so accounting built on the markers (GPU-hours, tokens, wall time) can be added
without reading the run directory again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardrun.core.terminal import shown
from shardrun.plan.render import table
from shardrun.rundir import cost
from shardrun.rundir.ledger import FailedRollout, class_text, unreliable_lines
from shardrun.rundir.records import FailureTally, LabelResult, Seal

MAX_LISTED_FAILED = 1000
SHOWN_FAILED = 10


@dataclass
class MergedShard:
    """What the merge saw of one shard and kept of it."""

    index: int
    sealed: bool
    reason: str = ""  # why the shard is not sealed ("" when sealed)
    lines: int = 0  # complete lines read from rollouts.jsonl
    kept: int = 0
    duplicates: int = 0
    foreign: int = 0  # identity not planned for this shard
    no_identity: int = 0
    unreadable: int = 0
    torn_bytes: int = 0
    renumbered: bool = False
    failure_rows: int = 0
    marker: Seal | None = None
    failure_rows_rejected: int = 0  # sidecar rows without a planned identity

    @property
    def rejected(self) -> int:
        return self.foreign + self.no_identity + self.unreadable

    @property
    def gpu_hours(self) -> float:
        return cost.shard_cost(self.marker).gpu_hours if self.marker is not None else 0.0  # 0: times go backwards


@dataclass
class AgentResult:
    name: str
    repeats: int
    tasks: int = 0
    complete: int = 0
    partial: int = 0
    missing: int = 0
    rollouts: int = 0
    expected_rollouts: int = 0
    mean_reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # pass@k etc., Gym's names, percent
    masked: int = 0  # completed rollouts left out of the quality metrics (Gym 0.7's mask_sample)


@dataclass
class MergeSummary:
    run_dir: str
    fingerprint: str
    allow_partial: bool
    shards: list[MergedShard] = field(default_factory=list)
    agents: list[AgentResult] = field(default_factory=list)
    tasks: int = 0
    tasks_complete: int = 0
    tasks_partial: int = 0
    tasks_missing: int = 0
    rollouts: int = 0
    expected_rollouts: int = 0
    masked_rollouts: int = 0  # completed, left out of the quality metrics (Gym 0.7's mask_sample)
    failed: list[FailedRollout] = field(default_factory=list)  # failed for good (rundir.ledger's definition)
    failed_total: int = 0
    failure_rows: int = 0
    outputs: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    labels: list[LabelResult] = field(default_factory=list)  # a blend's labels (labels.json's, records.BlendLabels)
    failed_lanes: list[str] = field(default_factory=list)  # a blend's labels that collected nothing
    failed_ids: list[tuple[int, int]] = field(default_factory=list, repr=False)  # every failed identity
    tally: FailureTally | None = None  # failures by class, per label (merged/failures_by_class.json)

    @property
    def unreliable_labels(self) -> list[str]:
        """The labels (or the run) whose failed share is above report.unreliable_failure_rate."""
        return [g.name for g in self.tally.unreliable] if self.tally is not None else []

    @property
    def duplicates(self) -> int:
        return sum(s.duplicates for s in self.shards)

    @property
    def rejected(self) -> dict[str, int]:
        return {
            "not planned for its shard": sum(s.foreign for s in self.shards),
            "no identity": sum(s.no_identity for s in self.shards),
            "unreadable line": sum(s.unreadable for s in self.shards),
        }

    @property
    def torn_lines(self) -> int:
        return sum(1 for s in self.shards if s.torn_bytes)

    @property
    def sealed_shards(self) -> int:
        return sum(1 for s in self.shards if s.sealed)

    @property
    def gpu_hours(self) -> float:
        return sum(s.gpu_hours for s in self.shards if s.sealed)

    @property
    def run_cost(self) -> cost.RunCost:
        """Cost accounting over the sealed shards' markers (GPU-hours, rollouts per GPU-hour, tokens/s)."""
        return cost.run_costs(cost.shard_costs(s.marker for s in self.shards if s.sealed))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["failed_ids"]  # `failed` lists them (the first MAX_LISTED_FAILED)
        d["tally"] = self.tally.to_json() if self.tally is not None else None
        if self.tally is not None:
            d.update(
                failures_by_class=self.tally.by_class,
                unreliable_failure_rate=self.tally.unreliable_failure_rate,
                unreliable_labels=self.unreliable_labels,
            )
        if not self.labels:  # a run without a blend: merge_summary.json as before blends existed
            del d["labels"], d["failed_lanes"]
        else:
            d["labels"] = [r.to_json() for r in self.labels]
        for shard, row in zip(self.shards, d["shards"]):
            row["marker"] = shard.marker.to_json() if shard.marker is not None else None
        d.update(
            duplicates=self.duplicates,
            rejected=self.rejected,
            gpu_hours=self.gpu_hours,
            sealed_shards=self.sealed_shards,
            cost=cost.run_row(self.run_cost),
        )
        return d


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def pass_table(agent: AgentResult) -> str:
    """k | pass@k | pass@1[avg-of-k] | majority@k (accuracy, percent)."""
    ks = sorted(
        {
            int(k.split("@")[1].split("/")[0])
            for k in agent.metrics
            if k.startswith("pass@") and not k.startswith("pass@1[")
        }
    )
    if not ks:
        return "    (no pass@k: no scored rollouts)"
    has_majority = any(k.startswith("majority@") for k in agent.metrics)
    head = ["k", "pass@k", "pass@1[avg-of-k]"] + (["majority@k"] if has_majority else [])
    rows = [head]
    for k in ks:
        m = agent.metrics
        row = [str(k), _pct(m.get(f"pass@{k}/accuracy")), _pct(m.get(f"pass@1[avg-of-{k}]/accuracy"))]
        if has_majority:
            row.append(_pct(m.get(f"majority@{k}/accuracy")))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("    " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def render(s: MergeSummary) -> str:
    """The merge summary for the terminal."""
    rows = [
        ("run directory", shown(s.run_dir)),
        (
            "shards merged",
            f"{len(s.shards):,} ({s.sealed_shards:,} sealed"
            + (
                f", {len(s.shards) - s.sealed_shards:,} unsealed merged as partial)"
                if s.sealed_shards < len(s.shards)
                else ")"
            ),
        ),
        ("rollouts", f"{s.rollouts:,} of {s.expected_rollouts:,} planned"),
    ]
    if s.masked_rollouts:
        rows.append(("masked rollouts", f"{s.masked_rollouts:,} (completed, left out of the quality metrics)"))
    rows += [
        (
            "tasks",
            f"{s.tasks:,}: {s.tasks_complete:,} complete, {s.tasks_partial:,} partial, {s.tasks_missing:,} missing",
        ),
        ("duplicates dropped", f"{s.duplicates:,}"),
        (
            "rows rejected",
            f"{sum(s.rejected.values()):,}" + "".join(f"; {n:,} {why}" for why, n in s.rejected.items() if n),
        ),
        ("torn last lines", f"{s.torn_lines:,} (ignored)"),
        (
            "failed rollouts",
            f"{s.failed_total:,}"
            + (f": {class_text(s.tally.by_class)}" if s.tally is not None and s.failed_total else "")
            + f" ({s.failure_rows:,} failure rows in the sidecars; failures, never scores)",
        ),
        ("GPU-hours (markers)", f"{s.gpu_hours:,.2f}"),
    ]
    rows += [r for r in cost.cost_rows(s.run_cost) if r[0] not in ("sealed shards", "GPU-hours (markers)")]
    if s.timings.get("total_s") is not None:
        rows.append(("merge time", f"{s.timings['total_s']:.1f} s"))
    out = [table(rows), ""]
    for a in s.agents:
        out.append(
            f"agent {shown(a.name)} ({a.repeats} repeats): mean reward "
            f"{'—' if a.mean_reward is None else format(a.mean_reward, '.4f')}; tasks {a.complete:,} "
            f"complete, {a.partial:,} partial, {a.missing:,} missing; {a.rollouts:,}/"
            f"{a.expected_rollouts:,} rollouts" + (f" ({a.masked:,} masked)" if a.masked else "")
        )
        out.append(pass_table(a))
    if s.failed:
        out.append("")
        out.append("failed rollouts (task:rollout, shard, class, reason):")
        for f in s.failed[:SHOWN_FAILED]:
            out.append(
                f"  {f.task}:{f.rollout}  shard {f.shard:05d}  {f.failure_class}  {shown(f.reason)} "
                f"({f.attempts} attempt(s))"
            )
        if s.failed_total > SHOWN_FAILED:
            out.append(f"  ... and {s.failed_total - SHOWN_FAILED:,} more (merged/rollouts_failures.jsonl)")
    unsealed = [x for x in s.shards if not x.sealed]
    if unsealed:
        out.append("")
        out.append("unsealed shards merged as partial:")
        for x in unsealed[:SHOWN_FAILED]:
            out.append(f"  {x.index:05d}: {shown(x.reason)}")
        if len(unsealed) > SHOWN_FAILED:
            out.append(f"  ... and {len(unsealed) - SHOWN_FAILED:,} more")
    if s.labels:
        out += ["", *label_lines(s)]
    out += unreliable_lines(s.tally)
    for w in s.warnings:
        out.append(f"warning: {shown(w)}")
    out.append("")
    out.append("outputs:")
    out += [f"  {p}" for p in s.outputs.values()]
    if s.labels:
        out.append(f"  {s.run_dir}/merged/labels.json and merged/by_label/<label>/ ({len(s.labels):,} labels)")
    return "\n".join(out)


def label_lines(s: MergeSummary) -> list[str]:
    """A blend's labels (merged/labels.json's rows) for the terminal, each failed lane named."""
    rows = [("label", "agent", "rollouts", "failed", "skipped", "tasks c/p/m", "mean reward", "pass@1", "per GPU-h")]
    for r in s.labels:
        mean, pass1, rate = r.mean_reward, r.pass_at_1, r.rate.rollouts_per_gpu_hour
        rows.append(
            (
                shown(r.label),
                shown(r.agent),
                f"{r.collected:,}/{r.rollouts_planned:,}",
                f"{r.failed:,}"
                + (f" ({class_text(r.failures)})" if r.failures else "")
                + (" !" if r.unreliable else ""),
                f"{r.skipped:,}",
                f"{r.tasks_complete:,}/{r.tasks_partial:,}/{r.tasks_missing:,}",
                "—" if mean is None else f"{mean:.4f}",
                "—" if pass1 is None else f"{pass1:.4f}",
                "—" if rate is None else f"{rate:,.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["labels:"] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    out += [f"error: label {shown(label)} collected nothing: that lane failed" for label in s.failed_lanes]
    return out
