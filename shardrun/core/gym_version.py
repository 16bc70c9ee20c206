"""Which NeMo Gym release a venv holds, read from its installed metadata (no interpreter started).

A run is made with one release: the planner records the version found in `gym.venv`, every `.done` marker repeats
it, and `resume` refuses a venv that holds another one. What differs between releases (commands, flags, server
kinds, profile files) lives in the adapters (shardrun/core/gym_adapter.py); this module only finds
and names the version.
"""

from __future__ import annotations

import re
from email.parser import HeaderParser
from pathlib import Path
from typing import Mapping

from shardrun.core.errors import BadInput

DIST_INFO_GLOB = "lib/python3*/site-packages/nemo_gym-*.dist-info/METADATA"
DEFAULT_VERSION = "0.7.0"  # the release scripts/setup.sh gym installs unless told another (GYM_DEFAULT_VERSION)
VERSION_KEY = "gym_version"  # the field in plan.json and in `.done` markers
_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def installed_version(venv: Path | str) -> str | None:
    """The nemo-gym version installed in `venv` (its dist-info METADATA), or None when there is none."""
    found = sorted(Path(venv).glob(DIST_INFO_GLOB))
    for meta in reversed(found):
        try:
            with open(meta, encoding="utf-8", errors="replace") as f:
                version = HeaderParser().parse(f, headersonly=True).get("Version")
        except OSError:
            continue
        if version:
            return str(version).strip()
    return None


def detect(venv: Path | str) -> str:
    """The nemo-gym version of `venv`; BadInput naming the venv when no nemo-gym is installed there."""
    version = installed_version(venv)
    if version is None:
        raise BadInput(
            f"gym venv {venv}: no nemo-gym installed there (no {DIST_INFO_GLOB}); scripts/setup.sh gym builds one"
        )
    return version


def series(version: str) -> str:
    """The release series a version belongs to: '0.7.0' and '0.7.2' -> '0.7'. BadInput for an unparsable one."""
    m = _RELEASE.match(version)
    if not m:
        raise BadInput(f"nemo-gym version {version!r} is not a release number like 0.7.0")
    return f"{int(m.group(1))}.{int(m.group(2))}"


VENV_ENV = "SHARDRUN_GYM_VENV"


SETUP_VENV = "gym-venv"  # what `scripts/setup.sh gym` builds in $SHARDRUN_CACHE (default ~/.cache/shardrun)


def default_venv_path(env: Mapping[str, str]) -> Path | None:
    """Where `scripts/setup.sh gym` builds the Gym venv for this environment (it may not exist)."""
    cache = env.get("SHARDRUN_CACHE") or (str(Path(env["HOME"]) / ".cache" / "shardrun") if env.get("HOME") else None)
    return Path(cache) / SETUP_VENV if cache else None


def configured_venv(venv_setting: str | None, env: Mapping[str, str]) -> Path | None:
    """The Gym venv a run uses: gym.venv, else $SHARDRUN_GYM_VENV, else the venv `scripts/setup.sh gym` built when
    it exists; None when none of them names one."""
    venv = venv_setting or env.get(VENV_ENV)
    if venv:
        return Path(venv)
    default = default_venv_path(env)
    return default if default is not None and default.is_dir() else None


def of_settings(venv_setting: str | None, env: Mapping[str, str]) -> str | None:
    """The nemo-gym version of the configured venv, or None when none is configured or installed there."""
    venv = configured_venv(venv_setting, env)
    return installed_version(venv) if venv is not None else None
