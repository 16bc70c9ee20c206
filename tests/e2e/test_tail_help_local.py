"""The end of a run is not a tail (cluster workers with collector services, real NeMo Gym, the stand-in policy that
records every request and answer): two workers, two shards; shard 0's first two requests are held in the model, so
its holder's two policy slots are stuck: the rollouts its collector service runs beyond them (collector.rollouts_per_slot,
the default 3 per slot) wait at its slot gate and the rest of its rows wait for the service's budget. The other worker seals shard 1, finds nothing
to claim, asks the holder for help, and is lent half of what waits; it collects that share while the holder is
still stuck. Once the held requests are answered the holder finishes its own rows (never the lent ones), folds the
helper's rows in and seals: every identity once in the shard, the model asked for each rollout once, the shard's
seal exact and its help folder gone."""

from __future__ import annotations

import json
import os
import signal
import re
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import records, store
from shardrun.shard import gym_stack
from tests.e2e.test_pipeline_local import answers
from tests.e2e.test_workers_local import submit, wait_for
from tests.faults import gymkit
from tests.fakes import harness

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
TASKS, REPEATS = 4, 12  # shards of 24 rows: more than the service's budget of 6 keeps in flight wait to be lent


def tag_env(monkeypatch, venv: Path) -> str:
    """The test's process tag, the stand-in's key and the Gym venv, in the environment the workers inherit."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(venv))
    return tag


@pytest.fixture
def env(gym_venv_each: Path, monkeypatch) -> str:
    """Each Gym release (the service lends from Gym's own semaphore, whose rows 0.4 and 0.7 run alike)."""
    return tag_env(monkeypatch, gym_venv_each)


def rows(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in store.complete_lines(path)]


def plan_two_shards(tmp_path: Path, fake: harness.FakePolicy) -> tuple[Path, Path, list[dict]]:
    """Two workers, two shards of TASKS x REPEATS rollouts, planned and written (the test holds requests by the
    planned questions before it submits): the config, the run directory and shard 0's planned rows."""
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=TASKS)
    run_dir = tmp_path / "run"
    cfg_path = gymkit.write_config(
        tmp_path / "run.yaml",
        input_jsonl,
        run_dir,
        fake.base_url,
        repeats=REPEATS,
        shards=2,
        api_key_env=harness.API_KEY_ENV,
        cluster={"workers": 2, "claim_heartbeat_s": 1, "claim_lease_s": 10},
        collector={"pipeline_shards": 1},
    )
    plan = subprocess.run(
        [sys.executable, "-m", "shardrun.cli", "plan", str(cfg_path), "--write"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    return cfg_path, run_dir, rows(store.materialized_path(run_dir, 0))


def test_an_idle_worker_collects_a_share_of_the_last_shard_and_every_identity_lands_once(
    tmp_path: Path, env: str
) -> None:
    answer_log = tmp_path / "answers.jsonl"
    with harness.fake_policy(tmp_path, "--delay", "0.2", "--answer-log", str(answer_log)) as fake:
        cfg_path, run_dir, shard0 = plan_two_shards(tmp_path, fake)
        [first] = {r["question"] for r in shard0[:1]}
        assert first not in store.materialized_path(run_dir, 1).read_text()
        assert sum(r["question"] == first for r in shard0) >= 2
        fake.set_faults([f"hold:match={first},times=2"])
        proc = submit(cfg_path, tmp_path)
        try:
            wait_for(
                "shard 0's two slots held in the model", lambda: len([r for r in fake.requests() if r["fault"]]) == 2
            )
            helped = wait_for("a worker to collect a share of shard 0", lambda: helped_line(run_dir))
            fake.set_faults([])  # the holder's stuck requests are answered now
            out, _ = proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        answered = answers(answer_log)

    shard_log = store.shard_log_path(run_dir, 0).read_text()
    lent = [int(n) for n in re.findall(r"lent (\d+) rollouts still waiting for a slot", shard_log)]
    folded = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+) lent rollouts folded in", shard_log)]
    collected = [int(n) for n in re.findall(r"shard 0: helped with (\d+) of", worker_logs(run_dir))]
    assert int(helped.split("helped with ")[1].split(" of ")[0]) >= 2
    assert sum(lent) == sum(a for a, _ in folded) == sum(b for _, b in folded) == sum(collected) >= 2
    got = rows(store.rollouts_path(run_dir, 0)) + rows(store.rollouts_path(run_dir, 1))
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got]
    assert len(keys) == len(set(keys)) == TASKS * REPEATS  # every identity once
    pairs = [(a["prompt"], a["seed"]) for a in answered]
    assert len(pairs) == len(set(pairs)) == TASKS * REPEATS  # the model ran each rollout once: none ran twice
    marker = json.loads(store.done_path(run_dir, 0).read_text())
    assert marker["num_rollouts"] == len(shard0) and marker["rollouts_sha256"] == store.sha256_file(
        store.rollouts_path(run_dir, 0)
    )
    assert not (store.shard_dir(run_dir, 0) / "help").exists()
    states = {s.worker_id: s for s in records.read_worker_states(run_dir)}
    assert len(states) == 2 and all(s.state == "stopped" for s in states.values())
    assert harness.tagged_processes(env) == []


