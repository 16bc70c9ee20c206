"""Session fixtures of the fault suite: the stand-in policy server and one uninterrupted Gym run (the reference the
kill tests compare against, and a run directory the secrets test searches)."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from shardrun.shard import gym_stack
from shardrun.rundir import store
from tests.faults import faultkit, gymkit
from tests.fakes import harness

# a rollout of task 1 ("What is 1 * 2?") with seed 2 is always refused by the model: it must end up in the failure
# sidecar after gym.max_rollout_attempts, in every run, killed or not
ALWAYS_REFUSED = "400:seed=2,match=What is 1 * 2?"
DELAY_S = "0.3"  # each answer takes this long, so collection lasts a few seconds


@dataclass
class GymReference:
    tmp: Path
    key: str
    fake: harness.FakePolicy
    input: Path
    run_dir: Path
    merged: dict[str, bytes]
    planned: list[tuple[int, int]]
    failed: set[tuple[int, int]]
    milestones: dict[str, float]
    submit_output: str

    def config(self, path: Path, run_dir: Path, **kw) -> Path:
        return gymkit.write_config(path, self.input, run_dir, self.fake.base_url, **kw)


@pytest.fixture(scope="session")
def policy_key() -> str:
    return "sk-shardrun-fault-suite-" + secrets.token_hex(16)


@pytest.fixture(scope="session")
def gym_env(gym_venv: Path, policy_key: str) -> Iterator[dict[str, str]]:
    """The environment every Gym fault test runs shardrun in: the key in its variable, the Gym venv."""
    saved = {k: os.environ.get(k) for k in (gymkit.KEY_ENV, gym_stack.VENV_ENV)}
    os.environ[gymkit.KEY_ENV] = policy_key
    os.environ[gym_stack.VENV_ENV] = str(gym_venv)
    yield dict(os.environ)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def shared_policy(tmp_path_factory, gym_env, policy_key) -> Iterator[harness.FakePolicy]:
    tmp = tmp_path_factory.mktemp("policy")
    with faultkit.fake_policy(tmp, "--delay", DELAY_S, "--fault", ALWAYS_REFUSED, key=policy_key) as fake:
        yield fake


@pytest.fixture
def tag(monkeypatch) -> Iterator[str]:
    """A fresh process tag: everything shardrun starts in this test carries it (see harness.tagged_processes)."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, value)
    yield value
    for pid in harness.tagged_processes(value):  # a failed test must not leave its servers running
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(pid, 9)


@pytest.fixture(scope="session")
def gym_reference(tmp_path_factory, shared_policy, policy_key, gym_env) -> GymReference:
    """`shardrun submit` of the small run, uninterrupted; then merge-and-profile."""
    tmp = tmp_path_factory.mktemp("gym-reference")
    input_jsonl = gymkit.write_input(tmp / "input.jsonl")
    run_dir = tmp / "run"
    cfg = gymkit.write_config(tmp / "run.yaml", input_jsonl, run_dir, shared_policy.base_url)
    tag = uuid.uuid4().hex
    env = dict(os.environ, **{harness.TAG_ENV: tag})
    t0 = time.monotonic()
    proc = faultkit.start_cli("submit", cfg, log=tmp / "submit.log", env=env)
    ms = gymkit.Milestones()
    try:
        while proc.poll() is None:
            ms.watch(run_dir, t0, 0)
            time.sleep(0.05)
            if time.monotonic() - t0 > 900:
                pytest.fail("the reference run did not finish in 900 s")
    finally:
        if proc.poll() is None:
            faultkit.kill_tree(proc, tag=tag)
    out = (tmp / "submit.log").read_text()
    assert proc.returncode == 0, out[-3000:] + gymkit.log_text(run_dir)
    assert faultkit.leftovers(tag, also=run_dir) == []
    res = faultkit.cli("merge-and-profile", run_dir)
    assert res.returncode == 0, res.stderr
    planned = gymkit.planned_identities(run_dir)
    failed = set(faultkit.identities(store.failures_path(run_dir, 0)))
    assert failed == {(1, 2)}, failed
    faultkit.assert_exactly_once(run_dir, planned, failed)
    return GymReference(
        tmp,
        policy_key,
        shared_policy,
        input_jsonl,
        run_dir,
        faultkit.merged_outputs(run_dir, gym=True),
        planned,
        failed,
        ms.at,
        out,
    )


@pytest.fixture
def mounts() -> Iterator[list[Path]]:
    """tmpfs mounts a test made (faultkit.mount_tmpfs appends to it), lazily unmounted afterwards."""
    mounted: list[Path] = []
    yield mounted
    for m in reversed(mounted):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
