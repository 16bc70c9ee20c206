"""Adaptive sampling end to end with the real NeMo Gym stack (ng_run with math_with_judge, ng_collect_rollouts) and
the stand-in policy (tests/fakes/policy_server.py: the model is the one seam we do not own), whose pass rate is
known per task: never, always, or sometimes.

An adaptive run (sampling.stop_when_decided: drop solved and unsolved) and a full run of the same plan, on the
local executor with one job per shard: `select` writes the same bytes, every rollout the adaptive run collected
equals the full run's rollout with that identity, and the skipped count is planned minus collected.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from shardrun.rundir import store
from shardrun.shard import gym_stack
from tests import builders
from tests.fakes import harness
from tests.e2e.test_e2e_local import essentials, rows

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]
REPEATS = 4
SHARES = [0.0, 1.0, 0.5, 0.5, 0.5, 0.5]  # per task: never, always, sometimes
RULES = {"drop_solved": True, "drop_unsolved": True}


def write_input(path: Path) -> Path:
    template = json.loads(builders.arith_lines(1)[0])
    lines = []
    for i in range(len(SHARES)):
        row = json.loads(json.dumps(template))
        question = f"What is {i + 2} + 3?"
        row["responses_create_params"]["input"][-1]["content"] = (
            row["responses_create_params"]["input"][-1]["content"].rsplit("\n\n", 1)[0] + "\n\n" + question
        )
        row["question"], row["expected_answer"] = question, str(i + 5)
        lines.append(json.dumps(row))
    path.write_text("".join(line + "\n" for line in lines))
    return path


def config_for(tmp: Path, input_jsonl: Path, name: str, url: str, shards: int, sampling: dict | None) -> Path:
    path = harness.write_config(
        tmp / f"{name}.yaml",
        input_jsonl,
        tmp / name,
        url,
        repeats=REPEATS,
        shards=shards,
        gym={"max_rollout_attempts": 2},
    )
    if sampling is not None:
        data = yaml.safe_load(path.read_text())
        data["sampling"] = sampling
        path.write_text(yaml.safe_dump(data))
    return path


def shardrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "shardrun.cli", *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"shardrun {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@contextmanager
def full_run(tmp: Path, gym_venv: Path) -> Iterator[tuple[Path, harness.FakePolicy]]:
    """In `tmp`: the input, the per-task pass rates (shares.json), the stand-in policy that follows them (up while
    in the context), and the full run of the plan (one shard, `full/`) merged and selected (`full.jsonl`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(harness.TAG_ENV, uuid.uuid4().hex)
        mp.setenv(harness.API_KEY_ENV, harness.API_KEY)
        mp.setenv(gym_stack.VENV_ENV, str(gym_venv))
        input_jsonl = write_input(tmp / "input.jsonl")
        shares = {f"What is {i + 2} + 3?": s for i, s in enumerate(SHARES)}
        (tmp / "shares.json").write_text(json.dumps(shares))
        with harness.fake_policy(tmp, "--shares", str(tmp / "shares.json")) as fake:
            full_cfg = config_for(tmp, input_jsonl, "full", fake.base_url, 1, None)
            shardrun("submit", str(full_cfg), cwd=tmp)
            shardrun("merge-and-profile", str(tmp / "full"), cwd=tmp)
            shardrun("select", str(tmp / "full"), "-o", str(tmp / "full.jsonl"), *FLAGS, cwd=tmp)
            yield input_jsonl, fake


@pytest.fixture(scope="session")  # once per xdist worker, however its tests interleave with others
def world(tmp_path_factory: pytest.TempPathFactory, gym_venv: Path):
    """The stand-in policy with the per-task pass rates, the input, and the full run of the plan (one shard)."""
    tmp = tmp_path_factory.mktemp("adaptive")
    with full_run(tmp, gym_venv) as (input_jsonl, fake):
        yield tmp, input_jsonl, fake


FLAGS = ["--drop-solved", "--drop-unsolved"]


def check_against_full(tmp: Path, run_dir: Path, shards: int) -> list[dict]:
    """select's bytes, every collected rollout, the skipped count; returns the markers."""
    out = tmp / f"{run_dir.name}.jsonl"
    shardrun("select", str(run_dir), "-o", str(out), *FLAGS, cwd=tmp)
    assert out.read_bytes() == (tmp / "full.jsonl").read_bytes()
    assert len(rows(out)) == 4  # the never and the always solved task are dropped
    got = essentials(rows(store.merged_rollouts_path(run_dir)))
    want = essentials(rows(store.merged_rollouts_path(tmp / "full")))
    assert got and set(got) < set(want)
    assert all(got[key] == want[key] for key in got)
    markers = [json.loads(store.done_path(run_dir, i).read_text()) for i in range(shards)]
    skipped = sum(m.get("num_skipped_decided", 0) for m in markers)
    assert skipped == len(SHARES) * REPEATS - len(got) > 0
    assert all(m["num_failed"] == 0 for m in markers)
    stopped = {t for m in markers for t in m.get("skipped_decided_tasks", [])}
    assert stopped and not stopped & {0, 1}  # never and always solved tasks get all their rollouts
    status = json.loads(shardrun("status", str(run_dir), "--json", cwd=tmp).stdout)
    assert status["skipped_decided"] == skipped and status["done"] + skipped == status["planned"]
    return markers


def test_one_job_per_shard(world) -> None:
    """Shard 0 holds every task's first wave, shard 1 the second: shard 1 starts after shard 0 sealed (one job at
    a time) and skips the rows of the tasks shard 0 decided. Then `resume --fill` collects exactly those rows."""
    tmp, input_jsonl, fake = world
    cfg = config_for(tmp, input_jsonl, "per_shard", fake.base_url, 2, {"stop_when_decided": RULES})
    shardrun("submit", str(cfg), cwd=tmp)
    shardrun("merge-and-profile", str(tmp / "per_shard"), cwd=tmp)
    markers = check_against_full(tmp, tmp / "per_shard", 2)
    assert markers[1].get("num_skipped_decided", 0) > 0
    assert "adaptive sampling:" in store.shard_log_path(tmp / "per_shard", 1).read_text()

    # `resume --fill`: the shard that skipped rows is unsealed and collects exactly those, with the real Gym stack;
    # then the run holds every rollout of the full run, each once, and nothing counts as skipped
    run_dir = tmp / "per_shard"
    asked_before = len(fake.requests())
    filled = shardrun("resume", str(run_dir), "--fill", cwd=tmp)
    assert "fill: every stopped task; 1 shard(s) unsealed" in filled.stdout, filled.stdout
    shardrun("merge-and-profile", str(run_dir), cwd=tmp)
    got = essentials(rows(store.merged_rollouts_path(run_dir)))
    assert got == essentials(rows(store.merged_rollouts_path(tmp / "full")))
    assert len(fake.requests()) - asked_before == markers[1]["num_skipped_decided"]  # only the skipped rows ran
    refilled = json.loads(store.done_path(run_dir, 1).read_text())
    assert refilled.get("num_skipped_decided", 0) == 0
    status = json.loads(shardrun("status", str(run_dir), "--json", cwd=tmp).stdout)
    assert status["skipped_decided"] == 0 and status["done"] == status["planned"]


def test_one_warm_worker_claims_by_wave(world) -> None:
    """One warm worker over 4 shards (two per wave): it claims in shard order, so the second wave's shards find
    the first wave's rollouts on disk."""
    tmp, input_jsonl, fake = world
    cfg = config_for(tmp, input_jsonl, "worker", fake.base_url, 4, {"stop_when_decided": RULES})
    data = yaml.safe_load(cfg.read_text())
    data["cluster"] |= {"workers": 1, "claim_heartbeat_s": 1, "claim_lease_s": 10}
    cfg.write_text(yaml.safe_dump(data))
    shardrun("submit", str(cfg), cwd=tmp)
    shardrun("merge-and-profile", str(tmp / "worker"), cwd=tmp)
    markers = check_against_full(tmp, tmp / "worker", 4)
    assert all(m.get("worker") for m in markers)


def test_a_worker_killed_mid_way(world, tmp_path: Path) -> None:
    """Two warm workers over 4 shards; the first-wave shard holding task 2 hangs in the model on its rollout 1 and
    its worker is SIGKILLed there. The other worker takes the shard over after the lease, resumes it, and the later
    shards still decide from what is on disk: the same selection as the full run, nothing collected twice."""
    tmp, input_jsonl, _ = world
    question = f"What is {2 + 2} + 3?"  # task 2 (sometimes solved), in shard 0 with rollouts 0 and 1
    with harness.fake_policy(
        tmp_path, "--shares", str(tmp / "shares.json"), "--fault", f"hang:match={question},seed=1"
    ) as fake:
        cfg = config_for(tmp, input_jsonl, "killed", fake.base_url, 4, {"stop_when_decided": RULES})
        data = yaml.safe_load(cfg.read_text())
        # one shard at a time: the killed worker holds only shard 0, so the model answers each rollout once (a
        # worker killed with two shards in flight: tests/e2e/test_pipeline_local.py)
        data["cluster"] |= {
            "workers": 2,
            "claim_heartbeat_s": 1,
            "claim_lease_s": 10,
            "max_attempts": 3,
        }
        data["collector"] = {"pipeline_shards": 1}
        cfg.write_text(yaml.safe_dump(data))
        run_dir = tmp / "killed"
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardrun.cli", "submit", str(cfg)],
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for("the hanging request", lambda: [r for r in fake.requests() if r["fault"] == "hang"])
            claim = wait_for("shard 0's claim", lambda: json.loads(store.claim_path(run_dir, 0).read_text()))
            # every other rollout of shard 0 has landed: the worker is killed with exactly one rollout in flight
            wait_for(
                "shard 0's other rollouts", lambda: len(harness.keys_complete(store.rollouts_path(run_dir, 0))) == 5
            )
            os.kill(claim["pid"], signal.SIGKILL)
            fake.set_faults([])
            out, _ = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        answered = [(r["prompt"], r["seed"]) for r in fake.requests() if r["fault"] is None]
    assert len(answered) == len(set(answered))  # the model answered each rollout once
    shardrun("merge-and-profile", str(run_dir), cwd=tmp)
    markers = check_against_full(tmp, run_dir, 4)
    assert markers[0]["worker"]["id"] != claim["worker_id"]


def wait_for(what: str, check, timeout: float = 600):
    """Poll the run directory and the stand-in's request log (files other processes write) until `check` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
        except (FileNotFoundError, json.JSONDecodeError):
            got = None
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")
