"""The run directory's layout: every file name in it and the path of each (pure: nothing is read or written here).

    RUN_DIR/plan.json
    RUN_DIR/shards/<5-digit shard index>/rollouts_materialized_inputs.jsonl   planned rows (Gym format)
                                        /rollouts.jsonl, rollouts_failures.jsonl, .done, logs/
    RUN_DIR/merged/                                                          merge-and-profile results

An interface: later stages and outside tools rely on it. rundir/store.py keeps these names too (store.rollouts_path),
for the stages above it.
"""

from __future__ import annotations

from pathlib import Path

from shardrun.core.gym_names import FAILURES, MATERIALIZED, ROLLOUTS
from shardrun.rundir.fileio import MERGE_TMP_PREFIX, TMP_PREFIX

PLAN_FILE = "plan.json"
SHARDS_DIR = "shards"
MERGED_DIR = "merged"
LOCK_FILE = ".shardrun.lock"
BLEND_INPUT = "input.jsonl"  # a blend's rows, written by store.write_plan (blend_input_path)
DONE = ".done"
DAMAGED_SEAL = ".done.damaged"  # a seal the merge found disagreeing with the shard's rows, set aside (rundir/seal.py)
LOGS = "logs"

__all__ = [
    "BY_LABEL_DIR",
    "LABELS_FILE",
    "by_label_dir",
    "labels_path",
    "failure_tally_path",
    "FAILURES",
    "MATERIALIZED",
    "ROLLOUTS",
    "TMP_PREFIX",
    "MERGE_TMP_PREFIX",
    "PLAN_FILE",
    "SHARDS_DIR",
    "MERGED_DIR",
    "LOCK_FILE",
    "BLEND_INPUT",
    "DONE",
    "DAMAGED_SEAL",
    "LOGS",
    "MERGED_ROLLOUTS_STEM",
    "REPORT_FILE",
    "SANDBOX_LOG",
    "VLLM_LOG",
    "VLLM_SCRATCH",
    "JOBS_DIR",
    "LAUNCHES_FILE",
    "SHARD_FAILURE",
    "GYM_DIR",
    "ENV_YAML",
    "SERVER_VENVS",
    "ROLLOUT_ATTEMPTS",
    "SHARD_LOG",
    "GYM_LOG",
    "COLLECTOR_LOG",
    "SHARD_LOCK",
    "LAUNCH_SETTINGS",
    "COLLECT_DIR",
    "FILL_FILE",
    "CLAIM",
    "WORKERS_DIR",
    "WORKER_STATE",
    "WORKER_LOG",
    "plan_path",
    "shard_dir",
    "materialized_path",
    "rollouts_path",
    "failures_path",
    "done_path",
    "damaged_seal_path",
    "logs_dir",
    "merged_dir",
    "merged_reward_profiling_path",
    "merged_agent_metrics_path",
    "merged_aggregate_metrics_path",
    "merged_failures_path",
    "merged_rollouts_path",
    "merged_materialized_path",
    "merged_summary_path",
    "merge_scratch",
    "report_path",
    "report_figure_path",
    "sandbox_log_path",
    "vllm_log_path",
    "vllm_scratch_dirs",
    "jobs_dir",
    "job_log_path",
    "launches_path",
    "shard_failure_path",
    "blend_input_path",
    "gym_dir",
    "collect_dir",
    "fill_path",
    "env_yaml_path",
    "server_venvs_dir",
    "rollout_attempts_path",
    "shard_log_path",
    "gym_log_path",
    "collector_log_path",
    "claim_path",
    "workers_dir",
    "worker_dir",
    "worker_state_path",
    "worker_log_path",
    "worker_gym_dir",
    "worker_gym_log_path",
    "launch_settings_path",
]


def plan_path(run_dir: Path) -> Path:
    return Path(run_dir) / PLAN_FILE


def shard_dir(run_dir: Path, index: int) -> Path:
    return Path(run_dir) / SHARDS_DIR / f"{index:05d}"


def materialized_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / MATERIALIZED


def rollouts_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / ROLLOUTS


def failures_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / FAILURES


def done_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / DONE


