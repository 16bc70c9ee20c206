"""`shardrun rescore` and `compare` with the real NeMo Gym stack (0.7; `gym eval reverify` is 0.7's) and the stand-in
policy (tests/fakes/policy_server.py) for the collection only: the re-score runs with the policy gone.

- A collected 2-shard run re-scored with the same config (forced: math_with_judge does not declare itself
  stateless) gives every rollout exactly its reward, and `compare` pairs them rollout by rollout: zero changed.
- Without --force the re-score is refused, naming the servers Gym refused.
- Re-scored with another scoring, another judge swapped in (math_with_judge's `should_use_judge` on, its judge
  `judges.math_judge`: an external stand-in in judge mode that says "equal" for one chosen question only, so the
  rollouts math-verify failed on that question turn 1 and no other reward moves: the change is decided by the
  judge's verdicts, never by timing), and SIGKILLed (the command's whole process group and the Gym servers of the
  shard it was running) once shard 0 is sealed, then resumed by running the same command again: shard 0 is not
  verified again (its seal and its Gym log as they were), and the merged rewards equal those Gym's own
  re-verification gives for the source's merged rollouts with the same scoring (one unsharded `gym eval reverify`
  against the same judge); `compare` counts exactly the rollouts whose reward differs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shardrun.core import gym_adapter
from shardrun.rundir import records, store
from shardrun.core.config import GymConfig, JudgeConfig
from shardrun.shard import gym_stack
from shardrun.shard import judges as judge_servers
from tests.fakes import harness

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]
JUDGE = "math_judge"
JUDGE_KEY_ENV = "SHARDRUN_TEST_RESCORE_JUDGE_KEY"
JUDGE_KEY = "rescore-judge-key"
MATH = "math_with_judge.resources_servers.math_with_judge"
JUDGE_SETTINGS = [f"++{MATH}.should_use_judge=true", f"++{MATH}.judge_model_server.name={JUDGE}"]


def judge_config(base_url: str) -> JudgeConfig:
    return JudgeConfig(base_url=base_url, model_name="judge-ext", api_key_env=JUDGE_KEY_ENV)


def changed_scoring(base_url: str) -> list[str]:
    """The overrides of the other scoring: the judge on, bound to judges.math_judge (Hydra's grammar)."""
    return [
        "gym.overrides=[" + ",".join(f"'{o}'" for o in JUDGE_SETTINGS) + "]",
        f"+judges.{JUDGE}={{base_url:'{base_url}',model_name:judge-ext,api_key_env:{JUDGE_KEY_ENV}}}",
    ]


def cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardrun.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def rewards(path: Path) -> dict[tuple[int, int], float]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[(r["_ng_task_index"], r["_ng_rollout_index"])] = r["reward"]
    return out


def compared(tmp: Path, base: Path, cand: Path, name: str) -> dict:
    done = cli("compare", str(base), str(cand), "-o", str(tmp / name), "--json", cwd=tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["candidates"][0]["rollouts"]


def gym_reverify(tmp: Path, source: Path, gym_venv: Path, judge_url: str) -> dict[tuple[int, int], float]:
    """Gym's own re-verification of the source's merged rollouts, unsharded, with the changed scoring."""
    cfg = store.load_plan(source).config
    gym = GymConfig.model_validate(cfg["gym"]).model_copy(update={"overrides": JUDGE_SETTINGS})
    out = tmp / "reference" / "reverified.jsonl"
    extra = [
        f"+materialized_inputs_jsonl_fpath={store.merged_materialized_path(source)}",
        f"+rollouts_jsonl_fpath={store.merged_rollouts_path(source)}",
        f"+output_jsonl_fpath={out}",
        "+disable_aggregation=true",
        "+model_endpoint_readiness_timeout_seconds=0",
        "+force=true",
    ]
    started, _ = judge_servers.start_all({JUDGE: judge_config(judge_url)}, tmp / "reference")
    stack = gym_stack.start(
        tmp / "reference",
        0,
        gym,
        ["http://127.0.0.1:9/v1"],
        None,
        "none",
        judges=[j.binding for j in started],
        command=lambda adapter, venv: adapter.reverify_command(venv),
        extra=extra,
    )
    try:
        assert stack.proc.wait(timeout=600) == 0, stack.proc.tail()
    finally:
        stack.stop()
        judge_servers.stop_all(started)
    return rewards(out.with_name("unsafe_" + out.name))


def collected_source(tmp: Path, gym_venv: Path, shards: int) -> tuple[Path, Path]:
    """The source run: 6 arithmetic tasks x 2 rollouts collected with real Gym and the stand-in policy (half right);
    (its input, its run directory)."""
    input_jsonl = harness.example_input(tmp / "input.jsonl", gym_venv, math_rows=6, weather_rows=0)
    source = tmp / "run"
    with harness.fake_policy(tmp, "--correct-share", "0.5") as fake:
        cfg_path = harness.write_config(tmp / "run.yaml", input_jsonl, source, fake.base_url, repeats=2, shards=shards)
        done = cli("submit", str(cfg_path), cwd=tmp, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
    return input_jsonl, source


def judged_question(input_jsonl: Path, before: dict[tuple[int, int], float]) -> tuple[int, str]:
    """A task that math-verify failed on at least once, whose question is in no other task's (the judge stand-in
    matches by substring): (its index, its question)."""
    qs = [json.loads(line)["question"] for line in input_jsonl.read_text().splitlines() if line.strip()]
    chosen = next(
        t
        for t, q in enumerate(qs)
        if any(before[(t, r)] == 0 for r in range(2)) and not any(q in other for o, other in enumerate(qs) if o != t)
    )
    return chosen, qs[chosen]


def wait_for(what: str, check, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_rescore_same_and_changed_setting_killed_and_resumed(tmp_path: Path, gym_venv: Path, monkeypatch) -> None:
    if gym_adapter.for_venv(gym_venv).version.startswith("0.4"):
        pytest.skip("gym eval reverify is nemo-gym 0.7's")
    tag = uuid.uuid4().hex
    monkeypatch.setenv(harness.TAG_ENV, tag)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    input_jsonl, source = collected_source(tmp_path, gym_venv, shards=2)
    done = cli("merge-and-profile", str(source), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    before = rewards(store.merged_rollouts_path(source))
    assert len(before) == 12 and 0 < sum(before.values()) < 12

    # not stateless: refused without --force, naming the servers
    refused = cli("rescore", str(source), "-o", str(tmp_path / "refused"), cwd=tmp_path)
    assert refused.returncode != 0
    assert "['math_with_judge'] are not safe to re-verify statelessly" in refused.stdout + refused.stderr
    assert "--force" in refused.stdout + refused.stderr

    # the same config: every reward as it was, compare says zero changed
    same = tmp_path / "same"
    done = cli("rescore", str(source), "-o", str(same), "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert cli("merge-and-profile", str(same), cwd=tmp_path).returncode == 0
    assert rewards(store.merged_rollouts_path(same)) == before
    plan = store.load_plan(same)
    assert plan.config["rescore"]["source_run"] == str(source.resolve())
    assert plan.config["rescore"]["source_fingerprint"] == store.load_plan(source).fingerprint
    got = compared(tmp_path, source, same, "cmp-same")
    assert (got["paired"], got["changed"], got["examples"]) == (12, 0, [])

    # another judge swapped in: equal for one chosen question that math-verify failed on at least once
    chosen, question = judged_question(input_jsonl, before)
    expected = {k: 1.0 if v == 1 or k[0] == chosen else 0.0 for k, v in before.items()}
    monkeypatch.setenv(JUDGE_KEY_ENV, JUDGE_KEY)
    changed = tmp_path / "changed"
    with harness.fake_policy(tmp_path, "--judge", "--judge-equal", question, key=JUDGE_KEY, tagged=False) as judge:
        scoring = changed_scoring(judge.base_url)
        args = [sys.executable, "-m", "shardrun.cli", "rescore", str(source), *scoring, "-o", str(changed), "--force"]
        killed = subprocess.Popen(args, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            wait_for("shard 0's seal", lambda: store.done_path(changed, 0).exists() or killed.poll() is not None)
        finally:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
            kill_tagged(tag)  # the Gym servers of the shard it was running (their own process groups)
        assert store.done_path(changed, 0).exists() and not store.done_path(changed, 1).exists()
        seal0 = store.done_path(changed, 0).read_bytes()
        log0 = store.gym_log_path(changed, 0).read_text()
        done = cli("rescore", str(source), *scoring, "-o", str(changed), "--force", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "already sealed: 1 shard(s)" in done.stdout
        assert store.done_path(changed, 0).read_bytes() == seal0
        assert store.gym_log_path(changed, 0).read_text() == log0  # shard 0 was not verified again
        assert cli("merge-and-profile", str(changed), cwd=tmp_path).returncode == 0
        after = rewards(store.merged_rollouts_path(changed))
        judged = [r for r in judge.requests() if r.get("route")]
        assert after == gym_reverify(tmp_path, source, gym_venv, judge.base_url)
    assert judged and all(r["auth_ok"] for r in judged)  # the judge was asked, with its key by name
    assert after == expected
    differ = sorted(k for k in before if before[k] != after[k])
    assert differ, "the other judge changed no reward: the test shows nothing"
    got = compared(tmp_path, source, changed, "cmp-changed")
    assert (got["paired"], got["changed"]) == (12, len(differ))
    assert [(e["task_index"], e["rollout_index"]) for e in got["examples"]] == differ[:10]
    assert JUDGE_KEY not in store.plan_path(changed).read_text()


def kill_tagged(tag: str) -> None:
    """SIGKILL every process the killed command started (they carry the test's tag), until none is left."""

    def gone() -> bool:
        for pid in harness.tagged_processes(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not harness.tagged_processes(tag)

    wait_for("the killed re-score's processes to end", gone, timeout=60)


def shard_rewards(run_dir: Path) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for i in range(len(store.load_plan(run_dir).shards)):
        out |= rewards(store.rollouts_path(run_dir, i))
    return out


def test_rescore_under_warm_workers_seals_each_shard_once_with_the_judges_verdicts(
    tmp_path: Path, gym_venv: Path, monkeypatch
) -> None:
    """A re-score with `cluster.workers: 2` (local): the workers claim the shards and re-verify each (Gym's
    re-verification starting its servers, the judge's binding as in a shard job); every shard is sealed once, by a
    worker that records it, and the rewards are the judge's verdicts where math-verify failed, the source's
    elsewhere: those the one-job-per-shard re-score of the test above gives (and equals Gym's own reverify)."""
    if gym_adapter.for_venv(gym_venv).version.startswith("0.4"):
        pytest.skip("gym eval reverify is nemo-gym 0.7's")
    monkeypatch.setenv(harness.TAG_ENV, uuid.uuid4().hex)
    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    monkeypatch.setenv(JUDGE_KEY_ENV, JUDGE_KEY)
    input_jsonl, source = collected_source(tmp_path, gym_venv, shards=2)
    before = shard_rewards(source)
    chosen, question = judged_question(input_jsonl, before)
    expected = {k: 1.0 if v == 1 or k[0] == chosen else 0.0 for k, v in before.items()}
    workers = tmp_path / "workers"
    with harness.fake_policy(tmp_path, "--judge", "--judge-equal", question, key=JUDGE_KEY, tagged=False) as judge:
        scoring = changed_scoring(judge.base_url)
        done = cli("rescore", str(source), *scoring, "++cluster.workers=2", "-o", str(workers), "--force", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        judged = [r for r in judge.requests() if r.get("route")]
    assert "warm workers: 2 job(s)" in done.stdout, done.stdout
    assert judged and all(r["auth_ok"] for r in judged)
    got = shard_rewards(workers)
    assert got == expected and len(got) == 12 and got != before  # the judge's verdicts count

    states = records.read_worker_states(workers)
    assert len(states) == 2 and all(s.server_starts == 0 for s in states), states
    assert sorted(i for s in states for i in s.sealed) == [0, 1]  # each shard sealed once
    for i in range(2):
        marker = json.loads(store.done_path(workers, i).read_text())
        assert marker["worker"]["id"] in {s.worker_id for s in states}
        assert store.shard_log_path(workers, i).read_text().count("start: attempt") == 1
        assert not store.claim_path(workers, i).exists()
