"""Curriculum selection: choose tasks by their reward statistics and write their ORIGINAL input rows.

The rules are pure functions over TaskStats and are applied in a fixed order, each to what the previous one
kept: profiled (has stats) -> label (a blend's) -> agent -> min mean -> max mean -> min std -> min mean length -> max
mean length -> drop unsolved -> drop solved -> top-k hardest. A task's length is its mean output length, the
profile's `mean/output_tokens` (Gym's mean of `response.usage.output_tokens` over the rollouts that have it); a
length bound drops a task none of whose rollouts recorded output tokens. A task is *solved* by a rollout whose metric reaches `solved_threshold` (1.0 by default):
`drop_unsolved` drops tasks no rollout solved (max < threshold), `drop_solved` drops tasks every rollout solved
(min >= threshold). `top_k_hardest` keeps the k tasks with the lowest mean (ties: higher std, then lower task
index).

Output rows are the input lines of the plan's input file, byte for byte, in input order (or, with
order="difficulty", hardest first: the `top_k_hardest` ranking); with a stats key the stats object is spliced in
before the row's closing brace, leaving every original byte in place. With stats_format="nvidia" the fields NVIDIA's
RL training blends label each prompt with are spliced in instead: `pass_rate` (passed / total), `pass_rate_total`
(the task's completed rollouts) and `pass_rate_passed` (those whose reward reaches `solved_threshold`). The input's
sha256 must equal the plan's, else nothing is written.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import orjson

from shardrun.core import stopping
from shardrun.plan.planner import Plan
from shardrun.rundir import safepaths, seal, store
from shardrun.profile import taskstats
from shardrun.core.errors import BadInput, PlanMismatch
from shardrun.core.task_rules import TaskRules, problems
from shardrun.core.gym_names import TASK_KEY
from shardrun.profile.taskstats import TaskStat


class Rules(TaskRules):
    """The per-task rules (core/task_rules.py, shared with sampling.stop_when_decided) and the two that look beyond
    one task: the spread of its rollouts (`min_std`) and the other tasks (`top_k_hardest`)."""

    min_std: float | None = None
    top_k_hardest: int | None = None
    labels: tuple[str, ...] = ()  # a blend's labels whose tasks are kept (empty: every task)
    min_mean_length: float | None = None  # keep tasks whose mean output length (LENGTH_METRIC) is at least this
    max_mean_length: float | None = None  # ... at most this

    def length_rules(self) -> bool:
        return self.min_mean_length is not None or self.max_mean_length is not None


LENGTH_METRIC = "output_tokens"
"""The profile field a task's length is read from: Gym's `response.usage.output_tokens`, per task as `mean/...`."""


@dataclass(frozen=True)
class Step:
    rule: str
    before: int
    kept: int


@dataclass(frozen=True)
class Selection:
    kept: tuple[TaskStat, ...]
    steps: tuple[Step, ...]


# ---------------------------------------------------------------- rules (pure)


def check_bounds(rules: Rules) -> None:
    """BadInput for rules no task can meet whatever the profile holds: a bound that is not a number, min above max."""
    found = problems(rules)
    if found:
        raise BadInput(found[0])
    if rules.min_std is not None and not math.isfinite(rules.min_std):
        raise BadInput(f"--min-std {rules.min_std}: must be a finite number")
    if rules.top_k_hardest is not None and rules.top_k_hardest < 1:
        raise BadInput(f"--top-k-hardest must be at least 1, got {rules.top_k_hardest}")
    if rules.min_std is not None and rules.min_std < 0:
        raise BadInput(f"--min-std must be >= 0, got {rules.min_std}")
    lo, hi = rules.min_mean_length, rules.max_mean_length
    for flag, value in (("--min-mean-length", lo), ("--max-mean-length", hi)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise BadInput(f"{flag} {value}: must be a finite number of tokens, at least 0")
    if lo is not None and hi is not None and lo > hi:
        raise BadInput(f"--min-mean-length {lo:g} is above --max-mean-length {hi:g}: no task can match")


def check_rules(rules: Rules, tasks: Sequence[TaskStat]) -> None:
    """BadInput for contradictory or unknown settings, with 'did you mean' hints."""
    check_bounds(rules)
    known = taskstats.agents(tasks)
    for a in rules.agents:
        if a not in known:
            hint = difflib.get_close_matches(a, known, n=1)
            raise BadInput(
                f"--agent {a!r}: no task in the profile belongs to it"
                + (f" (did you mean {hint[0]!r}?" if hint else " (")
                + f"{' ' if hint else ''}agents: {', '.join(known)})"
            )
    taskstats.require_metric(tasks, rules.metric)
    if rules.length_rules() and tasks and not any(t.stat("mean", LENGTH_METRIC) is not None for t in tasks):
        raise BadInput(
            f"--min-mean-length / --max-mean-length: no task has a mean/{LENGTH_METRIC} in the profile (its rollouts "
            f"carry no response.usage.output_tokens); known metrics: {', '.join(taskstats.metrics(tasks))}"
        )


def _std(t: TaskStat, metric: str) -> float:
    """A task's std; a missing one (a single rollout) counts as 0, as in Gym's profile."""
    s = t.stat("std", metric)
    return 0.0 if s is None else s


def check_labels(rules: Rules, plan: Plan) -> None:
    """BadInput for a --label the run's blend does not have (listing its labels), or any on a run without one."""
    if not rules.labels:
        return
    if not plan.blend:
        raise BadInput(f"--label {rules.labels[0]!r}: this run is not a blend (its config has no entries): no labels")
    for label in rules.labels:
        if label not in plan.labels:
            hint = difflib.get_close_matches(label, plan.labels, n=1)
            raise BadInput(
                f"--label {label!r}: the blend has no such label"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; its labels: {', '.join(plan.labels)}"
            )


