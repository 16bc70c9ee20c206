"""The one seam between shardrun and a NeMo Gym release: what a shard runs, and what the profile writes, per version.

Everything that differs between the supported releases lives in one adapter module per release series
(gym_v04.py for 0.4.x, gym_v07.py for 0.7.x), each a subclass of `GymAdapter`; the rest of shardrun asks the
adapter and never compares version numbers itself. docs/gym-versions.md lists the differences.

`for_version` picks the adapter of a version; `for_venv` reads the version installed in a venv
(core/gym_version.py) and picks its adapter.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar

from shardrun.core import gym_version
from shardrun.core.errors import BadInput

Key = tuple[int, int]
MISSING_POLICIES = ("omit", "zero")


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

    @abc.abstractmethod
    def profile_command(self, venv: Path, materialized: Path, rollouts: Path, partial: bool) -> list[str]:
        """The release's own reward profiler over a materialized file and a rollouts file."""

    def failed_identities(self, log_text: str) -> dict[Key, str]:
        """{identity: reason} for rollouts whose failure the collector only reported in its log (and did not
        record in the failures sidecar itself). Releases that record every failed /run in the sidecar: none."""
        return {}

    def profile_file_suffixes(self) -> tuple[str, ...]:
        """The files the release's profiler writes beside `<stem>.jsonl`, as suffixes of the stem."""
        base = ("_reward_profiling.jsonl", "_agent_metrics.json")
        return base + (("_repeat_level_metrics.json",) if self.repeat_level_metrics else ())


def for_version(version: str) -> GymAdapter:
    """The adapter of a nemo-gym version; BadInput for a release series shardrun does not support."""
    from shardrun.core import gym_v04, gym_v07

    adapters: dict[str, type[GymAdapter]] = {a.series: a for a in (gym_v04.GymV04, gym_v07.GymV07)}
    cls = adapters.get(gym_version.series(version))
    if cls is None:
        supported = ", ".join(f"{s}.x" for s in adapters)
        raise BadInput(f"nemo-gym {version} is not supported by shardrun (supported: {supported})")
    return cls(version)


def for_venv(venv: Path | str) -> GymAdapter:
    """The adapter of the release installed in `venv` (BadInput when none is, or an unsupported one)."""
    return for_version(gym_version.detect(venv))


def supported_series() -> tuple[str, ...]:
    from shardrun.core import gym_v04, gym_v07

    return (gym_v04.GymV04.series, gym_v07.GymV07.series)
