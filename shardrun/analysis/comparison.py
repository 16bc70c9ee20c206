"""`shardrun compare BASE CAND [CAND ...] -o DIR`: merged runs side by side, task by task, with intervals.

Pairing. Two runs that planned the same input (the same sha256 in plan.json) pair by identity: task index with
task index. Otherwise (or when `key` is given) a task is known by a key read from its input row: the row's field
`key`, or by default the sha256 of its `responses_create_params` (canonical JSON, keys sorted) less what the
planner writes into every planned row (the sampling seed, the runs' `gym.responses_create_params` overrides). The
rows are the planned input's (`plan.input.path`, when it is still there with the planned sha256), else the
profile's `sample` of each task. A key two tasks of one run share is refused, naming them. Tasks profiled in only
one run are counted and listed.

Per task (one row per paired task and candidate): both means, the delta, both buckets (core/task_rules.py:
never / sometimes / always solved at `solved_threshold`), the rollouts behind each mean. A task whose sampling
stopped early (adaptive sampling) has no full mean: its mean is None and it is left out of the mean, pass@1 and
pass@k differences; its bucket is known when its rollouts already disagree (sometimes solved), else it is unknown
and left out of the flips too. Both counts are in the summary.

Per candidate and per group (every task, each agent, each label when the runs have labels): the mean reward of each
run over the tasks with both means and the difference, pass@1 and pass@k (k: the most rollouts both runs have for
every such task of the group) in percent, each difference with a paired percentile bootstrap 95% interval over
tasks (seeded); the 3x3 flip matrix of buckets; McNemar's exact test on the tasks that flipped between solved and
unsolved, for two notions of solved (by some rollout: not `never`; by every rollout: `always`).

`compare` is the reading edge; `pair`, `summarize` and the statistics are pure; `write_outputs` writes DIR.
"""

from __future__ import annotations

import hashlib
import html
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import orjson
from filelock import FileLock, Timeout

from shardrun.analysis import report, rollout_pairs, selection
from shardrun.core import task_rules
from shardrun.core.errors import BadInput, ShardrunError
from shardrun.core.gym_names import RCP_KEY, TASK_KEY
from shardrun.plan import planner
from shardrun.plan.planner import Plan
from shardrun.profile import intervals, taskstats
from shardrun.profile.taskstats import TaskStat
from shardrun.rundir import safepaths, store

TASKS_FILE = "compare_tasks.jsonl"
SUMMARY_FILE = "compare.json"
HTML_FILE = "compare.html"
CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
DEFAULT_KEY = f"sha256({RCP_KEY})"
ALL = "all"
LISTED = 50  # unpaired tasks listed by key in compare.json (all are counted)


# ---------------------------------------------------------------- one run as compared


@dataclass(frozen=True)
class Side:
    """One merged run: its plan, profiled tasks, the tasks whose sampling stopped early, the label of each task."""

    run_dir: Path
    plan: Plan
    tasks: Mapping[int, TaskStat]
    stopped: frozenset[int] = frozenset()
    labels: Mapping[int, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.run_dir)

    def complete(self, t: TaskStat) -> bool:
        """The task's mean is over every rollout it would have had: its sampling did not stop early."""
        return not (t.task_index in self.stopped and t.num_rollouts < t.expected_num_rollouts)


def task_labels(plan: Plan, task_indices: Iterable[int]) -> dict[int, str]:
    """{task index: label} from the run's plan (its blend entries' task ranges); empty for a run without labels.
    Never from folder names: whatever lies under merged/by_label/ is not taken for a label."""
    indices = np.fromiter(task_indices, dtype=np.int64)
    if not plan.blend or not len(indices):
        return {}
    codes = plan.label_codes(indices)
    return {int(t): plan.labels[c] for t, c in zip(indices, codes) if c >= 0}


MAX_REWARD = 1e12
"""The largest reward (and mean reward) compare differences: past it a sum of a few tasks could overflow a float
(1e308), and no reward a verifier gives is that large; a run holding one is refused, naming the task."""


def check_rewards(run_dir: Path, tasks: Sequence[TaskStat]) -> None:
    """BadInput naming the run and the first task whose mean reward or a reward is beyond MAX_REWARD (or infinite)."""
    for t in tasks:
        mean = t.stat("mean")
        values = ([] if mean is None or math.isnan(mean) else [("a mean reward", mean)]) + [
            ("a reward", r) for r in t.rewards if not math.isnan(r)
        ]
        big = next(((what, v) for what, v in values if not abs(v) <= MAX_REWARD), None)
        if big is not None:
            raise BadInput(
                f"{run_dir}: task {t.task_index} has {big[0]} of {big[1]:g}, beyond what compare can difference "
                f"(at most {MAX_REWARD:g} in size); the merged profile holds a reward out of any verifier's range"
            )


