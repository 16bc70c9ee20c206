"""A blend's input (docs/blends.md): its entries' files read into one stream of rows, as one input file would be.

`layout(cfg)` reads every entry's file once (its sha256, its non-blank rows) and picks its rows (all, the first N,
or N sampled at random with a generator seeded by `materialize.seed` and the entry's label alone, so adding,
removing or reordering other entries never moves an entry's sample; chosen rows keep their file order). `lines`
then yields the blended rows, entry after entry, each as it is in its file except that `agent_ref` naming the
entry's agent is added where the row has none. The planner validates and plans these rows as one input
(planner.BlendLayout names each row's file and line in its errors); write_plan stores them as RUN_DIR/input.jsonl,
the plan's input.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from array import array
from pathlib import Path
from typing import Iterator

import orjson

from shardrun.core.config import EntryConfig, MaterializeConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.core.gym_names import AGENT_KEY
from shardrun.plan import planner
from shardrun.rundir import fileio

BLEND_SOURCE = "blend"  # the source name of blended lines where no entry's file applies


def sample_seed(seed: int, label: str) -> int:
    """The random-sampling seed of one entry: `seed` mixed with its label alone (CRC-32 of the label, as NeMo
    Gym's reward-profiling materialize mixes it, so a manifest samples the same rows under both)."""
    return seed + (zlib.crc32(label.encode()) & 0xFFFFFFFF)


def layout(cfg: RunConfig) -> planner.BlendLayout:
    """Read every entry's file (streamed) and pick its rows: the blend's layout. BadInput names the entry."""
    if not cfg.entries:
        raise BadInput("this config has no entries (a blend); it names input_jsonl")
    missing = [
        f"entries.{i}.data (entry {e.label!r}): {e.data}: no such file"
        for i, e in enumerate(cfg.entries)
        if not Path(e.data).is_file()
    ]
    if missing:
        root = "under data_root" if cfg.data_root is not None else "(set data_root=DIR where the files are elsewhere)"
        raise BadInput(f"{len(missing)} of {len(cfg.entries)} entries' data files are missing {root}", missing)
    return planner.BlendLayout(tuple(_part(entry, cfg.materialize) for entry in cfg.entries))


def _part(entry: EntryConfig, spec: MaterializeConfig) -> planner.BlendPart:
    limit = spec.limit_for(entry)
    hasher = hashlib.sha256()
    hint = f" (entry {entry.label!r}, field data)"
    chosen = array("q")
    rows = 0
    rng = random.Random(sample_seed(spec.seed, entry.label)) if spec.sample == "random" and limit else None
    reservoir: list[int] = []
    with fileio.open_input(Path(entry.data), hint) as f:
        for line_no, raw in enumerate(f, 1):
            hasher.update(raw)
            if not raw.strip():
                continue
            if rng is not None and limit is not None:  # Algorithm R over the non-blank rows
                if len(reservoir) < limit:
                    reservoir.append(line_no)
                else:
                    j = rng.randrange(rows + 1)
                    if j < limit:
                        reservoir[j] = line_no
            elif limit is None or rows < limit:
                chosen.append(line_no)
            rows += 1
    if rng is not None:
        chosen = array("q", sorted(reservoir))
    if rows == 0:
        raise BadInput(f"{entry.data}: entry {entry.label!r}: the file has no rows (no non-blank lines)")
    return planner.BlendPart(
        label=entry.label,
        agent=entry.agent,
        data=str(entry.data),
        sha256=hasher.hexdigest(),
        rows_in_file=rows,
        line_numbers=chosen,
        repeats=entry.num_repeats,
        configs=tuple(entry.configs),
        owner=entry.owner,
    )


def lines(plan_layout: planner.BlendLayout, hasher: "hashlib._Hash | None" = None) -> Iterator[tuple[int, bytes]]:
    """(blended line number, row) for every chosen row, entry after entry; `hasher` gets every blended line with
    its newline (the bytes of RUN_DIR/input.jsonl). A file that changed since `layout` read it ends in BadInput."""
    n = 0
    for part in plan_layout.parts:
        wanted = iter(part.line_numbers)
        target = next(wanted, None)
        with fileio.open_input(Path(part.data), f" (entry {part.label!r}, field data)") as f:
            for line_no, raw in enumerate(f, 1):
                if target is None:
                    break
                if line_no != target:
                    continue
                row = with_agent(raw.rstrip(b"\r\n"), part.agent)
                n += 1
                if hasher is not None:
                    hasher.update(row + b"\n")
                yield n, row
                target = next(wanted, None)
        if target is not None:
            raise BadInput(f"{part.data}: entry {part.label!r}: the file changed while it was being read; plan again")


def with_agent(raw: bytes, agent: str) -> bytes:
    """The row as it is, with `agent_ref: {name: agent}` added at its end when it has no agent_ref of its own. A
    line that is not a JSON object is left as it is (the planner names its file and line)."""
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(row, dict) or AGENT_KEY in row:
        return raw
    row[AGENT_KEY] = {"name": agent}
    return orjson.dumps(row)
