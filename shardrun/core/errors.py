"""Domain exceptions. The CLI maps each to an exit code and prints its message (tracebacks only with --debug)."""

from __future__ import annotations


class ShardrunError(Exception):
    """Base class: a failure a user can act on. `exit_code` is what the CLI exits with."""

    exit_code = 1


class BadInput(ShardrunError):
    """The config, the overrides or the input JSONL is wrong. Raised before anything is written or submitted."""

    exit_code = 2

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            message = message + "\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class PlanMismatch(ShardrunError):
    """A run directory holds a plan made with other settings or another input, or plan.json was edited."""

    exit_code = 2


class RunDirError(ShardrunError):
    """The run directory cannot be used (not a directory, not writable, missing plan, ...)."""

    exit_code = 2


class NotRegularFile(RunDirError):
    """A FIFO, a device or a socket where shardrun reads a file of its own (reading it could block for ever)."""


class BadRecord(RunDirError):
    """A record shardrun wrote in a run directory (launch record, claim, worker state, ...) has the wrong shape or
    a field of the wrong type: the file was edited or damaged. The message names the file, the line and the field."""


class ServerFailure(ShardrunError):
    """A policy or Gym server did not start, died, or stopped answering. `check`: the name of the watchdog check
    that found it down (shard/watchdog.py), when one did."""

    exit_code = 3

    def __init__(self, message: str, check: str | None = None):
        super().__init__(message)
        self.check = check


class ShardFailed(ShardrunError):
    """A shard's collection did not finish (collector error, stall, missing rollouts)."""

    exit_code = 4


class IncompleteRun(ShardrunError):
    """Some shards are not sealed; merging them needs --allow-partial or `shardrun resume` first."""

    exit_code = 5
