"""The config of a re-score (`shardrun rescore RUN [overrides] -o NEW_RUN`, docs/rescore.md): the source run's
config as its plan.json recorded it, with the user's Hydra overrides applied (Hydra's grammar, as every config),
the new run directory, and a `rescore` section naming the source run and its plan fingerprint. The plan made from it
has the source's rollouts exactly (same input bytes, planning settings and shard table: the same identities in the
same shards), and its fingerprint covers the new scoring config (the whole config is in plan.json).

Refused before anything is written or launched: a source that is not a run directory with a valid plan, a source
shard that is not sealed, overrides that change which rollouts exist (num_repeats, seeds, sharding, ...), and a
new run directory that is the source itself."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from shardrun.core import config as config_mod
from shardrun.core.config import RescoreConfig, RunConfig
from shardrun.core.errors import BadInput
from shardrun.plan import planner
from shardrun.plan.planner import Plan
from shardrun.rundir import seal, store


@dataclass
class RescoreSetup:
    cfg: RunConfig
    source_plan: Plan


def source_config(source_plan: Plan, new_run: Path) -> dict:
    """The source's recorded config as a config file's data: the new run directory, no earlier re-score section
    (a re-score of a re-score names its own source)."""
    data = dict(source_plan.config)
    data.pop("rescore", None)
    data["run_dir"] = str(new_run)
    return data


def unsealed_shards(source: Path, plan: Plan) -> list[str]:
    """`index: reason` for each shard of the source that is not sealed (what a re-score cannot read)."""
    out = []
    for spec in plan.shards:
        state = seal.check(source, plan, spec.index)
        if not state.sealed:
            out.append(f"{spec.index}: {state.reason}")
    return out


def rescore_config(
    source: Path, overrides: Sequence[str], new_run: Path, *, failed_only: bool = False, force: bool = False
) -> RescoreSetup:
    """The re-score's config (module docstring); BadInput for what it refuses."""
    source = Path(source).resolve()
    new_run = Path(new_run).resolve()
    if new_run == source:
        raise BadInput(f"-o {new_run}: that is the source run; re-score into a new run directory")
    store.check_run_dir(source)
    if not store.plan_path(source).exists():
        raise BadInput(f"{source}: no plan.json; name a run directory that shardrun collected")
    source_plan = store.load_plan(source)
    bad = overrides_of(overrides, "rescore")
    if bad:
        raise BadInput(f"override {bad!r}: the rescore section is set by `shardrun rescore` itself")
    with tempfile.TemporaryDirectory(prefix="shardrun-rescore-") as d:
        path = Path(d) / "source-config.yaml"
        path.write_text(yaml.safe_dump(source_config(source_plan, new_run), sort_keys=False))
        try:
            cfg = config_mod.load(path, list(overrides))
        except BadInput as e:  # name the source run's config, not the temporary file it was composed from
            raise BadInput(str(e).replace(str(path), f"{store.plan_path(source)} (its config)")) from None
    cfg.require("gym")
    rescore = RescoreConfig(
        source_run=source, source_fingerprint=source_plan.fingerprint, failed_only=failed_only, force=force
    )
    cfg = cfg.model_copy(update={"rescore": rescore})
    cfg = RunConfig.model_validate(cfg.model_dump())  # checked as a whole again, as every config is
    unsealed = unsealed_shards(source, source_plan)
    if unsealed:
        shown = "; ".join(unsealed[:5]) + (f"; and {len(unsealed) - 5} more" if len(unsealed) > 5 else "")
        raise BadInput(f"{source}: {len(unsealed)} shard(s) not sealed, nothing to re-score there ({shown})")
    plan = store.scan_input(cfg)
    check_same_rollouts(source_plan, plan)
    if store.plan_path(new_run).exists():  # resuming: only the same re-score (a plan of the same rollouts would
        old = store.load_plan(new_run)  # otherwise be taken as it is, with its own scoring config)
        if old.fingerprint != plan.fingerprint:
            raise BadInput(
                f"-o {new_run} holds another run or a re-score with other settings (fingerprint "
                f"{old.fingerprint[:12]}…, this re-score {plan.fingerprint[:12]}…); re-score into a new directory"
            )
    return RescoreSetup(cfg, source_plan)


def overrides_of(overrides: Sequence[str], key: str) -> str | None:
    """The first override that sets `key` or a key under it (any of Hydra's +, ++, ~ prefixes), or None (pure)."""
    for o in overrides:
        name = o.lstrip("+~").split("=", 1)[0].strip()
        if name == key or name.startswith(key + "."):
            return o
    return None


def check_same_rollouts(source_plan: Plan, plan: Plan) -> None:
    """BadInput unless the re-score's plan has the source's rollouts (identities, seeds, shards) exactly."""
    if not planner.same_rollouts(source_plan, plan):
        diffs = planner.plan_differences(source_plan, plan)
        raise BadInput(
            "the overrides change which rollouts exist; a re-score changes only how they are scored:\n"
            + "\n".join(f"  - {d}" for d in diffs)
        )
