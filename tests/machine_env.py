"""What a test that runs no real Gym must not see of this machine: its Gym venvs.

A run planned without `gym.venv` takes its Gym version (0.4 or 0.7 behaviour) from `$SHARDRUN_GYM_VENV`, else from
the venv `scripts/setup.sh` linked as the default in `$SHARDRUN_CACHE`. A test without real Gym (and the session
fixtures such tests share) runs inside `without_machine_gym_venv()`, so what it sees never depends on which venvs
this machine has; its own stand-in venvs and settings still apply.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

NO_CACHE = Path(__file__).resolve().parent.parent / ".no-cache-in-unit-tests"  # never created


@contextmanager
def without_machine_gym_venv() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SHARDRUN_GYM_VENV", raising=False)
        mp.setenv("SHARDRUN_CACHE", str(NO_CACHE))
        yield
