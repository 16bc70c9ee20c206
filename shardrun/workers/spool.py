"""The collector service's spool files, as shardrun writes and reads them: one typed model each.

The service's program (workers/collector_service_gym.py, run by the Gym venv's Python, which cannot import
shardrun) writes its side with plain JSON; its docstring lists the protocol, and these models are the one definition
shardrun holds it to. Every file is written whole by rename, by either side. What the service wrote and shardrun
cannot read as its model is never trusted: a garbled exit ends the round as failed, a garbled answer to a lend lends
nothing, a garbled slots report says nothing is free.
"""

from __future__ import annotations

from pathlib import Path
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardrun.rundir import store
from shardrun.rundir.records import Count, Finite

RUN = ".run.json"  # shardrun: collect one shard round
CANCEL = ".cancel"  # shardrun: stop that round
EXIT = ".exit.json"  # the service: the round is over
LEND = ".lend.json"  # shardrun: lend a share of the round's rollouts waiting for a slot
LENT = ".lent.json"  # the service: the identities lent
ROUND_FILES = (RUN, CANCEL, EXIT, LEND, LENT)
SLOTS = "slots.json"  # the service: its budget's state, written when it changes
STOP = "stop"  # shardrun: end the service


class SpoolFile(BaseModel):
    """A spool file: strict types; fields a newer service adds are kept."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class RoundJob(SpoolFile):
    """NAME.run.json: the shard round's materialized rows, where its rows go, its collector log."""

    input: str
    output: str
    log: str


class RoundExit(SpoolFile):
    """NAME.exit.json: 0: Gym returned, or every row but the lent ones is done; 1: it raised; -15: cancelled."""

    rc: int


class LendAsk(SpoolFile):
    """NAME.lend.json: the share of the round's rollouts still waiting for a slot to lend (0 to 1)."""

    fraction: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)


class LentRows(SpoolFile):
    """NAME.lent.json: the identities lent, as [task, rollout] pairs."""

    rows: list[tuple[Count, Count]]


class SlotsReport(SpoolFile):
    """slots.json: the rollouts holding a slot of the budget (`held`; `budget` None: no budget), since when
    (time.time()) a slot has been free with no rollout waiting (`idle_since`, None while all are taken or one waits),
    since when no rollout has waited (`drained_since`, None while one waits), the rounds whose rollouts have asked
    for a slot (`started`)."""

    budget: Count | None = None
    held: Count = 0
    idle_since: Finite | None = None
    drained_since: Finite | None = None
    started: list[str] = Field(default_factory=list)

    def shards_started(self) -> set[int]:
        """The shards of the started rounds (a round is named shard-INDEX-N)."""
        out = set()
        for name in self.started:
            parts = name.split("-")
            if len(parts) == 3 and parts[0] == "shard" and parts[1].isascii() and parts[1].isdigit():
                out.add(int(parts[1]))
        return out


def write(path: Path, record: SpoolFile) -> None:
    with store.atomic_writer(path) as f:
        f.write(orjson.dumps(record.model_dump(mode="json")))


class Garbled(Exception):
    """A spool file that is not its model (the service wrote something else, or the file was damaged)."""


def read[M: SpoolFile](path: Path, model: type[M]) -> M | None:
    """The file as `model`, or None when there is none; Garbled when it is not one (the caller does not trust it)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Garbled(f"{path}: unreadable ({e.strerror})") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise Garbled(f"{path}: not {model.__name__} ({e.error_count()} problem(s))") from None
