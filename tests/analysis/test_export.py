"""`shardrun export`: a merged run as a Hugging Face dataset folder, an MLflow run and a W&B offline run.

The run is a blend of three labels planned by the planner and written in Gym's formats (tests/blendkit.py, no
servers): alpha and beta collected, gamma's lane failed (every rollout in the failure sidecar), so the run has
failures by class and a label without tasks. Its environment.json is what a launch with a checkpoint and sampling
settings records. The expected values are recomputed from the rows the builder wrote and the input file, not read
back from the profile the export reads; each target is read back with its own library (`datasets`, MLflow's client,
W&B's own record format)."""

from __future__ import annotations

import glob
import json
import os
import statistics
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from shardrun.analysis import export, hf_dataset
from shardrun.analysis.selection import Rules
from shardrun.cli import app
from shardrun.core import config
from shardrun.core.gym_names import ROLLOUT_KEY, TASK_KEY
from shardrun.profile.merge_and_profile import merge_and_profile
from shardrun.rundir import env_manifest, store
from tests.blendkit import LABELS, REPEATS, label_of, make_blend_run, write_lane_shards

CHECKPOINT = "/ckpts/nemotron-step-1200"
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "max_output_tokens": 512}
PROFILED = [t for t in range(sum(n for _, _, n in LABELS)) if label_of(t) != "gamma"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("export")
    run = make_blend_run(tmp, LABELS, num_repeats=REPEATS)
    written = write_lane_shards(run, failing="gamma")
    merge_and_profile(run.run_dir)
    cfg = config.validate(
        {
            "input_jsonl": str(run.plan.input.path),
            "run_dir": str(run.run_dir),
            "policy": {"vllm": {"model": CHECKPOINT}},
            "gym": {"responses_create_params": SAMPLING},
        }
    )
    manifest = env_manifest.build(cfg, env={}, cwd=tmp)
    env_manifest.manifest_path(run.run_dir).write_bytes(orjson.dumps(manifest))
    rows: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in written["rows"]:
        rows[r[TASK_KEY]][r[ROLLOUT_KEY]] = r
    lines = Path(run.plan.input.path).read_bytes().splitlines()
    return {"run": run, "rows": rows, "failed": written["failed"], "lines": lines, "tmp": tmp}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["export", *args], catch_exceptions=False)


def rewards(blend: dict, t: int) -> list[float]:
    return [blend["rows"][t][r]["reward"] for r in sorted(blend["rows"][t])]


# ---------------------------------------------------------------- Hugging Face


def test_hf_dataset_loads_with_datasets_one_row_per_task_with_the_profiles_numbers(blend, tmp_path):
    datasets = pytest.importorskip("datasets")  # the test extra installs it: .ci/run runs this
    out = tmp_path / "arith-hf"
    res = invoke(str(blend["run"].run_dir), str(out), "--to", "hf")
    assert res.exit_code == 0, res.output
    assert f"dataset: {len(PROFILED)} tasks -> {out}" in res.output
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == len(PROFILED) and ds["task_index"] == PROFILED
    for row in ds:
        t = row["task_index"]
        got = rewards(blend, t)
        assert row["label"] == label_of(t) and row["agent"] == {"alpha": "a", "beta": "a"}[label_of(t)]
        assert row["num_rollouts"] == row["expected_num_rollouts"] == len(got) == REPEATS["a"]
        assert row["mean/reward"] == pytest.approx(statistics.mean(got))
        assert row["std/reward"] == pytest.approx(statistics.stdev(got))
        assert row["pass_rate_passed"] == sum(x >= 1.0 for x in got) and row["pass_rate_total"] == len(got)
        assert row["pass_rate"] == pytest.approx(row["pass_rate_passed"] / len(got))
        assert row["rollout_rewards"] == got
        outs = [blend["rows"][t][r]["response"]["usage"]["output_tokens"] for r in sorted(blend["rows"][t])]
        assert row["rollout_output_tokens"] == outs
        assert row["mean/output_tokens"] == pytest.approx(statistics.mean(outs))
        assert row["source_row"].encode() == blend["lines"][t]  # the original input line, byte for byte
        passed = row["pass_rate_passed"]
        assert row["bucket"] == ("never" if not passed else "always" if passed == len(got) else "sometimes")


