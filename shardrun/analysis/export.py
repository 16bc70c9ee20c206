"""`shardrun export`: a merged run's per-task profile where researchers look (docs/export.md).

    shardrun export RUN --to hf DIR          a Hugging Face dataset folder (Parquet + a dataset card), `--push REPO`
    shardrun export RUN --to mlflow [URI]    one MLflow run (a local file store RUN/mlruns by default)
    shardrun export RUN --to wandb [DIR]     one W&B run (offline by default, its folder under DIR, default RUN)

What every target gets is gathered once here (`gather`): the run's plan, its profile as `report` reads it (the
failures by class, Gym's key metrics), the tasks `select`'s rules keep (all of them without a rule) and each kept
task's ORIGINAL input row (`selection.source_rows`: the plan's input, its sha256 checked). From that: one record
per task (`task_records`: the profile's numbers, the pass rate, the difficulty bucket, each rollout's reward and
output length from the profile's `rollout_infos`, the source row), the run's facts (`run_facts`: checkpoint,
sampling settings, Gym version, plan fingerprint, counts, failure rates, the pass-rate histogram, the selection),
its metrics (`metrics`: per agent and per label) and its parameters (`parameters`: the plan's config, flattened).
The targets only write these down; hf_dataset.py and tracking.py hold the writers.

The libraries are optional extras (`pip install 'shardrun[hf]'`, `[mlflow]`, `[wandb]`): `need` imports one or
says which command installs it, before anything is written.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

from shardrun.analysis import report, selection
from shardrun.analysis.selection import Rules, Step
from shardrun.core import credentials
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.profile import taskstats
from shardrun.profile.taskstats import TaskStat
from shardrun.rundir import env_manifest

TARGETS = ("hf", "mlflow", "wandb")
EXTRAS = {"hf": "hf", "mlflow": "mlflow", "wandb": "wandb"}
HISTOGRAM_BINS = 10


def need(module: str, target: str) -> ModuleType:
    """The optional library `module` that `--to target` writes with; ShardrunError with the command that installs
    it when it is missing (nothing is written before)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ShardrunError(
            f"--to {target} needs the {module.split('.')[0]} package ({e}); install it with: "
            f"pip install 'shardrun[{EXTRAS[target]}]'"
        ) from None


@dataclass(frozen=True)
class ExportData:
    """A merged run as an export sees it: `data` (report.gather's: plan, every profiled task, failures by class,
    Gym's key metrics), the exported `tasks` (select's rules applied; all without one), the rules and their steps,
    and each exported task's original input row (`rows`, by task index, from `source`)."""

    run_dir: Path
    data: report.ReportData
    tasks: tuple[TaskStat, ...]
    rows: Mapping[int, bytes]
    source: Path
    rules: Rules | None = None
    steps: tuple[Step, ...] = ()
    environment: Mapping[str, Any] = field(default_factory=dict)

    @property
    def solved_threshold(self) -> float:
        return self.rules.solved_threshold if self.rules is not None else 1.0


def gather(
    run_dir: Path, rules: Rules | None = None, undecided: str | None = None, input_path: Path | None = None
) -> ExportData:
    """Read what an export holds. `rules` (select's; None or no rule set: every profiled task) choose the tasks,
    `undecided` says what to do with tasks adaptive sampling stopped early that the rules are not decided on (as
    `select --undecided`). RunDirError for a run not merged; PlanMismatch when the input is not the planned one."""
    run_dir = Path(run_dir)
    data = report.gather(run_dir, use_sacct=False)
    plan = data.plan
    chosen: Sequence[TaskStat] = data.tasks
    steps: tuple[Step, ...] = ()
    if rules is not None and rules != Rules():
        selection.check_bounds(rules)
        if undecided is not None and undecided not in selection.UNDECIDED:
            raise BadInput(f"--undecided {undecided!r}: one of {', '.join(selection.UNDECIDED)}")
        picked, open_tasks = selection.run_selection(data.tasks, rules, plan, set(data.stopped), undecided)
        selection.refuse_undecided(run_dir, open_tasks, undecided)
        chosen, steps = picked.kept, picked.steps
    else:
        rules = None
    source, rows = selection.source_rows(plan, {t.task_index: t for t in chosen}, input_path, "export")
    return ExportData(run_dir, data, tuple(chosen), rows, source, rules, steps, env_manifest.read(run_dir) or {})


# ---------------------------------------------------------------- per task (pure)


