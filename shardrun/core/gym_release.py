"""What every NeMo Gym release series' adapter answers (`GymAdapter`): the commands a shard runs, the flags they need,
what the release's profiler writes, and how it counts missing rollouts (the policies: core/stopping.py). One subclass per series (gym_v04.py,
gym_v07.py); core/gym_adapter.py picks the one of a version.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar
from shardrun.core.errors import BadInput

Key = tuple[int, int]


class GymAdapter(abc.ABC):
    """One Gym release series. Instances carry the exact version (e.g. '0.7.0') they were made for."""

    series: ClassVar[str]
    python: ClassVar[str]  # the Python minor version the release needs (scripts/setup.sh finds it)
    entry_point: ClassVar[str]  # the console script a venv of this release must have
    server_kinds: ClassVar[tuple[str, ...]]  # the server packages ng_run may start, each with its own venv dir
    repeat_level_metrics: ClassVar[bool]  # the profiler writes *_repeat_level_metrics.json and across-repeat stats
    missing_policy: ClassVar[str]  # how the release's profile and aggregate metrics count missing/failed rollouts
    # the rollout flag of a sample that is not a measurement (Gym 0.7's `mask_sample`), or None: a rollout whose
    # flag is truthy is left out of the profile's quality statistics (not of completion), and the flag itself is
    # never a stats column; None: no such flag (a field of that name is an ordinary field)
    mask_field: ClassVar[str | None]
    agent_name_overrides: ClassVar[bool]  # `+agent_name` routes every row (else only rows without an agent_ref)

    def __init__(self, version: str):
        self.version = version

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.version!r})"

    @abc.abstractmethod
    def stack_command(self, venv: Path) -> list[str]:
        """The command (before Hydra overrides) that starts the Gym servers and the head server."""

    def stack_flags(self) -> list[str]:
        """Hydra overrides this release needs on the stack command besides shardrun's common ones."""
        return []

    @abc.abstractmethod
    def collect_command(self, venv: Path) -> list[str]:
        """The command (before Hydra overrides) that collects rollouts against running servers."""

    def collect_flags(self) -> list[str]:
        """Hydra overrides this release needs on the collector besides shardrun's common ones."""
        return []

    def reverify_command(self, venv: Path) -> list[str]:
        """The command (before Hydra overrides) that starts the Gym servers and re-verifies stored rollouts against
        them (`shardrun rescore`); BadInput for a release that has none."""
        raise BadInput(f"nemo-gym {self.version} cannot re-verify stored rollouts; rescore needs nemo-gym 0.7 or later")

    @abc.abstractmethod
    def profile_command(self, venv: Path, materialized: Path, rollouts: Path, partial: bool) -> list[str]:
        """The release's own reward profiler over a materialized file and a rollouts file."""

    def failed_identities(self, log_text: str) -> dict[Key, str]:
        """{identity: reason} for rollouts whose failure the collector only reported in its log (and did not
        record in the failures sidecar itself). Releases that record every failed /run in the sidecar: none."""
        return {}

    def no_result_exit(self, log_text: str) -> bool:
        """Whether the collector's non-zero exit, whose log is `log_text`, only says that every rollout it ran
        failed (each one recorded in the failures sidecar): the round ended as planned, with nothing to score.
        Releases that exit 0 then: never."""
        return False

    def profile_file_suffixes(self) -> tuple[str, ...]:
        """The files the release's profiler writes beside `<stem>.jsonl`, as suffixes of the stem."""
        base = ("_reward_profiling.jsonl", "_agent_metrics.json")
        return base + (("_repeat_level_metrics.json",) if self.repeat_level_metrics else ())
