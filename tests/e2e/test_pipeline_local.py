"""A warm worker's pipeline (collector.pipeline_shards) with the real NeMo Gym stack and the stand-in policy server,
which records every request it gets (and when it answered it).

- Across a shard boundary: the first request of shard 0 is held in the model; the worker's next shard is claimed
  and its requests reach the policy while shard 0's last request is still open (through the worker's collector
  service), the policy never has more than num_samples_in_parallel requests open, and every identity is answered
  once. The worker's record carries its slot occupancy.
- The rollouts beyond the policy's slots (collector.rollouts_per_slot): with both slots held in the model, the
  worker's collector service still has slots x 3 rollouts in flight, the policy only the held requests.
- SIGKILL a worker while it has two shards in flight (two workers; the first request of each of shards 4 to 7 is
  held in the model, so once 0 to 3 are sealed the workers hold 4 to 7, and one of them has two of them in flight): the sealed shards stay as they were, the other
  worker takes the killed one's over after the lease, and the run ends with every identity once.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from shardrun.rundir import records, store
from shardrun.shard import gym_stack
from tests.e2e.test_e2e_local import REPEATS
from tests.e2e.test_workers_local import all_rollouts, submit, wait_for, write_config
from tests.faults import gymkit
from tests.fakes import harness

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(900)]
SHARDS = 8


@pytest.fixture
def env(tmp_path: Path, gym_venv: Path, monkeypatch) -> str:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    return tag


def answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def max_open(answered: list[dict]) -> int:
    """The most requests the policy had open at once (from the answer log's start and end times)."""
    events = sorted([(a["t0"], 1) for a in answered] + [(a["t1"], -1) for a in answered], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def question_of(input_jsonl: Path, task: int) -> str:
    return json.loads(input_jsonl.read_text().splitlines()[task])["question"]


def test_the_next_shard_s_requests_start_before_the_last_request_of_the_previous_one_ends(
    tmp_path: Path, gym_venv: Path, env: str
) -> None:
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS)
    run_dir = tmp_path / "run"
    answer_log = tmp_path / "answers.jsonl"
    held = question_of(input_jsonl, 0)
    with harness.fake_policy(
        tmp_path, "--answer-log", str(answer_log), "--fault", f"hold:match={held},times=1"
    ) as fake:
        cfg_path = write_config(
            tmp_path / "run.yaml",
            input_jsonl,
            run_dir,
            fake.base_url,
            cluster={"workers": 1},
            collector={"pipeline_shards": 2},
        )
        proc = submit(cfg_path, tmp_path)
        try:
            wait_for("shard 0's request held in the model", lambda: [r for r in fake.requests() if r["fault"]])
            # held there, shard 0 cannot end; the worker's next shard's requests reach the policy all the same
            nxt = wait_for(
                "a request of another shard",
                lambda: [r for r in fake.requests() if r["fault"] is None and held not in r["prompt"]],
            )
            fake.set_faults([])  # shard 0's held request is answered now
            out, _ = proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        requests = fake.requests()
        answered = answers(answer_log)

    [held_request] = [r for r in requests if r["fault"] == "hold"]
    [held_answer] = [a for a in answered if a["n"] == held_request["n"]]
    assert nxt[0]["t"] < held_answer["t1"]  # the next shard's request started before shard 0's last one ended
    got = all_rollouts(run_dir)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == SHARDS * REPEATS  # every identity once
    pairs = [(a["prompt"], a["seed"]) for a in answered]
    assert len(pairs) == len(set(pairs)) == SHARDS * REPEATS  # the model answered each rollout once
    assert all("in the collector service" in store.collector_log_path(run_dir, i).read_text() for i in range(SHARDS))
    assert max_open(answered) <= 2  # two shards at once, one budget: never more than num_samples_in_parallel
    [state] = records.read_worker_states(run_dir)
    assert state.slots == 2 and state.request_s > 0 and state.holding_s > 0
    assert sorted(state.sealed) == list(range(SHARDS)) and state.current_shards == []
    assert state.holding_s < sum(state.collecting_s.values())  # shards were held at once
    assert harness.tagged_processes(env) == []


def test_the_rollouts_beyond_the_policy_s_slots_run_up_to_its_gate(tmp_path: Path, gym_venv: Path, env: str) -> None:
    """collector.rollouts_per_slot (default 3): with both of the policy's 2 slots held in the model, the worker's
    collector service still has 2 x 3 rollouts in flight (the other 4 went through their agent and model server and
    wait at the slot gate, so each takes a slot the moment one frees); once the held requests are answered every
    identity lands once and the policy never had more than 2 requests open."""
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS)
    run_dir = tmp_path / "run"
    answer_log = tmp_path / "answers.jsonl"
    held = question_of(input_jsonl, 0)
    with harness.fake_policy(
        tmp_path, "--answer-log", str(answer_log), "--fault", f"hold:match={held},times=2"
    ) as fake:
        cfg_path = write_config(
            tmp_path / "run.yaml",
            input_jsonl,
            run_dir,
            fake.base_url,
            cluster={"workers": 1},
            collector={"pipeline_shards": 3},
        )
        proc = submit(cfg_path, tmp_path)
        try:
            wait_for("both slots held in the model", lambda: len([r for r in fake.requests() if r["fault"]]) == 2)

            def in_flight() -> int | None:
                for spool in store.workers_dir(run_dir).glob("*/collector-service"):
                    try:
                        n = json.loads((spool / "slots.json").read_text())["held"]
                    except (OSError, ValueError, KeyError):
                        continue
                    return n if n == 2 * 3 else None
                return None

            wait_for("the service to have 6 rollouts in flight", in_flight)  # 2 in the model, 4 at the gate
            fake.set_faults([])
            out, _ = proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out
        answered = answers(answer_log)

    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in all_rollouts(run_dir)]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == SHARDS * REPEATS  # every identity once
    pairs = [(a["prompt"], a["seed"]) for a in answered]
    assert len(pairs) == len(set(pairs)) == SHARDS * REPEATS  # the model answered each rollout once
    assert max_open(answered) <= 2
    assert harness.tagged_processes(env) == []