def worker_logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted(store.workers_dir(run_dir).glob(f"*/{store.LOGS}/{store.WORKER_LOG}")))


def helped_line(run_dir: Path) -> str | None:
    lines = [line for line in worker_logs(run_dir).splitlines() if "shard 0: helped with" in line]
    return lines[0] if lines else None


def test_a_helper_killed_mid_share_loses_nothing_and_the_holder_runs_only_what_it_missed(
    tmp_path: Path, gym_venv: Path, monkeypatch
) -> None:
    """As above on the default Gym, but the helper's request for one lent row is held too, and the helper is
    SIGKILLed once its other lent rows landed in its share: the holder, silent helper after the lease, takes the
    share back, folds in what the helper finished and runs the rest itself; every identity lands once."""
    tag = tag_env(monkeypatch, gym_venv)
    with harness.fake_policy(tmp_path, "--delay", "0.2") as fake:
        cfg_path, run_dir, shard0 = plan_two_shards(tmp_path, fake)
        first, last = shard0[0]["question"], shard0[-1]["question"]
        assert first != last and sum(r["question"] == last for r in shard0) >= 5  # the lent rows ask `last`
        fake.set_faults([f"hold:match={first},times=2", f"hold:match={last},times=1"])
        proc = submit(cfg_path, tmp_path)
        try:

            def share_nearly_done() -> tuple[records.WorkerState, int, int] | None:
                for g in (store.shard_dir(run_dir, 0) / "help").glob("*.grant.json"):
                    lent = len(json.loads(g.read_text())["rows"])
                    landed = store.count_complete_lines(g.parent / g.name.replace(".grant.json", "") / "rollouts.jsonl")
                    helper = g.name.split("-")[0]
                    [state] = [s for s in records.read_worker_states(run_dir) if s.worker_id == helper]
                    if lent >= 2 and landed == lent - 1:
                        return state, lent, landed
                return None

            helper, lent, landed = wait_for("the helper to hold its last lent row", share_nearly_done)
            os.kill(helper.pid, signal.SIGKILL)
            fake.set_faults([])
            proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()

    shard_log = store.shard_log_path(run_dir, 0).read_text()
    assert "fell silent" in shard_log and f"{landed} of {lent} lent rollouts folded in" in shard_log
    got = rows(store.rollouts_path(run_dir, 0)) + rows(store.rollouts_path(run_dir, 1))
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got]
    assert len(keys) == len(set(keys)) == TASKS * REPEATS  # every identity once, the helper's missing one too
    assert json.loads(store.done_path(run_dir, 0).read_text())["num_rollouts"] == len(shard0)
    assert not (store.shard_dir(run_dir, 0) / "help").exists()
    assert harness.tagged_processes(tag) == []  # the killed helper's servers were reaped
