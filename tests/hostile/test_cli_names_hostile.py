"""Hostile names and numbers from the command line, checked against the data: a field no row has (--answer-field,
--metric, --agent) is refused with the ones that exist; an interval must be positive and finite; a shard index must
be the plan's; times that go backwards (a clock step) are an unknown duration, said as such, never a crash; a
profile line that is not JSON is an error naming the file and the line; overrides follow Hydra's grammar exactly
(`null` is None for every optional key). Each case: exit 2 (or the correct answer), no traceback, within a bound,
and nothing in the run directory changed."""

from __future__ import annotations

import typing

import orjson
import pytest
import yaml
from hostilekit import invoke_bounded, refused
from reportkit import input_row, merge_run, planned_run, seal_shards

from shardrun import api
from shardrun.core import config
from shardrun.core.errors import BadInput
from shardrun.rundir import store


def reward(t: int, r: int) -> float:
    return float((t + r) % 3 == 0)


@pytest.fixture()
def run(tmp_path):
    rows = [input_row(i, "agent_a" if i % 2 else "agent_b") for i in range(6)]
    run_dir, _ = planned_run(tmp_path, rows, num_repeats=3, num_shards=2)
    seal_shards(run_dir, reward)
    merge_run(run_dir)
    return run_dir


# ---------------------------------------------------------------- field names no row has


def test_an_answer_field_no_row_has_is_refused_with_the_fields_there_are(run, unchanged):
    with unchanged(run):
        outcome = invoke_bounded("merge-and-profile", run, "--answer-field", "extracted_answr")
    refused(outcome, "--answer-field extracted_answr", "no rollout row has", "extracted_answer", "reward")


def test_an_answer_field_the_rows_have_gives_majority_at_k(run):
    outcome = invoke_bounded("merge-and-profile", run, "--answer-field", "extracted_answer", "--json")
    assert outcome.exit_code == 0, outcome.output
    metrics = orjson.loads((store.merged_dir(run) / "rollouts_aggregate_metrics.json").read_bytes())
    assert any("majority" in k for entry in metrics for k in entry.get("key_metrics", {})), metrics


def test_an_answer_field_only_later_rows_have_is_accepted(run):
    """A sparse field: the first rows of every shard lack it; the check reads on until one has it."""
    path = store.rollouts_path(run, 1)
    lines = path.read_bytes().splitlines()
    last = orjson.loads(lines[-1])
    last["sparse_answer"] = "4"
    path.write_bytes(b"".join(line + b"\n" for line in [*lines[:-1], orjson.dumps(last)]))
    marker = orjson.loads(store.done_path(run, 1).read_bytes())
    import hashlib

    marker["rollouts_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    marker["rollouts_bytes"] = path.stat().st_size
    store.done_path(run, 1).write_bytes(orjson.dumps(marker))
    outcome = invoke_bounded("merge-and-profile", run, "--answer-field", "sparse_answer")
    assert outcome.exit_code == 0, outcome.output


def test_a_metric_no_task_has_is_refused_by_select_with_the_metrics_there_are(run, tmp_path, unchanged):
    with unchanged(tmp_path):
        outcome = invoke_bounded("select", run, "-o", tmp_path / "o.jsonl", "--min-mean", "0.5", "--metric", "rewrd")
    refused(outcome, "rewrd", "known metrics", "reward")


def test_an_agent_no_task_has_is_refused_by_select_with_the_agents_there_are(run, tmp_path, unchanged):
    with unchanged(tmp_path):
        outcome = invoke_bounded("select", run, "-o", tmp_path / "o.jsonl", "--agent", "agent_c")
    refused(outcome, "agent_c", "agent_a")


@pytest.mark.parametrize("flag", [("--metric", "rewrd"), ("--agent", "agent_c")])
def test_a_fill_rule_on_a_name_no_task_has_is_refused(run, tmp_path, unchanged, flag):
    with unchanged(tmp_path):
        refused(invoke_bounded("resume", run, "--fill", *flag, "--dry-run"), flag[1])


@pytest.mark.parametrize("index", ["2", "99"])
def test_a_shard_index_beyond_the_plan_is_refused(run, tmp_path, unchanged, index):
    with unchanged(tmp_path):
        refused(invoke_bounded("run-shard", run, index), f"INDEX {index}", "2 shards")


# ---------------------------------------------------------------- intervals


@pytest.mark.parametrize("interval", ["-1", "0", "nan", "inf", "-inf", "1e300"])
def test_a_watch_interval_that_is_not_positive_and_finite_is_refused(run, tmp_path, unchanged, interval):
    with unchanged(tmp_path):
        refused(invoke_bounded("status", run, "--watch", "--interval", interval), "--interval")


# ---------------------------------------------------------------- times that go backwards


def _backwards(run_dir, index: int, **fields) -> None:
    path = store.done_path(run_dir, index)
    marker = orjson.loads(path.read_bytes())
    marker.update({"finished_at": marker["started_at"] - 1e6, "gpu_hours": -555.0} | fields)
    path.write_bytes(orjson.dumps(marker))


@pytest.mark.parametrize("command", ["report", "status", "merge-and-profile"])
def test_a_seal_that_finished_before_it_started_gives_an_unknown_duration(run, tmp_path, command, unchanged):
    _backwards(run, 1)
    args = {
        "report": ("report", run, "--no-sacct"),
        "status": ("status", run),
        "merge-and-profile": ("merge-and-profile", run),
    }
    outcome = invoke_bounded(*args[command])
    assert outcome.exit_code == 0, outcome.output
    assert "unknown (1 shard(s) finished before they started" in outcome.output
    assert "-555" not in outcome.output and "Traceback" not in outcome.output


def test_a_negative_gpu_hours_alone_is_unknown_too_and_json_says_null(run):
    _backwards(run, 0, finished_at=None)  # times unchanged below: only gpu_hours is negative
    marker = orjson.loads(store.done_path(run, 0).read_bytes())
    marker["finished_at"] = marker["started_at"] + 60
    store.done_path(run, 0).write_bytes(orjson.dumps(marker))
    outcome = invoke_bounded("status", run, "--json")
    assert outcome.exit_code == 0, outcome.output
    sealed = orjson.loads(outcome.output)["sealed_cost"]
    assert sealed["wall_s"] is None and sealed["unknown_durations"] == 1 and sealed["gpu_hours"] >= 0


# ---------------------------------------------------------------- a profile that is not JSON


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b"null", b'{"_ng_task_index": '])
@pytest.mark.parametrize("command", ["select", "report", "api"])
def test_a_profile_line_that_is_not_a_json_object_names_file_and_line(run, tmp_path, unchanged, command, line):
    profile = store.merged_reward_profiling_path(run)
    n = len(profile.read_bytes().splitlines()) + 1
    profile.write_bytes(profile.read_bytes() + line + b"\n")
    where = f"{profile}:{n}"
    with unchanged(tmp_path):
        if command == "api":
            with pytest.raises(BadInput, match=where):
                api.profile_frame(run)
        else:
            args = ("select", run, "-o", tmp_path / "o.jsonl") if command == "select" else ("report", run, "--no-sacct")
            refused(invoke_bounded(*args), where, "not a JSON object")