def test_a_worker_sigkilled_with_two_shards_in_flight_loses_nothing(tmp_path: Path, gym_venv: Path, env: str) -> None:
    input_jsonl = gymkit.write_input(tmp_path / "input.jsonl", tasks=SHARDS)
    run_dir = tmp_path / "run"
    held = [question_of(input_jsonl, t) for t in range(4, SHARDS)]
    faults = [arg for q in held for arg in ("--fault", f"hold:match={q},times=1")]
    with harness.fake_policy(tmp_path, *faults) as fake:
        cfg_path = write_config(
            tmp_path / "run.yaml",
            input_jsonl,
            run_dir,
            fake.base_url,
            cluster={"workers": 2},
            collector={"pipeline_shards": 2},
        )
        proc = submit(cfg_path, tmp_path)
        try:

            def two_in_flight() -> records.WorkerState | None:
                states = records.read_worker_states(run_dir)
                held_now = sorted(i for s in states for i in s.current_shards)
                asked = {4 + held.index(q) for r in fake.requests() if r["fault"] for q in held if q in r["prompt"]}
                holders = [s for s in states if len(set(s.current_shards) & asked) >= 2]
                return holders[0] if len(states) == 2 and held_now == [4, 5, 6, 7] and holders else None

            victim = wait_for("the workers to hold shards 4 to 7, one with two in flight", two_in_flight)
            sealed_before = {
                i: json.loads(store.done_path(run_dir, i).read_text())
                for i in range(SHARDS)
                if store.done_path(run_dir, i).exists()
            }
            os.kill(victim.pid, signal.SIGKILL)
            fake.set_faults([])
            out, _ = proc.communicate(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out

    assert sorted(sealed_before) == [0, 1, 2, 3] and set(victim.current_shards) <= {4, 5, 6, 7}
    assert len(victim.current_shards) >= 2
    for i, marker in sealed_before.items():  # no sealed rollout lost: the seal and its file are as they were
        assert json.loads(store.done_path(run_dir, i).read_text()) == marker
        assert store.sha256_file(store.rollouts_path(run_dir, i)) == marker["rollouts_sha256"]
    got = all_rollouts(run_dir)
    keys = [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in got]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == SHARDS * REPEATS  # nothing lost, nothing twice
    assert harness.tagged_processes(env) == []
