"""CI=true turns a skip for a missing part of the environment into a failure (the hooks in tests/conftest.py); a
test that does not apply (NOT_APPLICABLE) and an expected failure stay what they are. Run as a separate pytest
session over a small test folder, with and without CI=true."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest
from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # the hooks under test

@pytest.fixture
def slurm():
    pytest.skip("Slurm cannot be installed here: not root")
"""

TESTS = """
import pytest
from tests.conftest import NOT_APPLICABLE

def test_skips_in_the_test():
    pytest.skip("the NeMo Gym venv is not installed")

def test_skips_in_a_fixture(slurm):
    pass

@pytest.mark.skipif(True, reason="no C compiler here")
def test_skipif_mark():
    pass

@pytest.mark.parametrize("case", ["applies", "does not apply"])
def test_parametrised(case):
    if case == "does not apply":
        pytest.skip(NOT_APPLICABLE + "this case has nothing to check")

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
"""

MODULE_SKIP = """
import pytest
pytest.importorskip("a_module_nobody_installed")

def test_never_collected():
    pass
"""


def outcomes(folder: Path, ci: bool) -> dict[str, str]:
    """Run pytest over `folder` -> {test name (or module, for collection): passed|failed|skipped|error}."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci:
        env["CI"] = "true"
    xml = folder / f"report-{ci}.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors"]
        + [f"--junitxml={xml}", str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr
    result = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
        result[case.get("name") or case.get("classname", "")] = kinds.pop() if kinds else "passed"
    return result


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ci-skips")
    (root / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (root / "test_cases.py").write_text(textwrap.dedent(TESTS))
    (root / "test_module_skip.py").write_text(textwrap.dedent(MODULE_SKIP))
    return root


def test_outside_ci_an_environment_skip_stays_a_skip(folder: Path) -> None:
    got = outcomes(folder, ci=False)
    assert got == {
        "test_skips_in_the_test": "skipped",
        "test_skips_in_a_fixture": "skipped",
        "test_skipif_mark": "skipped",
        "test_parametrised[applies]": "passed",
        "test_parametrised[does not apply]": "skipped",
        "test_expected_failure": "skipped",  # junit's word for xfailed
        "test_module_skip": "skipped",
        "test_passes": "passed",
    }


def test_in_ci_an_environment_skip_fails(folder: Path) -> None:
    got = outcomes(folder, ci=True)
    assert got == {
        "test_skips_in_the_test": "failure",
        "test_skips_in_a_fixture": "error",  # a fixture's failure is reported as an error at setup
        "test_skipif_mark": "error",
        "test_parametrised[applies]": "passed",
        "test_parametrised[does not apply]": "skipped",
        "test_expected_failure": "skipped",
        "test_module_skip": "error",
        "test_passes": "passed",
    }
