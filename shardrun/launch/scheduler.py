"""Every question to the Slurm scheduler and every order to it after submission: `squeue` (what is queued or
running), `sacct` (how jobs ended, and what they used: GPU-hours), `scancel`, and `scontrol show config`
(MaxArraySize). Each call is one command and one parse; the parsers are pure and tested on their own.

Submission itself goes through submitit (submission.py) with the parameters slurm.py renders.

    live = scheduler.query_live_jobs([tag])                  # {job id: LiveJob}, one squeue call
    done = scheduler.query_sacct(["123", "124_3"])           # {job id: SacctJob}, one sacct call ({} without it)
    gpu_hours = {j: s.gpu_hours for j, s in done.items()}    # for cost.with_sacct
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Iterable

from shardrun.core.config import DEFAULT_MAX_ARRAY_SIZE, ClusterConfig
from shardrun.core import slurm_values
from shardrun.core.errors import RunDirError, ShardrunError

COMMAND_TIMEOUT_S = 60.0

# squeue states of a job that holds (or is about to hold) its node; everything else squeue lists is waiting
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING"})


class SlurmError(ShardrunError):
    """A Slurm command failed or answered something we cannot read."""

    exit_code = 6


# ---------------------------------------------------------------- squeue


SQUEUE_FORMAT = "%i|%T|%r|%S|%j"


@dataclass(frozen=True)
class LiveJob:
    """A job (or one array task) that squeue still lists."""

    job_id: str  # "123" or "123_4"
    state: str  # Slurm state, e.g. PENDING, RUNNING
    reason: str  # Slurm reason, e.g. JobArrayTaskLimit, Dependency, None
    start: str  # start time (or expected start) as squeue prints it, N/A if unknown
    name: str

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def array_id(self) -> str:
        return self.job_id.split("_", 1)[0]


def squeue_command(names: Iterable[str]) -> list[str]:
    """squeue for jobs with these names. Names come from the run's launch records too: one that is not a Slurm
    name (a comma would widen --name into a list of other jobs) is refused, not asked for."""
    names = sorted(set(names))
    for name in names:
        if not slurm_values.NAME.fullmatch(name):
            raise RunDirError(
                f"job name {name!r} (from the run's launch records) is not a Slurm name ({slurm_values.NAME_RULE}); "
                f"not asking squeue for it: launches.jsonl was edited or damaged"
            )
    return ["squeue", "--noheader", "--array", f"--name={','.join(names)}", f"--format={SQUEUE_FORMAT}"]


def parse_squeue(text: str) -> dict[str, LiveJob]:
    """Parse `squeue --noheader --array --format=SQUEUE_FORMAT` output into {job id: LiveJob}."""
    jobs: dict[str, LiveJob] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 5:
            raise SlurmError(f"unexpected squeue line: {line!r}")
        job_id, state, reason, start = (p.strip() for p in parts[:4])
        name = "|".join(parts[4:]).strip()
        jobs[job_id] = LiveJob(job_id, state, reason, start, name)
    return jobs


def query_live_jobs(names: Iterable[str]) -> dict[str, LiveJob]:
    """Every queued or running job carrying one of `names`: one squeue call."""
    names = [n for n in names if n]
    if not names:
        return {}
    return parse_squeue(_run(squeue_command(names)))


# ---------------------------------------------------------------- sacct


SACCT_FORMAT = "JobID,State,ExitCode,Start,End,ElapsedRaw,AllocTRES"


@dataclass(frozen=True)
class SacctJob:
    """A job (or one array task) as Slurm's accounting records it."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL, PREEMPTED, RUNNING, ...
    exit_code: str
    start: str
    end: str
    elapsed_s: int
    gpus: int  # allocated GPUs (AllocTRES)

    @property
    def gpu_hours(self) -> float:
        """What the scheduler allocated: elapsed time x allocated GPUs, start-up included."""
        return self.elapsed_s * self.gpus / 3600.0


def sacct_command(job_ids: Iterable[str]) -> list[str]:
    """The sacct call: allocations only (no steps), parsable, no header; array ids include their tasks."""
    ids = ",".join(sorted(set(job_ids), key=lambda s: (len(s), s)))
    return ["sacct", "--noheader", "--parsable2", "--allocations", f"--format={SACCT_FORMAT}", "--jobs", ids]