def task_records(ex: ExportData, source_rows: bool = True) -> list[dict[str, Any]]:
    """One record per exported task, in task order: identity, agent, a blend's label (None otherwise), completion,
    NVIDIA's pass-rate fields (`pass_rate` = rollouts reaching the solved threshold / completed rollouts), the
    difficulty bucket, every `<stat>/<field>` of the profile (taskstats.stat_columns), each completed rollout's
    reward and output length (`response.usage.output_tokens`; None where the rollout has none), in rollout-index
    order, and (`source_rows`) the task's original input row as text."""
    plan = ex.data.plan
    columns = taskstats.stat_columns(ex.tasks)
    out = []
    for t in ex.tasks:
        record: dict[str, Any] = {
            "task_index": t.task_index,
            "agent": t.agent,
            "label": plan.label_of(t.task_index) if plan.blend else None,
            "num_rollouts": t.num_rollouts,
            "expected_num_rollouts": t.expected_num_rollouts,
            "stopped_early": t.task_index in ex.data.stopped,
            **selection.nvidia_fields(t, ex.solved_threshold),
            "bucket": taskstats.task_bucket(t, ex.solved_threshold),
            **{c: t.stats.get(c) for c in columns},
            "rollout_rewards": [r.reward for r in t.rollouts],
            "rollout_output_tokens": [r.output_tokens for r in t.rollouts],
        }
        if source_rows:
            record["source_row"] = ex.rows[t.task_index].decode("utf-8", errors="replace")
        out.append(record)
    return out