def _filters(rules: Rules, label_of: Callable[[int], str | None] | None = None) -> list[tuple[str, Any]]:
    m = rules.metric
    th = rules.solved_threshold
    steps: list[tuple[str, Any]] = [(f"profiled (has mean/{m})", lambda t: t.stat("mean", m) is not None)]
    if rules.labels and label_of is not None:
        steps.append((f"--label {','.join(rules.labels)}", lambda t: label_of(t.task_index) in rules.labels))
    if rules.agents:
        steps.append((f"--agent {','.join(rules.agents)}", lambda t: rules.allows_agent(t.agent)))
    if rules.min_mean is not None:
        steps.append((f"--min-mean {rules.min_mean:g}", lambda t: rules.above_min_mean(t.stat("mean", m))))
    if rules.max_mean is not None:
        steps.append((f"--max-mean {rules.max_mean:g}", lambda t: rules.below_max_mean(t.stat("mean", m))))
    if rules.min_std is not None:
        steps.append((f"--min-std {rules.min_std:g}", lambda t: _std(t, m) >= rules.min_std))
    if rules.min_mean_length is not None:
        lo = rules.min_mean_length
        steps.append((f"--min-mean-length {lo:g}", lambda t: _length(t) >= lo))
    if rules.max_mean_length is not None:
        hi = rules.max_mean_length
        steps.append((f"--max-mean-length {hi:g}", lambda t: _length(t) <= hi))
    if rules.drop_unsolved:
        steps.append((f"--drop-unsolved (max/{m} < {th:g})", lambda t: rules.solved_by_some(_max(t, m))))
    if rules.drop_solved:
        steps.append((f"--drop-solved (min/{m} >= {th:g})", lambda t: rules.unsolved_by_some(_min(t, m))))
    return steps


def _length(t: TaskStat) -> float:
    """The task's mean output length; NaN (which meets no bound) for a task whose rollouts recorded none."""
    value = t.stat("mean", LENGTH_METRIC)
    return math.nan if value is None else value


def _max(t: TaskStat, metric: str) -> float:
    return _stat_or_mean(t, "max", metric)


