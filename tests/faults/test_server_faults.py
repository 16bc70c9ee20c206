"""Faulty servers, against real NeMo Gym and the stand-in policy server (the fake at the model seam, which can
answer 500 / 400 / garbage for chosen requests, never answer, or be frozen): each case ends in a bounded time
with a clear message, and rollouts that fail deterministically are recorded with identity and reason in the
failure sidecar after gym.max_rollout_attempts, never as reward 0, and are listed by `shardrun status` and the
merge summary. (A policy server that dies mid-run, and a row it always answers 400, are in
tests/shard/test_runtime_faults.py; a SIGKILLed shard in test_kill_shard.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import store
from tests.faults import faultkit, gymkit

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(600)]


def submit(cfg: Path, timeout: float = 600) -> tuple[int, str, float]:
    t0 = time.monotonic()
    res = faultkit.cli("submit", cfg, timeout=timeout)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t0


def after_first_rollout(run_dir: Path, action, timeout: float = 600) -> threading.Thread:
    """Run `action` once the shard's first rollout has landed (in a thread; the test runs the shard)."""

    def wait_then_act() -> None:
        path = store.rollouts_path(run_dir, 0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if store.count_complete_lines(path) >= 1:
                action()
                return
            time.sleep(0.05)

    t = threading.Thread(target=wait_then_act, daemon=True)
    t.start()
    return t


def test_500_and_garbage_answers_are_retried_then_recorded_failed_and_listed(
    tmp_path: Path, gym_env, policy_key, tag: str
):
    faults = [
        "500:seed=1,match=What is 1 + 9?",  # task 3, rollout 1: HTTP 500 every time
        "garbage:seed=3,match=What is 2 * 6?",  # task 2, rollout 3: 200 with a body that is not JSON
        "500:seed=0,match=What is 6 - 3?,times=1",  # task 0, rollout 0: its first request fails once, by content
    ]  # (not "the run's first request", which may be one of the faulty rollouts' own): Gym's client retries it
    with faultkit.fake_policy(
        tmp_path, "--delay", "0.2", *[a for f in faults for a in ("--fault", f)], key=policy_key
    ) as fake:
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml", gymkit.write_input(tmp_path / "input.jsonl"), run_dir, fake.base_url
        )
        rc, out, took = submit(cfg)
        requests = fake.requests()
    assert rc == 0, out + gymkit.log_text(run_dir)
    assert "shard 00000: sealed (14 rollouts, 2 failed)" in out
    prompts = gymkit.prompt_and_seed(run_dir)
    rows_of: dict[tuple[int, int], list[dict]] = {}
    for r in store.iter_jsonl_objects(store.failures_path(run_dir, 0)):
        rows_of.setdefault((r["_ng_task_index"], r["_ng_rollout_index"]), []).append(r)
    assert set(rows_of) == {(3, 1), (2, 3)}
    v04 = (store.load_plan(run_dir).gym_version or "").startswith("0.4.")
    reasons = {}
    # Gym's model client itself tries a 500 three times (openai_utils MAX_NUM_TRIES) and garbage once, per attempt
    for key, calls_per_attempt in (((3, 1), 3), ((2, 3), 1)):
        rows = rows_of[key]
        assert all("reward" not in r for r in rows)
        if v04:  # shardrun's retry ledger: one terminal row after the two attempts (gym.max_rollout_attempts)
            assert rows[-1]["_ng_failure_terminal"] is True and rows[-1]["attempts"] == 2
            reasons[key] = rows[-1]["reason"]
        else:  # Gym 0.7's failure sidecar: one row per attempt, the agent's /run answered HTTP 500
            assert [r.get("_ng_attempt_index", 0) for r in rows] == [0, 1], rows
            assert all(r["_ng_failure_http_status"] == 500 for r in rows)
            reasons[key] = rows[-1]["_ng_failure_response_body"]
        asked = [r for r in requests if (r["prompt"], r["seed"]) == prompts[key]]
        # (a call in flight when Gym's collector aborted on another rollout's failure is not an attempt)
        assert 2 * calls_per_attempt <= len(asked) <= 4 * calls_per_attempt, (key, len(asked))
    assert "VLLMModel___policy_model" in reasons[(3, 1)]  # where: the adapter of the policy model
    assert "JSONDecodeError" in reasons[(2, 3)], reasons[(2, 3)]  # what: the model's answer was not JSON
    if v04:
        assert "HTTP 500" in reasons[(3, 1)] and "HTTP 500" in reasons[(2, 3)]
        attempts = faultkit.identities(store.rollout_attempts_path(run_dir, 0))
        assert sorted(attempts) == [(2, 3), (2, 3), (3, 1), (3, 1)]
    transient = [r for r in requests if r["fault"] == "500" and (r["prompt"], r["seed"]) != prompts[(3, 1)]]
    keys = faultkit.identities(store.rollouts_path(run_dir, 0))
    assert sorted(keys) == sorted(set(gymkit.planned_identities(run_dir)) - {(3, 1), (2, 3)})
    first_of_0_0 = min(r["n"] for r in requests if (r["prompt"], r["seed"]) == prompts[(0, 0)])
    assert len(transient) == 1 and transient[0]["n"] == first_of_0_0  # task 0's first request failed once ...
    assert (transient[0]["prompt"], transient[0]["seed"]) == prompts[(0, 0)] and (0, 0) in keys  # ... and finished

    # listed by `shardrun status` (identity and reason) and by the merge summary; no reward 0 anywhere
    st = faultkit.cli("status", run_dir)
    assert st.returncode == 0, st.stderr
    assert "2 recorded as failed" in st.stdout and "3:1" in st.stdout and "2:3" in st.stdout, st.stdout
    assert "HTTP 500" in st.stdout
    st_json = orjson.loads(faultkit.cli("status", run_dir, "--json").stdout)
    assert {(f["task"], f["rollout"]) for f in st_json["failed"]} == {(3, 1), (2, 3)}
    merged = faultkit.cli("merge-and-profile", run_dir)
    assert merged.returncode == 0, merged.stderr
    assert "failed rollouts (task:rollout, shard, class, reason):" in merged.stdout
    assert "3:1" in merged.stdout and "2:3" in merged.stdout
    summary = orjson.loads(store.merged_summary_path(run_dir).read_bytes())
    assert summary["failed_total"] == 2
    classes = {(f["task"], f["rollout"]): f["failure_class"] for f in summary["failed"]}
    assert classes[(3, 1)] == "policy", summary["failed"]  # the policy's 500: a policy failure, never a score
    profile = {r["_ng_task_index"]: r for r in store.iter_jsonl_objects(store.merged_reward_profiling_path(run_dir))}
    assert profile[3]["num_rollouts"] == 3 and profile[3]["missing_num_rollouts"] == 1
    assert {i["_ng_rollout_index"] for i in profile[3]["rollout_infos"]} == {0, 2, 3}
    assert faultkit.leftovers(tag, also=run_dir) == []
    assert no_key_in(run_dir, policy_key)
    faultkit.counts_line(
        "500/garbage", seconds=round(took), failed_rows=2, model_requests=len(requests), transient_500s=len(transient)
    )