def pass_rate_histogram(ex: ExportData, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    """How many exported tasks have a pass rate in each of `bins` equal bins over [0, 1] (the last one closed)."""
    counts = [0] * bins
    for t in ex.tasks:
        rate = selection.nvidia_fields(t, ex.solved_threshold)["pass_rate"]
        if t.rewards:
            counts[min(bins - 1, int(rate * bins))] += 1
    edges = [round(i / bins, 6) for i in range(bins + 1)]
    return {"bin_edges": edges, "counts": counts, "solved_threshold": ex.solved_threshold}


# ---------------------------------------------------------------- the run (pure)


def model_facts(ex: ExportData) -> dict[str, Any]:
    """The checkpoint or model the rollouts came from: the run's environment.json (as launched), else its plan's
    config. A URL's password, if any, is never shown."""
    policy = ex.environment.get("policy") if isinstance(ex.environment.get("policy"), dict) else None
    if policy is None:
        cfg = ex.data.plan.config.get("policy") or {}
        vllm = cfg.get("vllm") or {}
        policy = (
            {"model": vllm.get("model"), "served_model_name": vllm.get("served_model_name")}
            if vllm
            else {"base_url": cfg.get("base_url"), "model_name": cfg.get("model_name")}
        )
    keys = ("model", "served_model_name", "model_name", "base_url")
    return {k: _public(policy[k]) for k in keys if policy.get(k) is not None}


def _public(value: Any) -> Any:
    if isinstance(value, str):
        return credentials.redact(value)
    if isinstance(value, list):
        return [_public(v) for v in value]
    return value


def sampling_facts(ex: ExportData) -> dict[str, Any]:
    """The sampling settings: repeats, the seed offset (a rollout's seed = offset + rollout index) and the
    Responses create parameters every row was sent with (temperature, top_p, max_output_tokens, ...), as launched
    (environment.json), else as planned."""
    cfg = ex.data.plan.config
    launched = ex.environment.get("gym") if isinstance(ex.environment.get("gym"), dict) else None
    gym = launched if launched is not None else (cfg.get("gym") or {})
    return {
        "num_repeats": cfg.get("num_repeats"),
        "seed_offset": cfg.get("seed_offset"),
        "responses_create_params": dict(gym.get("responses_create_params") or {}),
    }


def failure_facts(ex: ExportData) -> dict[str, Any]:
    """Failed rollouts (failed for good: never a score) by class and their share of the planned rollouts, per
    label of a blend; the planned rollouts without a result."""
    plan, tally = ex.data.plan, ex.data.tally
    completed = sum(t.num_rollouts for t in ex.data.tasks)
    skipped = ex.data.skipped_decided
    without = plan.num_rollouts - completed - skipped
    out: dict[str, Any] = {
        "rollouts_without_result": without,
        "without_result_rate": _rate(without, plan.num_rollouts),
    }
    if tally is not None:
        failed = sum(g.failed for g in tally.groups)
        out |= {
            "failed_rollouts": failed,
            "failure_rate": _rate(failed, plan.num_rollouts),
            "by_class": dict(sorted(tally.by_class.items())),
            "unreliable_failure_rate": tally.unreliable_failure_rate,
        }
        if tally.group == "label":
            out["labels"] = {
                g.name: {"failed": g.failed, "rate": g.rate, "by_class": dict(g.by_class), "unreliable": g.unreliable}
                for g in tally.groups
            }
    return out


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def selection_facts(ex: ExportData) -> dict[str, Any] | None:
    """select's rules that chose the exported tasks (the ones set) and what each step kept; None for none."""
    if ex.rules is None:
        return None
    rules = {k: v for k, v in ex.rules.model_dump().items() if v != Rules.model_fields[k].default}
    rules = {k: list(v) if isinstance(v, tuple) else v for k, v in rules.items()}
    return {
        "rules": rules,
        "steps": [{"rule": s.rule, "before": s.before, "kept": s.kept} for s in ex.steps],
    }


def run_facts(ex: ExportData) -> dict[str, Any]:
    """What the dataset card and the tracking runs say of the run, as plain data."""
    plan = ex.data.plan
    return {
        "run": ex.run_dir.name,
        "model": model_facts(ex),
        "sampling": sampling_facts(ex),
        "gym_version": plan.gym_version,
        "plan_fingerprint": plan.fingerprint,
        "input": {"file": Path(plan.input.path).name, "sha256": plan.input.sha256},
        "tasks": {"planned": plan.num_tasks, "profiled": len(ex.data.tasks), "exported": len(ex.tasks)},
        "rollouts": {
            "planned": plan.num_rollouts,
            "completed": sum(t.num_rollouts for t in ex.data.tasks),
            "exported": sum(t.num_rollouts for t in ex.tasks),
        },
        "agents": sorted({t.agent for t in ex.tasks}),
        "labels": list(plan.labels),
        "failures": failure_facts(ex),
        "pass_rate_histogram": pass_rate_histogram(ex),
        "selection": selection_facts(ex),
    }


def metrics(ex: ExportData) -> dict[str, float]:
    """The run's numbers by name, over the exported tasks: counts, failure rates, and per agent and per label of
    a blend its tasks, rollouts, mean reward (over rollouts, Gym's), pass@1 and pass@k (percent), the tasks never
    / sometimes / always solved and the mean output length; Gym's key metrics per agent (`gym/<agent>/<name>`)."""
    facts = run_facts(ex)
    out: dict[str, float] = {
        "tasks/planned": facts["tasks"]["planned"],
        "tasks/exported": facts["tasks"]["exported"],
        "rollouts/planned": facts["rollouts"]["planned"],
        "rollouts/completed": facts["rollouts"]["completed"],
        "rollouts/exported": facts["rollouts"]["exported"],
    }
    fails = facts["failures"]
    for key in ("failed_rollouts", "failure_rate", "rollouts_without_result", "without_result_rate"):
        if fails.get(key) is not None:
            out[f"failures/{key}"] = fails[key]
    for cls, n in (fails.get("by_class") or {}).items():
        out[f"failures/by_class/{cls}"] = n
    for s in taskstats.agent_summaries(ex.tasks):
        out |= _summary_metrics(f"agent/{s.agent}", s, [t for t in ex.tasks if t.agent == s.agent])
    if ex.data.plan.blend:
        plan = ex.data.plan
        for label, _, summary, _ in report.label_summaries(plan, ex.tasks):
            if summary is not None:
                mine = [t for t in ex.tasks if plan.label_of(t.task_index) == label]
                out |= _summary_metrics(f"label/{label}", summary, mine)
            group = (fails.get("labels") or {}).get(label)
            if group is not None and group["rate"] is not None:
                out[f"label/{label}/failure_rate"] = group["rate"]
    for agent, key_metrics in ex.data.key_metrics.items():
        for name, value in key_metrics.items():
            if _finite(value):
                out[f"gym/{agent}/{name}"] = float(value)
    return {k: float(v) for k, v in out.items() if _finite(v)}


def _summary_metrics(prefix: str, s: taskstats.AgentSummary, tasks: Sequence[TaskStat]) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"{prefix}/tasks": s.tasks,
        f"{prefix}/rollouts": s.rollouts,
        f"{prefix}/mean_reward": s.mean_reward,
        f"{prefix}/pass@1": s.pass_at_1,
        f"{prefix}/mean_output_tokens": taskstats.rollout_weighted_mean(tasks, "output_tokens"),
    }
    if s.k > 1:
        out[f"{prefix}/pass@{s.k}"] = s.pass_at_k
    for bucket, n in s.buckets.items():
        out[f"{prefix}/{bucket}_solved"] = n
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def parameters(ex: ExportData) -> dict[str, str]:
    """The plan's settings as flat `section.key` parameters (every config leaf that is set; lists and mappings as
    JSON), with the plan's fingerprint, Gym version, input and model; values never hold a credential."""
    import orjson

    flat: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict) and value and prefix.count(".") < 2:
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif value is not None and value != [] and value != {}:
            flat[prefix] = value

    walk({k: v for k, v in ex.data.plan.config.items() if k != "run_dir"}, "")
    facts = run_facts(ex)
    flat |= {
        "plan.fingerprint": facts["plan_fingerprint"],
        "plan.gym_version": facts["gym_version"],
        "plan.input_sha256": facts["input"]["sha256"],
        "plan.num_tasks": facts["tasks"]["planned"],
        "plan.num_rollouts": facts["rollouts"]["planned"],
        **{f"model.{k}": v for k, v in facts["model"].items()},
    }
    out = {}
    for k, v in flat.items():
        if v is None:
            continue
        text = v if isinstance(v, str) else orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()
        out[k] = credentials.redact(text)
    return out


# ---------------------------------------------------------------- names


def tracking_name(name: str) -> str:
    """A metric or parameter name as MLflow accepts it (letters, digits, `_ - . / :` and spaces): `@` reads `_at_`
    (pass@1 -> pass_at_1), `[` `.`, and every other character `_`."""
    name = name.replace("@", "_at_").replace("[", ".").replace("]", "")
    return re.sub(r"[^\w./\- :]", "_", name)