def _min(t: TaskStat, metric: str) -> float:
    return _stat_or_mean(t, "min", metric)


def _stat_or_mean(t: TaskStat, name: str, metric: str) -> float:
    """The task's `name/metric`, else its mean; NaN (which meets no bound) for a task without the metric, which the
    first filter has already dropped."""
    for v in (t.stat(name, metric), t.stat("mean", metric)):
        if v is not None:
            return v
    return math.nan


def by_difficulty(tasks: Sequence[TaskStat], metric: str = "reward") -> list[TaskStat]:
    """Hardest first: the lowest mean (ties: higher std first, then lower task index)."""
    return sorted(tasks, key=lambda t: (_stat_or_mean(t, "mean", metric), -_std(t, metric), t.task_index))


def hardest(tasks: Sequence[TaskStat], k: int, metric: str = "reward") -> list[TaskStat]:
    """The k hardest tasks (by_difficulty), in task order."""
    return sorted(by_difficulty(tasks, metric)[:k], key=lambda t: t.task_index)


def choose(
    tasks: Sequence[TaskStat],
    rules: Rules,
    planned_tasks: int | None = None,
    label_of: Callable[[int], str | None] | None = None,
) -> Selection:
    """Apply the rules in order; each Step says how many tasks the rule saw and kept (`label_of`: a blend's label
    of a task index, for `rules.labels`)."""
    check_rules(rules, tasks)
    current = list(tasks)
    steps = []
    for i, (name, keep) in enumerate(_filters(rules, label_of)):
        before = planned_tasks if i == 0 and planned_tasks is not None else len(current)
        current = [t for t in current if keep(t)]
        steps.append(Step(name, before, len(current)))
    if rules.top_k_hardest is not None:
        before = len(current)
        current = hardest(current, rules.top_k_hardest, rules.metric)
        steps.append(Step(f"--top-k-hardest {rules.top_k_hardest}", before, len(current)))
    return Selection(tuple(current), tuple(steps))


# ---------------------------------------------------------------- rows (pure)


def stats_payload(t: TaskStat) -> dict[str, Any]:
    return {
        "task_index": t.task_index,
        "agent": t.agent,
        "num_rollouts": t.num_rollouts,
        "expected_num_rollouts": t.expected_num_rollouts,
        **dict(sorted(t.stats.items())),
    }


NVIDIA_FIELDS = ("pass_rate", "pass_rate_total", "pass_rate_passed")
STATS_FORMATS = ("shardrun", "nvidia")
ORDERS = ("input", "difficulty")


def nvidia_fields(t: TaskStat, solved_threshold: float = 1.0) -> dict[str, Any]:
    """NVIDIA's per-prompt labels: of the task's completed rollouts, how many reached `solved_threshold`."""
    total = len(t.rewards)
    passed = sum(1 for r in t.rewards if r >= solved_threshold)
    return {"pass_rate": passed / total if total else 0.0, "pass_rate_total": total, "pass_rate_passed": passed}


def split_terminator(raw: bytes) -> tuple[bytes, bytes]:
    """(content, line terminator); a last line without one gets b'\\n' so the output stays JSONL."""
    for term in (b"\r\n", b"\n"):
        if raw.endswith(term):
            return raw[: -len(term)], term
    return raw, b"\n"


def attach(content: bytes, key: str, payload: Any) -> bytes:
    """Splice `"key": payload` before the object's closing brace; every original byte stays where it was."""
    return attach_fields(content, {key: payload})


def attach_fields(content: bytes, fields: Mapping[str, Any]) -> bytes:
    """Splice each `"key": value` of `fields` before the object's closing brace, in order."""
    body = content.rstrip()
    if not body.endswith(b"}"):
        raise BadInput("cannot attach stats: the row does not end with '}'")
    inner = body[:-1]
    sep = b"" if inner.rstrip().endswith(b"{") else b","
    items = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v, option=orjson.OPT_SORT_KEYS) for k, v in fields.items())
    return inner + sep + items + b"}"


