"""The planner: config + input rows in, plan out. Pure: no files, no clocks; callers pass iterators of lines.

Identity. Every non-blank input line is one task. Its global task index is its 0-based position among the
non-blank lines, unless the row carries `_ng_task_index` (then honoured; a clash is an error). Each task gets
k rollouts (k from `num_repeats` for its agent) with rollout indices 0..k-1 and sampling seed
`seed_offset + rollout index`, written into `responses_create_params.metadata.extra_body` exactly as NeMo Gym's
`num_repeats_add_seed` does, so the planned rows equal what one unsharded
`ng_collect_rollouts +num_repeats=k +num_repeats_add_seed=true` run materializes (seed_offset 0).

Sharding. Rollouts are numbered by an ordinal in input order (task by task, rollout by rollout). `contiguous`
gives each shard one range of ordinals, `round_robin` gives shard s every ordinal o with o % N == s. Either way
shard sizes differ by at most one rollout.

Waves. With `sampling.stop_when_decided` set (adaptive sampling, docs/adaptive-sampling.md) the ordinals are
wave-major instead: a task's rollouts come in waves of `sampling.wave` repeats, and every task's first wave is
numbered before any task's second (then task by task within a wave). Identities and seeds are the same; only
which shard holds a rollout changes, so that shards in index order run the waves in order.
"""

from __future__ import annotations

import bisect
import copy
import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal

import orjson
from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter

from shardrun.core.config import DEFAULT_MAX_ARRAY_SIZE, RunConfig, SamplingConfig
from shardrun.core.errors import BadInput
from shardrun.core.gym_names import AGENT_KEY, MAX_JSON_DEPTH, MAX_TASK_INDEX, RCP_KEY, ROLLOUT_KEY, TASK_KEY

PLANNER_VERSION = "1"
MAX_ROW_BYTES = 16 * 1024 * 1024
MAX_LISTED_PROBLEMS = 50


Count = Annotated[int, Field(ge=0)]  # a count or an index in plan.json (never negative)


# ---------------------------------------------------------------- rows


@dataclass(frozen=True)
class Task:
    """One validated input row: where it came from, its identity and how many rollouts it gets."""

    line_no: int
    task_index: int
    agent: str
    repeats: int
    entry: int = -1  # a blend's entry (its position in BlendLayout.parts); -1 for one input file