def tres_gpus(tres: str) -> int:
    """GPUs in an AllocTRES string such as 'billing=8,cpu=64,gres/gpu=8,mem=512G,node=1' (typed gres summed)."""
    untyped = None
    typed = 0
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == "gres/gpu" and value.isascii() and value.isdigit():
            untyped = int(value)
        elif key.startswith("gres/gpu:") and value.isascii() and value.isdigit():
            typed += int(value)
    return untyped if untyped is not None else typed


def parse_sacct(text: str) -> dict[str, SacctJob]:
    """Parse `sacct_command(...)` output into {job id: SacctJob}.

    Array ranges that never started ("123_[4-9]") are expanded; "CANCELLED by 0" becomes CANCELLED."""
    out: dict[str, SacctJob] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 7 or not parts[0]:
            continue
        job_id, state, code, start, end, elapsed, tres = parts[:7]
        state = state.split(" ", 1)[0]
        m = re.fullmatch(r"(\d+)_\[([\d,\-]+)(?:%\d+)?\]", job_id)
        ids = [f"{m.group(1)}_{i}" for i in _expand(m.group(2))] if m else [job_id]
        for jid in ids:
            out[jid] = SacctJob(
                jid,
                state,
                code,
                start,
                end,
                int(elapsed) if elapsed.isascii() and elapsed.isdigit() else 0,
                tres_gpus(tres),
            )
    return out


def _expand(spec: str) -> list[int]:
    values: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        values.extend(range(int(lo), int(hi or lo) + 1))
    return values


def query_sacct(job_ids: Iterable[str]) -> dict[str, SacctJob]:
    """What accounting says about these jobs (array ids include their tasks): one sacct call. Empty when there are
    no ids or there is no accounting (sacct missing, accounting off, slurmdbd down): callers treat it as optional."""
    ids = [j for j in job_ids if j]
    if not ids:
        return {}
    try:
        return parse_sacct(_run(sacct_command(ids)))
    except SlurmError:
        return {}


def describe_ended(job: SacctJob) -> str:
    """A failure reason from sacct, in words."""
    words = {
        "TIMEOUT": "hit its time limit",
        "CANCELLED": "was cancelled",
        "OUT_OF_MEMORY": "ran out of memory",
        "NODE_FAIL": "lost its node",
        "PREEMPTED": "was preempted",
        "FAILED": f"failed (exit code {job.exit_code})",
        "BOOT_FAIL": "node failed to boot",
        "DEADLINE": "missed its deadline",
        "COMPLETED": "completed without sealing the shard",
    }
    return f"Slurm job {job.job_id} {words.get(job.state, job.state.lower())}"


# ---------------------------------------------------------------- scancel, scontrol


def cancel(job_ids: Iterable[str]) -> list[str]:
    """scancel the given job (or array) ids; returns them."""
    ids = sorted(set(job_ids))
    for job_id in ids:
        if not re.fullmatch(r"\d+(?:_\d+)?", job_id):  # never an option: scancel takes '--user=...' too
            raise SlurmError(f"not a Slurm job id: {job_id!r}; nothing was cancelled")
    if ids:
        _run(["scancel", *ids])
    return ids


def parse_max_array_size(scontrol_show_config: str) -> int | None:
    m = re.search(r"^\s*MaxArraySize\s*=\s*(\d+)\s*$", scontrol_show_config, re.MULTILINE)
    return int(m.group(1)) if m else None


def query_max_array_size() -> int:
    """MaxArraySize from `scontrol show config` (Slurm's default when it is not listed)."""
    return parse_max_array_size(_run(["scontrol", "show", "config"])) or DEFAULT_MAX_ARRAY_SIZE


def max_array_size(cluster: ClusterConfig) -> int:
    """The configured override, else what the cluster says."""
    return cluster.max_array_size or query_max_array_size()


# ---------------------------------------------------------------- the one runner


def _run(cmd: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise SlurmError(f"{cmd[0]} not found: is this a Slurm login node (and SLURM_CONF set if needed)?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(cmd)} did not answer in {timeout:.0f} s") from None
    if res.returncode != 0:
        raise SlurmError(f"{shlex.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()[:500]}")
    return res.stdout