def read_side(run_dir: Path, fields: Sequence[str] = ()) -> Side:
    run_dir = Path(run_dir)
    plan = store.load_plan(run_dir)
    tasks = taskstats.load_profile(run_dir, fields)
    check_rewards(run_dir, tasks)
    return Side(
        run_dir,
        plan,
        {t.task_index: t for t in tasks},
        frozenset(selection.stopped_tasks(run_dir, plan)),
        task_labels(plan, (t.task_index for t in tasks)),
    )


# ---------------------------------------------------------------- keys


def key_value(row: Mapping[str, Any], key: str | None, where: str, strip: Iterable[str] = ()) -> str:
    """The key of one input row: its field `key` (a string as it is, anything else as canonical JSON), or the
    sha256 of its canonical `responses_create_params` (`task_params`)."""
    name = key or RCP_KEY
    if name not in row:
        raise BadInput(f"{where}: field {name}: missing; every row needs the key " + (f"--key {key}" if key else ""))
    if key:
        value = row[name]
        return value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return hashlib.sha256(orjson.dumps(task_params(row[name], strip), option=orjson.OPT_SORT_KEYS)).hexdigest()


def task_params(rcp: Any, strip: Iterable[str] = ()) -> Any:
    """A row's `responses_create_params` as the task's identity: less the sampling seed and the keys in `strip`
    (the runs' `gym.responses_create_params` overrides), the two things the planner writes into every planned row,
    with `metadata.extra_body` (a JSON string) read as the object it holds."""
    if not isinstance(rcp, dict):
        return rcp
    drop = set(strip)
    out = {k: v for k, v in rcp.items() if k not in drop}
    meta = out.get("metadata")
    if isinstance(meta, dict) and "extra_body" in meta:
        extra = meta["extra_body"]
        try:
            extra = orjson.loads(extra) if isinstance(extra, str) else extra
        except orjson.JSONDecodeError:
            pass
        if isinstance(extra, dict):
            extra = {k: v for k, v in extra.items() if k != "seed"}
        meta = {k: v for k, v in meta.items() if k != "extra_body"} | ({"extra_body": extra} if extra else {})
        out = {k: v for k, v in out.items() if k != "metadata"} | ({"metadata": meta} if meta else {})
    return out


def rcp_overrides(plan: Plan) -> set[str]:
    """The keys the run's `gym.responses_create_params` set in every planned row (part of the plan's planning)."""
    overrides = plan.planning.get("responses_create_params")
    if overrides is None:
        overrides = (plan.config.get("gym") or {}).get("responses_create_params")
    return set(overrides or {})


def task_keys(side: Side, key: str | None, strip: Iterable[str] = ()) -> tuple[dict[int, str], str]:
    """{task index: key} for the run's profiled tasks, and where the keys were read. BadInput when a key is shared
    by two tasks (naming them) or a row lacks the field."""
    source = Path(side.plan.input.path)
    where_of: dict[int, str] = {}
    keys: dict[int, str] = {}
    if source.is_file() and store.sha256_file(source) == side.plan.input.sha256:
        position = 0
        for line_no, raw in store.read_lines(source):
            if not raw.strip():
                continue
            row = planner.parse_line(raw, line_no, str(source))
            index = row.get(TASK_KEY, position)
            position += 1
            keys[index] = key_value(row, key, f"{source}:{line_no}", strip)
            where_of[index] = f"line {line_no}"
        origin = str(source)
    else:
        for index, t in side.tasks.items():
            where = f"{store.merged_reward_profiling_path(side.run_dir)}: task {index}"
            keys[index] = key_value(t.inputs, key, where, strip)
            where_of[index] = f"task {index}"
        origin = (
            f"{store.merged_reward_profiling_path(side.run_dir)} (the profile's samples: {source} is gone or changed)"
        )
    _refuse_duplicates(keys, where_of, key, origin)
    return {i: k for i, k in keys.items() if i in side.tasks}, origin


def _refuse_duplicates(keys: Mapping[int, str], where: Mapping[int, str], key: str | None, origin: str) -> None:
    holders: dict[str, list[int]] = {}
    for index, k in keys.items():
        holders.setdefault(k, []).append(index)
    dups = [(k, ts) for k, ts in holders.items() if len(ts) > 1]
    if not dups:
        return
    shown = [
        f"{_short(k)} is the key of tasks {', '.join(f'{i} ({where[i]})' for i in sorted(ts))}"
        for k, ts in sorted(dups, key=lambda d: min(d[1]))[:10]
    ]
    raise BadInput(
        f"{origin}: --key {key or DEFAULT_KEY} is not unique ({len(dups)} key(s) shared by several tasks); "
        "tasks cannot be paired by it. Pass a field that names one task, e.g. --key id",
        shown + ([f"... and {len(dups) - 10} more"] if len(dups) > 10 else []),
    )


