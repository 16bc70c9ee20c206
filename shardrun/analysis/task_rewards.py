"""The per-task reward picture for the terminal: `shardrun profile`, and the short version that ends
`merge-and-profile` and `report`.

Per group (each agent, or each label of a blend): how many tasks have a mean reward, the mean of those per-task
means (every task counts once, unlike Gym's agent mean, which weighs tasks by their rollouts), their spread (min,
quartiles, max; numpy's linear percentiles, pandas' `quantile`), the mean of the per-task std (a task without
one, where Gym left it out, is skipped as pandas skips NaN), and how many tasks are never / sometimes / always
solved (core/task_rules.py's buckets over each task's rollout rewards, as `report`, `select --drop-unsolved
--drop-solved` and `compare` count them). Then the N hardest tasks (`select`'s difficulty order: lowest mean, then
higher std, then lower task index: the tasks `select --top-k-hardest N` keeps) and the N easiest (highest mean,
then lower std, then lower task index), each with its agent (and label), mean, std, rollouts and a short preview
of its prompt (the last user message of its profile row's `sample.responses_create_params.input`).

`gather` is the reading edge: the merged profile through `taskstats.load_profile` (the one checked reader of it),
and the previews of the listed tasks only, through the same reader's rows. Everything else is pure. Text from
data (agent names, labels, prompts) goes through core/terminal.py's `shown`; the JSON form stays exact.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from shardrun.analysis import selection
from shardrun.core import task_rules
from shardrun.core.errors import BadInput
from shardrun.core.gym_names import TASK_KEY
from shardrun.core.terminal import shown
from shardrun.plan.planner import Plan
from shardrun.profile import taskstats
from shardrun.profile.taskstats import TaskStat
from shardrun.rundir import store

GROUPINGS = ("agent", "label")
DEFAULT_TOP = 10
PREVIEW_CHARS = 60  # a prompt's preview on the terminal
PROMPT_CHARS = 200  # a prompt's start as the JSON form and the task lists keep it
SHARED_PREFIX_CHARS = 16  # a start the listed prompts share from this long on is shown as "…" (an instruction)
QUARTILES = ("min", "q1", "median", "q3", "max")
NO_TASK = "no task profiled"


@dataclass(frozen=True)
class GroupSummary:
    """One agent's (or label's) tasks with a mean reward, summarized."""

    name: str
    tasks: int
    mean: float | None  # the mean of the per-task mean rewards
    quartiles: Mapping[str, float] = field(default_factory=dict)  # QUARTILES of the per-task mean rewards
    mean_std: float | None = None  # the mean of the per-task std of the reward (tasks with one)
    buckets: Mapping[str, int] = field(default_factory=dict)  # never / sometimes / always solved: task counts


@dataclass(frozen=True)
class TaskLine:
    task_index: int
    agent: str
    label: str | None
    mean: float
    std: float | None
    num_rollouts: int
    prompt: str = ""  # the prompt's start on one line, PROMPT_CHARS at most (raw: shown() escapes it)


@dataclass(frozen=True)
class Picture:
    by: str
    groups: Sequence[GroupSummary]
    top: int
    hardest: Sequence[TaskLine] = ()
    easiest: Sequence[TaskLine] = ()
    unscored: int = 0  # profiled tasks without a mean reward (left out of everything above)
    labelled: bool = False  # a blend's: the task tables have a label column


# ---------------------------------------------------------------- reading (the edge)


def gather(run_dir: Path, by: str = "agent", top: int = DEFAULT_TOP) -> Picture:
    """RUN_DIR's merged profile as the picture; RunDirError (exit 2, saying to run merge-and-profile) when it was
    not merged yet, BadInput for `--by label` on a run without a blend."""
    run_dir = Path(run_dir)
    plan = store.load_plan(run_dir)
    check_by(by, plan)
    tasks = taskstats.load_profile(run_dir)
    picture = build(tasks, plan, by, top)
    wanted = {t.task_index for t in (*picture.hardest, *picture.easiest)}
    if not wanted:
        return picture
    found = previews(store.merged_reward_profiling_path(run_dir), wanted)
    return Picture(
        picture.by,
        picture.groups,
        picture.top,
        [_with_prompt(t, found) for t in picture.hardest],
        [_with_prompt(t, found) for t in picture.easiest],
        picture.unscored,
        picture.labelled,
    )


def previews(path: Path, wanted: set[int]) -> dict[int, str]:
    """The prompt preview of each wanted task, from the profile's rows (`taskstats.profile_rows`: complete lines of
    a regular file, each a JSON object), read until every wanted task was seen."""
    out: dict[int, str] = {}
    for row in taskstats.profile_rows(path):
        index = row.get(TASK_KEY)
        if index in wanted and isinstance(index, int) and not isinstance(index, bool):
            out[index] = prompt_preview(row.get("sample"))
            if len(out) == len(wanted):
                break
    return out


def _with_prompt(t: TaskLine, found: Mapping[int, str]) -> TaskLine:
    return TaskLine(t.task_index, t.agent, t.label, t.mean, t.std, t.num_rollouts, found.get(t.task_index, ""))


# ---------------------------------------------------------------- the numbers (pure)


def check_by(by: str, plan: Plan) -> None:
    if by not in GROUPINGS:
        raise BadInput(f"--by {by!r}: one of {', '.join(GROUPINGS)}")
    if by == "label" and not plan.blend:
        raise BadInput("--by label: this run is not a blend, its tasks have no labels (docs/blends.md); use --by agent")


def build(tasks: Sequence[TaskStat], plan: Plan, by: str = "agent", top: int = DEFAULT_TOP) -> Picture:
    """The picture of these profiled tasks: a summary per agent (by="agent") or per label of the plan's blend, in
    config order, a label without a profiled task included (by="label"); the `top` hardest and easiest tasks."""
    check_by(by, plan)
    scored = [t for t in tasks if _mean(t) is not None]
    labels = labels_of(scored, plan)
    if by == "agent":
        groups = [summarize(a, ts) for a, ts in taskstats.by_agent(scored).items()]
    else:
        members: dict[str, list[TaskStat]] = {label: [] for label in plan.labels}
        for t in scored:
            label = labels[t.task_index]
            if label is not None:
                members[label].append(t)
        groups = [summarize(label, ts) for label, ts in members.items()]

    def line(t: TaskStat) -> TaskLine:
        return TaskLine(
            t.task_index, t.agent, labels[t.task_index], t.stat("mean") or 0.0, t.stat("std"), t.num_rollouts
        )

    return Picture(
        by,
        groups,
        top,
        [line(t) for t in hardest(scored, top)],
        [line(t) for t in easiest(scored, top)],
        len(tasks) - len(scored),
        bool(plan.blend),
    )


def labels_of(tasks: Sequence[TaskStat], plan: Plan) -> dict[int, str | None]:
    """Each task's label in the plan's blend (None for every task of a run without one)."""
    if not plan.blend:
        return {t.task_index: None for t in tasks}
    codes = plan.label_codes([t.task_index for t in tasks])
    return {t.task_index: (plan.labels[c] if c >= 0 else None) for t, c in zip(tasks, codes.tolist())}


def _mean(t: TaskStat) -> float | None:
    return t.stat("mean")


def summarize(name: str, tasks: Sequence[TaskStat]) -> GroupSummary:
    """One group's numbers over its tasks (each with a mean reward)."""
    means = np.array([_mean(t) for t in tasks], dtype=np.float64)
    stds = [s for t in tasks if (s := t.stat("std")) is not None and math.isfinite(s)]
    if not len(means):
        return GroupSummary(name, 0, None, {}, None, dict.fromkeys(task_rules.BUCKETS, 0))
    points = np.percentile(means, [0, 25, 50, 75, 100])
    return GroupSummary(
        name,
        len(tasks),
        float(means.mean()),
        {q: float(v) for q, v in zip(QUARTILES, points)},
        float(np.mean(stds)) if stds else None,
        taskstats.bucket_counts(tasks),
    )