def test_policy_server_that_accepts_connections_but_never_answers_fails_the_shard_in_bounded_time(
    tmp_path: Path, gym_env, policy_key, tag: str
):
    """The whole server wedged (SIGSTOP: the kernel still accepts connections, nothing answers)."""
    with faultkit.fake_policy(tmp_path, "--delay", "0.3", key=policy_key) as fake:
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            run_dir,
            fake.base_url,
            gym={"health_interval_s": 2, "stall_timeout_s": 300},
        )
        frozen_at: list[float] = []
        after_first_rollout(
            run_dir, lambda: (os.kill(fake.proc.pid, signal.SIGSTOP), frozen_at.append(time.monotonic()))
        )
        rc, out, _ = submit(cfg)
        failed_after = time.monotonic() - frozen_at[0]
    assert rc == 3, out  # a server failure (docs/troubleshooting.md)
    assert "shard 00000: failed (ServerFailure: policy server" in out and "does not answer" in out, out
    assert fake.base_url in out
    # two health checks that time out (5 s each, 2 s apart), then teardown; far below the stall timeout
    assert failed_after < 60, f"took {failed_after:.0f} s after the server froze"
    assert not store.done_path(run_dir, 0).exists() and not store.env_yaml_path(run_dir, 0).exists()
    st = faultkit.cli("status", run_dir)
    assert "ServerFailure: policy server" in st.stdout, st.stdout
    assert faultkit.leftovers(tag, also=run_dir) == []
    assert no_key_in(run_dir, policy_key)
    faultkit.counts_line("policy frozen", seconds_to_fail=round(failed_after))