def _short(key: str, width: int = 60) -> str:
    return repr(key if len(key) <= width else key[: width - 1] + "…")


# ---------------------------------------------------------------- pairing (pure)


@dataclass(frozen=True)
class TaskPair:
    """One task in both runs. Means are None for a task whose sampling stopped early; buckets None when unknown."""

    key: str | int
    base: TaskStat
    cand: TaskStat
    base_complete: bool
    cand_complete: bool
    bucket_base: str | None
    bucket_cand: str | None
    label: str | None = None

    @property
    def agent(self) -> str:
        return self.base.agent

    @property
    def mean_base(self) -> float | None:
        return self.base.stat("mean") if self.base_complete else None

    @property
    def mean_cand(self) -> float | None:
        return self.cand.stat("mean") if self.cand_complete else None

    @property
    def delta(self) -> float | None:
        b, c = self.mean_base, self.mean_cand
        return None if b is None or c is None else c - b

    @property
    def in_means(self) -> bool:
        return self.delta is not None

    def row(self, candidate: str, with_label: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "candidate": candidate,
            "key": self.key,
            "task_index_base": self.base.task_index,
            "task_index_cand": self.cand.task_index,
            "agent": self.agent,
        }
        if self.cand.agent != self.base.agent:
            out["agent_cand"] = self.cand.agent
        if with_label:
            out["label"] = self.label
        return out | {
            "mean_base": self.mean_base,
            "mean_cand": self.mean_cand,
            "delta": self.delta,
            "bucket_base": self.bucket_base,
            "bucket_cand": self.bucket_cand,
            "rollouts_base": self.base.num_rollouts,
            "rollouts_cand": self.cand.num_rollouts,
            "planned_rollouts_base": self.base.expected_num_rollouts,
            "planned_rollouts_cand": self.cand.expected_num_rollouts,
            "stopped_early_base": not self.base_complete,
            "stopped_early_cand": not self.cand_complete,
        }


def task_bucket(side: Side, t: TaskStat, threshold: float) -> str | None:
    low = t.stat("min") if t.stat("min") is not None else min(t.rewards, default=None)
    high = t.stat("max") if t.stat("max") is not None else max(t.rewards, default=None)
    return task_rules.bucket(low, high, threshold, side.complete(t))


@dataclass(frozen=True)
class Pairing:
    mode: str  # "identity", or the key: a field name or DEFAULT_KEY
    pairs: tuple[TaskPair, ...]
    only_base: tuple[tuple[str | int, int], ...]  # (key, task index), in key order
    only_cand: tuple[tuple[str | int, int], ...]
    key_sources: tuple[str, ...] = ()


def pair(
    base: Side,
    cand: Side,
    threshold: float = 1.0,
    keys: tuple[Mapping[int, str], Mapping[int, str]] | None = None,
    mode: str = "identity",
) -> Pairing:
    """Pair the tasks of two runs: by task index (keys None), else by the given {task index: key} of each run."""
    kb: Mapping[int, str | int] = keys[0] if keys else {i: i for i in base.tasks}
    kc: Mapping[int, str | int] = keys[1] if keys else {i: i for i in cand.tasks}
    by_key_c = {k: i for i, k in kc.items()}
    pairs = []
    for ib, k in sorted(kb.items(), key=lambda item: item[0]):
        ic = by_key_c.get(k)
        if ic is None:
            continue
        tb, tc = base.tasks[ib], cand.tasks[ic]
        pairs.append(
            TaskPair(
                k,
                tb,
                tc,
                base.complete(tb),
                cand.complete(tc),
                task_bucket(base, tb, threshold),
                task_bucket(cand, tc, threshold),
                base.labels.get(ib) or cand.labels.get(ic),
            )
        )
    in_b = set(kb.values())
    only_b = tuple(sorted(((k, i) for i, k in kb.items() if k not in by_key_c), key=lambda x: str(x[0])))
    only_c = tuple(sorted(((k, i) for i, k in kc.items() if k not in in_b), key=lambda x: str(x[0])))
    if keys is None:
        only_b = tuple(sorted(only_b, key=lambda x: x[1]))
        only_c = tuple(sorted(only_c, key=lambda x: x[1]))
    return Pairing(mode, tuple(pairs), only_b, only_c)


def pair_runs(base: Side, cand: Side, key: str | None, threshold: float) -> Pairing:
    """Identity when both runs planned the same input and no key is asked for; else by key."""
    if key is None and base.plan.input.sha256 == cand.plan.input.sha256:
        return pair(base, cand, threshold)
    strip = rcp_overrides(base.plan) | rcp_overrides(cand.plan)
    kb, src_b = task_keys(base, key, strip)
    kc, src_c = task_keys(cand, key, strip)
    p = pair(base, cand, threshold, (kb, kc), key or DEFAULT_KEY)
    return Pairing(p.mode, p.pairs, p.only_base, p.only_cand, (src_b, src_c))