def damaged_seal_path(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / DAMAGED_SEAL


def logs_dir(run_dir: Path, index: int) -> Path:
    return shard_dir(run_dir, index) / LOGS


def merged_dir(run_dir: Path) -> Path:
    return Path(run_dir) / MERGED_DIR


# merged outputs (Gym's names: <rollouts stem>_reward_profiling.jsonl, ..._agent_metrics.json, ...) and the report

MERGED_ROLLOUTS_STEM = "rollouts"
REPORT_FILE = "report.html"


def merged_reward_profiling_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_reward_profiling.jsonl"


def merged_agent_metrics_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_agent_metrics.json"


def merged_aggregate_metrics_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_aggregate_metrics.json"


def merged_failures_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / f"{MERGED_ROLLOUTS_STEM}_failures.jsonl"


def merged_rollouts_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / ROLLOUTS


def merged_materialized_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / MATERIALIZED


BY_LABEL_DIR = "by_label"
LABELS_FILE = "labels.json"


def by_label_dir(run_dir: Path, label: str) -> Path:
    """A blend's label's own profile files after the merge: merged/by_label/<label>/."""
    return merged_dir(run_dir) / BY_LABEL_DIR / label


def failure_tally_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / "failures_by_class.json"


def labels_path(run_dir: Path) -> Path:
    """A blend's per-label results after the merge (records.BlendLabels): merged/labels.json."""
    return merged_dir(run_dir) / LABELS_FILE


def merged_summary_path(run_dir: Path) -> Path:
    """What the last merge-and-profile saw and did (counts, per shard, timings): merged/merge_summary.json."""
    return merged_dir(run_dir) / "merge_summary.json"


def merge_scratch(run_dir: Path, name: str) -> Path:
    """A scratch file of the running merge (snapshots, spills); removed as a stale temp if the merge is killed."""
    return merged_dir(run_dir) / f"{MERGE_TMP_PREFIX}{name}"


def report_path(run_dir: Path) -> Path:
    return merged_dir(run_dir) / REPORT_FILE


def report_figure_path(run_dir: Path, name: str) -> Path:
    """A report figure, beside report.html: merged/report_<name>.png."""
    return merged_dir(run_dir) / f"report_{name}.png"


# the job's code-execution sandbox (shard/sandbox.py): its log

SANDBOX_LOG = "sandbox.log"


def sandbox_log_path(home: Path) -> Path:
    """The sandbox's log in the logs/ of the servers' home (a shard's directory or a warm worker's; appended by
    every start)."""
    return Path(home) / LOGS / SANDBOX_LOG


# the shard's self-hosted policy server (vLLM): its log and per-server scratch (IPC sockets, compile caches)

VLLM_LOG = "vllm.log"
VLLM_SCRATCH = "vllm"


def vllm_log_path(shard: Path) -> Path:
    """The vLLM server's log in the shard's logs/ (appended by every attempt)."""
    return Path(shard) / LOGS / VLLM_LOG


def vllm_scratch_dirs(shard: Path) -> tuple[Path, Path]:
    """(TMPDIR, VLLM_CACHE_ROOT) of the shard's vLLM server: SHARD/vllm/tmp and SHARD/vllm/cache."""
    base = Path(shard) / VLLM_SCRATCH
    return base / "tmp", base / "cache"


# launches: what was submitted for which shard (written by launch, read by status / resume / cancel)

JOBS_DIR = "jobs"
LAUNCHES_FILE = "launches.jsonl"
SHARD_FAILURE = ".failed"


def jobs_dir(run_dir: Path) -> Path:
    """submitit's folder: job scripts, pickles and the job logs (RUN_DIR/jobs/)."""
    return Path(run_dir) / JOBS_DIR


def job_log_path(run_dir: Path, job_id: str) -> Path:
    """The log of one submitted job or array task, named as submitit names it: <job id>_<task 0>_log.out."""
    return jobs_dir(run_dir) / f"{job_id}_0_log.out"


def launches_path(run_dir: Path) -> Path:
    return Path(run_dir) / LAUNCHES_FILE


def shard_failure_path(run_dir: Path, index: int) -> Path:
    """The last attempt's error, written by the shard job when it raises (removed when a later attempt seals)."""
    return shard_dir(run_dir, index) / SHARD_FAILURE


def blend_input_path(run_dir: Path) -> Path:
    """A blend's input: its entries' chosen rows as one JSONL file (rundir/blend_input.py), the plan's input."""
    return Path(run_dir) / BLEND_INPUT


# ---------------------------------------------------------------- shard runtime (one shard on one node)

GYM_DIR = "gym"
ENV_YAML = "env.yaml"
SERVER_VENVS = "venvs"
ROLLOUT_ATTEMPTS = "rollout_attempts.jsonl"
SHARD_LOG = "shard.log"
GYM_LOG = "ng_run.log"
COLLECTOR_LOG = "collector.log"
SHARD_LOCK = ".shard.lock"
LAUNCH_SETTINGS = "launch.json"


def gym_dir(run_dir: Path, index: int) -> Path:
    """ng_run's working directory for the shard (env.yaml while the stack runs, Gym's own caches)."""
    return shard_dir(run_dir, index) / GYM_DIR


def collect_dir(run_dir: Path, index: int) -> Path:
    """The collector's view of a shard that skips decided tasks (adaptive sampling): its own materialized file
    (the planned rows less the skipped ones) beside links to the shard's rollouts.jsonl and failures sidecar, so
    Gym, which finds the materialized file beside its output, dispatches only the rows still to collect."""
    return shard_dir(run_dir, index) / COLLECT_DIR


COLLECT_DIR = "collect"
FILL_FILE = "fill.json"


def fill_path(run_dir: Path) -> Path:
    """The tasks `shardrun resume --fill` asked to collect in full (adaptive sampling): never skipped again."""
    return Path(run_dir) / FILL_FILE


def env_yaml_path(run_dir: Path, index: int) -> Path:
    """Gym's env.yaml (policy URL, key, model), 0600, present only while the shard's Gym stack runs."""
    return gym_dir(run_dir, index) / ENV_YAML


def server_venvs_dir(run_dir: Path, index: int) -> Path:
    """Gym's uv_venv_dir for the shared-venv route: <type>/<impl>/.venv symlinks to the Gym venv."""
    return gym_dir(run_dir, index) / SERVER_VENVS


def rollout_attempts_path(run_dir: Path, index: int) -> Path:
    """One line per failed attempt of one identity (identity, reason, time): shardrun's retry ledger."""
    return shard_dir(run_dir, index) / ROLLOUT_ATTEMPTS


def shard_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / SHARD_LOG


def gym_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / GYM_LOG


def collector_log_path(run_dir: Path, index: int) -> Path:
    return logs_dir(run_dir, index) / COLLECTOR_LOG


# warm workers: claims on shards and each worker's own directory (docs/workers.md)

CLAIM = ".claim"
WORKERS_DIR = "workers"
WORKER_STATE = "worker.json"
WORKER_LOG = "worker.log"


def claim_path(run_dir: Path, index: int) -> Path:
    """The shard's claim (JSON: worker id, job id, host, pid, claimed at), held by the worker collecting it."""
    return shard_dir(run_dir, index) / CLAIM


def workers_dir(run_dir: Path) -> Path:
    return Path(run_dir) / WORKERS_DIR


def worker_dir(run_dir: Path, worker_id: str) -> Path:
    """One worker's home: its servers' working dirs and logs (gym/, logs/) and its state (worker.json)."""
    return workers_dir(run_dir) / worker_id


def worker_state_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / WORKER_STATE


def worker_log_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / LOGS / WORKER_LOG


def worker_gym_dir(run_dir: Path, worker_id: str) -> Path:
    """ng_run's working directory for a worker's Gym stack (env.yaml while it runs): WORKER/gym."""
    return worker_dir(run_dir, worker_id) / GYM_DIR


def worker_gym_log_path(run_dir: Path, worker_id: str) -> Path:
    return worker_dir(run_dir, worker_id) / LOGS / GYM_LOG


def launch_settings_path(run_dir: Path) -> Path:
    """The validated config of the latest launch (env-var names only, never secrets): resume needs no config."""
    return Path(run_dir) / LAUNCH_SETTINGS
