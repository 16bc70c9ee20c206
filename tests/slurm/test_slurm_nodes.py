"""A job over several nodes on the real local Slurm of two nodes (scripts/local-slurm.sh --nodes 2: each node a
slurmd in its own network namespace, with its own hostname and address).

A warm worker over both nodes with `policy.vllm.replicas: 2`: the worker runs once, on the first node, with Gym and
the collector; the policy's server step (`srun --kill-on-bad-exit=1`, one task per node) starts one replica on each
node, bound to its node's hostname; both replicas answer requests, every identity lands once, and the merged
profile equals one unsharded Gym run's. Then a replica that exits (status 0, as vLLM does when its engine dies)
ends the step and fails the worker as a server failure; `resume` completes the run with every identity once.

Real Slurm, `ng_run` and `ng_collect_rollouts`; in these two tests the replicas are the stand-in policy server
(tests/fakes/policy_server.py) given vLLM's command line: a fake at the seam shardrun does not own, the GPU model
server. One more (marked `vllm` too) runs the real vLLM CPU build on the tiny model as both replicas, one on each
node, and checks from each node's vLLM log that both answered.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import orjson
import pytest

from shardrun.rundir import store
from shardrun.shard import gym_stack
from slurm_helpers import math_input, planned_identities, shardrun, wait_for, write_config
from tests.e2e.test_e2e_local import profile_rows, unsharded_reference
from tests.fakes import harness

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1500)]
SHARDS = 4
TASKS = 8
REPEATS = 2
# every node binds the same port (each has its own network namespace); each test its own, so a server of the test
# before that is still going away never stands in the way, nor one of a test another xdist worker runs at once
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = itertools.count(24917 + 200 * WORKER, 10)
ROUTER = Path(sys.executable).parent / "vllm-router"


@pytest.fixture
def nodes_env(slurm_nodes_cluster, gym_venv) -> dict[str, str]:
    env = slurm_nodes_cluster.env
    env[harness.API_KEY_ENV] = harness.API_KEY
    env[gym_stack.VENV_ENV] = str(gym_venv)
    return env


def cli(env: dict[str, str], cwd: Path, *args, timeout: float = 300, check: bool = True):
    return shardrun(*args, cwd=cwd, timeout=timeout, check=check, env=env)


def stand_in(request_log: Path, faults=()) -> dict:
    """policy.vllm for the stand-in policy server given vLLM's command line."""
    return {
        "model": "fake-model",
        "command": [
            sys.executable,
            str(harness.FAKE),
            "--correct-share",
            "0.5",
            "--request-log",
            str(request_log),
            *faults,
        ],
        "host": "0.0.0.0",
        "ready_timeout_s": 300,
        "liveness_timeout_s": 60,
    }


def config(
    tmp_path: Path,
    inp: Path,
    run_dir: Path,
    vllm: dict,
    port: int,
    router=False,
    shards: int = SHARDS,
    gym: dict | None = None,
    **cluster,
) -> Path:
    """A warm worker over the two nodes with `policy.vllm` (`vllm`) as two replicas, one on each node."""
    return write_config(
        tmp_path / "run.yaml",
        inp,
        run_dir,
        None,
        repeats=REPEATS,
        shards=shards,
        policy={
            "base_url": None,
            "model_name": None,
            "vllm": {**vllm, "port": port, "replicas": 2, "device": "cpu"},
            # vllm-router from PyPI (the test extra), spreading requests in turn so both replicas see some
            **(
                {
                    "router": "vllm-router",
                    "router_options": {"command": [str(ROUTER)], "policy": "round_robin", "startup_timeout_s": 300},
                }
                if router
                else {}
            ),
        },
        cluster={"nodes": 2, "gpus_per_node": 0, "workers": 1, "claim_heartbeat_s": 1, "claim_lease_s": 20, **cluster},
        gym={"num_samples_in_parallel": 4, **(gym or {})},
    )


