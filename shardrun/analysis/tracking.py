"""`shardrun export RUN --to mlflow [URI]` and `--to wandb [DIR]`: one tracking run per export.

Each run holds the plan's settings as parameters (export.parameters), the run's numbers as metrics (export.metrics:
counts, failure rates, per agent and per label), the per-task results as a table (export.task_records without the
source rows) and, as artifacts, the report (merged/report.html and its figures, drawn first when the run has none
yet) and the profile files (merged/: the reward profile, agent and aggregate metrics, the merge summary, the
failures by class, a blend's labels) with plan.json.

MLflow: a local file store `RUN/mlruns` unless a tracking URI is given (`file:`, a path, or a server's http(s)
URL, whose own variables, e.g. MLFLOW_TRACKING_TOKEN, MLflow reads itself). MLflow 3 keeps its file store in
maintenance mode behind MLFLOW_ALLOW_FILE_STORE; an export to a file store sets it for its own process. Names go
through export.tracking_name (pass@1 -> pass_at_1): MLflow accepts no `@`.

W&B: offline unless `online` (WANDB_MODE is not read: an export never uploads unless asked), the run folder under
DIR/wandb/ (DIR: the run directory unless given); `wandb sync` uploads it later.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from shardrun.analysis import export, report
from shardrun.analysis.export import ExportData
from shardrun.core import credentials
from shardrun.core.errors import ShardrunError
from shardrun.rundir import store

EXPERIMENT = "shardrun"
TABLE = "tasks"
PARAM_VALUE_MAX = 6000  # MLflow's limit on a parameter's value
PARAM_BATCH, METRIC_BATCH = 100, 1000  # MLflow's limits per log_batch


@dataclass(frozen=True)
class TrackedRun:
    target: str  # mlflow or wandb
    where: str  # the tracking URI (MLflow) or the run folder (W&B offline) or the run's URL (W&B online)
    run_id: str
    metrics: int
    params: int
    artifacts: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


def artifact_files(ex: ExportData) -> tuple[list[tuple[Path, str]], list[str]]:
    """(file, folder in the run) of every artifact, and notes on what could not be added. The report is drawn when
    the run has none yet (`shardrun report`'s own code; without matplotlib a note says so)."""
    run_dir, notes = ex.run_dir, []
    html = store.report_path(run_dir)
    if not html.is_file():
        try:
            report.build_report(run_dir, use_sacct=False)
        except ShardrunError as e:
            notes.append(f"no report artifact: {e}")
    out: list[tuple[Path, str]] = []
    if html.is_file():
        out.append((html, "report"))
        out += [(store.report_figure_path(run_dir, name), "report") for name, _ in report.FIGURES]
    merged = [
        store.merged_reward_profiling_path(run_dir),
        store.merged_agent_metrics_path(run_dir),
        store.merged_aggregate_metrics_path(run_dir),
        store.merged_summary_path(run_dir),
        store.failure_tally_path(run_dir),
        store.labels_path(run_dir),
    ]
    out += [(p, "profile") for p in merged]
    out.append((store.plan_path(run_dir), "plan"))
    return [(p, folder) for p, folder in out if p.is_file()], notes


def table_columns(ex: ExportData) -> tuple[list[str], list[list[Any]]]:
    records = export.task_records(ex, source_rows=False)
    columns = list(records[0]) if records else ["task_index"]
    return columns, [[r[c] for c in columns] for r in records]


def _batches(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ---------------------------------------------------------------- MLflow


def mlflow_uri(run_dir: Path, uri: str | None) -> str:
    """The tracking URI: RUN/mlruns as a file store by default; a plain path becomes its file: URI."""
    if uri is None:
        return (Path(run_dir) / "mlruns").resolve().as_uri()
    if "://" not in uri and not uri.startswith(("file:", "databricks", "sqlite:", "postgresql:", "mysql:")):
        return Path(uri).resolve().as_uri()
    return uri


def to_mlflow(
    ex: ExportData, uri: str | None = None, experiment: str = EXPERIMENT, run_name: str | None = None
) -> TrackedRun:
    """Log the export as one MLflow run; returns where and which."""
    export.need("mlflow", "mlflow")
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    uri = mlflow_uri(ex.run_dir, uri)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    params = {export.tracking_name(k)[:250]: v[:PARAM_VALUE_MAX] for k, v in export.parameters(ex).items()}
    metrics = {export.tracking_name(k): v for k, v in export.metrics(ex).items()}
    files, notes = artifact_files(ex)
    columns, rows = table_columns(ex)
    shown_uri = credentials.redact(uri)
    try:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        tags = {
            "shardrun.plan_fingerprint": ex.data.plan.fingerprint,
            "shardrun.run_dir": str(ex.run_dir),
            "shardrun.gym_version": str(ex.data.plan.gym_version),
        }
        run = client.create_run(experiment_id, run_name=run_name or ex.run_dir.name, tags=tags)
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        for chunk in _batches([Param(k, v) for k, v in params.items()], PARAM_BATCH):
            client.log_batch(run_id, params=chunk)
        for chunk in _batches([Metric(k, v, now, 0) for k, v in metrics.items()], METRIC_BATCH):
            client.log_batch(run_id, metrics=chunk)
        client.log_batch(run_id, tags=[RunTag("shardrun.tasks_exported", str(len(ex.tasks)))])
        client.log_table(
            run_id, data={c: [r[i] for r in rows] for i, c in enumerate(columns)}, artifact_file=f"{TABLE}.json"
        )
        for path, folder in files:
            client.log_artifact(run_id, str(path), folder)
        client.set_terminated(run_id)
    except ShardrunError:
        raise
    except Exception as e:  # MLflow's errors (a server down, a refused name) as one line, no credential in it
        raise ShardrunError(
            f"--to mlflow {shown_uri}: {type(e).__name__}: {credentials.redact(str(e))[:500]}"
        ) from None
    return TrackedRun(
        "mlflow",
        shown_uri,
        run_id,
        len(metrics),
        len(params),
        (f"{TABLE}.json", *(f"{folder}/{p.name}" for p, folder in files)),
        tuple(notes),
    )


# ---------------------------------------------------------------- Weights & Biases


def to_wandb(
    ex: ExportData,
    folder: Path | None = None,
    project: str = EXPERIMENT,
    entity: str | None = None,
    run_name: str | None = None,
    online: bool = False,
) -> TrackedRun:
    """Log the export as one W&B run: offline (its folder under FOLDER/wandb/) unless `online`."""
    wandb = export.need("wandb", "wandb")
    base = Path(folder) if folder is not None else ex.run_dir
    params = export.parameters(ex)
    metrics = export.metrics(ex)
    files, notes = artifact_files(ex)
    columns, rows = table_columns(ex)
    base.mkdir(parents=True, exist_ok=True)
    try:
        run = wandb.init(
            project=project,
            entity=entity,
            name=run_name or ex.run_dir.name,
            dir=str(base),
            mode="online" if online else "offline",
            job_type="reward-profile",
            config=params,
            tags=["shardrun"],
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False),
        )
        run.summary.update(metrics)
        run.log({TABLE: wandb.Table(columns=columns, data=rows)})
        artifact = wandb.Artifact(f"reward-profile-{ex.data.plan.fingerprint[:12]}", type="reward-profile")
        for path, sub in files:
            artifact.add_file(str(path), name=f"{sub}/{path.name}")
        run.log_artifact(artifact)
        run_id, where = run.id, (run.url if online else str(Path(run.dir).parent))
        run.finish()
    except ShardrunError:
        raise
    except Exception as e:  # W&B's errors as one line, no credential in it
        raise ShardrunError(f"--to wandb: {type(e).__name__}: {credentials.redact(str(e))[:500]}") from None
    return TrackedRun(
        "wandb",
        where or "",
        run_id,
        len(metrics),
        len(params),
        (TABLE, *(f"{sub}/{p.name}" for p, sub in files)),
        tuple(notes),
    )
