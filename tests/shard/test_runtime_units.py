"""The shard runtime's parts without a Gym stack: identity ledger, collector log parsing, Gym stack settings,
watchdog, policy checks, launch helpers, and run_shard's paths that need no servers (seal from files, refusals).
Where a policy endpoint is needed it is the stand-in server (tests/fakes/policy_server.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import orjson
import pytest

from shardrun.shard import collector
from shardrun.core import gym_adapter
from shardrun.shard import gym_stack
from shardrun.launch import local_jobs
from shardrun.rundir import ledger
from shardrun.shard import policy
from shardrun.shard import processes
from shardrun.shard import runtime
from shardrun.rundir import seal
from shardrun.rundir import store
from shardrun.shard import watchdog
from shardrun.core.config import GymConfig, PolicyConfig, RunConfig
from shardrun.core.errors import BadInput, ServerFailure, ShardFailed
from tests import builders
from tests.fakes import harness

# ---------------------------------------------------------------- ledger


def row(t: int, r: int, **kw) -> dict:
    return {"_ng_task_index": t, "_ng_rollout_index": r, **kw}


def test_ledger_gates_failures_like_gym_resume() -> None:
    planned = [row(0, 0, agent_ref={"name": "a"}), row(0, 1), row(1, 0), row(1, 1), row(2, 0)]
    rollouts = [
        row(0, 0, response={"usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}),
        row(0, 0),
        row(1, 0, response={"usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}),
    ]
    failures = [
        row(0, 1, _ng_failure_class="x"),
        row(0, 1, _ng_failure_class="x"),  # 2 attempts: maxed at 2
        row(1, 1, _ng_failure_terminal=True, reason="nope"),  # terminal at once
        {"no": "identity"},
    ]
    attempts = [row(2, 0, reason="500"), row(2, 0, reason="500")]
    book = ledger.tally(planned, rollouts, failures, attempts, max_attempts=2)
    assert book.done == {(0, 0), (1, 0)} and book.duplicates == 1
    assert book.failed == {(0, 1), (1, 1)} and book.num_failed == 2
    assert book.pending == [(2, 0)] and not book.complete
    assert book.usage == {"input_tokens": 4, "output_tokens": 3, "total_tokens": 7}
    assert book.due_for_quarantine(2) == [(2, 0)] and book.due_for_quarantine(3) == []
    assert book.reasons[(1, 1)] == "nope" and book.sidecar_rows == 3
    assert ledger.tally(planned, rollouts, failures, attempts, max_attempts=3).failed == {(1, 1)}


def test_quarantine_row_is_terminal_with_reason_and_no_reward() -> None:
    r = ledger.quarantine_row((4, 2), {"name": "agent"}, "/run failed with HTTP 500", 3)
    assert r == {
        "_ng_task_index": 4,
        "_ng_rollout_index": 2,
        "_ng_failure_class": "shardrun_max_attempts",
        "_ng_failure_terminal": True,
        "reason": "/run failed with HTTP 500",
        "attempts": 3,
        "failure_class": "other",  # what failed: the reason names no server (docs/failures.md)
        "agent_ref": {"name": "agent"},
    }
    assert ledger.tally([row(4, 2)], [], [r], [], max_attempts=9).failed == {(4, 2)}


# ---------------------------------------------------------------- collector

# Lines as Gym 0.4.0's collector prints them with request debugging on (body shortened; escaping as observed).
COLLECTOR_LOG = r"""Resumed from cache. Found:
- 4 original input rows
Collecting rollouts:   0%|          | 0/4 [00:00<?, ?it/s]Request info: RequestInfo(url=URL('http://127.0.0.1:16132/run'), method='POST')
Response content: b'"Hit an exception in SimpleAgent___math_with_judge_simple_agent calling an inner server: b\'\\"Hit an exception in VLLMModel___policy_model calling an inner server: b\\\\\'{\\\\\\\\\\"error\\\\\\\\\\": {\\\\\\\\\\"message\\\\\\\\\\": \\\\\\\\\\"injected 400\\\\\\\\\\", \\\\\\\\\\"code\\\\\\\\\\": 400}}\\\\\'\\"\'"'
[rollout_collection] /run failed status=500 row={"_ng_rollout_index": 1, "_ng_task_index": 2, "agent_name": "math_with_judge_simple_agent"}
Traceback (most recent call last):
aiohttp.client_exceptions.ClientResponseError: 500, message='Internal Server Error', url='http://127.0.0.1:16132/run'
[rollout_collection] /run failed status=502 row={"_ng_rollout_index": 0, "_ng_task_index": 7}
"""


V04 = gym_adapter.for_version("0.4.0")
V07 = gym_adapter.for_version("0.7.0")


def test_failed_identities_and_reasons_from_the_collector_log() -> None:
    got = collector.failed_identities(V04, COLLECTOR_LOG)
    assert got == {
        (2, 1): "/run failed with HTTP 500 (VLLMModel___policy_model: injected 400)",
        (7, 0): "/run failed with HTTP 502",
    }
    assert collector.failed_identities(V04, "Traceback\nKeyError: 'x'\n") == {}
    # Gym 0.7 records a failed /run in the failures sidecar itself (route_failures_to_sidecar): nothing from the log
    assert collector.failed_identities(V07, COLLECTOR_LOG) == {}


def test_gym_07s_no_result_exit_is_a_round_whose_every_rollout_failed() -> None:
    """Gym 0.7 exits 1 when every rollout it dispatched failed (all in the sidecar) and nothing was scored before:
    the runtime takes such a round as ended (its progress still checked), any other traceback as a crash."""
    said = (
        "Traceback (most recent call last):\n  ...\nRuntimeError: None of the 2 dispatched rollouts produced a result "
        "{'judge_failed': 2}. Inspect /x/collect/rollouts_failures.jsonl; the run has no score to report.\n"
    )
    assert V07.no_result_exit(said)
    assert not V07.no_result_exit("Traceback\nRuntimeError: something else\n")
    assert not V07.no_result_exit(COLLECTOR_LOG)
    assert not V04.no_result_exit(said)  # 0.4 never says it: a non-zero exit there is a /run failure or a crash


def test_adapters_by_version() -> None:
    assert type(gym_adapter.for_version("0.4.0")).__name__ == "GymV04"
    assert gym_adapter.for_version("0.7.3").version == "0.7.3"
    for bad in ("0.5.0", "1.0.0", "nightly"):
        with pytest.raises(BadInput, match="not"):
            gym_adapter.for_version(bad)
    assert "environment_servers" in V07.server_kinds and "environment_servers" not in V04.server_kinds
    assert V07.profile_file_suffixes()[-1] == "_repeat_level_metrics.json"
    assert V04.profile_command(Path("/v"), Path("m.jsonl"), Path("r.jsonl"), True) == [
        "/v/bin/ng_reward_profile",
        "+materialized_inputs_jsonl_fpath=m.jsonl",
        "+rollouts_jsonl_fpath=r.jsonl",
        "++allow_partial_rollouts=True",
    ]
    assert V07.profile_command(Path("/v"), Path("m.jsonl"), Path("r.jsonl"), False) == [
        "/v/bin/gym",
        "eval",
        "profile",
        "--inputs",
        "m.jsonl",
        "--rollouts",
        "r.jsonl",
    ]


@pytest.mark.parametrize("adapter", [V04, V07], ids=["0.4", "0.7"])
def test_collector_command_resumes_the_shard_files(tmp_path: Path, adapter) -> None:
    gym = GymConfig(num_samples_in_parallel=3, collect_overrides=["+x=1"])
    cmd = collector.command(adapter, Path("/v"), 4242, tmp_path, 7, gym)
    if adapter is V04:
        assert cmd[0] == "/v/bin/ng_collect_rollouts"
    else:
        assert cmd[:4] == ["/v/bin/gym", "eval", "run", "--no-serve"] and "+route_failures_to_sidecar=true" in cmd
    assert f"+input_jsonl_fpath={store.materialized_path(tmp_path, 7)}" in cmd
    assert f"+output_jsonl_fpath={store.rollouts_path(tmp_path, 7)}" in cmd
    assert {
        "+resume_from_cache=true",
        "+disable_aggregation=true",
        "+head_server.port=4242",
        "+head_server.host=127.0.0.1",
        "+num_samples_in_parallel=3",
    } <= set(cmd)
    assert cmd[-1] == "+x=1"
    assert not any("num_repeats" in c for c in cmd)  # the planned rows already carry identities and seeds


# ---------------------------------------------------------------- Gym stack settings


def test_env_yaml_and_ng_run_command(tmp_path: Path) -> None:
    import yaml

    assert yaml.safe_load(gym_stack.env_yaml_text(["http://a/v1"], "k", "m")) == {
        "policy_base_url": "http://a/v1",
        "policy_api_key": "k",
        "policy_model_name": "m",
    }
    assert yaml.safe_load(gym_stack.env_yaml_text(["http://a/v1", "http://b/v1"], None, "m"))["policy_base_url"] == [
        "http://a/v1",
        "http://b/v1",
    ]
    assert gym_stack.hydra_list(["a/b.yaml", "c d.yaml"]) == "[a/b.yaml,'c d.yaml']"
    gym = GymConfig(config_paths=["x.yaml"], overrides=["+foo=1"])
    assert gym_stack.ng_run_command(V07, Path("/v"), gym, 5555, tmp_path)[:4] == [
        "/v/bin/gym",
        "env",
        "start",
        "+config_paths=[x.yaml]",
    ]
    cmd = gym_stack.ng_run_command(V04, Path("/v"), gym, 5555, tmp_path)
    assert cmd[:2] == ["/v/bin/ng_run", "+config_paths=[x.yaml]"]
    assert {
        "+head_server.host=127.0.0.1",
        "+head_server.port=5555",
        "+skip_venv_if_present=true",
        "+global_aiohttp_client_request_debug=true",
        f"+uv_venv_dir={tmp_path}",
    } <= set(cmd)
    assert cmd[-1] == "+foo=1"


def test_env_yaml_is_written_0600(tmp_path: Path) -> None:
    path = tmp_path / "gym" / "env.yaml"
    gym_stack.write_env_yaml(path, gym_stack.env_yaml_text(["http://a/v1"], "secret", "m"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and b"secret" in path.read_bytes()


def fake_venv(root: Path, version: str = "0.4.0") -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "ng_run").write_text("")
    (venv / "pyvenv.cfg").write_text("home = /opt/python3.12/bin\nversion = 3.12.1\n")
    site = venv / "lib" / "python3.12" / "site-packages"
    meta = site / f"nemo_gym-{version}.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"Metadata-Version: 2.4\nName: nemo-gym\nVersion: {version}\n\nREADME text\n")
    for d in (
        "resources_servers/math",
        "responses_api_agents/simple_agent",
        "responses_api_models/vllm_model",
        "resources_servers/__pycache__",
    ):
        (site / d).mkdir(parents=True)
    return venv


def test_shared_venv_links_and_environment(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path)
    links = tmp_path / "links"
    assert gym_stack.link_server_venvs(links, venv, V04.server_kinds) == 3
    assert gym_stack.link_server_venvs(links, venv, V04.server_kinds) == 0  # idempotent
    assert (links / "resources_servers" / "math" / ".venv").resolve() == venv.resolve()
    assert not (links / "resources_servers" / "__pycache__").exists()
    env = gym_stack.stack_env({"PATH": "/usr/bin", "VIRTUAL_ENV": "/x", "KEEP": "1"}, venv, tmp_path / "ray", True)
    assert env["PATH"].split(os.pathsep)[:3] == [str(venv / "bin"), "/opt/python3.12/bin", "/usr/bin"]
    assert env["UV_PYTHON_DOWNLOADS"] == "never" and env["UV_OFFLINE"] == "1" and env["RAY_AUTH_MODE"] == "disabled"
    assert env["RAY_TMPDIR"] == str(tmp_path / "ray") and "VIRTUAL_ENV" not in env and env["KEEP"] == "1"
    assert gym_stack.gym_venv(GymConfig(venv=str(venv)), {}) == venv
    with pytest.raises(BadInput, match="SHARDRUN_GYM_VENV"):
        gym_stack.gym_venv(GymConfig(), {})
    with pytest.raises(BadInput, match="no nemo-gym installed"):
        gym_stack.gym_venv(GymConfig(venv=str(tmp_path)), {})
    (venv / "bin" / "ng_run").unlink()
    with pytest.raises(BadInput, match="has nemo-gym 0.4.0 but no bin/ng_run"):
        gym_stack.gym_venv(GymConfig(venv=str(venv)), {})


def test_gym_version_from_the_venv_metadata(tmp_path: Path) -> None:
    from shardrun.core import gym_version

    venv = fake_venv(tmp_path, "0.7.0")
    assert gym_version.detect(venv) == "0.7.0" and gym_version.series("0.7.12") == "0.7"
    assert gym_version.of_settings(None, {gym_version.VENV_ENV: str(venv)}) == "0.7.0"
    assert gym_version.of_settings(None, {}) is None and gym_version.installed_version(tmp_path) is None


# ---------------------------------------------------------------- watchdog


def sleeper(tmp_path: Path, seconds: float = 30) -> processes.Proc:
    return processes.start(["sleep", str(seconds)], tmp_path / "sleep.log")


def test_watchdog_returns_the_exit_code(tmp_path: Path) -> None:
    p = processes.start(["sh", "-c", "exit 3"], tmp_path / "x.log")
    assert watchdog.watch(p, checks=[], progress=lambda: 0, stall_timeout_s=10, interval_s=0.2) == 3


def test_watchdog_stops_on_a_dead_server_after_two_strikes(tmp_path: Path) -> None:
    p = sleeper(tmp_path)
    calls = []

    def flaky() -> str | None:
        calls.append(1)
        return None if len(calls) == 1 else "down"

    t0 = time.monotonic()
    with pytest.raises(ServerFailure, match="policy: down; stopped the collector"):
        watchdog.watch(
            p, checks=[watchdog.Check("policy", flaky)], progress=lambda: 0, stall_timeout_s=60, interval_s=0.2
        )
    assert time.monotonic() - t0 < 5 and len(calls) == 3 and not p.alive()


def test_watchdog_one_failed_check_is_not_enough(tmp_path: Path) -> None:
    p = processes.start(["sleep", "1.5"], tmp_path / "s.log")
    answers = iter(["blip"] + [None] * 100)
    assert (
        watchdog.watch(
            p,
            checks=[watchdog.Check("x", lambda: next(answers))],
            progress=lambda: 0,
            stall_timeout_s=60,
            interval_s=0.2,
        )
        == 0
    )


def test_watchdog_stall(tmp_path: Path) -> None:
    p = sleeper(tmp_path)
    ticks = iter(range(1000))
    t0 = time.monotonic()
    with pytest.raises(ShardFailed, match="no rollout landed for"):
        watchdog.watch(p, checks=[], progress=lambda: 5, stall_timeout_s=1.0, interval_s=0.2)
    assert 1.0 <= time.monotonic() - t0 < 5 and not p.alive()
    p = processes.start(["sleep", "2"], tmp_path / "s2.log")
    assert watchdog.watch(p, checks=[], progress=lambda: next(ticks), stall_timeout_s=1.0, interval_s=0.2) == 0


# ---------------------------------------------------------------- policy endpoint


def test_prehosted_policy_checks(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="SHARDRUN_NOT_SET_X"):
        policy.api_key(PolicyConfig(base_url="http://x/v1", model_name="m", api_key_env="SHARDRUN_NOT_SET_X"), {})
    assert policy.api_key(PolicyConfig(base_url="http://x/v1", model_name="m"), {}) is None
    with harness.fake_policy(tmp_path) as fake:
        pcfg = PolicyConfig(base_url=[fake.base_url + "/"], model_name="other", api_key_env="K")
        ep = policy.open_policy(pcfg, tmp_path, env={"K": harness.API_KEY})
        assert ep.base_urls == [fake.base_url] and ep.problem() is None
        assert "does not list 'other'" in ep.notes[0]
        with pytest.raises(ServerFailure, match="refused the API key"):
            policy.open_policy(pcfg, tmp_path, env={"K": "wrong"})
    assert "does not answer" in ep.problem()


# ---------------------------------------------------------------- launch helpers


def test_local_groups_cap_concurrency() -> None:
    assert local_jobs.local_groups([0, 1, 2, 3, 4], 2) == [[0, 2, 4], [1, 3]]
    assert local_jobs.local_groups([5, 6], 64) == [[5], [6]]
    assert local_jobs.local_groups([3], 1) == [[3]]


def plan_run(tmp_path: Path, with_gym: bool = True, shards: int = 2) -> RunConfig:
    input_jsonl = builders.arith_input(tmp_path / "input.jsonl", 3)
    data = {
        "input_jsonl": str(input_jsonl),
        "run_dir": str(tmp_path / "run"),
        "num_repeats": 2,
        "sharding": {"num_shards": shards},
    }
    if with_gym:
        data |= {
            "gym": {"config_paths": ["x.yaml"]},
            "policy": {"base_url": "http://127.0.0.1:9/v1", "model_name": "m"},
        }
    cfg = RunConfig.model_validate(data)
    store.write_plan(cfg)
    return cfg


def test_local_jobs_use_the_local_executor_and_slurm_configs_another_backend(tmp_path: Path) -> None:
    from shardrun.launch import backends, executors

    cfg = plan_run(tmp_path)
    assert backends.for_config(cfg).mode == "local jobs"
    ex = executors.local_executor(cfg, cfg.run_dir)
    assert type(ex).__name__ == "LocalExecutor" and Path(ex.folder) == store.jobs_dir(cfg.run_dir).resolve()
    slurm_cfg = cfg.model_copy(update={"cluster": cfg.cluster_or_default.model_copy(update={"executor": "slurm"})})
    assert backends.for_config(slurm_cfg).mode == "Slurm job arrays"


def test_shard_worker_runs_every_shard_and_reports_each_failure(tmp_path: Path) -> None:
    cfg = plan_run(tmp_path, with_gym=False)
    with pytest.raises(ShardFailed, match="2 of 2 shard\\(s\\) failed: shard 0: BadInput.*shard 1: BadInput"):
        local_jobs.shard_worker(str(cfg.run_dir), [0, 1])


# ---------------------------------------------------------------- run_shard without servers


def synthesize_rollouts(run_dir: Path, index: int, skip: int = 0) -> None:
    lines = store.materialized_path(run_dir, index).read_bytes().splitlines()
    out = []
    for line in lines[skip:]:
        r = orjson.loads(line)
        out.append(
            orjson.dumps(
                {
                    "reward": 1.0,
                    "response": {"usage": {"output_tokens": 2}},
                    "_ng_task_index": r["_ng_task_index"],
                    "_ng_rollout_index": r["_ng_rollout_index"],
                    "agent_ref": r["agent_ref"],
                }
            )
            + b"\n"
        )
    store.rollouts_path(run_dir, index).write_bytes(b"".join(out))


def test_shard_with_every_rollout_on_disk_seals_without_servers(tmp_path: Path) -> None:
    cfg = plan_run(tmp_path)
    run_dir = cfg.run_dir
    synthesize_rollouts(run_dir, 0)
    with open(store.rollouts_path(run_dir, 0), "ab") as f:
        f.write(b'{"reward": 1.0, "_ng_ta')  # a torn tail is cut before anything is read
    store.atomic_write_json(store.shard_failure_path(run_dir, 0), {"error": "earlier attempt"})
    result = runtime.run_shard(run_dir, 0, job_id="42")
    assert result.state == "sealed"
    m = result.marker
    assert (m.num_rollouts, m.num_failed, m.job_id, m.attempt) == (3, 0, "42", 1)
    assert m.server_wait_s == 0 and m.extra == {"output_tokens": 6}
    assert seal.check(run_dir, store.load_plan(run_dir), 0, deep=True).sealed
    assert not store.shard_failure_path(run_dir, 0).exists()
    assert runtime.run_shard(run_dir, 0).state == "already_sealed"


def test_shard_refuses_foreign_rollouts_and_records_why(tmp_path: Path) -> None:
    cfg = plan_run(tmp_path)
    run_dir = cfg.run_dir
    synthesize_rollouts(run_dir, 1)  # shard 1's identities in shard 0's file
    store.rollouts_path(run_dir, 0).write_bytes(store.rollouts_path(run_dir, 1).read_bytes())
    with pytest.raises(ShardFailed, match="does not contain"):
        runtime.run_shard(run_dir, 0, job_id="7")
    failure = json.loads(store.shard_failure_path(run_dir, 0).read_text())
    assert failure["job_id"] == "7" and failure["error"].startswith("ShardFailed:")
    assert "FAILED: ShardFailed" in store.shard_log_path(run_dir, 0).read_text()


def test_a_running_shard_is_not_run_twice(tmp_path: Path) -> None:
    cfg = plan_run(tmp_path)
    with store.shard_lock(cfg.run_dir, 0):
        with pytest.raises(ShardFailed, match="already running"):
            runtime.run_shard(cfg.run_dir, 0)
    assert not store.shard_failure_path(cfg.run_dir, 0).exists()  # the running attempt's state is left alone


def test_missing_api_key_fails_before_any_server(tmp_path: Path, monkeypatch) -> None:
    cfg = plan_run(tmp_path)
    data = cfg.model_dump(mode="json")
    data["policy"]["api_key_env"] = "SHARDRUN_TEST_UNSET_KEY"
    monkeypatch.delenv("SHARDRUN_TEST_UNSET_KEY", raising=False)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(fake_venv(tmp_path)))
    store.write_launch_settings(cfg.run_dir, RunConfig.model_validate(data))
    with pytest.raises(BadInput, match="SHARDRUN_TEST_UNSET_KEY"):
        runtime.run_shard(cfg.run_dir, 0)
    assert not store.env_yaml_path(cfg.run_dir, 0).exists()


def test_bundled_example_config_is_a_full_run_config(gym_venv: Path) -> None:
    from shardrun.core import config as config_mod

    cfg = config_mod.load(harness.REPO / "examples/arith/config.yaml", ["policy.model_name=m"])
    cfg.require("gym", "policy")
    assert cfg.policy.base_url and cfg.gym.server_venvs == "shared" and cfg.cluster_or_default.executor == "local"
    site = gym_stack.site_packages(gym_stack.gym_venv(cfg.gym, {gym_stack.VENV_ENV: str(gym_venv)}))
    names = [p.split("/")[1] for p in cfg.gym.config_paths]
    assert names == ["math_with_judge", "example_single_tool_call", "vllm_model"]
    assert all((site / p).is_file() for p in cfg.gym.config_paths)


def test_a_stack_start_is_retried_only_for_transient_failures() -> None:
    """The lines a failed start leaves at the end of ng_run's log, as Ray and uvicorn print them: a port taken under
    us and Ray's fixed 30 s wait for its node on a loaded machine are worth another start; anything else is not."""
    ray_node = (
        "Exception: The current node timed out during startup. This could happen because some of the raylet failed "
        "to startup or the GCS has become overloaded."
    )
    ray_socket = "TimeoutError: Timed out after 30 seconds while waiting for node to startup. Did not find socket name"
    port = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 11000): Address already in use"
    for tail in (ray_node, ray_socket, port):
        assert gym_stack.transient_start_failure(
            f"Gym servers (ng_run, head server x): exited 1 before it was ready\n{tail}"
        )
    for tail in ("ModuleNotFoundError: No module named 'nemo_gym'", "not ready after 300 s", ""):
        assert not gym_stack.transient_start_failure(tail)


