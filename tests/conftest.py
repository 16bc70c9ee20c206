"""Shared fixtures: where the real NeMo Gym and vLLM venvs live (installed by scripts/setup.sh).

Outside CI a missing part of the environment (a venv, Slurm, a C compiler, setpriv, a tmpfs mount, ...) skips the
tests that need it, with the reason; in CI (CI=true) every such skip is a failure (pytest_runtest_makereport
below), so a broken set-up can never pass as green. A test that does not apply to a parametrised case is not a
missing environment: it skips with a reason starting with NOT_APPLICABLE, which stays a skip in CI.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.machine_env import without_machine_gym_venv

CACHE = Path(os.environ.get("SHARDRUN_CACHE", Path.home() / ".cache" / "shardrun"))
GYM_VENV = Path(os.environ.get("SHARDRUN_GYM_VENV", CACHE / "gym-venv"))
VLLM_VENV = Path(os.environ.get("SHARDRUN_VLLM_VENV", CACHE / "vllm-venv"))
REPO = Path(__file__).resolve().parent.parent
NOT_APPLICABLE = "not applicable: "


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _environment_skip_fails_in_ci(report: pytest.TestReport | pytest.CollectReport) -> None:
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not reason.startswith(NOT_APPLICABLE):
        report.outcome = "failed"
        report.longrepr = f"CI=true: skipped for a missing part of the environment, which fails in CI: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    _environment_skip_fails_in_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    _environment_skip_fails_in_ci(report)
    return report


HEAVY_MARKS = ("gym", "vllm", "slurm", "slow")


def xdist_group(item: pytest.Item) -> str | None:
    """Which heavy tests must share a pytest-xdist worker (scripts/test.sh runs the suite with `-n 2 --dist
    loadgroup`): every test on the one local Slurm cluster in one group, so their jobs never compete for its CPUs;
    the fault suite in one, so its session-wide reference run is made once; any other heavy module in its own, so
    its module-wide fixtures are made once. Light tests go wherever a worker is free."""
    if not any(item.get_closest_marker(m) for m in HEAVY_MARKS):
        return None
    if item.get_closest_marker("slurm"):
        return "slurm"
    path = Path(str(item.path)).relative_to(REPO / "tests")
    return "faults" if path.parts[0] == "faults" else path.stem


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """First of all hooks: pytest-xdist's worker reads the xdist_group markers in its own pytest_collection_modifyitems
    (to suffix the node ids with the group); markers added after it would group nothing."""
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _no_machine_gym_venv(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs no real Gym never sees this machine's Gym venvs (tests/machine_env.py)."""
    if any(request.node.get_closest_marker(m) for m in ("gym", "vllm", "slurm")):
        yield
        return
    with without_machine_gym_venv():
        yield


def _need(path: Path, what: str) -> Path:
    if (path / ".shardrun-ok").exists():
        return path
    pytest.skip(f"{what} not installed at {path}; run ./scripts/setup.sh")


@pytest.fixture(scope="session")
def gym_venv() -> Path:
    return _need(GYM_VENV, "NeMo Gym venv")


GYM_VERSIONS = ("0.4.0", "0.7.0")  # what scripts/setup.sh gyms builds: the vs-Gym equality tests run against each


def gym_venv_of_version(version: str) -> Path:
    """The venv scripts/setup.sh builds for that nemo-gym version, else $SHARDRUN_GYM_VENV when it holds that version
    (missing: a skip, a failure in CI)."""
    from shardrun.core import gym_version

    venv = CACHE / f"gym-venv-{version}"
    if not (venv / ".shardrun-ok").exists() and gym_version.installed_version(GYM_VENV) == version:
        venv = GYM_VENV
    return _need(venv, f"NeMo Gym {version} venv")


@pytest.fixture(scope="session", params=GYM_VERSIONS, ids=[f"gym-{v}" for v in GYM_VERSIONS])
def gym_venv_each(request) -> Path:
    """Each supported Gym version's venv in turn (for the tests that compare shardrun with Gym itself)."""
    return gym_venv_of_version(request.param)


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
