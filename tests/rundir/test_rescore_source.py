"""`shardrun rescore`'s config and plan (rundir/rescore_source.py), without Gym: the re-score's plan has the source's
rollouts (same identities in the same shards), its fingerprint covers the new scoring config and names the source,
and what cannot be re-scored is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardrun.core import config
from shardrun.core.errors import BadInput
from shardrun.plan import planner
from shardrun.rundir import rescore_source, store
from tests import builders
from tests.planning_helpers import row

MATH = "resources_servers/math_with_judge/configs/math_with_judge.yaml"
SCORING = "gym.overrides=['++math_with_judge.resources_servers.math_with_judge.should_use_judge=true']"


def source_run(tmp: Path, seal: bool = True) -> builders.Run:
    src = tmp / "input.jsonl"
    src.write_text("".join(json.dumps(row(i)) + "\n" for i in range(6)))
    cfg = config.validate(
        {
            "input_jsonl": str(src),
            "run_dir": str(tmp / "source"),
            "num_repeats": 2,
            "sharding": {"num_shards": 3},
            "gym": {"config_paths": [MATH]},
            "policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
        }
    )
    plan, _ = store.write_plan(cfg)
    run = builders.Run(cfg.run_dir, cfg, plan)
    for spec in plan.shards:
        builders.write_shard(run, spec.index, seal_it=seal or spec.index != 1)
    return run


def test_same_config_gives_the_source_rollouts_under_a_fingerprint_that_names_the_source(tmp_path: Path) -> None:
    run = source_run(tmp_path)
    setup = rescore_source.rescore_config(run.run_dir, [], tmp_path / "new")
    cfg = setup.cfg
    assert cfg.rescore is not None
    assert cfg.rescore.source_run == run.run_dir.resolve()
    assert cfg.rescore.source_fingerprint == run.plan.fingerprint
    assert cfg.gym == run.cfg.gym and cfg.run_dir == (tmp_path / "new").resolve()
    plan = store.scan_input(cfg)
    assert planner.same_rollouts(plan, run.plan) and plan.shards == run.plan.shards
    assert plan.fingerprint != run.plan.fingerprint  # a re-score never takes the source's seals for its own


def test_the_fingerprint_covers_the_scoring_config_and_the_flags(tmp_path: Path) -> None:
    run = source_run(tmp_path)
    plain = store.scan_input(rescore_source.rescore_config(run.run_dir, [], tmp_path / "a").cfg)
    changed_cfg = rescore_source.rescore_config(run.run_dir, [SCORING], tmp_path / "a").cfg
    assert changed_cfg.gym is not None and changed_cfg.gym.overrides == [
        "++math_with_judge.resources_servers.math_with_judge.should_use_judge=true"
    ]
    changed = store.scan_input(changed_cfg)
    forced = store.scan_input(rescore_source.rescore_config(run.run_dir, [], tmp_path / "a", force=True).cfg)
    failed = store.scan_input(rescore_source.rescore_config(run.run_dir, [], tmp_path / "a", failed_only=True).cfg)
    prints = {plain.fingerprint, changed.fingerprint, forced.fingerprint, failed.fingerprint}
    assert len(prints) == 4
    assert all(planner.same_rollouts(p, run.plan) for p in (plain, changed, forced, failed))


def test_overrides_that_change_the_rollouts_are_refused(tmp_path: Path) -> None:
    run = source_run(tmp_path)
    for o in ("num_repeats=3", "seed_offset=7", "sharding.num_shards=2"):
        with pytest.raises(BadInput, match="change which rollouts exist"):
            rescore_source.rescore_config(run.run_dir, [o], tmp_path / "new")
    with pytest.raises(BadInput, match="set by `shardrun rescore` itself"):
        rescore_source.rescore_config(run.run_dir, ["rescore.force=true"], tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_an_unsealed_source_shard_and_the_source_as_output_are_refused(tmp_path: Path) -> None:
    run = source_run(tmp_path, seal=False)
    with pytest.raises(BadInput, match=r"1 shard\(s\) not sealed.*1: no marker"):
        rescore_source.rescore_config(run.run_dir, [], tmp_path / "new")
    with pytest.raises(BadInput, match="that is the source run"):
        rescore_source.rescore_config(run.run_dir, [], run.run_dir)


def test_a_new_run_dir_holding_another_scoring_is_refused(tmp_path: Path) -> None:
    run = source_run(tmp_path)
    first = rescore_source.rescore_config(run.run_dir, [], tmp_path / "new").cfg
    store.write_plan(first)
    again = rescore_source.rescore_config(run.run_dir, [], tmp_path / "new")  # the same re-score: resumable
    assert again.cfg.rescore == first.rescore
    with pytest.raises(BadInput, match="holds another run or a re-score with other settings"):
        rescore_source.rescore_config(run.run_dir, [SCORING], tmp_path / "new")


def test_warm_workers_are_kept(tmp_path: Path) -> None:
    run = source_run(tmp_path)
    setup = rescore_source.rescore_config(run.run_dir, ["+cluster.workers=2"], tmp_path / "new")
    assert setup.cfg.cluster is not None and setup.cfg.cluster.workers == 2