def hardest(tasks: Sequence[TaskStat], n: int) -> list[TaskStat]:
    """The n hardest, hardest first: `select`'s difficulty order (lowest mean, then higher std, then lower index)."""
    return selection.by_difficulty(tasks)[:n] if n > 0 else []


def easiest(tasks: Sequence[TaskStat], n: int) -> list[TaskStat]:
    """The n easiest, easiest first: highest mean, then lower std, then lower task index."""
    order = sorted(tasks, key=lambda t: (-(_mean(t) or 0.0), t.stat("std") or 0.0, t.task_index))
    return order[:n] if n > 0 else []


_WHITESPACE = re.compile(r"[ \t\r\n]+")


def prompt_preview(sample: Any, limit: int = PROMPT_CHARS) -> str:
    """The last user message of a planned row's `responses_create_params.input` (a string input as it is), on one
    line, cut to `limit` characters; "" when the row has none. Control characters other than line breaks and tabs
    are kept: the terminal's `shown` escapes them."""
    return cut(_WHITESPACE.sub(" ", _prompt_text(sample)).strip(), limit)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shared_prefix(prompts: Sequence[str]) -> int:
    """How much of their start the listed prompts share, to the last space in it (an instruction every task
    repeats), when that is at least SHARED_PREFIX_CHARS long; else 0."""
    if len(prompts) < 2:
        return 0
    first, last = min(prompts), max(prompts)
    n = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
    if n < len(first) or n < len(last):  # end it where a sentence ends in it, else at a space
        shared = first[: n + 1]
        n = max((shared.rfind(end) + len(end) for end in (". ", "? ", "! ", ": ") if end in shared), default=0)
        n = n or shared.rfind(" ") + 1
    return n if n >= SHARED_PREFIX_CHARS else 0