def test_a_head_server_that_lost_its_port_fails_the_start_as_transient(tmp_path: Path) -> None:
    """ng_run whose head server could not bind its port waits for it forever: readiness sees the bind error for
    the head port in ng_run's log and fails the start with a reason start_ready starts the stack again for; the
    same error for another port (another server's) is not the head's."""
    from shardrun.core.errors import ServerFailure
    from shardrun.shard import processes

    line = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {}): address already in use"
    proc = processes.start(["sh", "-c", f"echo \"{line.format(32967)}\"; sleep 30"], tmp_path / "ng_run.log")
    try:
        processes.wait_until(lambda: "32967" in proc.tail(), timeout=60, what="the log line")
        other = gym_stack.GymStack(proc, 40001, tmp_path / "env.yaml", tmp_path / "ray")
        assert not other.head_port_lost() and not other.ready()  # nothing listens on 40001, nothing lost either
        stack = gym_stack.GymStack(proc, 32967, tmp_path / "env.yaml", tmp_path / "ray")
        assert stack.head_port_lost()
        with pytest.raises(ServerFailure) as failed:
            stack.ready()
        assert gym_stack.transient_start_failure(str(failed.value))
    finally:
        processes.stop(proc)


def test_what_is_transient_is_read_from_the_whole_start_log(tmp_path: Path) -> None:
    """Issue 20: the head server lost its port, then ng_run printed many more lines and exited ('Head server
    finished unexpectedly!'): the failure's message (the log's last lines) does not say why, the start log does.
    Only this start's part of the log counts (an earlier start's error was dealt with), the bind line may be split
    across reads, and an error that is not transient is not made one."""
    from shardrun.core.errors import ServerFailure
    from shardrun.shard import processes

    log = tmp_path / "ng_run.log"
    bind = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {}): Address already in use"
    noise = "; ".join(f"echo 'ray: worker {k} started'" for k in range(200))
    script = tmp_path / "ng_run.sh"  # a file: the log's first line names the command, not what it prints
    script.write_text(
        f'sleep 1; echo "{bind.format(32968)}"; {noise}; echo "Head server finished unexpectedly!"; exit 1'
    )
    log.write_text(bind.format(32968) + "\n")  # an earlier start's, dealt with then
    offset = log.stat().st_size
    assert gym_stack.StartLog(log, offset, [*gym_stack.TRANSIENT_START, "32968"]).scan() == set()  # not this start's
    proc = processes.start(["sh", str(script)], log)
    stack = gym_stack.GymStack(proc, 32968, tmp_path / "env.yaml", tmp_path / "ray", log_from=offset)
    assert proc.popen.wait(timeout=120) == 1  # ng_run exited before it was ready
    with pytest.raises(ServerFailure) as failed:
        gym_stack.wait_ready(stack, 120)
    assert "Head server finished unexpectedly!" in str(failed.value) and "already in use" not in str(failed.value)
    assert not gym_stack.transient_start_failure(str(failed.value))  # the message alone: not transient
    assert gym_stack.transient_start_failure(str(failed.value), stack)  # the whole start log: transient
    assert stack.head_port_lost() and stack.transient_failure() == "address already in use"

    small = gym_stack.StartLog(log, offset, ["bind on address ('127.0.0.1', 32968)"])
    small.CHUNK = 7  # the phrase straddles reads
    assert small.scan() == {"bind on address ('127.0.0.1', 32968)"}

    other = tmp_path / "other.log"
    other.write_text("ModuleNotFoundError: No module named 'nemo_gym'\n" + "line\n" * 100)
    quiet = gym_stack.GymStack(proc, 32969, tmp_path / "env.yaml", tmp_path / "ray")
    quiet.start_log = gym_stack.StartLog(other, 0, [quiet.head_bind_failure, *gym_stack.TRANSIENT_START])
    assert quiet.transient_failure() is None and not gym_stack.transient_start_failure("exited 1", quiet)


def test_ray_tmp_dir_is_short_per_shard_and_emptied(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    a = gym_stack.ray_tmp_dir(tmp_path / "shards" / "00000")
    (a / "left-by-a-killed-attempt").write_text("x")
    assert gym_stack.ray_tmp_dir(tmp_path / "shards" / "00000") == a and not any(a.iterdir())
    b = gym_stack.ray_tmp_dir(tmp_path / "shards" / "00001")
    try:
        assert b != a and len(str(a)) <= gym_stack.RAY_TMP_BASE_MAX + 20
        assert a.parent == tmp_path or len(str(tmp_path)) > gym_stack.RAY_TMP_BASE_MAX
    finally:
        for d in (a, b):
            shutil.rmtree(d, ignore_errors=True)
