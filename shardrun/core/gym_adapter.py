"""The one seam between shardrun and a NeMo Gym release: what a shard runs, and what the profile writes, per version.

Everything that differs between the supported releases lives in one adapter module per release series
(gym_v04.py for 0.4.x, gym_v07.py for 0.7.x), each a subclass of `GymAdapter` (core/gym_release.py, the
interface, which the adapters import and this module re-exports); the rest of shardrun asks the adapter and never
compares version numbers itself. docs/gym-versions.md lists the differences.

`for_version` picks the adapter of a version; `for_venv` reads the version installed in a venv
(core/gym_version.py) and picks its adapter.
"""

from __future__ import annotations

from pathlib import Path

from shardrun.core import gym_v04, gym_v07, gym_version
from shardrun.core.errors import BadInput
from shardrun.core.gym_release import GymAdapter as GymAdapter  # the interface, asked of the adapter this returns


def for_version(version: str) -> GymAdapter:
    """The adapter of a nemo-gym version; BadInput for a release series shardrun does not support."""
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
    return (gym_v04.GymV04.series, gym_v07.GymV07.series)