def parse_line(raw: bytes, line_no: int, source: str) -> dict[str, Any]:
    """Parse one input line into a row dict, or raise BadInput naming file, line and field."""
    where = f"{source}:{line_no}"
    if len(raw) > MAX_ROW_BYTES:
        raise BadInput(f"{where}: row is {len(raw):,} bytes, over the {MAX_ROW_BYTES // 2**20} MiB limit per row")
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        kind = "not valid UTF-8" if "utf-8" in str(e).lower() else "not valid JSON"
        raise BadInput(f"{where}: {kind}: {e}") from None
    if not isinstance(row, dict):
        raise BadInput(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(row) > MAX_JSON_DEPTH:
        raise BadInput(
            f"{where}: nested {json_depth(row)} levels deep (objects and arrays); a row may have at most "
            f"{MAX_JSON_DEPTH}, what the JSON writer of the shards and the profile supports"
        )
    return row


def json_depth(value: Any) -> int:
    """How many objects and arrays are nested at the deepest point of `value` (a scalar: 0); iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def row_agent(
    row: dict[str, Any], line_no: int, source: str, default_agent: str | None, overrides: bool = False
) -> str | None:
    """The row's agent: its agent_ref's name, else `default_agent` (agent_name); with `overrides` (Gym 0.7's
    agent_name, which routes every row) `default_agent` whenever it is set."""
    where = f"{source}:{line_no}"
    ref = row.get(AGENT_KEY)
    if ref is None:
        return default_agent
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
        raise BadInput(f"{where}: field {AGENT_KEY}: must be an object with a non-empty string 'name', got {ref!r}")
    return default_agent if overrides and default_agent else ref["name"]


def check_row(row: dict[str, Any], line_no: int, source: str) -> None:
    where = f"{source}:{line_no}"
    rcp = row.get(RCP_KEY)
    if RCP_KEY not in row:
        raise BadInput(f"{where}: field {RCP_KEY}: missing (every row needs the Responses create params)")
    if not isinstance(rcp, dict):
        raise BadInput(f"{where}: field {RCP_KEY}: must be an object, got {type(rcp).__name__}")
    metadata = rcp.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise BadInput(f"{where}: field {RCP_KEY}.metadata: must be an object, got {type(metadata).__name__}")
        extra = metadata.get("extra_body")
        if extra is not None:
            try:
                ok = isinstance(extra, str) and isinstance(json.loads(extra), dict)
            except ValueError:
                ok = False
            if not ok:
                raise BadInput(
                    f"{where}: field {RCP_KEY}.metadata.extra_body: must be a JSON object encoded as a "
                    f"string (NeMo Gym adds the seed there), got {extra!r}"
                )
    if TASK_KEY in row:
        ti = row[TASK_KEY]
        if isinstance(ti, bool) or not isinstance(ti, int) or ti < 0:
            raise BadInput(f"{where}: field {TASK_KEY}: must be a non-negative integer, got {ti!r}")
        if ti > MAX_TASK_INDEX:
            raise BadInput(
                f"{where}: field {TASK_KEY}: {ti} is above {MAX_TASK_INDEX:,} (2^40 - 1), the largest task "
                f"index a run can merge; renumber the tasks"
            )


def repeats_for(agent: str, num_repeats: int | dict[str, int]) -> int | None:
    if isinstance(num_repeats, int):
        return num_repeats
    return num_repeats.get(agent, num_repeats.get("_default"))


# ---------------------------------------------------------------- blends


@dataclass(frozen=True)
class BlendPart:
    """One entry of a blend as read from its file (rundir/blend_input.py reads it): which of its lines are in
    the blend (`line_numbers`, 1-based file line numbers in file order) and what it is."""

    label: str
    agent: str
    data: str
    sha256: str  # of the whole file
    rows_in_file: int  # its non-blank lines
    line_numbers: Any  # a sequence of ints (array('q'))
    repeats: int | None = None  # the entry's own num_repeats
    configs: tuple[str, ...] = ()
    owner: str | None = None


@dataclass(frozen=True)
class BlendLayout:
    """The blended input: every part's chosen rows, part after part. Blended line n (1-based) is row
    n - start of the part that holds it; `locate` names the file and line it came from."""

    parts: tuple[BlendPart, ...]
    starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        starts, at = [], 0
        for part in self.parts:
            starts.append(at)
            at += len(part.line_numbers)
        object.__setattr__(self, "starts", tuple(starts))

    @property
    def num_rows(self) -> int:
        return self.starts[-1] + len(self.parts[-1].line_numbers) if self.parts else 0

    def entry_at(self, line_no: int) -> int:
        return bisect.bisect_right(self.starts, line_no - 1) - 1

    def locate(self, line_no: int) -> tuple[str, int]:
        """(file, line) of blended line `line_no`."""
        e = self.entry_at(line_no)
        part = self.parts[e]
        offset = line_no - 1 - self.starts[e]
        if e < 0 or offset >= len(part.line_numbers):
            return "blend", line_no  # past the planned rows: the input changed (materialize says so)
        return part.data, int(part.line_numbers[offset])


def _where(layout: BlendLayout | None, source: str, line_no: int) -> str:
    if layout is None:
        return f"{source}:{line_no}"
    data, line = layout.locate(line_no)
    return f"{data}:{line}"


def task_ranges(indices: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint [start, stop) ranges covering exactly `indices`."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        elif not out or out[-1][1] < i:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


# ---------------------------------------------------------------- scan (validation pass)


@dataclass
class AgentCounts:
    """How many tasks and rollouts one agent has in the input, at how many repeats per task."""

    tasks: int = 0
    rollouts: int = 0
    repeats: int = 0


@dataclass
class InputSummary:
    num_lines: int = 0
    num_tasks: int = 0
    num_rollouts: int = 0
    agents: dict[str, AgentCounts] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    entries: list[EntryCounts] = field(default_factory=list)  # a blend's, per part of its layout


@dataclass
class EntryCounts:
    """One blend entry's tasks (their indices) and rollouts, at its repeats."""

    repeats: int = 0
    rollouts: int = 0
    indices: list[int] = field(default_factory=list)


class _IndexSet:
    """Task indices seen so far: a bitmap for small ones (at most LIMIT / 8 bytes, 16 MiB), a set for the rest, so
    memory grows with how many indices there are, never with how large one is."""

    LIMIT = 1 << 27

    def __init__(self) -> None:
        self.bits = bytearray()
        self.big: set[int] = set()

    def add(self, i: int) -> bool:
        """Add i; False if it was already there."""
        if i >= self.LIMIT:
            if i in self.big:
                return False
            self.big.add(i)
            return True
        byte, bit = divmod(i, 8)
        if byte >= len(self.bits):
            self.bits.extend(b"\0" * max(byte + 1 - len(self.bits), len(self.bits)))
        if self.bits[byte] >> bit & 1:
            return False
        self.bits[byte] |= 1 << bit
        return True


def iter_tasks(
    lines: Iterable[tuple[int, bytes]],
    cfg: RunConfig,
    source: str,
    problems: list[str] | None = None,
    agent_name_overrides: bool = False,
    layout: BlendLayout | None = None,
) -> Iterator[tuple[Task, dict[str, Any]]]:
    """Yield (task, row) for every non-blank line. Row problems go to `problems` (if given) or raise.
    `agent_name_overrides`: cfg.agent_name routes every row (Gym 0.7), not only rows without an agent_ref.
    `layout`: the lines are a blend's (each problem names the entry's file and line; a row must run its entry's
    agent; the entry's num_repeats wins)."""
    position = 0
    for line_no, raw in lines:
        if not raw.strip():
            continue
        entry = -1
        try:
            if layout is None:
                where_file, where_line = source, line_no
            else:
                entry = layout.entry_at(line_no)
                where_file, where_line = layout.locate(line_no)
            row = parse_line(raw, where_line, where_file)
            check_row(row, where_line, where_file)
            agent = row_agent(row, where_line, where_file, cfg.agent_name, agent_name_overrides)
            if layout is not None and 0 <= entry < len(layout.parts) and agent != layout.parts[entry].agent:
                part = layout.parts[entry]
                raise BadInput(
                    f"{where_file}:{where_line}: field {AGENT_KEY}: names agent {agent!r}, but entry "
                    f"{part.label!r} runs agent {part.agent!r}; a row reaches Gym as it is in its file, so fix the "
                    f"row or the entry's agent"
                )
        except BadInput as e:
            if problems is None:
                raise
            problems.append(str(e))
            position += 1
            continue
        index = row[TASK_KEY] if TASK_KEY in row else position
        position += 1
        if agent is None:
            msg = (
                f"{where_file}:{where_line}: field {AGENT_KEY}: missing, and no agent_name is configured "
                f"(set agent_name=... or add agent_ref to the row)"
            )
            if problems is None:
                raise BadInput(msg)
            problems.append(msg)
            continue
        k = repeats_for(agent, cfg.num_repeats)
        original = (row.get(AGENT_KEY) or {}).get("name") if agent_name_overrides else None
        if original and isinstance(cfg.num_repeats, dict) and agent not in cfg.num_repeats:
            k = repeats_for(original, cfg.num_repeats)  # Gym 0.7: the row's own agent's entry, before _default
        if entry >= 0 and layout is not None and layout.parts[entry].repeats is not None:
            k = layout.parts[entry].repeats
        yield Task(line_no, index, agent, k or 0, entry), row


def scan(
    lines: Iterable[tuple[int, bytes]],
    cfg: RunConfig,
    source: str,
    agent_name_overrides: bool = False,
    layout: BlendLayout | None = None,
) -> InputSummary:
    """Validate every row and count tasks and rollouts. One BadInput lists every problem found. `layout`: the
    lines are a blend's (see iter_tasks); the summary then counts each entry."""
    problems: list[str] = []
    summary = InputSummary()
    if layout is not None:
        summary.entries = [EntryCounts() for _ in layout.parts]
    seen = _IndexSet()
    first_line: dict[int, int] = {}
    missing_agents: dict[str, str] = {}
    mixed: dict[str, set[int]] = {}
    for task, _row in iter_tasks(_count(lines, summary), cfg, source, problems, agent_name_overrides, layout):
        if not seen.add(task.task_index):
            line = first_line.get(task.task_index)
            problems.append(
                f"{_where(layout, source, task.line_no)}: field {TASK_KEY}: task index {task.task_index} is used by "
                f"another row{_earlier(layout, source, line)} (each task needs its own index)"
            )
            continue
        if len(first_line) < 100_000:
            first_line[task.task_index] = task.line_no
        if task.repeats == 0:
            missing_agents.setdefault(task.agent, _where(layout, source, task.line_no))
            continue
        agent = summary.agents.setdefault(task.agent, AgentCounts(repeats=task.repeats))
        if agent.repeats != task.repeats:
            mixed.setdefault(task.agent, {agent.repeats}).add(task.repeats)
            agent.repeats = max(agent.repeats, task.repeats)
        if task.entry >= 0:
            counts = summary.entries[task.entry]
            counts.repeats = task.repeats
            counts.rollouts += task.repeats
            counts.indices.append(task.task_index)
        agent.tasks += 1
        agent.rollouts += task.repeats
        summary.num_tasks += 1
        summary.num_rollouts += task.repeats
    if missing_agents:
        listed = sorted(k for k in cfg.num_repeats if k != "_default") if isinstance(cfg.num_repeats, dict) else []
        problems.append(
            "num_repeats: no entry for agent(s) "
            + ", ".join(f"{a!r} (first at {where})" for a, where in sorted(missing_agents.items()))
            + f" and no '_default'; listed agents: {listed}"
        )
    for agent_name, values in sorted(mixed.items()):
        summary.warnings.append(
            f"agent {agent_name!r} runs entries at different repeats ({', '.join(map(str, sorted(values)))}); its "
            f"line in the plan's agents shows the largest, the blend table each entry's own"
        )
    if not problems and summary.num_tasks == 0:
        problems.append(f"{source}: the input has no tasks (no non-blank lines)")
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more problems")
        raise BadInput(f"{source}: {len(problems)} problem(s) in the input", shown)
    if isinstance(cfg.num_repeats, dict):
        unused = sorted(k for k in cfg.num_repeats if k != "_default" and k not in summary.agents)
        if unused:
            summary.warnings.append(f"num_repeats lists agent(s) no row uses (typo?): {', '.join(unused)}")
    return summary


def _earlier(layout: BlendLayout | None, source: str, line: int | None) -> str:
    if not line:
        return ""
    return f" (line {line})" if layout is None else f" ({_where(layout, source, line)})"


def _count(lines: Iterable[tuple[int, bytes]], summary: InputSummary) -> Iterator[tuple[int, bytes]]:
    for item in lines:
        summary.num_lines += 1
        yield item


# ---------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardSpec:
    """Which rollout ordinals a shard owns: range(start, stop) or every ordinal o with o % step == offset."""

    index: Count
    num_rollouts: Count
    kind: Literal["range", "stride"]
    start: Count = 0
    stop: Count = 0
    offset: Count = 0
    step: Annotated[int, Field(gt=0)] = 1

    @property
    def name(self) -> str:
        return f"{self.index:05d}"

    def owns(self, ordinal: int) -> bool:
        if self.kind == "range":
            return self.start <= ordinal < self.stop
        return ordinal % self.step == self.offset


def shard_count(num_rollouts: int, cfg: RunConfig) -> int:
    s = cfg.sharding
    if s.num_shards is not None:
        n = s.num_shards
    elif s.rollouts_per_shard is not None:
        n = math.ceil(num_rollouts / s.rollouts_per_shard)
    else:
        n = 1
    return max(1, min(n, num_rollouts))


AGENT_NAME_OVERRIDES = "agent_name_overrides"  # the planning key: agent_name routes every row (Gym 0.7)


def make_shards(num_rollouts: int, num_shards: int, slicing: str) -> tuple[ShardSpec, ...]:
    if slicing == "round_robin":
        return tuple(
            ShardSpec(s, (num_rollouts - s + num_shards - 1) // num_shards, "stride", offset=s, step=num_shards)
            for s in range(num_shards)
        )
    base, extra = divmod(num_rollouts, num_shards)
    shards = []
    start = 0
    for s in range(num_shards):
        size = base + (1 if s < extra else 0)
        shards.append(ShardSpec(s, size, "range", start=start, stop=start + size))
        start += size
    return tuple(shards)


class Router:
    """Maps a rollout ordinal to the shard that owns it."""

    def __init__(self, shards: tuple[ShardSpec, ...]):
        self.shards = shards
        self.stride = shards[0].kind == "stride"
        self.starts = [s.start for s in shards]

    def __call__(self, ordinal: int) -> int:
        if self.stride:
            return ordinal % len(self.shards)
        return bisect.bisect_right(self.starts, ordinal) - 1


# ---------------------------------------------------------------- plan


@dataclass(frozen=True)
class InputInfo:
    path: str
    sha256: str
    num_lines: Count


@dataclass(frozen=True)
class BlendEntry:
    """One entry of a blend (docs/blends.md), as planned: its label, where its rows came from, and which task
    indices it holds (`tasks`: sorted, disjoint [start, stop) ranges). A plan without a blend has none."""

    label: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$", min_length=1)]
    agent: str
    data: str
    sha256: str
    rows_in_file: Count
    num_tasks: Count
    num_rollouts: Count
    repeats: Count
    tasks: tuple[tuple[Count, Count], ...]
    configs: tuple[str, ...] = ()
    owner: str | None = None


def _numbered_in_order(shards: tuple[ShardSpec, ...]) -> tuple[ShardSpec, ...]:
    for position, shard in enumerate(shards):
        if shard.index != position:
            raise ValueError(f"shard {position} has index {shard.index}")
    return shards


@dataclass(frozen=True)
class Plan:
    """The plan, and plan.json's shape: these dataclasses (Plan, InputInfo, ShardSpec, BlendEntry) are its one
    definition. `to_json` writes it; `from_json` reads it back checked against the same fields and their types
    (pydantic, strict: no "16" for 16; no field it does not have), so a damaged plan.json names the field at fault."""

    __pydantic_config__ = ConfigDict(strict=True, extra="forbid")

    planner_version: str
    input: InputInfo
    planning: dict[str, Any]
    config: dict[str, Any]
    num_tasks: Count
    num_rollouts: Count
    agents: dict[str, dict[str, int]]
    shards: Annotated[tuple[ShardSpec, ...], AfterValidator(_numbered_in_order)]
    warnings: tuple[str, ...] = ()
    fingerprint: str = ""
    gym_version: str | None = None  # the nemo-gym release of gym.venv when planned
    blend: tuple[BlendEntry, ...] = ()  # a blend's entries in config order; () for one input file

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        d["warnings"] = list(self.warnings)
        if self.blend:
            d["blend"] = [
                asdict(e) | {"tasks": [list(r) for r in e.tasks], "configs": list(e.configs)} for e in self.blend
            ]
        else:
            del d["blend"]  # plans without a blend keep plan.json's shape (and fingerprint) as before
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Plan":
        """The plan `to_json` wrote (parsed JSON); pydantic's ValidationError, naming the field, for another shape."""
        return _plan_json().validate_json(orjson.dumps(d))

    @property
    def labels(self) -> tuple[str, ...]:
        """The blend's labels in config order; () for a plan of one input file."""
        return tuple(e.label for e in self.blend)

    def label_codes(self, task_index: Any) -> Any:
        """Per task index (a numpy integer array), the position of its entry in `labels`; -1 for a task no entry
        holds (every planned task has one in a blend)."""
        import numpy as np

        task_index = np.asarray(task_index, dtype=np.int64)
        out = np.full(task_index.shape, -1, dtype=np.int64)
        for code, entry in enumerate(self.blend):
            for start, stop in entry.tasks:
                out[(task_index >= start) & (task_index < stop)] = code
        return out

    def label_counts(self, task_index: Any) -> list[int]:
        """How many of these task indices (one per rollout) each entry of `labels` holds, in entry order; indices no
        entry holds are not counted. Empty for a plan without a blend."""
        import numpy as np

        if not self.blend:
            return []
        codes = self.label_codes(task_index)
        return [int(n) for n in np.bincount(codes[codes >= 0], minlength=len(self.blend))]

    def repeats_of(self, task_index: int, agent: str) -> int:
        """The planned rollouts of one task: its entry's repeats in a blend, else its agent's."""
        for entry in self.blend:
            if any(start <= task_index < stop for start, stop in entry.tasks):
                return entry.repeats
        return repeats_for(agent, self.planning["num_repeats"]) or 0

    def label_of(self, task_index: int) -> str | None:
        """The label of one task index; None outside a blend."""
        for entry in self.blend:
            if any(start <= task_index < stop for start, stop in entry.tasks):
                return entry.label
        return None

    def shard(self, index: int) -> ShardSpec:
        return self.shards[index]

    @property
    def shard_sizes(self) -> tuple[int, int]:
        sizes = [s.num_rollouts for s in self.shards]
        return min(sizes), max(sizes)

    def array_jobs_needed(self, max_array_size: int = DEFAULT_MAX_ARRAY_SIZE) -> int:
        return math.ceil(len(self.shards) / max_array_size)

    @property
    def sampling(self) -> SamplingConfig | None:
        """The adaptive-sampling settings the plan was made with (None: every planned rollout is collected)."""
        view = self.planning.get("sampling")
        return None if view is None else SamplingConfig.model_validate(view)


@functools.cache
def _plan_json() -> TypeAdapter[Plan]:
    """plan.json read as a Plan (JSON mode: its arrays are the plan's tuples)."""
    return TypeAdapter(Plan)


def _rollouts_payload(plan: Plan) -> dict[str, Any]:
    return {
        "planner_version": plan.planner_version,
        "input_sha256": plan.input.sha256,
        "planning": plan.planning,
        "num_tasks": plan.num_tasks,
        "num_rollouts": plan.num_rollouts,
        "agents": plan.agents,
        "shards": [asdict(s) for s in plan.shards],
    } | ({"blend": [_without_data(e) for e in plan.to_json()["blend"]]} if plan.blend else {})


def _without_data(entry: dict[str, Any]) -> dict[str, Any]:
    """A blend entry less where its file lies (its bytes are in it, by sha256)."""
    return {k: v for k, v in entry.items() if k != "data"}


def same_rollouts(a: Plan, b: Plan) -> bool:
    """True when two plans decide the same rollouts (planner version, input bytes, planning settings, shard
    table; a blend's entries with their files' bytes): a run directory holding `a` may be launched or resumed for
    `b`. Where the input or an entry's file lies, the Gym release
    found and the rest of the config may differ; the plan in the run directory stays what it recorded."""
    return _rollouts_payload(a) == _rollouts_payload(b)


def fingerprint(plan: Plan) -> str:
    """sha256 over every field of plan.json that changes what a command does: what decides the rollouts (planner
    version, input bytes, planning settings, shard table) and what commands read back from the plan (the input's
    path and line count, the Gym release whose layout the merge writes, the warnings, the config a shard run by
    hand falls back to). Only the config's run_dir is left out: a run directory is where its plan.json is."""
    config = {k: v for k, v in plan.config.items() if k != "run_dir"} if isinstance(plan.config, dict) else plan.config
    payload = _rollouts_payload(plan) | {
        "input": asdict(plan.input),
        "gym_version": plan.gym_version,
        "warnings": list(plan.warnings),
        "config": config,
    }
    if plan.blend:  # each entry with where its file lies, as plan.json has it
        payload["blend"] = plan.to_json()["blend"]
    return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The validated config as stored in plan.json (it holds only env-var names, never secret values)."""
    return cfg.model_dump(mode="json")


def translation_notes(cfg: RunConfig) -> list[str]:
    """A translated manifest's notes, less those about a `${var}` that gym.secrets now maps."""
    from shardrun.core.sweep_manifest import UNMAPPED_VARIABLE

    mapped = cfg.gym.secrets if cfg.gym else {}
    return [
        n
        for n in cfg.translation_notes
        if not (UNMAPPED_VARIABLE in n and any(f"${{{var}}}{UNMAPPED_VARIABLE}" in n for var in mapped))
    ]


def make_plan(
    cfg: RunConfig,
    info: InputInfo,
    summary: InputSummary,
    gym_version: str | None = None,
    agent_name_overrides: bool = False,
    layout: BlendLayout | None = None,
) -> Plan:
    """The plan; `agent_name_overrides` (the Gym release's agent_name routes every row) is a planning setting
    then, in the fingerprint, as it decides the rows' agents. `layout`: a blend's (scanned into `summary`)."""
    overrides = agent_name_overrides and bool(cfg.agent_name)
    blend = tuple(
        BlendEntry(
            label=part.label,
            agent=part.agent,
            data=part.data,
            sha256=part.sha256,
            rows_in_file=part.rows_in_file,
            num_tasks=len(counts.indices),
            num_rollouts=counts.rollouts,
            repeats=counts.repeats,
            tasks=task_ranges(counts.indices),
            configs=part.configs,
            owner=part.owner,
        )
        for part, counts in zip(layout.parts if layout else (), summary.entries)
    )
    shards = make_shards(summary.num_rollouts, shard_count(summary.num_rollouts, cfg), cfg.sharding.slicing)
    plan = Plan(
        planner_version=PLANNER_VERSION,
        input=info,
        planning=cfg.planning_view() | ({AGENT_NAME_OVERRIDES: True} if overrides else {}),
        config=public_config(cfg),
        num_tasks=summary.num_tasks,
        num_rollouts=summary.num_rollouts,
        agents={a: asdict(s) for a, s in sorted(summary.agents.items())},
        shards=shards,
        warnings=tuple(summary.warnings)
        + tuple(f"not carried out: {w}" for w in cfg.not_carried_out)
        + tuple(f"manifest: {w}" for w in translation_notes(cfg))
        + tuple(cfg.deprecations)
        + tuple(cfg.sandbox_warnings()),
        gym_version=gym_version,
        blend=blend,
    )
    return _with_fingerprint(plan)


def _with_fingerprint(plan: Plan) -> Plan:
    from dataclasses import replace

    return replace(plan, fingerprint=fingerprint(plan))


def plan_differences(old: Plan, new: Plan) -> list[str]:
    """Human-readable list of what differs between two plans (for the refusal message)."""
    diffs = []
    if old.planner_version != new.planner_version:
        diffs.append(f"planner version {old.planner_version} -> {new.planner_version}")
    if old.input.sha256 != new.input.sha256:
        diffs.append(
            f"input content changed (sha256 {old.input.sha256[:12]}… -> {new.input.sha256[:12]}…, "
            f"{old.input.path} -> {new.input.path})"
        )
    for key in sorted(set(old.planning) | set(new.planning)):
        if old.planning.get(key) != new.planning.get(key):
            diffs.append(f"{key}: {old.planning.get(key)!r} -> {new.planning.get(key)!r}")
    old_files = {e.label: e for e in old.blend}
    for e in new.blend:
        was = old_files.get(e.label)
        if was is not None and was.sha256 != e.sha256:
            diffs.append(f"entry {e.label}: its file changed (sha256 {was.sha256[:12]}… -> {e.sha256[:12]}…, {e.data})")
    if not diffs and [e.label for e in old.blend] != [e.label for e in new.blend]:
        diffs.append(f"blend entries {[e.label for e in old.blend]} -> {[e.label for e in new.blend]}")
    if not diffs and old.shards != new.shards:
        diffs.append("shard table differs")
    return diffs or ["plan content differs"]


# ---------------------------------------------------------------- materialization

_SENT_ROLLOUT = 7316492850184736291
_SENT_SEED = 8426193057264819374


def stamp(
    row: dict[str, Any],
    task: Task,
    default_agent: str | None,
    rcp_overrides: dict[str, Any],
    agent_name_overrides: bool = False,
) -> dict:
    """Apply Gym's per-row preprocessing (agent, params overrides, task index) to a freshly parsed row."""
    if default_agent and agent_name_overrides:
        row[AGENT_KEY] = {"name": default_agent}  # Gym 0.7: agent_name re-routes the row (a new agent_ref)
    elif default_agent:
        row.setdefault(AGENT_KEY, {"name": default_agent})
    if rcp_overrides:
        row[RCP_KEY] = row[RCP_KEY] | rcp_overrides
    if TASK_KEY not in row:
        row[TASK_KEY] = task.task_index
    return row


def _set_rollout(row: dict[str, Any], rollout: int, seed: int) -> None:
    row[ROLLOUT_KEY] = rollout
    metadata = row[RCP_KEY].setdefault("metadata", {})
    extra_body = json.loads(metadata.get("extra_body", "{}"))
    extra_body["seed"] = seed
    metadata["extra_body"] = json.dumps(extra_body)


def _template_copy(row: dict[str, Any]) -> dict[str, Any]:
    """Copy exactly the parts `_set_rollout` mutates (row, its params, their metadata), keeping key order."""
    out = dict(row)
    rcp = dict(row[RCP_KEY])
    if isinstance(rcp.get("metadata"), dict):
        rcp["metadata"] = dict(rcp["metadata"])
    out[RCP_KEY] = rcp
    return out


_R_TOK, _S_TOK = str(_SENT_ROLLOUT).encode(), str(_SENT_SEED).encode()
_INTS = [str(i).encode() for i in range(4096)]


def _int_bytes(i: int) -> bytes:
    return _INTS[i] if i < len(_INTS) else str(i).encode()


def expansion(row: dict[str, Any], seed_offset: int) -> Callable[[int, int], bytes]:
    """A renderer of the task's materialized rows: (a, b) -> rollouts a..b-1 as JSON lines, byte-identical to
    Gym's (orjson, same key order). Rows are rendered on demand, so memory does not grow with the repeats."""
    template = _template_copy(row)
    _set_rollout(template, _SENT_ROLLOUT, _SENT_SEED)
    raw = orjson.dumps(template)
    if raw.count(_R_TOK) != 1 or raw.count(_S_TOK) != 1:  # the sentinels collided with row content
        return lambda a, b: b"".join(_render_slowly(row, r, seed_offset) for r in range(a, b))
    r_first = raw.index(_R_TOK) < raw.index(_S_TOK)
    head, rest = raw.split(_R_TOK if r_first else _S_TOK)
    mid, tail = rest.split(_S_TOK if r_first else _R_TOK)
    tail += b"\n"
    if r_first:
        return lambda a, b: b"".join(
            head + _int_bytes(r) + mid + _int_bytes(seed_offset + r) + tail for r in range(a, b)
        )
    return lambda a, b: b"".join(head + _int_bytes(seed_offset + r) + mid + _int_bytes(r) + tail for r in range(a, b))


def _render_slowly(row: dict[str, Any], rollout: int, seed_offset: int) -> bytes:
    one = copy.deepcopy(row)
    _set_rollout(one, rollout, seed_offset + rollout)
    return orjson.dumps(one) + b"\n"


MATERIALIZE_CHUNK = 4096
"""Rollouts rendered at once: what one chunk of materialize holds in memory, whatever a task's repeats."""


def materialize(
    plan: Plan,
    cfg: RunConfig,
    lines: Iterable[tuple[int, bytes]],
    source: str,
    only: set[int] | None = None,
    layout: BlendLayout | None = None,
) -> Iterator[tuple[int, bytes]]:
    """Yield (shard index, materialized lines) chunks covering every planned rollout, in input order.

    Consecutive rollouts of one task that go to one shard come together, in chunks of at most MATERIALIZE_CHUNK
    rollouts (memory stays flat in the repeats). `only` restricts the output to some shards (to bound open files
    when writing many round-robin shards).
    """
    route = Router(plan.shards)
    rcp_overrides = dict(cfg.gym.responses_create_params) if cfg.gym else {}
    waves = WaveOrder(plan)
    ordinal = 0
    overrides = bool(plan.planning.get(AGENT_NAME_OVERRIDES))
    for task, row in iter_tasks(lines, cfg, source, agent_name_overrides=overrides, layout=layout):
        runs: Iterable[tuple[int, int, int]] = (
            run for first, a, b in waves.segments(ordinal, task.repeats) for run in _runs(plan, route, first, a, b)
        )
        ordinal += task.repeats
        if only is not None:
            runs = [run for run in runs if run[0] in only]
            if not runs:
                continue
        stamp(row, task, cfg.agent_name, rcp_overrides, overrides)
        render = expansion(row, cfg.seed_offset)
        for shard_index, a, b in runs:
            for start in range(a, b, MATERIALIZE_CHUNK):
                yield shard_index, render(start, min(b, start + MATERIALIZE_CHUNK))
    if ordinal != plan.num_rollouts:
        raise BadInput(
            f"{source}: input changed while planning ({ordinal} rollouts now, {plan.num_rollouts} planned); plan again"
        )


def _runs(plan: Plan, route: Router, first: int, a: int, b: int) -> Iterator[tuple[int, int, int]]:
    """Split a task's rollouts a..b-1, numbered by the ordinals first.., into (shard, from, to) runs of consecutive
    rollouts, lazily."""
    if route.stride:
        yield from ((route(first + r - a), r, r + 1) for r in range(a, b))
        return
    r = a
    while r < b:
        s = route(first + r - a)
        end = min(b, plan.shards[s].stop - first + a)
        yield s, r, end
        r = end


class WaveOrder:
    """The ordinals of each task's rollouts, fed the tasks in input order: task-major (one segment per task), or
    wave-major when the plan samples adaptively (one segment per wave of the task)."""

    def __init__(self, plan: Plan):
        sampling = plan.sampling
        self.wave = sampling.wave if sampling is not None else 0
        if not self.wave:
            return
        repeats = (
            [(e.num_tasks, e.repeats) for e in plan.blend]  # repeats are per entry in a blend
            if plan.blend
            else [(a["tasks"], a["repeats"]) for a in plan.agents.values()]
        )
        count = max((math.ceil(k / self.wave) for _, k in repeats), default=0)
        sizes = [sum(n * min(self.wave, max(0, k - v * self.wave)) for n, k in repeats) for v in range(count)]
        self.base = [0] * count  # the first ordinal of each wave
        for v in range(1, count):
            self.base[v] = self.base[v - 1] + sizes[v - 1]
        self.seen = [0] * count  # rollouts of each wave given to earlier tasks

    def waves_of(self, spec: ShardSpec) -> tuple[int, int] | None:
        """The first and last wave a shard's rollouts belong to (adaptive sampling cuts contiguous shards over the
        wave-major ordinals); None when the plan is not wave-major or the shard is a stride."""
        if not self.wave or spec.kind != "range" or spec.stop <= spec.start:
            return None
        return bisect.bisect_right(self.base, spec.start) - 1, bisect.bisect_right(self.base, spec.stop - 1) - 1

    def segments(self, ordinal: int, k: int) -> list[tuple[int, int, int]]:
        """(first ordinal, from, to): the task's rollouts from..to-1 have the ordinals first, first + 1, ...
        `ordinal` is the task's first ordinal in input order (used when not wave-major)."""
        if not self.wave:
            return [(ordinal, 0, k)]
        out = []
        for v, a in enumerate(range(0, k, self.wave)):
            b = min(k, a + self.wave)
            out.append((self.base[v] + self.seen[v], a, b))
            self.seen[v] += b - a
        return out
