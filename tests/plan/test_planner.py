"""The planner's identity, seed and sharding rules (pure: no files)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.plan import planner
from tests.planning_helpers import plan_rows, row


def identities(out):
    return [(r["_ng_task_index"], r["_ng_rollout_index"]) for _, r in out]


def seed_of(r):
    return json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"]


@settings(max_examples=150, deadline=None)
@given(
    agents=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=40),
    repeats=st.one_of(
        st.integers(1, 6),
        st.fixed_dictionaries({"a": st.integers(1, 5), "b": st.integers(1, 5), "_default": st.integers(1, 3)}),
    ),
    num_shards=st.integers(1, 50),
    slicing=st.sampled_from(["contiguous", "round_robin"]),
    seed_offset=st.integers(0, 1000),
)
def test_every_identity_in_exactly_one_shard(agents, repeats, num_shards, slicing, seed_offset):
    rows = [row(i, agent=a) for i, a in enumerate(agents)]
    plan, out = plan_rows(
        rows, num_repeats=repeats, seed_offset=seed_offset, sharding={"num_shards": num_shards, "slicing": slicing}
    )
    expected = set()
    for t, a in enumerate(agents):
        k = repeats if isinstance(repeats, int) else repeats.get(a, repeats["_default"])
        expected |= {(t, r) for r in range(k)}
    ids = identities(out)
    assert Counter(ids) == Counter(expected)  # each identity exactly once over all shards
    per_shard = Counter(s for s, _ in out)
    assert len(plan.shards) == min(num_shards, len(expected))
    for spec in plan.shards:
        assert per_shard[spec.index] == spec.num_rollouts
    sizes = [s.num_rollouts for s in plan.shards]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == plan.num_rollouts == len(expected)
    for _, r in out:
        assert seed_of(r) == seed_offset + r["_ng_rollout_index"]


def test_contiguous_keeps_tasks_together_when_sizes_allow():
    plan, out = plan_rows([row(i) for i in range(4)], num_repeats=4, sharding={"num_shards": 2})
    shards = defaultdict(set)
    for s, r in out:
        shards[s].add(r["_ng_task_index"])
    assert shards == {0: {0, 1}, 1: {2, 3}}


def test_contiguous_splits_a_task_only_when_it_must():
    # 3 tasks x 4 = 12 rollouts over 2 shards of 6: task 1 must be split, tasks 0 and 2 are not
    _, out = plan_rows([row(i) for i in range(3)], num_repeats=4, sharding={"num_shards": 2})
    owners = defaultdict(set)
    for s, r in out:
        owners[r["_ng_task_index"]].add(s)
    assert owners == {0: {0}, 1: {0, 1}, 2: {1}}


def test_round_robin_spreads_a_tasks_rollouts_over_shards():
    _, out = plan_rows([row(i) for i in range(3)], num_repeats=4, sharding={"num_shards": 4, "slicing": "round_robin"})
    owners = defaultdict(set)
    for s, r in out:
        owners[r["_ng_task_index"]].add(s)
    assert all(len(v) == 4 for v in owners.values())


def test_rollouts_per_shard_sets_the_shard_count():
    plan, _ = plan_rows([row(i) for i in range(10)], num_repeats=3, sharding={"rollouts_per_shard": 7})
    assert len(plan.shards) == 5  # ceil(30 / 7)
    assert {s.num_rollouts for s in plan.shards} == {6}


def test_identical_lines_are_distinct_tasks():
    same = row(0)
    _, out = plan_rows([same, same, same], num_repeats=2)
    assert sorted(set(identities(out))) == [(t, r) for t in range(3) for r in range(2)]


def test_explicit_task_index_is_honoured_and_positions_fill_the_rest():
    rows = [row(0, _ng_task_index=100), row(1), row(2, _ng_task_index=7)]
    _, out = plan_rows(rows, num_repeats=1)
    assert [r["_ng_task_index"] for _, r in out] == [100, 1, 7]


def test_blank_lines_are_not_tasks():
    import orjson

    rows = [orjson.dumps(row(0)), b"", b"   ", orjson.dumps(row(1))]
    _, out = plan_rows(rows, num_repeats=1)
    assert [r["_ng_task_index"] for _, r in out] == [0, 1]


def test_seed_merges_into_existing_extra_body_and_offset_applies():
    r = row(0)
    r["responses_create_params"]["metadata"] = {"extra_body": json.dumps({"top_k": 5}), "tag": "x"}
    _, out = plan_rows([r], num_repeats=3, seed_offset=1000)
    for _, m in out:
        eb = json.loads(m["responses_create_params"]["metadata"]["extra_body"])
        assert eb == {"top_k": 5, "seed": 1000 + m["_ng_rollout_index"]}
        assert m["responses_create_params"]["metadata"]["tag"] == "x"


def test_default_agent_and_params_overrides_are_stamped():
    r = row(0, agent=None)
    _, out = plan_rows([r], num_repeats=1, agent_name="fallback", gym={"responses_create_params": {"temperature": 0.5}})
    m = out[0][1]
    assert m["agent_ref"] == {"name": "fallback"}
    assert m["responses_create_params"]["temperature"] == 0.5


def test_sentinel_collision_falls_back_to_exact_rows():
    r = row(0, note=str(planner._SENT_ROLLOUT))
    _, out = plan_rows([r], num_repeats=2)
    assert [m["_ng_rollout_index"] for _, m in out] == [0, 1]
    assert out[0][1]["note"] == str(planner._SENT_ROLLOUT)


def test_fingerprint_changes_with_settings_and_not_with_run_dir():
    p1, _ = plan_rows([row(i) for i in range(5)], num_repeats=2)
    p2, _ = plan_rows([row(i) for i in range(5)], num_repeats=2, run_dir="elsewhere")
    p3, _ = plan_rows([row(i) for i in range(5)], num_repeats=3)
    p4, _ = plan_rows([row(i) for i in range(5)], num_repeats=2, sharding={"num_shards": 2})
    assert p1.fingerprint == p2.fingerprint
    assert len({p1.fingerprint, p3.fingerprint, p4.fingerprint}) == 3
    assert planner.fingerprint(p1) == p1.fingerprint


def test_plan_round_trips_through_json():
    p, _ = plan_rows([row(i) for i in range(5)], num_repeats=2, sharding={"num_shards": 3, "slicing": "round_robin"})
    assert planner.Plan.from_json(p.to_json()) == p


def test_unused_num_repeats_key_warns():
    p, _ = plan_rows([row(0, agent="a")], num_repeats={"a": 2, "typo_agent": 3})
    assert any("typo_agent" in w for w in p.warnings)


@pytest.mark.parametrize("n,shards", [(1, 1), (7, 3), (100, 7), (5, 9)])
def test_router_agrees_with_shard_specs(n, shards):
    for slicing in ("contiguous", "round_robin"):
        specs = planner.make_shards(n, min(shards, n), slicing)
        route = planner.Router(specs)
        for o in range(n):
            assert specs[route(o)].owns(o)
            assert sum(s.owns(o) for s in specs) == 1


# ---------------------------------------------------------------- wave-major shards (adaptive sampling)

ADAPTIVE = {"stop_when_decided": {"drop_solved": True, "drop_unsolved": True}}


@settings(max_examples=100, deadline=None)
@given(
    agents=st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=25),
    repeats=st.one_of(
        st.integers(1, 7), st.fixed_dictionaries({"a": st.integers(1, 7), "_default": st.integers(1, 4)})
    ),
    num_shards=st.integers(1, 40),
    slicing=st.sampled_from(["contiguous", "round_robin"]),
    wave=st.integers(1, 4),
)
def test_wave_major_shards_keep_every_identity_and_seed_and_order_the_waves(agents, repeats, num_shards, slicing, wave):
    rows = [row(i, agent=a) for i, a in enumerate(agents)]
    settings_ = dict(num_repeats=repeats, seed_offset=5, sharding={"num_shards": num_shards, "slicing": slicing})
    full_plan, full = plan_rows(rows, **settings_)
    plan, out = plan_rows(rows, **settings_, sampling=ADAPTIVE | {"wave": wave})
    # the same rows (identities, seeds, bytes), only in other shards
    assert sorted(orjson_dumps(r) for _, r in out) == sorted(orjson_dumps(r) for _, r in full)
    assert [s.num_rollouts for s in plan.shards] == [s.num_rollouts for s in full_plan.shards]
    per_shard = Counter(s for s, _ in out)
    for spec in plan.shards:
        assert per_shard[spec.index] == spec.num_rollouts
    if slicing == "contiguous":
        # shards in index order run the waves in order: a task's first wave comes before any task's second
        waves = [max(r["_ng_rollout_index"] // wave for s2, r in out if s2 == s) for s in range(len(plan.shards))]
        firsts = [min(r["_ng_rollout_index"] // wave for s2, r in out if s2 == s) for s in range(len(plan.shards))]
        assert all(waves[i] <= firsts[i + 1] for i in range(len(waves) - 1))
        # what a pipelining worker reads off the plan: the first and last wave each shard's rollouts belong to
        order = planner.WaveOrder(plan)
        assert [order.waves_of(s) for s in plan.shards] == [
            (firsts[s.index], waves[s.index]) if s.num_rollouts else None for s in plan.shards
        ]


def orjson_dumps(r):
    return json.dumps(r, sort_keys=True)


def test_wave_major_example_and_fingerprints():
    rows = [row(i) for i in range(3)]
    plan, out = plan_rows(rows, num_repeats=4, sharding={"num_shards": 4}, sampling=ADAPTIVE)
    by_shard = defaultdict(list)
    for s, r in out:
        by_shard[s].append((r["_ng_task_index"], r["_ng_rollout_index"]))
    # wave 0 (rollouts 0-1 of tasks 0, 1, 2) fills shards 0 and 1, wave 1 shards 2 and 3
    assert by_shard == {
        0: [(0, 0), (0, 1), (1, 0)],
        1: [(1, 1), (2, 0), (2, 1)],
        2: [(0, 2), (0, 3), (1, 2)],
        3: [(1, 3), (2, 2), (2, 3)],
    }
    assert [planner.WaveOrder(plan).waves_of(s) for s in plan.shards] == [(0, 0), (0, 0), (1, 1), (1, 1)]
    plain, _ = plan_rows(rows, num_repeats=4, sharding={"num_shards": 4})
    assert [planner.WaveOrder(plain).waves_of(s) for s in plain.shards] == [None] * 4  # not wave-major
    unset, _ = plan_rows(rows, num_repeats=4, sharding={"num_shards": 4}, sampling={"wave": 3, "min_repeats": 2})
    assert "sampling" not in plain.planning and plain.sampling is None
    assert planner.same_rollouts(unset, plain)  # without stop_when_decided the rollouts are the same
    assert unset.fingerprint != plain.fingerprint  # the settings recorded differ (plan.config)
    assert plan.fingerprint != plain.fingerprint and not planner.same_rollouts(plan, plain)
    other, _ = plan_rows(rows, num_repeats=4, sharding={"num_shards": 4}, sampling=ADAPTIVE | {"min_repeats": 2})
    assert other.fingerprint != plan.fingerprint and not planner.same_rollouts(other, plan)
    assert plan.sampling is not None and plan.sampling.stop_when_decided is not None
    assert planner.Plan.from_json(json.loads(json.dumps(plan.to_json()))).sampling == plan.sampling