def test_hf_card_holds_the_runs_facts(blend, tmp_path):
    out = tmp_path / "card"
    assert invoke(str(blend["run"].run_dir), str(out), "--to", "hf").exit_code == 0
    text = (out / "README.md").read_text()
    meta = hf_dataset.front_matter(text)
    facts = meta["shardrun"]
    plan = blend["run"].plan
    assert meta["configs"] == [
        {"config_name": "default", "data_files": [{"split": "train", "path": "data/train-00000-of-00001.parquet"}]}
    ]
    assert facts["model"]["model"] == CHECKPOINT and CHECKPOINT in text
    assert facts["sampling"] == {"num_repeats": REPEATS, "seed_offset": 0, "responses_create_params": SAMPLING}
    assert facts["gym_version"] == plan.gym_version and facts["plan_fingerprint"] == plan.fingerprint
    assert plan.fingerprint in text
    completed = sum(len(v) for v in blend["rows"].values())
    assert facts["tasks"] == {"planned": plan.num_tasks, "profiled": len(PROFILED), "exported": len(PROFILED)}
    assert facts["rollouts"] == {"planned": plan.num_rollouts, "completed": completed, "exported": completed}
    failures = facts["failures"]
    assert failures["failed_rollouts"] == len(blend["failed"]) == 2 * REPEATS["b"]
    assert failures["failure_rate"] == pytest.approx(len(blend["failed"]) / plan.num_rollouts)
    assert failures["labels"]["gamma"]["rate"] == 1.0 and failures["labels"]["gamma"]["unreliable"]
    assert failures["labels"]["alpha"]["failed"] == 0
    rates = [sum(x >= 1 for x in rewards(blend, t)) / len(rewards(blend, t)) for t in PROFILED]
    want = [0] * 10
    for r in rates:
        want[min(9, int(r * 10))] += 1
    assert facts["pass_rate_histogram"]["counts"] == want
    assert facts["selection"] is None and "| selection |" not in text
    assert os.stat(out / "README.md").st_mode & 0o044  # readable by others: a dataset is shared