def subset_lines(
    lines: Iterable[bytes],
    chosen: Mapping[int, TaskStat],
    stats_key: str | None,
    source: str = "input",
    nvidia_threshold: float | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yield (task index, output line) for the input lines whose task is chosen, in input order; with
    `nvidia_threshold`, NVIDIA's pass-rate fields spliced in (counted at that threshold).

    The task index is the planner's: an explicit `_ng_task_index`, else the position among non-blank lines.
    """
    position = 0
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        content, term = split_terminator(raw)
        row = _parse(content, f"{source}:{line_no}")
        index = row.get(TASK_KEY, position)
        position += 1
        if index not in chosen:
            continue
        if nvidia_threshold is not None:
            clash = [f for f in NVIDIA_FIELDS if f in row]
            if clash:
                raise BadInput(
                    f"{source}:{line_no}: the row already has {', '.join(clash)}; select keeps every input byte and "
                    f"will not write a key twice (drop those fields from the input, or use --stats-format shardrun)"
                )
            yield index, attach_fields(content, nvidia_fields(chosen[index], nvidia_threshold)) + term
            continue
        if stats_key is None:
            yield index, content + term
            continue
        if stats_key in row:
            raise BadInput(f"{source}:{line_no}: the row already has a field {stats_key!r}; pick another --stats-key")
        yield index, attach(content, stats_key, stats_payload(chosen[index])) + term


def _parse(content: bytes, where: str) -> dict[str, Any]:
    try:
        row = orjson.loads(content)
    except orjson.JSONDecodeError as e:
        raise BadInput(f"{where}: not valid JSON: {e}") from None
    if not isinstance(row, dict):
        raise BadInput(f"{where}: a row must be a JSON object")
    return row


# ---------------------------------------------------------------- the command (edge)


@dataclass(frozen=True)
class SelectResult:
    selection: Selection
    output: Path
    rows_written: int
    input_path: Path


def _hashed_lines(path: Path, hasher: "hashlib._Hash") -> Iterator[bytes]:
    with store.open_input(path, " (the plan's input; pass --input if it moved)") as f:
        for raw in f:
            hasher.update(raw)
            yield raw


def select_run(
    run_dir: Path,
    output: Path,
    rules: Rules,
    stats_key: str | None = None,
    input_path: Path | None = None,
    stats_format: str = "shardrun",
    order: str = "input",
    undecided: str | None = None,
) -> SelectResult:
    """Choose tasks from RUN_DIR's profile and write their original input rows to `output` (atomically): in input
    order or hardest first (`order`), with shardrun's stats object under `stats_key` or NVIDIA's pass-rate fields
    (`stats_format="nvidia"`)."""
    check_bounds(rules)
    if stats_format not in STATS_FORMATS:
        raise BadInput(f"--stats-format {stats_format!r}: one of {', '.join(STATS_FORMATS)}")
    if order not in ORDERS:
        raise BadInput(f"--order {order!r}: one of {', '.join(ORDERS)}")
    if undecided is not None and undecided not in UNDECIDED:
        raise BadInput(f"--undecided {undecided!r}: one of {', '.join(UNDECIDED)}")
    nvidia = rules.solved_threshold if stats_format == "nvidia" else None
    plan = store.load_plan(run_dir)
    source = Path(input_path or plan.input.path)
    target = safepaths.output_target(Path(output), "--output", run_dir, [source, Path(plan.input.path)])
    tasks = taskstats.load_profile(run_dir)
    selection, open_tasks = run_selection(tasks, rules, plan, stopped_tasks(run_dir, plan), undecided)
    refuse_undecided(run_dir, open_tasks, undecided)
    output = Path(output)
    chosen = {t.task_index: t for t in selection.kept}
    hasher = hashlib.sha256()
    found: set[int] = set()
    target.parent.mkdir(parents=True, exist_ok=True)
    held: dict[int, bytes] = {}  # order="difficulty": the chosen rows, written once all are read
    with store.atomic_writer(target) as f:
        for index, line in subset_lines(
            _hashed_lines(source, hasher), chosen, None if nvidia is not None else stats_key, str(source), nvidia
        ):
            found.add(index)
            if order == "difficulty":
                held[index] = held.get(index, b"") + line
            else:
                f.write(line)
        for t in by_difficulty(selection.kept, rules.metric) if order == "difficulty" else ():
            f.write(held.get(t.task_index, b""))
        check_input(source, hasher.hexdigest(), plan, set(chosen) - found)
    return SelectResult(selection, output, len(found), source)


def check_input(source: Path, sha256: str, plan: Plan, missing: Iterable[int], command: str = "select") -> None:
    """PlanMismatch when the input read (`sha256` of its bytes) is not the one the run was planned from, or lacks
    tasks of the profile (`missing`): nothing of the command's output is written then."""
    if sha256 != plan.input.sha256:
        raise PlanMismatch(
            f"{source}: the input changed since it was planned (sha256 "
            f"{sha256[:12]}…, plan {plan.input.sha256[:12]}…); {command} needs the "
            f"exact input the run was planned from. Nothing was written"
        )
    absent = sorted(missing)
    if absent:
        raise PlanMismatch(
            f"{source}: task(s) {absent[:10]} of the profile are not in the input; the "
            f"profile belongs to another input. Nothing was written"
        )


def source_rows(
    plan: Plan, chosen: Mapping[int, TaskStat], input_path: Path | None = None, command: str = "select"
) -> tuple[Path, dict[int, bytes]]:
    """(the input file read, each chosen task's ORIGINAL input row: its bytes without the line terminator, the
    first line of the task where several are), from the plan's input (or `input_path`, if it moved), checked
    against the plan as `select_run` checks it."""
    source = Path(input_path or plan.input.path)
    hasher = hashlib.sha256()
    rows: dict[int, bytes] = {}
    for index, line in subset_lines(_hashed_lines(source, hasher), chosen, None, str(source)):
        rows.setdefault(index, split_terminator(line)[0])
    check_input(source, hasher.hexdigest(), plan, set(chosen) - set(rows), command)
    return source, rows


UNDECIDED = ("keep", "drop")


def refuse_undecided(run_dir: Path, open_tasks: Sequence[int], undecided: str | None) -> None:
    """BadInput naming the stopped tasks the rules are not decided on (run_selection's `open_tasks`) when the user
    did not say what to do with them (`undecided`): nothing is written then."""
    if not open_tasks or undecided in UNDECIDED:
        return
    shown = ", ".join(map(str, open_tasks[:20])) + (f" and {len(open_tasks) - 20} more" if len(open_tasks) > 20 else "")
    raise BadInput(
        f"{len(open_tasks)} task(s) stopped early by adaptive sampling are not decided by these rules on the "
        f"rollouts collected: {shown}. Collect the rest with `shardrun resume {run_dir} --fill`, or say what "
        f"to do with them: --undecided keep|drop. Nothing was written"
    )


def run_selection(
    tasks: Sequence[TaskStat], rules: Rules, plan: Plan, stopped: set[int], undecided: str | None = None
) -> tuple[Selection, list[int]]:
    """What `select` keeps of a run's profile (`stopped`: the tasks adaptive sampling stopped early), and the
    stopped tasks these rules are not decided on. Those are left out (as `--undecided drop`), or kept with
    `undecided="keep"`; `select_run` refuses to write anything when there are some and `undecided` is not given."""
    open_tasks = undecided_tasks(tasks, rules, plan, stopped)
    check_labels(rules, plan)
    selection = choose([t for t in tasks if t.task_index not in set(open_tasks)], rules, plan.num_tasks, plan.label_of)
    if open_tasks and undecided == "keep":
        extra = [t for t in tasks if t.task_index in set(open_tasks)]
        kept = tuple(sorted((*selection.kept, *extra), key=lambda t: t.task_index))
        selection = Selection(kept, (*selection.steps, Step("--undecided keep", len(extra), len(extra))))
    return selection, open_tasks


def stopped_tasks(run_dir: Path, plan: Plan) -> set[int]:
    """Tasks some sealed shard of an adaptive run skipped rollouts of, because they were decided."""
    if plan.sampling is None or plan.sampling.stop_when_decided is None:
        return set()
    out: set[int] = set()
    for spec in plan.shards:
        state = seal.check(run_dir, plan, spec.index)
        if state.sealed and state.marker:
            out.update(state.marker.skipped_decided_tasks)
    return out


def undecided_tasks(tasks: Sequence[TaskStat], rules: Rules, plan: Plan, stopped: set[int]) -> list[int]:
    """The stopped tasks whose collected rollouts do not decide what `rules` do with them (core/stopping.py): rules
    that look beyond one task, another metric than the run stopped on, or an interval that still crosses a bound."""
    sampling = plan.sampling
    if not stopped or sampling is None or sampling.stop_when_decided is None:
        return []
    beyond = rules.min_std is not None or rules.top_k_hardest is not None or rules.length_rules()
    same = rules.task_rules() == sampling.stop_when_decided and not beyond
    profiled = {t.task_index for t in tasks}
    out = [] if same else sorted(stopped - profiled)  # no rollout collected: only the run's own rules decided them
    for t in tasks:
        if t.task_index not in stopped:
            continue
        if beyond or rules.metric != sampling.stop_when_decided.metric:
            out.append(t.task_index)
            continue
        verdict = stopping.decide(
            rules.task_rules(), t.agent, _partial(t, rules.metric, sampling.metric_range), sampling.metric_range
        )
        if verdict is None:
            out.append(t.task_index)
    return sorted(out)


def fill_tasks(run_dir: Path, rules: Rules) -> list[int]:
    """The stopped tasks `rules` keep, or may keep (undecided): what `shardrun resume --fill` with a rule collects in
    full, so that a later `select` with those rules has every rollout of the tasks it writes."""
    plan = store.load_plan(run_dir)
    check_bounds(rules)
    tasks = taskstats.load_profile(run_dir)
    stopped = stopped_tasks(run_dir, plan)
    open_tasks = set(undecided_tasks(tasks, rules, plan, stopped))
    check_labels(rules, plan)
    rest = [t for t in tasks if t.task_index not in open_tasks]
    kept = {t.task_index for t in choose(rest, rules, label_of=plan.label_of).kept}
    return sorted(stopped & (kept | open_tasks))


def _partial(t: TaskStat, metric: str, metric_range: tuple[float, float]) -> stopping.Partial:
    """A stopped task as the decision sees it: its collected values (the rewards themselves for `reward`), and its
    other planned rollouts open (failed ones among them: more open rollouts only widen the interval)."""
    still_open = max(0, t.expected_num_rollouts - t.num_rollouts)
    if metric == "reward" and len(t.rewards) == t.num_rollouts:
        return stopping.Partial.of(t.rewards, 0, still_open, metric_range)
    mean, low, high = t.stat("mean", metric), t.stat("min", metric), t.stat("max", metric)
    if mean is None or low is None or high is None:
        return stopping.Partial(0, 0.0, 0.0, 0.0, 0, still_open + t.num_rollouts)
    return stopping.Partial(t.num_rollouts, mean * t.num_rollouts, low, high, 0, still_open, exact=False)


def summary_rows(result: SelectResult) -> list[tuple[str, str]]:
    rows = [(s.rule, f"kept {s.kept:,} of {s.before:,}") for s in result.selection.steps]
    rows.append(("output", f"{result.rows_written:,} rows -> {result.output}"))
    return rows


def summary_json(result: SelectResult) -> dict[str, Any]:
    return {
        "steps": [{"rule": s.rule, "before": s.before, "kept": s.kept} for s in result.selection.steps],
        "rows_written": result.rows_written,
        "output": str(result.output),
        "task_indices": [t.task_index for t in result.selection.kept],
    }
