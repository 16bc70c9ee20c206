"""What Slurm accepts for each value shardrun puts in an sbatch script or a Slurm command (pure).

An sbatch script is read line by line, and sbatch stops reading `#SBATCH` directives at the first line that is not
a comment: one newline in a partition, an account or the run directory would end the directives there and drop
the ones after it (`--time`, `--signal`, `--requeue`) without a word. `squeue --name` takes a comma-separated list,
so a comma in a job name would make `status` and `cancel` see other jobs. So:

- names (partition, account, qos, the job name prefix, the keys of `timeouts`) are letters, digits, `_`, `.` and
  `-`, starting with a letter, a digit or `_`;
- every other string (setup lines, exported values, container images and mounts, the run directory, the values of
  `additional_parameters`) holds no control character (newline, carriage return, NUL, escape, ...);
- `additional_parameters` keys are sbatch option names, and never one shardrun sets itself (`OWNED`), in any
  spelling submitit accepts (`job_name`, `job-name`, `--job-name`, `JOB_NAME`) or sbatch would take for it (a
  unique prefix such as `--job` or `--out`: sbatch accepts abbreviated long options);
- time limits are Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS;
- with the Slurm executor the run directory has no `%` (Slurm reads `%j`, `%A`, ... in the log paths under it).

Each check returns a message for a ValueError (the config names the key) or raises it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

from shardrun.core.errors import BadInput

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
NAME_RULE = "letters, digits, '_', '.' and '-' (starting with a letter, a digit or '_'), at most 128"
OPTION = re.compile(r"-{0,2}[A-Za-z][A-Za-z0-9_\-]{0,63}")
TIME_LIMIT = re.compile(r"^(?:(?P<d>\d+)-)?(?P<rest>[\d:]+)$")
DEFAULT_TIME_LIMIT = "04:00:00"  # a shard job's, when the config gives none
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # every control character but the tab
_CONTROL_OR_TAB = re.compile(r"[\x00-\x1f\x7f]")

OWNED: dict[str, str] = {
    "job-name": "shardrun names the jobs (<job_name_prefix>-<run tag>); set cluster.job_name_prefix",
    "output": "submitit writes the job logs into RUN_DIR/jobs/",
    "error": "submitit writes the job logs into RUN_DIR/jobs/",
    "open-mode": "the job logs are appended across requeues",
    "export": "jobs get the submitting shell's environment (ALL) and cluster.env_vars",
    "export-file": "jobs get the submitting shell's environment (ALL) and cluster.env_vars",
    "requeue": "shard jobs are requeued at their time limit; set cluster.max_requeues",
    "no-requeue": "shard jobs are requeued at their time limit; set cluster.max_requeues",
    "signal": "the checkpoint signal comes cluster.signal_delay_s before the time limit",
    "array": "shardrun lays out the job arrays; set cluster.array_parallelism and cluster.max_array_size",
    "dependency": "the merge job runs after the shard arrays",
    "kill-on-invalid-dep": "the merge job runs after the shard arrays",
    "wrap": "submitit writes the job script",
    "partition": "set cluster.partition (and cluster.merge_partition)",
    "account": "set cluster.account",
    "qos": "set cluster.qos",
    "time": "set cluster.time_limit, cluster.timeouts or cluster.merge_time_limit",
    "nodes": "set cluster.nodes",
    "ntasks-per-node": "one task per node runs the shard",
    "cpus-per-task": "set cluster.cpus_per_task (and cluster.merge_cpus_per_task)",
    "gpus-per-node": "set cluster.gpus_per_node",
    "mem": "set cluster.mem_gb (and cluster.merge_mem_gb)",
}
"""The sbatch options shardrun sets itself, with why (what to set instead)."""

EXACT_OPTIONS = frozenset({"ntasks", "gpus"})
"""sbatch options of their own whose names are prefixes of an owned one (sbatch takes an exact name as it is)."""


def has_control(text: str, allow_tab: bool = True) -> bool:
    return bool((_CONTROL if allow_tab else _CONTROL_OR_TAB).search(text))


def name(value: str | None) -> str | None:
    """A Slurm name (partition, account, qos, job name prefix, a `timeouts` key)."""
    if value is not None and not NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a Slurm name: {NAME_RULE}")
    return value


def text(value: str | None, what: str = "value") -> str | None:
    """A string that lands on one line of an sbatch script: no control character."""
    if value is not None and has_control(value):
        raise ValueError(f"{value!r}: a {what} may not hold a control character (newline, carriage return, ...)")
    return value


def time_limit(value: str | int | None) -> str | int | None:
    """Slurm's time limit syntax (whole minutes as an integer, or MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]])."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"time limit {value}: at least 1 minute")
        return value
    m = TIME_LIMIT.match(str(value))
    parts = m.group("rest").split(":") if m else []
    if not m or not 1 <= len(parts) <= 3 or any(not p for p in parts) or has_control(str(value), allow_tab=False):
        raise ValueError(f"time limit {value!r}: expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]")
    return value