def test_model_that_never_answers_chat_requests_stalls_and_fails_in_bounded_time(
    tmp_path: Path, gym_env, policy_key, tag: str
):
    """/v1/models answers (health checks pass) but every chat request after the first `answered` hangs: Gym would
    wait forever. The fault is in place before the run starts (the stand-in server counts the requests), so the run
    cannot finish before the model hangs. The bound is the stall timeout: the shard fails through it (the message
    names it) and not sooner than stall_timeout_s after a rollout landed; no wall-clock upper bound is asserted (a
    loaded machine may take any time to tear the Gym stack down; the test's own timeout catches a run that never
    ends)."""
    stall = 15.0
    answered = 2
    with faultkit.fake_policy(tmp_path, "--delay", "0.3", "--fault", f"hang:after={answered}", key=policy_key) as fake:
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            run_dir,
            fake.base_url,
            gym={"stall_timeout_s": stall},
        )
        rc, out, _ = submit(cfg)
        ended = time.time()
        requests = sorted(fake.requests(), key=lambda r: r["n"])
    assert rc == 4, out
    assert "shard 00000: failed (ShardFailed: stalled: no rollout landed for" in out, out
    assert f"gym.stall_timeout_s = {stall:g}" in out
    assert [r["fault"] for r in requests[:answered]] == [None] * answered, requests
    assert any(r["fault"] == "hang" for r in requests[answered:]), "no request reached the hanging model"
    # the stall is counted from the last rollout that landed, which came after the first answered request arrived
    # (the server logs each arrival with time.time(), this clock): the shard cannot have failed sooner than that
    since_first, failed_after = ended - requests[0]["t"], ended - requests[answered - 1]["t"]
    assert since_first >= stall, f"failed {since_first:.1f} s after the first answered request, before the stall"
    # only the answered requests' rollouts landed; every request after them hung, none was answered
    assert all(r["fault"] == "hang" for r in requests[answered:]), requests
    done = store.count_complete_lines(store.rollouts_path(run_dir, 0))
    assert 1 <= done <= answered and not store.done_path(run_dir, 0).exists()
    assert faultkit.leftovers(tag, also=run_dir) == []
    assert no_key_in(run_dir, policy_key)
    faultkit.counts_line("model hangs", seconds_to_fail=round(failed_after), stall_timeout_s=stall)


def no_key_in(run_dir: Path, key: str) -> bool:
    """No file of the run (logs with Gym's printed request headers, .failed, markers) holds the key's value."""
    held = [str(p) for p in run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert held == [], held
    return True


def server_pids(tag: str, server_dir: str) -> list[int]:
    """Pids of the Gym servers (`python app.py` in the server's directory) this test's shard started."""
    from tests.fakes import harness

    out = []
    for pid in harness.tagged_processes(tag):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.endswith(server_dir) and "app.py" in faultkit.cmdline(pid):
            out.append(pid)
    return out


def test_gym_server_that_dies_fails_the_shard_in_bounded_time_with_its_name(
    tmp_path: Path, gym_env, policy_key, tag: str
):
    with faultkit.fake_policy(tmp_path, "--delay", "0.3", key=policy_key) as fake:
        run_dir = tmp_path / "run"
        cfg = gymkit.write_config(
            tmp_path / "run.yaml",
            gymkit.write_input(tmp_path / "input.jsonl"),
            run_dir,
            fake.base_url,
            gym={"health_interval_s": 2, "stall_timeout_s": 300},
        )
        killed: list[tuple[float, list[int]]] = []

        def kill_resources_server() -> None:
            pids = server_pids(tag, "resources_servers/math_with_judge")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.append((time.monotonic(), pids))

        after_first_rollout(run_dir, kill_resources_server)
        rc, out, _ = submit(cfg)
    assert killed and killed[0][1], "found no math_with_judge server process to kill"
    failed_after = time.monotonic() - killed[0][0]
    assert rc == 3, out  # a server failure (docs/troubleshooting.md)
    assert "shard 00000: failed (ServerFailure: Gym stack:" in out, out
    assert "Gym server(s) not answering: math_with_judge" in out or "the Gym stack exited" in out, out
    assert failed_after < 60, f"took {failed_after:.0f} s after the Gym server died"
    assert not store.done_path(run_dir, 0).exists() and not store.env_yaml_path(run_dir, 0).exists()
    assert faultkit.leftovers(tag, also=run_dir) == []
    assert no_key_in(run_dir, policy_key)
    faultkit.counts_line("Gym server dies", seconds_to_fail=round(failed_after))
