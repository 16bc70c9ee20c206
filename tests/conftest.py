"""Shared fixtures: where the real NeMo Gym and vLLM venvs live (installed by scripts/setup.sh).

Outside CI a missing venv skips the tests that need it, with the reason; in CI (CI=true) it is an error, so a
broken set-up can never pass as green.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("SHARDRUN_CACHE", Path.home() / ".cache" / "shardrun"))
GYM_VENV = Path(os.environ.get("SHARDRUN_GYM_VENV", CACHE / "gym-venv"))
VLLM_VENV = Path(os.environ.get("SHARDRUN_VLLM_VENV", CACHE / "vllm-venv"))
REPO = Path(__file__).resolve().parent.parent


def _need(path: Path, what: str) -> Path:
    if (path / ".shardrun-ok").exists():
        return path
    msg = f"{what} not installed at {path}; run ./scripts/setup.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def gym_venv() -> Path:
    return _need(GYM_VENV, "NeMo Gym venv")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return _need(VLLM_VENV, "vLLM CPU venv")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model(vllm_venv: Path) -> Path:
    """The tiny random ChatML model for real-engine tests, built into the cache on first use (about 5 s)."""
    import subprocess

    models = Path(os.environ.get("SHARDRUN_MODELS", CACHE / "models"))
    subprocess.run(
        [str(REPO / "scripts" / "setup-models.sh"), "tiny"],
        check=True,
        timeout=600,
        env={**os.environ, "SHARDRUN_VLLM_VENV": str(vllm_venv), "SHARDRUN_MODELS": str(models)},
    )
    return models / "tiny-chatml"


@pytest.fixture(params=["c-scanner", "pure-python"])
def scan_path(request, monkeypatch) -> str:
    """Run a merge test on both read paths: the C line scanner (shardrun.merge._jsonlscan) and the pure-Python one
    that stands in where no C compiler was found at install time; they must give the same results."""
    from shardrun.merge import linescan

    if request.param == "c-scanner":
        assert linescan.AVAILABLE, "shardrun.merge._jsonlscan is not built; run ./scripts/setup.sh"
    else:
        monkeypatch.setattr(linescan, "AVAILABLE", False)
    return request.param