def terminal_preview(prompt: str, skip: int) -> str:
    """A listed prompt on the terminal: without the start all listed prompts share ("…" instead), cut."""
    return cut("…" + prompt[skip:] if skip else prompt, PREVIEW_CHARS)


def _prompt_text(sample: Any) -> str:
    params = sample.get("responses_create_params") if isinstance(sample, Mapping) else None
    given = params.get("input") if isinstance(params, Mapping) else None
    if isinstance(given, str):
        return given
    if not isinstance(given, list):
        return ""
    users = [m for m in given if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        return ""
    content = users[-1].get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, joined
        return " ".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


# ---------------------------------------------------------------- figures (pure)


def figure(v: float | None) -> str:
    """A reward figure: three decimals, never rounded onto an integer it is not (0.0004 is not shown as 0.000, nor
    0.9996 as 1.000): two significant digits near 0 (as cost.share does), more decimals near another integer."""
    if v is None or not math.isfinite(v):
        return "—"
    text = f"{v:.3f}"
    if float(text) == v or not float(text).is_integer():
        return text
    if round(v) == 0:
        return f"{v:.2g}"
    for digits in range(4, 16):
        text = f"{v:.{digits}f}"
        if not float(text).is_integer():
            return text
    return repr(v)


def percent(part: int, whole: int) -> str:
    """A share of the tasks in whole percents, never 0% for some nor 100% for not all."""
    if not whole:
        return "—"
    p = 100 * part / whole
    if 0 < p < 1:
        return "<1%"
    if 99 < p < 100:
        return ">99%"
    return f"{p:.0f}%"


# ---------------------------------------------------------------- text (pure)

SUMMARY_HEADER = ("tasks", "mean", *QUARTILES, "mean std", *task_rules.BUCKETS)


def summary_lines(picture: Picture) -> list[str]:
    """The per-group table: tasks, mean of the task means, their quartiles, the mean std, the difficulty buckets."""
    rows: list[tuple[str, ...]] = [(picture.by, *SUMMARY_HEADER)]
    for g in picture.groups:
        if not g.tasks:
            rows.append((shown(g.name), "0", NO_TASK))
            continue
        rows.append(
            (
                shown(g.name),
                f"{g.tasks:,}",
                figure(g.mean),
                *(figure(g.quartiles[q]) for q in QUARTILES),
                figure(g.mean_std),
                *(f"{g.buckets.get(b, 0):,} ({percent(g.buckets.get(b, 0), g.tasks)})" for b in task_rules.BUCKETS),
            )
        )
    lines = _columns(rows)
    if picture.unscored:
        lines.append(f"  ({picture.unscored:,} profiled task(s) without a mean reward left out)")
    return lines


def task_lines(title: str, lines: Sequence[TaskLine], with_label: bool, skip: int = 0) -> list[str]:
    """One listed task per line; `skip`: the prompts' shared start (shared_prefix), left out."""
    if not lines:
        return []
    header = ("task", "agent", *(("label",) if with_label else ()), "mean", "std", "rollouts", "prompt")
    rows = [header] + [
        (
            str(t.task_index),
            shown(t.agent),
            *((shown(t.label or "—"),) if with_label else ()),
            figure(t.mean),
            figure(t.std),
            f"{t.num_rollouts:,}",
            shown(terminal_preview(t.prompt, skip)),
        )
        for t in lines
    ]
    return [f"{title}:", *_columns(rows)]


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


TITLE = "per-task mean reward (never / sometimes / always: tasks solved by no / some / every rollout)"


def render(picture: Picture) -> str:
    """`shardrun profile`: the summary per group, then the hardest and the easiest tasks."""
    out = [f"{TITLE}, per {picture.by}:", *summary_lines(picture)]
    n = len(picture.hardest)
    skip = shared_prefix([t.prompt for t in (*picture.hardest, *picture.easiest) if t.prompt])
    if skip:
        out += [
            "",
            f"(the listed prompts all start \"{shown(cut(picture.hardest[0].prompt[:skip], PREVIEW_CHARS))}\": "
            "shown as …)",
        ]
    for title, lines in ((f"the {n} hardest", picture.hardest), (f"the {n} easiest", picture.easiest)):
        if lines:
            out += ["", *task_lines(title, lines, picture.labelled, skip)]
    return "\n".join(out)


def render_short(pictures: Sequence[Picture], run_dir: Path | str) -> str:
    """What ends `merge-and-profile` and `report`: the summary per agent (and per label of a blend), no task table."""
    out: list[str] = []
    for picture in pictures:
        out += [*([""] if out else []), f"{TITLE}, per {picture.by}:", *summary_lines(picture)]
    out.append(f"the hardest and easiest tasks: shardrun profile {shown(shlex.quote(str(run_dir)))}")
    return "\n".join(out)


def short_pictures(tasks: Sequence[TaskStat], plan: Plan) -> list[Picture]:
    """Per agent, and per label on a blend, without the task tables."""
    return [build(tasks, plan, by, 0) for by in ("agent", *(("label",) if plan.blend else ()))]


def load_short(run_dir: Path) -> str:
    """The short picture of RUN_DIR's merged profile (the edge: the plan and the profile read back, checked)."""
    run_dir = Path(run_dir)
    return render_short(short_pictures(taskstats.load_profile(run_dir), store.load_plan(run_dir)), run_dir)


# ---------------------------------------------------------------- JSON (pure)


def to_json(picture: Picture, run_dir: Path | str) -> dict[str, Any]:
    """`shardrun profile --json`: the same numbers, exact (floats in full, text as the data has it)."""

    def group(g: GroupSummary) -> dict[str, Any]:
        return {
            picture.by: g.name,
            "tasks": g.tasks,
            "mean": g.mean,
            "quartiles": dict(g.quartiles) if g.tasks else None,
            "mean_std": g.mean_std,
            "buckets": dict(g.buckets),
        }

    def task(t: TaskLine) -> dict[str, Any]:
        return {
            "task_index": t.task_index,
            "agent": t.agent,
            **({"label": t.label} if t.label is not None else {}),
            "mean": t.mean,
            "std": t.std,
            "num_rollouts": t.num_rollouts,
            "prompt": t.prompt,
        }

    return {
        "run_dir": str(run_dir),
        "by": picture.by,
        "top": picture.top,
        "groups": [group(g) for g in picture.groups],
        "hardest": [task(t) for t in picture.hardest],
        "easiest": [task(t) for t in picture.easiest],
        "unscored_tasks": picture.unscored,
    }
