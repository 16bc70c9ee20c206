"""Build planned run directories and write shard outputs in NeMo Gym's formats (shared by tests and benchmarks).

    run = make_run(tmp_path, input_rows(10, agents=("math", "tool")), num_repeats={"math": 4, "_default": 2},
                   num_shards=3, slicing="round_robin")
    for i in range(run.num_shards):
        write_shard(run, i)                      # every planned rollout, shuffled completion order, sealed
    write_shard(run, 1, duplicates=2, torn=True, foreign=1, missing=3, seal=False)

A rollout row is what `ng_collect_rollouts` writes: the resources server's verify response (`responses_create_params`,
`response` with `output` text and `usage`, `reward`, server fields such as `library_reward`/`extracted_answer`)
plus `_ng_task_index`, `_ng_rollout_index` and `agent_ref`. Values are a pure function of the identity, so tests can
recompute them. `seal_shard` writes a valid `.done` marker via shardrun.rundir.seal.

The one writer of run config files is here too (`write_config`; a `Stack` holds a test area's defaults for runs
against a real Gym stack and the stand-in policy), as is the one writer of seals (`seal_shard`): docs/architecture.md,
Tests.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson
import yaml

from shardrun.core import config
from shardrun.plan import planner
from shardrun.rundir import seal
from shardrun.rundir import store

LOREM = (
    "the answer follows from the given facts so we compute each step carefully and check the result "
    "against the constraints before writing it in a box "
)


REPO = Path(__file__).resolve().parents[1]
ARITH_INPUT = REPO / "examples" / "arith" / "input.jsonl"


def arith_lines(n: int) -> list[str]:
    """The first n tasks of examples/arith/input.jsonl (math_with_judge rows for the real Gym stack), as lines."""
    return ARITH_INPUT.read_text().splitlines()[:n]


def arith_input(path: Path, rows: int) -> Path:
    """An input file of the first `rows` arith tasks: the input of every test that runs the real Gym stack."""
    path.write_text("".join(line + "\n" for line in arith_lines(rows)))
    return path


TOOL_CALL_AGENT = "example_single_tool_call_simple_agent"
GYM_CONFIG_PATHS = [
    "resources_servers/math_with_judge/configs/math_with_judge.yaml",
    "resources_servers/example_single_tool_call/configs/example_single_tool_call.yaml",
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
]
MATH_CONFIG_PATHS = [p for p in GYM_CONFIG_PATHS if "example_single_tool_call" not in p]  # the quickest real stack


def gym_config_paths(input_jsonl: Path) -> list[str]:
    """The Gym servers an input needs: the tool-call environment only where a row names its agent (its three idle
    servers cost a Gym 0.7 stack start about 12 s on 2 cores)."""
    rows = (json.loads(line) for line in Path(input_jsonl).read_text().splitlines() if line.strip())
    if any(row.get("agent_ref", {}).get("name") == TOOL_CALL_AGENT for row in rows):
        return GYM_CONFIG_PATHS
    return MATH_CONFIG_PATHS


@dataclass(frozen=True)
class Stack:
    """A test area's defaults for runs against a real Gym stack and the stand-in policy server (tests/fakes): the
    runtime tests' (tests/fakes/harness.py), the fault suite's (tests/faults/gymkit.py), the local Slurm's
    (tests/slurm/slurm_helpers.py). Each key of `gym` and `cluster` is a default a caller's own dict overrides;
    config_paths None: the servers the input needs (gym_config_paths)."""

    api_key_env: str
    gym: dict[str, Any]
    cluster: dict[str, Any]
    repeats: int = 2
    shards: int = 1
    config_paths: list[str] | None = None

    def but(self, *, gym: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None, **fields: Any) -> Stack:
        """These defaults with some changed (gym and cluster merged key by key)."""
        return replace(self, gym=self.gym | (gym or {}), cluster=self.cluster | (cluster or {}), **fields)


def write_config(
    path: Path,
    input_jsonl: Path,
    run_dir: Path,
    policy_url: str | None = None,
    *,
    stack: Stack | None = None,
    repeats: int | dict[str, int] | None = None,
    shards: int | None = None,
    gym: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    config_paths: list[str] | None = None,
    api_key_env: str | None = None,
    as_json: bool = False,
    **settings: Any,
) -> Path:
    """A run config file: the one writer every test and benchmark shares.

    Without `stack`: input_jsonl, run_dir, num_repeats (default 2), sharding.num_shards where `shards` is given, the
    gym, policy and cluster sections as given. With `stack` (a run against a real Gym stack and the stand-in policy
    at policy_url): the stack's defaults under the caller's gym and cluster settings, the servers from
    config_paths (else the stack's, else those the input needs) and the policy section for the stand-in, with
    the key in `api_key_env` (default the stack's). `settings` are further top-level keys (they replace a section
    built here). YAML, or JSON with as_json (JSON is YAML)."""
    data: dict[str, Any] = {
        "input_jsonl": str(input_jsonl),
        "run_dir": str(run_dir),
        "num_repeats": repeats if repeats is not None else stack.repeats if stack else 2,
    }
    if shards is None and stack:
        shards = stack.shards
    if shards is not None:
        data["sharding"] = {"num_shards": shards}
    if stack:
        paths = config_paths or stack.config_paths or gym_config_paths(input_jsonl)
        gym = {"config_paths": paths} | stack.gym | (gym or {})
        key_env = api_key_env or stack.api_key_env
        policy = {"base_url": policy_url, "model_name": "fake-model", "api_key_env": key_env} | (policy or {})
        cluster = stack.cluster | (cluster or {})
    elif policy_url is not None or config_paths is not None or api_key_env is not None:
        raise TypeError("policy_url, config_paths and api_key_env go with a stack")
    for key, section in (("gym", gym), ("policy", policy), ("cluster", cluster)):
        if section is not None:
            data[key] = section
    data.update(settings)
    path.write_text(json.dumps(data) if as_json else yaml.safe_dump(data))
    return path


def input_rows(
    n_tasks: int,
    agents: Iterable[str] = ("agent_a",),
    *,
    explicit_index: bool = False,
    shuffle_seed: int | None = None,
    index_base: int = 1000,
) -> list[dict[str, Any]]:
    """Input rows (Gym format): agent_ref cycles over `agents`. With explicit_index, task indices are
    index_base + 7 * i (sparse), and with shuffle_seed the input order is shuffled (so it is not task order)."""
    agents = list(agents)
    rows = []
    for i in range(n_tasks):
        row: dict[str, Any] = {
            "responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + {i}?"}]},
            "question": f"What is {i} + {i}?",
            "expected_answer": str(2 * i),
            "agent_ref": {"name": agents[i % len(agents)]},
        }
        if explicit_index:
            row["_ng_task_index"] = index_base + 7 * i
        rows.append(row)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(rows)
    return rows


@dataclass
class Run:
    run_dir: Path
    cfg: config.RunConfig
    plan: planner.Plan

    @property
    def num_shards(self) -> int:
        return len(self.plan.shards)

    def materialized(self, shard: int) -> list[dict[str, Any]]:
        return list(store.iter_jsonl_objects(store.materialized_path(self.run_dir, shard)))

    def identities(self, shard: int) -> list[tuple[int, int]]:
        return [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in self.materialized(shard)]


def make_run(
    tmp: Path,
    rows: list[dict[str, Any]],
    *,
    num_repeats: int | dict[str, int] = 2,
    num_shards: int = 3,
    slicing: str = "contiguous",
    seed_offset: int = 0,
    name: str = "run",
) -> Run:
    """Write the input JSONL, plan it into tmp/<name> and materialize the shards (store.write_plan)."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / f"{name}-input.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    cfg = config.validate(
        {
            "input_jsonl": str(src),
            "run_dir": str(tmp / name),
            "num_repeats": num_repeats,
            "seed_offset": seed_offset,
            "sharding": {"num_shards": num_shards, "slicing": slicing},
        }
    )
    plan, _ = store.write_plan(cfg)
    return Run(cfg.run_dir, cfg, plan)


def _unit(*key: Any) -> float:
    """A deterministic number in [0, 1) from a key."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def rollout_row(materialized: dict[str, Any], *, text_chars: int = 200, continuous: bool = False) -> dict[str, Any]:
    """A Gym verify response for one planned row; every value depends only on the identity."""
    t, r = materialized["_ng_task_index"], materialized["_ng_rollout_index"]
    correct = _unit("correct", t, r) < 0.2 + 0.6 * _unit("difficulty", t)
    answer = materialized.get("expected_answer", "0") if correct else str(int(_unit("wrong", t, r) * 3))
    text = (LOREM * (text_chars // len(LOREM) + 1))[: text_chars - 12] + f"\\boxed{{{answer}}}"
    inp, out = 20 + int(_unit("in", t) * 50), 30 + int(_unit("out", t, r) * 400)
    reward: Any = round(_unit("score", t, r), 6) if continuous else (1.0 if correct else 0.0)
    rcp = dict(materialized["responses_create_params"])
    rcp.setdefault("temperature", None)
    return {
        "responses_create_params": rcp,
        "response": {
            "id": f"resp_{t}_{r}",
            "object": "response",
            "model": "policy",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "id": f"msg_{t}_{r}",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": inp,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": inp + out,
            },
        },
        "reward": reward,
        "expected_answer": materialized.get("expected_answer"),
        "extracted_answer": answer if _unit("parsed", t, r) > 0.1 else None,
        "library_reward": reward,
        "is_correct": bool(correct),
        "num_turns": 1 + int(_unit("turns", t, r) * 3),
        "latency_s": round(0.5 + 4 * _unit("latency", t, r), 3),
        "_ng_task_index": t,
        "_ng_rollout_index": r,
        "agent_ref": materialized["agent_ref"],
    }


@dataclass
class ShardWrite:
    """What write_shard put in a shard (for tests to check against)."""

    rows: list[dict[str, Any]] = field(default_factory=list)  # the rows as written, file order
    missing: list[tuple[int, int]] = field(default_factory=list)  # planned identities left out
    failed: list[tuple[int, int]] = field(default_factory=list)  # identities written to the failure sidecar
    foreign: list[tuple[int, int]] = field(default_factory=list)


def write_shard(
    run: Run,
    shard: int,
    *,
    order: str = "shuffled",
    duplicates: int = 0,
    torn: bool = False,
    foreign: int = 0,
    missing: int = 0,
    failed: int = 0,
    renumber: bool = False,
    seal_it: bool = True,
    make_row: Callable[[dict[str, Any]], dict[str, Any]] = rollout_row,
    seed: int = 0,
    gpus: int = 1,
    hours: float = 0.5,
) -> ShardWrite:
    """Write rollouts.jsonl (+ failure sidecar) for a shard and seal it (unless seal_it=False).

    order: "shuffled" (completion order) or "planned"; duplicates: rows written twice (a resumed shard);
    torn: a half line at the end; foreign: rows with an identity the plan does not have; missing: planned
    rollouts never written; failed: planned rollouts recorded only in the failure sidecar (the marker counts
    them as failed); renumber: write rollout indices 0..m-1 per task as Gym does when it numbers repeats itself.
    """
    rng = random.Random(seed * 1009 + shard)
    planned = run.materialized(shard)
    rows = [make_row(m) for m in planned]
    if order == "shuffled":
        rng.shuffle(rows)
    result = ShardWrite()
    dropped = rows[: missing + failed]
    rows = rows[missing + failed :]
    result.missing = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in dropped[:missing]]
    result.failed = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in dropped[missing:]]
    if renumber:
        rows = _renumbered(rows, planned)
    for d in range(duplicates):
        twin = dict(rows[d % len(rows)])
        twin["reward"] = -1.0  # a later, different copy: the first one must win
        rows.append(twin)
    for f in range(foreign):
        alien = make_row({**planned[0], "_ng_task_index": 10**9 + f, "_ng_rollout_index": 0})
        rows.insert(rng.randrange(len(rows) + 1), alien)
        result.foreign.append((10**9 + f, 0))
    result.rows = rows
    path = store.rollouts_path(run.run_dir, shard)
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    if torn:
        data += orjson.dumps(make_row(planned[-1]))[:37]
    path.write_bytes(data)
    _write_failures(run, shard, result.failed, renumber, planned)
    if seal_it:
        seal_shard(run, shard, num_failed=len(result.failed) + len(result.missing), gpus=gpus, hours=hours)
    return result


def _renumbered(rows: list[dict[str, Any]], planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    local: dict[tuple[int, int], int] = {}
    per_task: dict[int, list[int]] = {}
    for m in planned:
        per_task.setdefault(m["_ng_task_index"], []).append(m["_ng_rollout_index"])
    for t, rs in per_task.items():
        for j, r in enumerate(sorted(rs)):
            local[(t, r)] = j
    return [{**r, "_ng_rollout_index": local[(r["_ng_task_index"], r["_ng_rollout_index"])]} for r in rows]


def _write_failures(
    run: Run, shard: int, failed: list[tuple[int, int]], renumber: bool, planned: list[dict[str, Any]]
) -> None:
    if not failed:
        return
    numbering = {}
    if renumber:
        rows = _renumbered([{"_ng_task_index": t, "_ng_rollout_index": r} for t, r in failed], planned)
        numbering = {f: (x["_ng_task_index"], x["_ng_rollout_index"]) for f, x in zip(failed, rows)}
    lines = []
    for attempt in range(2):
        for t, r in failed:
            t2, r2 = numbering.get((t, r), (t, r))
            lines.append(
                orjson.dumps(
                    {
                        "_ng_task_index": t2,
                        "_ng_rollout_index": r2,
                        "agent_ref": {"name": "x"},
                        "_ng_failure_class": "http_500",
                        "error": f"attempt {attempt}",
                    }
                )
                + b"\n"
            )
    store.failures_path(run.run_dir, shard).write_bytes(b"".join(lines))


def seal_shard(
    run: Run | Path,
    shard: int,
    *,
    plan: planner.Plan | None = None,
    num_rollouts: int | None = None,
    num_failed: int | None = None,
    gpus: int = 1,
    hours: float = 0.5,
    started_at: float | None = None,
    finished_at: float | None = None,
    host: str = "testhost",
    job_id: str | None = None,
    attempt: int = 1,
    server_wait_s: float = 1.0,
    collect_s: float | None = None,
    **fields: Any,
) -> seal.Seal:
    """Write a valid .done marker for the shard's current rollouts.jsonl, as a job seals it: the one writer of
    seals for tests and benchmarks. `run` is a Run or a run directory (its plan loaded unless `plan` is given).
    Counts: num_failed (default 0) and num_rollouts (default the planned rollouts less the failed). Times: ending
    now (or finished_at), `hours` long (or from started_at), collecting all but 1 s of it (or collect_s). `fields`
    go to seal.make_marker as they are (extra accounting, label_rollouts, skipped tasks of an adaptive run)."""
    if isinstance(run, Path):
        run_dir, plan = run, plan or store.load_plan(run)
    else:  # a Run (of this module, or of `builders` as scripts and reportkit import it)
        run_dir, plan = run.run_dir, plan or run.plan
    path = store.rollouts_path(run_dir, shard)
    failed = num_failed if num_failed is not None else 0
    finished = finished_at if finished_at is not None else time.time()
    started = started_at if started_at is not None else finished - hours * 3600
    marker = seal.make_marker(
        plan,
        shard,
        num_rollouts=num_rollouts if num_rollouts is not None else plan.shards[shard].num_rollouts - failed,
        num_failed=failed,
        rollouts_sha256=store.sha256_file(path),
        rollouts_bytes=path.stat().st_size,
        started_at=started,
        finished_at=finished,
        host=host,
        job_id=job_id,
        attempt=attempt,
        server_wait_s=server_wait_s,
        collect_s=collect_s if collect_s is not None else hours * 3600 - 1,
        gpus=gpus,
        **fields,
    )
    seal.write_marker(run_dir, shard, marker)
    return marker
