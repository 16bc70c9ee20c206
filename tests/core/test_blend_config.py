"""A blend's config: entries, materialize, their checks and their Hydra overrides (docs/blends.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardrun.core import config
from shardrun.core.errors import BadInput


def entries(*labels: str, agent: str = "a", **extra) -> list[dict]:
    return [{"label": x, "data": f"{x}.jsonl", "agent": agent} | extra for x in labels]


def blend(**kw) -> dict:
    return {"run_dir": "run", "entries": entries("one", "two")} | kw


def test_a_blend_validates_and_mixes_its_shards_by_default():
    cfg = config.validate(blend())
    assert [e.label for e in cfg.entries or ()] == ["one", "two"]
    assert cfg.input_jsonl is None
    assert cfg.sharding.slicing == "round_robin"  # unset: the labels are mixed over the shards
    assert config.validate(blend(sharding={"slicing": "contiguous"})).sharding.slicing == "contiguous"
    assert config.validate({"run_dir": "r", "input_jsonl": "x"}).sharding.slicing == "contiguous"


def test_adaptive_sampling_keeps_wave_order():
    cfg = config.validate(blend(sampling={"stop_when_decided": {"drop_solved": True}}))
    assert cfg.sharding.slicing == "contiguous"


@pytest.mark.parametrize(
    "data, says",
    [
        ({"run_dir": "r"}, "give exactly one of input_jsonl"),
        (blend(input_jsonl="x.jsonl"), "not both"),
        (blend(entries=entries("one", "one")), "label(s) used more than once: one"),
        (blend(entries=entries("a/b")), "entries.0.label"),
        (blend(entries=[]), "at least one entry"),
        (blend(agent_name="x"), "each entry names its agent"),
        (blend(entries=entries("one", limit=0)), "entries.0.limit"),
        (blend(materialize={"sample": "tail"}), "materialize.sample"),
        (blend(entries=entries("one", colour="red")), "entries.0.colour: unknown key"),
    ],
)
def test_bad_blends_are_named(data, says):
    with pytest.raises(BadInput) as e:
        config.validate(data)
    assert says in str(e.value)


def test_entry_configs_join_gym_config_paths_once_in_order():
    cfg = config.validate(
        blend(
            gym={"config_paths": ["model.yaml", "x.yaml"]},
            entries=entries("one", configs=["x.yaml", "y.yaml"]) + entries("two", configs=["y.yaml", "z.yaml"]),
        )
    )
    assert cfg.gym is not None and cfg.gym.config_paths == ["model.yaml", "x.yaml", "y.yaml", "z.yaml"]
    again = config.validate(cfg.model_dump(mode="json"))  # plan.json's config validates to the same
    assert again.gym is not None and again.gym.config_paths == cfg.gym.config_paths


def test_limit_resolution_and_planning_view():
    cfg = config.validate(
        blend(entries=entries("one") + entries("two", limit=3, num_repeats=5), materialize={"limit_per_entry": 2})
    )
    view = cfg.planning_view()["blend"]
    assert [(e["label"], e["limit"], e["num_repeats"]) for e in view["entries"]] == [
        ("one", 2, None),
        ("two", 3, 5),
    ]
    assert (view["sample"], view["seed"]) == ("head", 0)
    assert "blend" not in config.validate({"run_dir": "r", "input_jsonl": "x"}).planning_view()


def test_overrides_reach_entries_and_materialize(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "blend.yaml"
    path.write_text(yaml.safe_dump(blend(entries=entries("one", "two"), materialize={"limit_per_entry": 4})))
    cfg = config.load(path, ["materialize.sample=random", "entries.1.limit=3"])
    assert cfg.materialize.limit_per_entry == 4 and cfg.materialize.sample == "random"
    assert cfg.entries is not None and cfg.entries[1].limit == 3 and cfg.entries[0].limit is None
    # on the command line, limit_per_entry caps every entry, its own limit included (a smoke run)
    cfg = config.load(path, ["materialize.limit_per_entry=2", "entries.1.limit=3"])
    assert cfg.materialize.limit_per_entry == 2 and cfg.entries is not None and cfg.entries[1].limit == 2
    cfg = config.load(path, ["materialize.limit_per_entry=5", "entries.1.limit=3"])
    assert cfg.entries is not None and cfg.entries[1].limit == 3
    assert cfg.entries[0].data == tmp_path / "one.jsonl"  # relative to the current directory, as input_jsonl
    assert config.load(path, ["materialize.limit_per_entry=null"]).materialize.limit_per_entry is None