def test_aggregate_metrics_that_are_not_json_are_refused_by_report(run, tmp_path, unchanged):
    path = store.merged_dir(run) / "rollouts_aggregate_metrics.json"
    path.write_bytes(b"{not json")
    with unchanged(tmp_path):
        refused(invoke_bounded("report", run, "--no-sacct"), str(path), "not JSON")


# ---------------------------------------------------------------- Hydra's grammar: null is None


def _optional_keys(model: type = config.RunConfig, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = prefix + name
        if type(None) in typing.get_args(field.annotation):
            out.append(key)
        sub = config._model_in(field.annotation)
        if sub is not None:  # a mapping of sections (judges) is walked through one named entry
            named = typing.get_origin(field.annotation) is dict
            out += _optional_keys(sub, key + (".j1." if named else "."))
    return out


BASE = {
    "input_jsonl": "in.jsonl",
    "run_dir": "run",
    "num_repeats": 2,
    "agent_name": "a",
    "sharding": {"num_shards": 2},
    "gym": {"venv": "/opt/gym", "num_samples_in_parallel": 4, "uv_venv_dir": "/tmp/uv", "config_paths": ["x.yaml"]},
    "policy": {"base_url": "http://h:1/v1", "api_key_env": "MY_KEY", "model_name": "m"},
    "cluster": {
        "account": "acct",
        "partition": "gpu",
        "qos": "normal",
        "time_limit": "01:00:00",
        "cpus_per_task": 2,
        "mem_gb": 4,
        "max_array_size": 100,
        "merge_partition": "cpu",
        "workers": 2,
    },
    "sampling": {"stop_when_decided": {"min_mean": 0.1, "max_mean": 0.9}},
}
VLLM = {
    "model": "/models/m",
    "served_model_name": "served",
    "python": "/usr/bin/python3",
    "command": ["vllm", "serve"],
    "max_model_len": 1024,
    "port": 8000,
}


@pytest.mark.parametrize("key", _optional_keys())
def test_null_is_none_for_every_optional_key(tmp_path, key):
    data = dict(BASE, policy={"vllm": VLLM}) if key.startswith("policy.vllm") else BASE
    if key.startswith("judges."):
        data = dict(BASE, judges={"j1": {"vllm": VLLM}})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    composed = config.compose(tmp_path / "run.yaml", [f"{key}=null"])
    node = composed
    for part in key.split(".")[:-1]:
        node = node[part]
    assert node[key.split(".")[-1]] is None
    try:
        cfg = config.validate(composed)
    except BadInput as e:  # None is not allowed with the rest of this config (e.g. no policy source left)
        assert "'null'" not in str(e) + " ".join(e.problems if hasattr(e, "problems") else ())
        return
    node = cfg
    for part in key.split("."):
        node = (node[part] if isinstance(node, dict) else getattr(node, part)) if node is not None else None
    assert node is None


def test_cluster_workers_null_runs_one_job_per_shard(tmp_path, monkeypatch):
    """The named case: the docs say null runs one job per shard; it was refused as the string 'null'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_bytes(orjson.dumps(input_row(0)) + b"\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE | {"cluster": {"workers": 3}, "sampling": {}}))
    outcome = invoke_bounded("plan", tmp_path / "run.yaml", "cluster.workers=null")
    assert outcome.exit_code == 0, outcome.output
    assert config.load(tmp_path / "run.yaml", ["cluster.workers=null"]).cluster.workers is None


@pytest.mark.parametrize(
    ("override", "value"),
    [
        ("cluster.partition='null'", "null"),  # quoted: the string
        ("cluster.workers=4", 4),
        ("cluster.env_vars=[A,'B=1']", ["A", "B=1"]),
        ("cluster.time_limit=01:30:00", "01:30:00"),
    ],
)
def test_cluster_overrides_follow_hydras_grammar(tmp_path, override, value):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    key = override.split("=", 1)[0].split(".")[-1]
    assert getattr(config.load(tmp_path / "run.yaml", [override]).cluster, key) == value


def test_a_cluster_sweep_is_refused(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    refused(invoke_bounded("plan", tmp_path / "run.yaml", "cluster.workers=1,2"), "cluster.workers=1,2", "sweep")