# ---------------------------------------------------------------- statistics (pure)


def bootstrap_interval(
    diffs: Sequence[float] | np.ndarray, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """The paired percentile bootstrap 95% interval of the mean of per-task differences: the one percentile
    bootstrap over tasks (profile/intervals.py, the report's too) applied to the paired differences, so each
    resample keeps a task's base and candidate together. Seeded: the same inputs give the same interval. None
    without tasks."""
    ci = intervals.bootstrap_mean(diffs, resamples=resamples, seed=seed, level=CONFIDENCE)
    return None if ci is None else (ci.low, ci.high)


def mcnemar_exact(lost: int, gained: int) -> float:
    """McNemar's exact test: under no change each discordant task (solved in one run only) is gained or lost with
    probability 1/2; the two-sided p-value is twice the binomial tail of the smaller count, at most 1."""
    n = lost + gained
    if n == 0:
        return 1.0
    from scipy import stats

    return float(min(1.0, 2.0 * stats.binom.cdf(min(lost, gained), n, 0.5)))


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _difference(
    base: Sequence[float], cand: Sequence[float], resamples: int, seed: int, scale: float = 1.0
) -> dict[str, Any]:
    diffs = [c - b for b, c in zip(base, cand)]
    ci = bootstrap_interval(diffs, resamples, seed)
    mb, mc = _mean(base), _mean(cand)
    return {
        "tasks": len(diffs),
        "base": None if mb is None else scale * mb,
        "cand": None if mc is None else scale * mc,
        "delta": None if mb is None or mc is None else scale * (mc - mb),
        "ci95": None if ci is None else [scale * ci[0], scale * ci[1]],
    }


def flip_matrix(pairs: Sequence[TaskPair]) -> dict[str, dict[str, int]]:
    """{base bucket: {candidate bucket: tasks}} over the pairs whose buckets are both known."""
    out = {b: {c: 0 for c in task_rules.BUCKETS} for b in task_rules.BUCKETS}
    for p in pairs:
        if p.bucket_base is not None and p.bucket_cand is not None:
            out[p.bucket_base][p.bucket_cand] += 1
    return out


def solved_test(matrix: Mapping[str, Mapping[str, int]], solved: Sequence[str]) -> dict[str, Any]:
    """McNemar on the flips between `solved` buckets and the others."""
    unsolved = [b for b in task_rules.BUCKETS if b not in solved]
    lost = sum(matrix[b][c] for b in solved for c in unsolved)
    gained = sum(matrix[b][c] for b in unsolved for c in solved)
    return {"solved": list(solved), "gained": gained, "lost": lost, "p_value": mcnemar_exact(lost, gained)}


def _pass(t: TaskStat, k: int) -> float:
    value = taskstats.task_pass_at_k(t.rewards, k)
    assert value is not None  # callers pass tasks with at least k rewards
    return value


def group_summary(name: str, kind: str, pairs: Sequence[TaskPair], resamples: int, seed: int) -> dict[str, Any]:
    """Everything compare.json says of one group of paired tasks."""
    full = [p for p in pairs if p.in_means]
    k = min(taskstats.max_k([p.base for p in full]), taskstats.max_k([p.cand for p in full]))
    matrix = flip_matrix(pairs)
    per_k: dict[str, Any] = {"k": k or None}
    if k:  # the tasks with at least k scored rollouts in both runs (`aggregate.pass_at_k`'s rule)
        at_k = [p for p in full if min(len(p.base.rewards), len(p.cand.rewards)) >= k]
        per_k |= _difference([_pass(p.base, k) for p in at_k], [_pass(p.cand, k) for p in at_k], resamples, seed, 100.0)
    scored = [p for p in full if p.base.rewards and p.cand.rewards]
    return {
        "group": name,
        "kind": kind,
        "tasks_paired": len(pairs),
        "tasks_in_means": len(full),
        "left_out_stopped_early": sum(not (p.base_complete and p.cand_complete) for p in pairs),
        "mean_reward": _difference(
            [p.mean_base for p in full if p.mean_base is not None],
            [p.mean_cand for p in full if p.mean_cand is not None],
            resamples,
            seed,
        ),
        "pass_at_1": _difference(
            [_pass(p.base, 1) for p in scored],
            [_pass(p.cand, 1) for p in scored],
            resamples,
            seed,
            100.0,
        ),
        "pass_at_k": per_k,
        "flips": matrix,
        "bucket_unknown": sum(p.bucket_base is None or p.bucket_cand is None for p in pairs),
        "mcnemar": {
            "ever_solved": solved_test(matrix, (task_rules.SOMETIMES, task_rules.ALWAYS)),
            "always_solved": solved_test(matrix, (task_rules.ALWAYS,)),
        },
    }


def groups(pairs: Sequence[TaskPair]) -> list[tuple[str, str, list[TaskPair]]]:
    """(name, kind, pairs): every task, then each agent, then each label (when the runs have labels)."""
    out: list[tuple[str, str, list[TaskPair]]] = [(ALL, "all", list(pairs))]
    for kind, of in (("agent", lambda p: p.agent), ("label", lambda p: p.label)):
        names = sorted({of(p) for p in pairs if of(p) is not None})
        out += [(n, kind, [p for p in pairs if of(p) == n]) for n in names]
    return out


def notes(base: Side, cand: Side, pairing: Pairing, stopped_left_out: int, unknown: int) -> list[str]:
    """What a reader must know to read the numbers right: different Gym versions or repeats, early stops, tasks in
    one run only."""
    out = []
    gb, gc = base.plan.gym_version, cand.plan.gym_version
    if gb != gc:
        out.append(
            f"different NeMo Gym versions: base {gb or 'not recorded'}, candidate {gc or 'not recorded'}; "
            "compared as they are"
        )
    rb = {a: s.get("repeats") for a, s in base.plan.agents.items()}
    rc = {a: s.get("repeats") for a, s in cand.plan.agents.items()}
    differ = sorted(a for a in set(rb) & set(rc) if rb[a] != rc[a])
    if differ:
        out.append(
            "different repeats per task: "
            + "; ".join(f"{a}: base {rb[a]}, candidate {rc[a]}" for a in differ)
            + "; means rest on different numbers of rollouts and pass@k is compared at the smaller k"
        )
    if stopped_left_out:
        out.append(
            f"{stopped_left_out} paired task(s) stopped early under adaptive sampling in one run: left out of the "
            f"mean, pass@1 and pass@k differences; {stopped_left_out - unknown} of them enter the flips with a known "
            f"bucket, {unknown} have an unknown bucket and are left out of the flips too"
        )
    short = sum(
        p.in_means and any(t.num_rollouts < t.expected_num_rollouts for t in (p.base, p.cand)) for p in pairing.pairs
    )
    if short:
        out.append(
            f"{short} paired task(s) have fewer rollouts than planned in a run (failed, or merged with "
            "--allow-partial), not stopped early: compared on the rollouts there are (rollouts_base, rollouts_cand)"
        )
    if pairing.only_base or pairing.only_cand:
        out.append(
            f"{len(pairing.only_base)} task(s) only in the base run, {len(pairing.only_cand)} only in the candidate "
            "(not profiled there, or not in its input): not paired, listed under unpaired"
        )
    return out


def summarize(
    base: Side, cand: Side, pairing: Pairing, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> dict[str, Any]:
    """compare.json's entry for one candidate."""
    summaries = [group_summary(n, kind, ps, resamples, seed) for n, kind, ps in groups(pairing.pairs)]
    whole = summaries[0]
    unknown_stopped = sum((p.bucket_base is None or p.bucket_cand is None) for p in pairing.pairs if not p.in_means)
    return {
        "run_dir": cand.name,
        "pairing": pairing.mode,
        **({"key_sources": list(pairing.key_sources)} if pairing.key_sources else {}),
        "gym_version": {"base": base.plan.gym_version, "cand": cand.plan.gym_version},
        "repeats": {
            "base": {a: s.get("repeats") for a, s in base.plan.agents.items()},
            "cand": {a: s.get("repeats") for a, s in cand.plan.agents.items()},
        },
        "tasks_paired": whole["tasks_paired"],
        "unpaired": {
            "only_base": _unpaired(pairing.only_base),
            "only_cand": _unpaired(pairing.only_cand),
        },
        "notes": notes(base, cand, pairing, whole["left_out_stopped_early"], unknown_stopped),
        "groups": summaries,
    }


def _unpaired(items: Sequence[tuple[str | int, int]]) -> dict[str, Any]:
    return {
        "count": len(items),
        "tasks": [{"key": k, "task_index": i} for k, i in items[:LISTED]],
        **({"more": len(items) - LISTED} if len(items) > LISTED else {}),
    }


# ---------------------------------------------------------------- the whole comparison (edge)


@dataclass(frozen=True)
class Comparison:
    base: Side
    candidates: tuple[Side, ...]
    pairings: tuple[Pairing, ...]
    summary: dict[str, Any]

    def task_rows(self) -> list[dict[str, Any]]:
        return task_rows(self.base, self.candidates, self.pairings)


def read_and_pair(
    base: Path, candidates: Sequence[Path], key: str | None = None, solved_threshold: float = 1.0
) -> tuple[Side, tuple[Side, ...], tuple[Pairing, ...]]:
    """Read the runs and pair each candidate's tasks with the base's."""
    if not candidates:
        raise BadInput("compare needs a base run and at least one candidate run")
    if not math.isfinite(solved_threshold):
        raise BadInput(f"--solved-threshold {solved_threshold}: must be a finite number")
    fields = (key,) if key else (RCP_KEY,)
    sides = [read_side(Path(r), fields) for r in (base, *candidates)]
    b, cands = sides[0], tuple(sides[1:])
    return b, cands, tuple(pair_runs(b, c, key, solved_threshold) for c in cands)


def task_rows(base: Side, candidates: Sequence[Side], pairings: Sequence[Pairing]) -> list[dict[str, Any]]:
    """compare_tasks.jsonl's rows: per candidate, its paired tasks in the base's task order (`label` only when the
    runs have labels)."""
    labelled = any(p.label is not None for pg in pairings for p in pg.pairs)
    return [p.row(c.name, labelled) for c, pg in zip(candidates, pairings) for p in pg.pairs]


FRAME_COLUMNS = (
    "candidate",
    "key",
    "task_index_base",
    "task_index_cand",
    "agent",
    "mean_base",
    "mean_cand",
    "delta",
    "bucket_base",
    "bucket_cand",
    "rollouts_base",
    "rollouts_cand",
    "planned_rollouts_base",
    "planned_rollouts_cand",
    "stopped_early_base",
    "stopped_early_cand",
)
"""The columns of a task row (TaskPair.row), less the ones present only sometimes: `agent_cand` (a task whose
agent differs between the runs) and `label`."""


def compare(
    base: Path,
    candidates: Sequence[Path],
    key: str | None = None,
    solved_threshold: float = 1.0,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Comparison:
    """Read the runs, pair each candidate with the base, and summarize (nothing written)."""
    if resamples < 1:
        raise BadInput(f"--resamples must be at least 1, got {resamples}")
    b, cands, pairings = read_and_pair(base, candidates, key, solved_threshold)
    base_rewards = (
        rollout_pairs.read_rewards(b.run_dir) if any(rollout_pairs.same_rollouts(b.plan, c.plan) for c in cands) else {}
    )
    summary = {
        "base": b.name,
        "solved_threshold": solved_threshold,
        "buckets": list(task_rules.BUCKETS),
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": CONFIDENCE},
        "candidates": [
            summarize(b, c, pg, resamples, seed) | rollouts_entry(b, c, base_rewards) for c, pg in zip(cands, pairings)
        ],
    }
    return Comparison(b, cands, pairings, summary)


def rollouts_entry(base: Side, cand: Side, base_rewards: Mapping[tuple[int, int], tuple[str, float]]) -> dict:
    """{"rollouts": the rollout-by-rollout pairing} when the two runs hold the same rollouts (a run and its
    re-score: rollout_pairs.py), else {}."""
    if not rollout_pairs.same_rollouts(base.plan, cand.plan):
        return {}
    return {"rollouts": rollout_pairs.pair(base_rewards, rollout_pairs.read_rewards(cand.run_dir), base.labels)}


@dataclass(frozen=True)
class CompareResult:
    comparison: Comparison
    out_dir: Path
    tasks: Path
    summary: Path
    html: Path
    figures: tuple[Path, ...]


FIGURE_NAME = re.compile(r"compare_(?:means|deltas|flips)_[0-9]+\.png")
OUT_LOCK = ".compare.lock"
OUT_LOCK_S = 600.0  # how long a compare waits for another one writing into the same -o


def check_out_dir(out_dir: Path | str, runs: Sequence[Path]) -> Path:
    """DIR, checked before anything is read or written: a path (not ""), not a file, and its files are outputs
    shardrun may write (not inside a run directory, not a device, a link to one or a directory: rundir/safepaths.py)."""
    if not str(out_dir).strip():
        raise BadInput('-o "": an empty path; name the folder for compare\'s outputs (-o . for this one)')
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"-o {out_dir}: exists and is not a directory")
    for name in (TASKS_FILE, SUMMARY_FILE, HTML_FILE):
        for r in runs:
            safepaths.output_target(out_dir / name, "-o", Path(r))
    return out_dir


def is_output(name: str) -> bool:
    """Whether a file of -o is one that compare writes (its tables, page and figures)."""
    return name in (TASKS_FILE, SUMMARY_FILE, HTML_FILE) or FIGURE_NAME.fullmatch(name) is not None


def build(
    base: Path,
    candidates: Sequence[Path],
    out_dir: Path | str,
    key: str | None = None,
    solved_threshold: float = 1.0,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    embed: bool = False,
) -> CompareResult:
    """`shardrun compare`: write DIR/compare_tasks.jsonl, compare.json, compare.html and its figures. All of them
    are written to a folder of their own in DIR first and moved into DIR together, under DIR's lock: two compares
    into one DIR never mix their files, a failed one leaves DIR as it was, and an earlier compare's figures that
    this one does not draw are removed (DIR's other files are left alone)."""
    out_dir = check_out_dir(out_dir, [base, *candidates])
    comparison = compare(base, candidates, key, solved_threshold, resamples, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(str(out_dir / OUT_LOCK), timeout=OUT_LOCK_S)
        lock.acquire()
    except Timeout:
        raise BadInput(f"-o {out_dir}: another compare has been writing there for over {OUT_LOCK_S:.0f} s") from None
    try:
        stage = Path(tempfile.mkdtemp(prefix=store.TMP_PREFIX + "compare-", dir=out_dir))
        try:
            names = _write_outputs(comparison, stage, embed)
            for name in names:
                os.replace(stage / name, out_dir / name)
            for old in out_dir.iterdir():
                if is_output(old.name) and old.name not in names and old.is_file() and not old.is_symlink():
                    old.unlink()
            store.fsync_dir(out_dir)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    finally:
        lock.release()
    figs = tuple(out_dir / n for n in names if FIGURE_NAME.fullmatch(n))
    report.shareable([out_dir / n for n in names])
    return CompareResult(comparison, out_dir, out_dir / TASKS_FILE, out_dir / SUMMARY_FILE, out_dir / HTML_FILE, figs)


def _write_outputs(comparison: Comparison, stage: Path, embed: bool) -> list[str]:
    """Every output of one compare, written in `stage`; their names (the figures in the order drawn)."""
    with store.atomic_writer(stage / TASKS_FILE) as f:
        for row in comparison.task_rows():
            f.write(orjson.dumps(row) + b"\n")
    store.atomic_write_bytes(stage / SUMMARY_FILE, orjson.dumps(comparison.summary, option=orjson.OPT_INDENT_2) + b"\n")
    figs = draw(comparison, stage)
    srcs = [(n, t, report.data_uri(p.read_bytes()) if embed else p.name) for n, t, p in figs]
    page = render_html(comparison, srcs, time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    store.atomic_write_bytes(stage / HTML_FILE, page.encode())
    return [TASKS_FILE, SUMMARY_FILE, *(p.name for _, _, p in figs), HTML_FILE]


# ---------------------------------------------------------------- figures and HTML


def draw(comparison: Comparison, out_dir: Path) -> list[tuple[str, str, Path]]:
    """Per candidate: base vs candidate mean per task, the delta distribution, the flip matrix per agent."""
    try:
        from shardrun.analysis import comparison_figures as cf
    except ImportError as e:
        raise ShardrunError(
            f"compare's figures need matplotlib ({e}); install it with: pip install 'shardrun[report]'"
        ) from None
    out = []
    for n, (cand, pg) in enumerate(zip(comparison.candidates, comparison.pairings), 1):
        by_agent: dict[str, list[TaskPair]] = {}
        for p in pg.pairs:
            by_agent.setdefault(p.agent, []).append(p)
        points = {
            a: [(p.mean_base, p.mean_cand) for p in ps if p.mean_base is not None and p.mean_cand is not None]
            for a, ps in sorted(by_agent.items())
        }
        deltas = {a: [p.delta for p in ps if p.delta is not None] for a, ps in sorted(by_agent.items())}
        flips = {a: flip_matrix(ps) for a, ps in sorted(by_agent.items())}
        who = f"candidate {n}: {cand.name}"
        out += [
            (
                f"means_{n}",
                f"Per-task mean reward, base vs {who}",
                cf.means_scatter(points, out_dir / f"compare_means_{n}.png", comparison.base.name, cand.name),
            ),
            (f"deltas_{n}", f"Per-task delta, {who}", cf.delta_histogram(deltas, out_dir / f"compare_deltas_{n}.png")),
            (
                f"flips_{n}",
                f"Bucket flips per agent, {who}",
                cf.flip_matrices(flips, task_rules.BUCKETS, out_dir / f"compare_flips_{n}.png"),
            ),
        ]
    return out


def _num(v: float | None, spec: str = "+.3f") -> str:
    return "—" if v is None else format(v, spec)


def _ci(d: Mapping[str, Any], spec: str = "+.3f") -> str:
    ci = d.get("ci95")
    return "—" if not ci else f"[{format(ci[0], spec)}, {format(ci[1], spec)}]"


TABLE_HEADER = [
    "candidate",
    "group",
    "tasks",
    "mean base",
    "mean cand",
    "Δ mean [95% CI]",
    "Δ pass@1 (pts) [95% CI]",
    "Δ pass@k (pts) [95% CI]",
    "solved flips (gained/lost, p)",
]


def table_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for n, c in enumerate(summary["candidates"], 1):
        for g in c["groups"]:
            m, p1, pk = g["mean_reward"], g["pass_at_1"], g["pass_at_k"]
            ever = g["mcnemar"]["ever_solved"]
            rows.append(
                [
                    str(n),
                    g["group"] if g["kind"] == "all" else f"{g['kind']} {g['group']}",
                    f"{g['tasks_in_means']:,}/{g['tasks_paired']:,}",
                    _num(m["base"], ".3f"),
                    _num(m["cand"], ".3f"),
                    f"{_num(m['delta'])} {_ci(m)}",
                    f"{_num(p1['delta'], '+.1f')} {_ci(p1, '+.1f')}",
                    f"k={pk['k']}: {_num(pk.get('delta'), '+.1f')} {_ci(pk, '+.1f')}" if pk["k"] else "—",
                    f"+{ever['gained']}/-{ever['lost']}, p={ever['p_value']:.3g}",
                ]
            )
    return rows


def render_table(summary: Mapping[str, Any]) -> str:
    """compare.json as a terminal table: a line per candidate and group, then the candidates and their notes."""
    rows = [TABLE_HEADER, *table_rows(summary)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("tasks: in the mean differences / paired; pts: percentage points")
    lines.append(f"base: {summary['base']}")
    for n, c in enumerate(summary["candidates"], 1):
        lines.append(f"candidate {n}: {c['run_dir']} (paired by {c['pairing']})")
        lines += [f"  note: {note}" for note in c["notes"]]
        if "rollouts" in c:
            lines += rollout_pairs.text(c["rollouts"])
    return "\n".join(lines)


def _flip_html(matrix: Mapping[str, Mapping[str, int]]) -> str:
    rows = [[f"base {b}", *(str(matrix[b][c]) for c in task_rules.BUCKETS)] for b in task_rules.BUCKETS]
    return report._table(["", *(f"candidate {c}" for c in task_rules.BUCKETS)], rows)


def render_html(comparison: Comparison, figure_srcs: Sequence[tuple[str, str, str]], generated_at: str) -> str:
    """The whole page (report.py's style): the table, per candidate its notes, flips, unpaired tasks, figures."""
    s = comparison.summary
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>shardrun compare</title><style>{report.CSS}</style></head><body>",
        "<h1>shardrun compare</h1>",
        f"<p>base <code>{html.escape(s['base'])}</code> · solved at reward ≥ {s['solved_threshold']:g} · "
        f"bootstrap {s['bootstrap']['resamples']:,} resamples, seed {s['bootstrap']['seed']} · "
        f"generated {html.escape(generated_at)}</p>",
        "<h2>Summary</h2>",
        report._table(TABLE_HEADER, table_rows(s)),
        "<p>tasks: in the mean differences / paired; pts: percentage points; p: McNemar's exact test on the tasks "
        "solved by some rollout in one run only.</p>",
    ]
    for n, c in enumerate(s["candidates"], 1):
        parts.append(f"<h2>Candidate {n}: <code>{html.escape(c['run_dir'])}</code></h2>")
        parts.append(f"<p>paired by {html.escape(str(c['pairing']))}; {c['tasks_paired']:,} tasks paired</p>")
        parts += [f"<p class='warn'>{html.escape(note)}</p>" for note in c["notes"]]
        for g in c["groups"]:
            if g["kind"] in ("all", "agent"):
                title = "every task" if g["kind"] == "all" else f"agent {g['group']}"
                parts.append(f"<h3>Bucket flips, {html.escape(title)}</h3>" + _flip_html(g["flips"]))
        for side in ("only_base", "only_cand"):
            u = c["unpaired"][side]
            if u["count"]:
                parts.append(
                    f"<details><summary>{u['count']:,} task(s) {side.replace('_', ' in ')} run</summary>"
                    + report._table(["key", "task index"], [[str(t["key"]), str(t["task_index"])] for t in u["tasks"]])
                    + "</details>"
                )
        parts.append(
            "".join(
                f"<figure id='{html.escape(name)}'><img src='{html.escape(src)}' alt='{html.escape(title)}'>"
                f"<figcaption>{html.escape(title)}</figcaption></figure>"
                for name, title, src in figure_srcs
                if name.endswith(f"_{n}")
            )
        )
    parts.append("</body></html>\n")
    return "".join(parts)


def summary_text(result: CompareResult) -> str:
    return "\n".join(
        [
            render_table(result.comparison.summary),
            f"per task: {result.tasks}",
            f"summary: {result.summary}",
            f"report: {result.html}",
        ]
    )