def test_hf_export_of_a_selection_says_its_thresholds(blend, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "hard"
    res = invoke(str(blend["run"].run_dir), str(out), "--to", "hf", "--label", "alpha", "--drop-solved")
    assert res.exit_code == 0, res.output
    want = [t for t in PROFILED if label_of(t) == "alpha" and min(rewards(blend, t)) < 1.0]
    ds = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds["task_index"] == want
    facts = hf_dataset.front_matter((out / "README.md").read_text())["shardrun"]
    assert facts["selection"]["rules"] == {"labels": ["alpha"], "drop_solved": True}
    assert [s["kept"] for s in facts["selection"]["steps"]] == [len(PROFILED), 4, len(want)]
    assert facts["tasks"]["exported"] == len(want)


def test_push_without_the_token_variable_is_refused_before_anything_is_written(blend, tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("MY_HUB_TOKEN", raising=False)
    out = tmp_path / "pushed"
    res = invoke(str(blend["run"].run_dir), str(out), "--to", "hf", "--push", "me/arith")
    assert res.exit_code == 2 and "HF_TOKEN" in res.output and "Nothing was written" in res.output
    res = invoke(str(blend["run"].run_dir), str(out), "--to", "hf", "--push", "me/arith", "--token-env", "MY_HUB_TOKEN")
    assert res.exit_code == 2 and "MY_HUB_TOKEN" in res.output
    assert not out.exists()
    res = invoke(str(blend["run"].run_dir), "--to", "mlflow", "--push", "me/arith")
    assert res.exit_code == 2 and "--to hf" in res.output


def test_a_failed_push_never_shows_the_token_and_keeps_the_folder(blend, tmp_path):
    """The Hub is unreachable here (its endpoint a closed local port): the upload fails with one line that does not
    hold the token, after the folder was written. No network is used."""
    pytest.importorskip("huggingface_hub")
    token = "hf_" + "Zq8" * 12
    out = tmp_path / "pushed"
    env = os.environ | {"HUB_SECRET": token, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "export", str(blend["run"].run_dir), str(out), "--to", "hf"]
        + ["--push", "me/arith", "--token-env", "HUB_SECRET"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = proc.stdout + proc.stderr
    assert "--push me/arith: the upload failed" in said and token not in said
    assert (out / "README.md").is_file() and token not in (out / "README.md").read_text()


def test_the_dataset_folder_replaces_only_an_earlier_export(blend, tmp_path):
    run_dir = blend["run"].run_dir
    out = tmp_path / "ds"
    assert invoke(str(run_dir), str(out), "--to", "hf").exit_code == 0
    first = (out / "data" / "train-00000-of-00001.parquet").read_bytes()
    res = invoke(str(run_dir), str(out), "--to", "hf", "--label", "beta")  # an earlier export: replaced whole
    assert res.exit_code == 0, res.output
    assert (out / "data" / "train-00000-of-00001.parquet").read_bytes() != first
    assert not list(tmp_path.glob(".shardrun-export-*"))
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    res = invoke(str(run_dir), str(other), "--to", "hf")
    assert res.exit_code == 2 and "holds other files" in res.output
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    res = invoke(str(run_dir), str(run_dir / "merged" / "hf"), "--to", "hf")
    assert res.exit_code == 2 and "inside the run directory" in res.output
    res = invoke(str(run_dir), str(run_dir.parent), "--to", "hf")
    assert res.exit_code == 2 and "holds the run directory" in res.output


# ---------------------------------------------------------------- MLflow


def test_mlflow_run_reads_back_through_mlflows_client_with_the_same_metrics(blend, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the export sets it for a file store; restored here
    run_dir = blend["run"].run_dir
    res = invoke(str(run_dir), "--to", "mlflow", "--run-name", "arith-step-1200")
    assert res.exit_code == 0, res.output
    uri = (run_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shardrun")
    (found,) = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'arith-step-1200'")
    ex = export.gather(run_dir)
    want = {export.tracking_name(k): v for k, v in export.metrics(ex).items()}
    assert found.data.metrics == pytest.approx(want)
    # independently of the export's own code: the numbers from the rows written
    a_rewards = [x for t in PROFILED for x in rewards(blend, t)]
    assert found.data.metrics["agent/a/mean_reward"] == pytest.approx(statistics.mean(a_rewards))
    alpha = [x for t in PROFILED if label_of(t) == "alpha" for x in rewards(blend, t)]
    assert found.data.metrics["label/alpha/mean_reward"] == pytest.approx(statistics.mean(alpha))
    assert found.data.metrics["label/alpha/pass_at_1"] == pytest.approx(100 * statistics.mean(x >= 1 for x in alpha))
    assert found.data.metrics["failures/failed_rollouts"] == len(blend["failed"])
    assert found.data.metrics["label/gamma/failure_rate"] == 1.0
    params = found.data.params
    assert params["plan.fingerprint"] == blend["run"].plan.fingerprint and params["model.model"] == CHECKPOINT
    assert {k: int(params[f"num_repeats.{k}"]) for k in REPEATS} == REPEATS
    names = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"tasks.json", "report", "profile", "plan"} <= names
    profile = {a.path for a in client.list_artifacts(found.info.run_id, "profile")}
    assert "profile/rollouts_reward_profiling.jsonl" in profile and "profile/failures_by_class.json" in profile
    assert "report/report.html" in {a.path for a in client.list_artifacts(found.info.run_id, "report")}
    table = json.loads(Path(client.download_artifacts(found.info.run_id, "tasks.json")).read_text())
    column = table["columns"].index("task_index")
    assert [r[column] for r in table["data"]] == PROFILED


def test_tracking_names_are_what_mlflow_accepts():
    assert export.tracking_name("pass@1[avg-of-4]/accuracy") == "pass_at_1.avg-of-4/accuracy"
    assert export.tracking_name("agent/math agent/mean_reward") == "agent/math agent/mean_reward"
    assert export.tracking_name("label/a+b/x") == "label/a_b/x"


# ---------------------------------------------------------------- Weights & Biases


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file, parsed with W&B's own protobuf: a header, then 32 KiB blocks of chunks
    (checksum 4 bytes, length 2, type 1: full, first, middle, last), as `wandb sync` reads them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, part, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        part += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_wandb_offline_writes_a_run_folder_with_the_settings_metrics_table_and_artifacts(blend, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = blend["run"].run_dir
    try:
        res = invoke(str(run_dir), "--to", "wandb")
    finally:
        wandb.teardown()
    assert res.exit_code == 0, res.output
    (folder,) = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert f"-> {folder}" in res.output and f"wandb sync {folder}" in res.output
    (run_file,) = glob.glob(f"{folder}/run-*.wandb")
    records = wandb_records(Path(run_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    (head,) = [r.run for r, k in zip(records, kinds) if k == "run"]
    config = {u.key: json.loads(u.value_json) for u in head.config.update}
    assert config["plan.fingerprint"] == blend["run"].plan.fingerprint and config["model.model"] == CHECKPOINT
    summary = {
        u.key: json.loads(u.value_json)
        for r, k in zip(records, kinds)
        if k == "summary"
        for u in r.summary.update
        if u.key
    }
    want = export.metrics(export.gather(run_dir))
    assert {k: summary[k] for k in want} == pytest.approx(want)
    a_rewards = [x for t in PROFILED for x in rewards(blend, t)]
    assert summary["agent/a/mean_reward"] == pytest.approx(statistics.mean(a_rewards))
    artifacts = [r.artifact for r, k in zip(records, kinds) if k == "artifact"]
    profile = next(a for a in artifacts if a.type == "reward-profile")
    assert profile.name == f"reward-profile-{blend['run'].plan.fingerprint[:12]}"
    paths = {e.path for e in profile.manifest.contents}
    assert {"profile/rollouts_reward_profiling.jsonl", "report/report.html", "plan/plan.json"} <= paths
    (table_file,) = glob.glob(f"{folder}/files/media/table/tasks_*.table.json")
    table = json.loads(Path(table_file).read_text())
    assert [r[table["columns"].index("task_index")] for r in table["data"]] == PROFILED


# ---------------------------------------------------------------- missing libraries


@pytest.mark.parametrize(
    ("target", "module", "extra"),
    [("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb"), ("hf", "pyarrow", "hf")],
)
def test_a_missing_library_is_a_clear_error_with_the_install_command(
    blend, tmp_path, monkeypatch, target, module, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    dest = [str(tmp_path / "out")] if target != "mlflow" else [(tmp_path / "mlruns").as_uri()]
    res = invoke(str(blend["run"].run_dir), *dest, "--to", target)
    assert res.exit_code == 1
    assert f"pip install 'shardrun[{extra}]'" in res.output and f"--to {target} needs the {module}" in res.output
    assert not list(tmp_path.iterdir())


def test_gather_reads_the_rules_as_select_does(blend):
    ex = export.gather(blend["run"].run_dir, Rules(max_mean=0.5))
    want = [t for t in PROFILED if statistics.mean(rewards(blend, t)) <= 0.5]
    assert [t.task_index for t in ex.tasks] == want and ex.rules == Rules(max_mean=0.5)
    assert export.gather(blend["run"].run_dir, Rules()).rules is None
    assert store.merged_reward_profiling_path(blend["run"].run_dir).is_file()