def requests(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def merged_identities(run_dir: Path) -> list[tuple]:
    rows = [orjson.loads(line) for line in store.merged_rollouts_path(run_dir).read_bytes().splitlines() if line]
    return sorted((r["_ng_task_index"], r["_ng_rollout_index"]) for r in rows)


@pytest.mark.parametrize("router", [False, True], ids=["base-urls", "vllm-router"])
def test_a_warm_worker_over_two_nodes_with_a_replica_on_each(
    tmp_path: Path, nodes_env, gym_venv, slurm_nodes_cluster, router: bool
):
    inp = math_input(tmp_path / "input.jsonl", TASKS)
    run_dir = tmp_path / "run"
    log = tmp_path / "requests.jsonl"
    port = next(PORTS)
    cfg = config(tmp_path, inp, run_dir, stand_in(log), port, router=router)
    dry = cli(nodes_env, tmp_path, "submit", cfg, "--dry-run")
    assert "srun --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1" in dry.stdout, dry.stdout
    cli(nodes_env, tmp_path, "submit", cfg)
    wait_for(lambda: store.merged_summary_path(run_dir).exists(), 1200, "the merged run")

    # both replicas answered, each on its own node, at the same port
    served = {r["served_by"] for r in requests(log)}
    assert served == {f"{name}:{port}" for name in slurm_nodes_cluster.nodes}, served
    # every identity once
    assert merged_identities(run_dir) == planned_identities(run_dir, SHARDS)
    # the worker ran once, on the first node; the step's script says which replica ran where
    script = (run_dir / "workers").rglob("policy-servers.sh")
    text = next(script).read_text()
    first, second = list(slurm_nodes_cluster.nodes)
    assert f"--host {first} " in text and f"--host {second} " in text
    worker_log = "".join(p.read_text() for p in (run_dir / "workers").rglob("worker.log"))
    if router:  # the collector talked to the router alone, on the first node
        assert f"behind vllm-router at http://{first}:{port + 1000}" in worker_log, worker_log
        assert f"--worker-urls http://{first}:{port} http://{second}:{port}" in text
    else:
        assert f"http://{first}:{port}/v1, http://{second}:{port}/v1" in worker_log, worker_log
    # the merged profile equals one unsharded Gym run's (the stand-in answers the same whichever replica asks)
    with harness.fake_policy(tmp_path, "--correct-share", "0.5") as fake:
        ref_cfg = write_config(tmp_path / "ref.yaml", inp, tmp_path / "ref-run", fake.base_url, repeats=REPEATS)
        ref = unsharded_reference(tmp_path, ref_cfg, inp, gym_venv, repeats=REPEATS)
    ours = profile_rows(store.merged_reward_profiling_path(run_dir))
    assert ours == profile_rows(ref / "rollouts_reward_profiling.jsonl")


VLLM_TASKS = 8  # 16 rollouts: Gym's vllm_model pins each to a replica by a hash of a random session id, so all
# of them on one replica is a 2 in 65,536 chance; the tiny model answers 64 tokens in well under a second
SERVED = "tiny"


@pytest.mark.vllm
@pytest.mark.parametrize("router", [False, True], ids=["base-urls", "vllm-router"])
def test_a_warm_worker_over_two_nodes_with_a_real_vllm_replica_on_each(
    tmp_path: Path, nodes_env, slurm_nodes_cluster, vllm_venv: Path, tiny_model: Path, router: bool
):
    """The real vLLM CPU build on the tiny model, `replicas: 2` over the two nodes: each replica binds its node's
    hostname, the worker on the first node waits for both (`/health`, the served name in `/v1/models`), Gym's
    `vllm_model` gets both base URLs (or vllm-router's on the first node, in front of both, round robin), both
    replicas answer chat completions, every identity lands once, the rollouts name the served model and nothing
    is left running."""
    tag = uuid.uuid4().hex
    nodes_env[harness.TAG_ENV] = tag  # every process of the run inherits it (sbatch --export=ALL, srun)
    inp = math_input(tmp_path / "input.jsonl", VLLM_TASKS)
    run_dir = tmp_path / "run"
    port = next(PORTS)
    vllm = {
        "model": str(tiny_model),
        "served_model_name": SERVED,
        "python": str(vllm_venv),
        "max_model_len": 1024,
        "extra_args": ["--enforce-eager"],
        # two servers share the machine's cores: no thread pinning, 1 GiB of KV cache each
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        "ready_timeout_s": 600,
        "liveness_timeout_s": 300,
    }
    # the tiny model on a loaded CPU can take minutes for one answer: a generous stall timeout
    cfg = config(tmp_path, inp, run_dir, vllm, port, router, shards=2, gym={"stall_timeout_s": 900}, claim_lease_s=60)
    cli(nodes_env, tmp_path, "submit", cfg)
    wait_for(lambda: store.merged_summary_path(run_dir).exists(), 1200, "the merged run")

    # every identity once, each answered by the served model
    assert merged_identities(run_dir) == planned_identities(run_dir, 2)
    rows = [orjson.loads(line) for line in store.merged_rollouts_path(run_dir).read_bytes().splitlines() if line]
    assert {r["response"]["model"] for r in rows} == {SERVED}
    # one replica on each node, bound to its hostname, and each answered chat completions
    first, second = list(slurm_nodes_cluster.nodes)
    logs = {p.name: p.read_text() for p in (run_dir / "workers").rglob("vllm-r[0-9]*.log")}
    assert sorted(logs) == ["vllm-r0.log", "vllm-r1.log"], sorted(logs)
    for replica, node in (("r0", first), ("r1", second)):
        name = f"vllm-{replica}.log"
        assert f"starting {replica} on {node}" in logs[name], logs[name][-3000:]
        assert logs[name].count("Starting vLLM server") == 1, logs[name][-3000:]  # started once for both shards
        assert 'POST /v1/chat/completions HTTP/1.1" 200' in logs[name], logs[name][-3000:]
    worker_log = "".join(p.read_text() for p in (run_dir / "workers").rglob("worker.log"))
    if router:  # the collector talked to the router alone, on the first node, which spread the requests in turn
        assert f"behind vllm-router at http://{first}:{port + 1000}" in worker_log, worker_log
        router_log = next((run_dir / "workers").rglob("vllm-router.log")).read_text()
        assert f"starting router on {first}" in router_log, router_log[-3000:]
    else:
        assert f"http://{first}:{port}/v1, http://{second}:{port}/v1" in worker_log, worker_log
    # nothing of the run is left: no job in the queue, no process of it on either node
    wait_for(lambda: not queued(nodes_env, run_dir), 300, "the run's jobs to leave the queue")
    wait_for(lambda: not harness.tagged_processes(tag), 120, "the run's processes to end")


def post(url: str, body: dict, key: str | None = None, timeout: float = 30) -> int | None:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


@pytest.mark.parametrize(
    "die_code, restarts", [(0, 1), (3, 0)], ids=["exit-0-the-worker-restarts-its-servers", "exit-3-resume-completes"]
)
def test_a_replica_that_exits_fails_the_job_and_the_run_completes(
    tmp_path: Path, nodes_env, slurm_nodes_cluster, die_code: int, restarts: int
):
    """Rollouts of the last task are held at the policy, so the run is mid-way whatever the machine's pace; then the
    second node's replica exits with `die_code`. The step ends on both nodes; the worker restarts its servers
    (cluster.max_server_restarts 1) or ends (0, then `resume`); the holds on the new replicas are lifted and the
    run completes with every identity once."""
    inp = math_input(tmp_path / "input.jsonl", TASKS)
    last = orjson.loads(inp.read_text().splitlines()[-1])["question"]
    run_dir = tmp_path / "run"
    log = tmp_path / "requests.jsonl"
    port = next(PORTS)
    cfg = config(
        tmp_path,
        inp,
        run_dir,
        stand_in(log, faults=["--fault", f"hold:match={last}"]),
        port,
        max_server_restarts=restarts,
        auto_resume_rounds=0,
    )
    replicas = [f"http://{addr}:{port}" for addr in slurm_nodes_cluster.nodes.values()]

    def holds() -> int:
        return sum(1 for r in requests(log) if r["fault"] == "hold")

    cli(nodes_env, tmp_path, "submit", cfg)
    wait_for(lambda: holds() or queued(nodes_env, run_dir) == [], 900, "a rollout of the last task held at the policy")
    assert holds(), "the run ended without asking for the last task"
    before = holds()
    # the second node's replica exits with die_code on its next request: this one
    assert post(replicas[1] + "/_fault", {"faults": ["die:after=0"], "die_code": die_code}) == 200
    post(replicas[1] + "/v1/chat/completions", {"model": "fake-model", "messages": []}, harness.API_KEY)

    def failed_with_the_step() -> str | None:
        text = "".join(p.read_text() for p in (run_dir / "workers").rglob("worker.log"))
        return text if "the policy server step exited" in text else None

    text = wait_for(failed_with_the_step, 600, "the worker to see the server step gone")
    if restarts:
        assert "restarting the servers (1 of 1)" in wait_for(
            lambda: (t := failed_with_the_step()) and "restarting the servers" in t and t, 300, "a restart"
        )
    else:  # the worker ends, the job after it finds the run incomplete: nothing of the run is left in the queue
        wait_for(lambda: not queued(nodes_env, run_dir), 600, "the worker and the job after it to end")
        cli(nodes_env, tmp_path, "resume", run_dir)
    # the new replicas hold the last task again: lift the holds on both once they ask
    wait_for(lambda: holds() > before, 900, "the new replicas to be asked for the last task")
    for url in replicas:
        wait_for(lambda url=url: post(url + "/_fault", {"faults": []}) == 200, 300, f"{url} to take the lift")
    wait_for(lambda: store.merged_summary_path(run_dir).exists() or None, 1200, "the merged run")
    assert merged_identities(run_dir) == planned_identities(run_dir, SHARDS)
    step_logs = "".join(p.read_text() for p in (run_dir / "workers").rglob("policy-servers.log"))
    assert f"exited with status {die_code}; stopping this node's servers" in step_logs, step_logs
    assert "the policy server step exited" in text


def queued(env: dict[str, str], run_dir: Path) -> list[str]:
    """The run's jobs (workers and the job after them) that squeue still lists on the nodes cluster."""
    names = {name for rec in store.read_launches(run_dir) for name in rec.slurm_names}
    out = subprocess.run(
        ["squeue", "--noheader", "--array", f"--name={','.join(sorted(names))}", "--format=%i"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    ).stdout
    return out.split()


@pytest.fixture(autouse=True)
def no_jobs_left(tmp_path: Path, slurm_nodes_cluster):
    """Whatever a test leaves queued on the nodes cluster is cancelled."""
    yield
    run_dir = tmp_path / "run"
    if store.launches_path(run_dir).exists():
        env = slurm_nodes_cluster.env
        for job in queued(env, run_dir):
            subprocess.run(["scancel", job], capture_output=True, timeout=60, env=env)