def mount(value: str) -> str:
    """A pyxis mount SRC:DST[:FLAGS]; mounts are joined with commas, so none may hold one."""
    text(value, "mount")
    if "," in value or not value.strip():
        raise ValueError(f"{value!r}: a mount is SRC:DST[:FLAGS] without commas (mounts are joined with ',')")
    return value


def option_key(key: str) -> str:
    """An additional_parameters key as sbatch reads it: submitit turns '_' into '-' and adds '--'."""
    return key.strip().lstrip("-").replace("_", "-").lower()


def owned_by(key: str) -> str | None:
    """The owned option that `key` sets (exactly, or as the unique prefix sbatch would expand), or None."""
    option = option_key(key)
    if option in EXACT_OPTIONS:
        return None
    if option in OWNED:
        return option
    return next((o for o in OWNED if o.startswith(option)), None)


def additional_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """sbatch options shardrun passes on: option names it does not set itself, one-line values (a string, a
    number or true for a flag)."""
    for key, value in params.items():
        if not isinstance(key, str) or not OPTION.fullmatch(key):
            raise ValueError(f"{key!r} is not an sbatch option name (letters, digits, '-' and '_')")
        owned = owned_by(key)
        if owned is not None:
            said = f"{key!r}" + ("" if option_key(key) == owned else f" (sbatch reads it as --{owned})")
            raise ValueError(f"{said} is set by shardrun itself: {OWNED[owned]}")
        if value is True:
            continue
        if isinstance(value, bool) or value is None:
            raise ValueError(f"{key}: {value!r} is not an sbatch value; leave the option out, or give true for a flag")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}: {value!r} is not an sbatch value")
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{key}: an sbatch value is a string, a number or true, not {type(value).__name__}")
        if isinstance(value, str):
            text(value, f"value of {key}")
    return params


def lines(values: Iterable[str], what: str) -> None:
    """Each of `values` is one line of the job script."""
    for value in values:
        text(value, what)


def run_dir(value: str, slurm: bool) -> None:
    """The run directory is in the job script (log paths, comment, the merge command)."""
    text(value, "run directory")
    if slurm and "%" in value:
        raise ValueError(
            f"run_dir {value!r} holds '%', which Slurm reads as a pattern (%j, %A, ...) in the job log paths under "
            f"it; rename the run directory"
        )


def parse_time_limit(value: str | int) -> int:
    """A Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> whole minutes (rounded up)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise BadInput(f"time limit must be at least 1 minute, got {value}")
        return value
    text = str(value).strip()
    m = TIME_LIMIT.match(text)
    parts = m.group("rest").split(":") if m else []
    if not m or not 1 <= len(parts) <= 3 or any(not p for p in parts):
        raise BadInput(f"time limit {value!r}: expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]")
    nums = [int(p) for p in parts]
    if m.group("d") is not None:
        days = int(m.group("d"))
        h, mi, s = (nums + [0, 0])[:3]
    else:
        days = 0
        h, mi, s = (0, nums[0], 0) if len(nums) == 1 else (0, nums[0], nums[1]) if len(nums) == 2 else nums
    seconds = ((days * 24 + h) * 60 + mi) * 60 + s
    if seconds < 60:
        raise BadInput(f"time limit {value!r}: Slurm's smallest limit is 1 minute")
    return math.ceil(seconds / 60)
