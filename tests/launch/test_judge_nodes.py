"""Self-hosted judges on nodes of their own (`cluster.judge_nodes`; issue #36 item 2; docs/judges.md), the fast part:
where each judge runs (in turn over the judge nodes, packed where needed, each within one node), the judges' server
step (its srun line and the script every judge node runs, golden with and without a container image), the key
reaching each judge only through the step's environment, the refusals before anything is submitted (each naming
its field, `submit --dry-run` exits 2), and the script run for real by bash: a judge that exits is named.
The real thing on the local Slurm of two nodes: tests/slurm/test_slurm_judge_nodes.py."""

from __future__ import annotations

import json
import os
import secrets as pysecrets
import sys
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardrun.cli import app
from shardrun.core import config
from shardrun.core.config import ClusterConfig, JudgeConfig, VllmConfig
from shardrun.core.errors import BadInput
from shardrun.launch import preflight
from shardrun.shard import judges, processes, server_layout as sl, server_step, vllm
from tests import ports
from tests.faults import synthetic
from tests.fakes import harness
from tests.shard.test_server_layout import CONTAINER, GOLDEN, MODEL, RUN_DIR, SHARD, rendered

runner = CliRunner()
VAR = "SHARDRUN_TEST_JUDGE_KEY"


def judge(tp: int = 1, **more) -> dict:
    return {"vllm": {"model": "/lustre/models/judge", "tensor_parallel_size": tp, **more}}


def slurm_run(policy_vllm: dict | None, judges_section: dict, **cluster) -> config.RunConfig:
    return config.validate(
        {
            "input_jsonl": "/lustre/data/in.jsonl",
            "run_dir": str(RUN_DIR),
            "agent_name": "math",
            "num_repeats": 4,
            "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
            "policy": {"vllm": {"model": MODEL, "port": 8000, **policy_vllm}}
            if policy_vllm is not None
            else {"base_url": "http://h:1/v1", "model_name": "m"},
            "cluster": {"executor": "slurm", "time_limit": "04:00:00", **cluster},
            "judges": judges_section,
        }
    )


# ---------------------------------------------------------------- placement and layout


def test_judges_go_to_the_judge_nodes_in_turn_and_are_packed_where_turns_leave_one_out():
    # in turn: one judge per node where each fits
    assert sl.place_judges({"a": 4, "b": 4}, 2, 8) == {"a": (0, 0), "b": (1, 0)}
    # a third judge goes back to the first node, on the GPUs left there
    assert sl.place_judges({"a": 4, "b": 2, "c": 4}, 2, 8) == {"a": (0, 0), "b": (1, 0), "c": (0, 4)}
    # in turn would leave the 8-GPU judge no room: packed instead
    assert sl.place_judges({"a": 4, "b": 4, "c": 8}, 2, 8) == {"a": (0, 0), "b": (0, 4), "c": (1, 0)}
    # on CPUs (0 GPUs, or GPU-less nodes) the judges take the nodes in turn
    assert sl.place_judges({"a": 0, "b": 0, "c": 0}, 2, 0) == {"a": (0, 0), "b": (1, 0), "c": (0, 0)}
    # what fits nowhere is left out (the caller names it)
    assert sl.place_judges({"a": 8, "b": 16}, 2, 8) == {"a": (0, 0)}


def layout(judges_vllm: dict[str, dict], keyed=(), hosts=("n3", "n4"), gpus=8, ports_=None):
    hosted = {
        n: JudgeConfig(vllm=VllmConfig(model=f"/m/{n}", **v), api_key_env=VAR if n in keyed else None)
        for n, v in judges_vllm.items()
    }
    ports_ = ports_ or {n: 8100 + k for k, n in enumerate(hosted)}
    return sl.judge_layout(hosted, sl.JobNodes(tuple(hosts), gpus), ports_, SHARD, {})


def test_each_judge_binds_its_nodes_hostname_on_its_gpus_and_takes_its_key_from_the_step_environment():
    lay = layout(
        {"a": {"tensor_parallel_size": 4}, "b": {"tensor_parallel_size": 4}, "c": {"tensor_parallel_size": 8}},
        keyed=["a"],
    )
    assert [(s.name, lay.nodes.hosts[s.node], s.gpus) for s in lay.launches] == [
        ("a", "n3", (0, 4)),
        ("b", "n3", (4, 4)),
        ("c", "n4", None),  # the whole node: the GPUs the step gives
    ]
    assert lay.roots == ("http://n3:8100", "http://n3:8101", "http://n4:8102")
    assert lay.model_names == ("a", "b", "c")
    assert [s.cmd[s.cmd.index("--host") + 1] for s in lay.launches] == ["n3", "n3", "n4"]
    assert [s.log for s in lay.launches] == [SHARD / "judges" / n / "logs" / "vllm.log" for n in "abc"]
    script = sl.judge_script(lay)
    assert 'VLLM_API_KEY="${SHARDRUN_JUDGE_KEY_a:?not set in the server step environment}" serve a ' in script
    assert "    serve b " in script and "    serve c " in script  # no key: none in the step's environment
    assert 'CUDA_VISIBLE_DEVICES="$(gpus 4 4)"' in script
    assert "[shardrun] judge ${gone[*]:-?} on $(hostname) (node $rank) exited with status $rc" in script
    assert lay.describe() == "3 judge server(s) on 2 judge node(s): judge a on n3, judge b on n3, judge c on n4"


def test_two_judges_at_one_port_of_one_node_and_a_judge_too_big_are_refused_naming_them():
    with pytest.raises(BadInput, match="judges.a and judges.b are both on judge node n3 at port 9000"):
        layout({"a": {}, "b": {}}, hosts=("n3",), gpus=8, ports_={"a": 9000, "b": 9000})
    with pytest.raises(BadInput) as e:
        layout({"a": {"tensor_parallel_size": 16}}, hosts=("n3",), gpus=8)
    assert "judges.a.vllm needs 16 GPU(s) on one node; 1 judge node(s) of 8 GPU(s) leave no room for it" in str(e.value)


def test_the_judge_nodes_are_the_jobs_last_and_none_outside_a_slurm_job(monkeypatch):
    cluster = ClusterConfig(executor="slurm", nodes=3, judge_nodes=1, gpus_per_node=8)
    assert cluster.policy_nodes == 2
    assert server_step.judge_nodes(cluster, {}) is None  # local: the judges run on this node, as before
    assert server_step.judge_nodes(ClusterConfig(nodes=3), {"SLURM_JOB_ID": "1"}) is None
    monkeypatch.setattr(server_step, "slurm_hosts", lambda env: ("h1", "h2", "h3"))
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "h[1-3]"}
    assert server_step.judge_nodes(cluster, env) == sl.JobNodes(("h3",), 8)
    assert server_step.job_nodes(cluster, env, 0, None).hosts == ("h1", "h2")  # the policy's
    monkeypatch.setattr(server_step, "slurm_hosts", lambda env: ("h1",))
    with pytest.raises(Exception, match="cluster.judge_nodes is 1 but this job has 1 node"):
        server_step.judge_nodes(cluster, env)


# ---------------------------------------------------------------- golden: what submit --dry-run prints

SHAPES = {
    # 2 policy replicas of TP 8 on the first 2 nodes, one judge of TP 4 and one of TP 4 with a key on the third
    "judge-nodes": (
        {"tensor_parallel_size": 8, "replicas": 2},
        {
            "math_judge": judge(4, model="/lustre/models/math-judge") | {"api_key_env": VAR},
            "lc_judge": judge(4, model="/lustre/models/lc-judge"),
        },
        {"nodes": 3, "judge_nodes": 1, "gpus_per_node": 8},
    ),
}


@pytest.mark.parametrize("container", [False, True], ids=["plain", "container"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_golden_job_scripts_with_judge_nodes(shape, container):
    policy_vllm, judges_section, cluster = SHAPES[shape]
    cfg = slurm_run(policy_vllm, judges_section, **cluster, **(CONTAINER if container else {}))
    assert preflight.gpu_problems(cfg) == [] and preflight.judge_gpu_problems(cfg) == []
    text = rendered(cfg) + "\n".join(judges.preview(cfg.judges, str(SHARD), cfg.cluster_or_default)) + "\n"
    path = GOLDEN / f"{shape}{'-container' if container else ''}.txt"
    if os.environ.get("SHARDRUN_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; SHARDRUN_UPDATE_GOLDEN=1 to accept"
    # the job holds 3 nodes; the policy's step exactly the first two, the judges' the third
    assert "#SBATCH --nodes=3" in text
    assert "srun --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=NODE0,NODE1" in text
    assert "srun --overlap --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE2" in text
    assert "--host NODE2 --port 8100" in text and "--host NODE2 --port 8101" in text
    assert "base_url: http://127.0.0.1:GATE/v1" in text  # the Gym stack reaches each judge through its gate
    assert "--host NODE2" not in text.split("# ---- judges")[0]  # no judge in the policy's step
    if container:
        assert text.count("--container-image=/images/vllm-openai.sqsh") == 2  # both steps in the servers' image


# ---------------------------------------------------------------- refusals before anything is submitted


def dry_run(tmp_path: Path, monkeypatch, judges_section: dict, policy_vllm: dict | None, **cluster):
    run = synthetic.make(tmp_path, tasks=8, shards=2, seal=False)
    judge_nodes = cluster.pop("judge_nodes", 0)  # set in the file: the builder validates what it is given
    path = synthetic.launch_config_file(run, tmp_path / "run.yaml", executor="slurm", **cluster)
    data = json.loads(path.read_text())
    data["cluster"]["judge_nodes"] = judge_nodes
    data["judges"] = judges_section
    if policy_vllm is not None:
        data["policy"] = {"vllm": {"model": "pol/model", **policy_vllm}}
    path.write_text(json.dumps(data))
    monkeypatch.setenv(VAR, "judge-" + pysecrets.token_hex(8))
    return runner.invoke(app, ["submit", str(path), "--dry-run"])


REFUSALS = {
    "judge-nodes-not-below-nodes": (
        {"j": judge(2)},
        {"tensor_parallel_size": 2},
        {"nodes": 2, "judge_nodes": 2, "gpus_per_node": 8},
        "cluster.judge_nodes 2 must be below cluster.nodes 2",
    ),
    "replicas-without-judge-nodes": (
        {"j": judge(2)},
        {"tensor_parallel_size": 2, "replicas": 2},
        {"nodes": 2, "gpus_per_node": 8},
        "set cluster.judge_nodes (the job's last nodes run the judges: e.g. cluster.judge_nodes 1 and cluster.nodes 3)",
    ),
    "judge-nodes-without-a-self-hosted-judge": (
        {"j": {"base_url": "https://judge.example/v1", "model_name": "m"}},
        {"tensor_parallel_size": 2},
        {"nodes": 2, "judge_nodes": 1, "gpus_per_node": 8},
        "cluster.judge_nodes 1: no judge is self-hosted (judges.NAME.vllm), so the judge nodes would stay idle",
    ),
    "more-judge-nodes-than-judges": (
        {"j": judge(2)},
        {"tensor_parallel_size": 2},
        {"nodes": 3, "judge_nodes": 2, "gpus_per_node": 8},
        "cluster.judge_nodes 2 but 1 self-hosted judge(s): a judge runs within one node, so 1 judge node(s)",
    ),
    "a-judge-bigger-than-a-node": (
        {"j": judge(16)},
        {"tensor_parallel_size": 2},
        {"nodes": 2, "judge_nodes": 1, "gpus_per_node": 8},
        "judges.j.vllm tensor_parallel_size 16 x pipeline_parallel_size 1 needs 16 GPUs; a judge runs within one "
        "judge node, and cluster.gpus_per_node is 8",
    ),
    "judges-that-do-not-fit-their-nodes": (
        {"a": judge(8), "b": judge(4)},
        {"tensor_parallel_size": 2},
        {"nodes": 2, "judge_nodes": 1, "gpus_per_node": 8},
        "need 12 GPUs on cluster.judge_nodes 1 node(s) of cluster.gpus_per_node 8, and judges.b find no room",
    ),
    "a-policy-that-does-not-fit-the-other-nodes": (
        {"j": judge(8)},
        {"tensor_parallel_size": 8, "replicas": 3},
        {"nodes": 3, "judge_nodes": 1, "gpus_per_node": 8},
        "needs 24 GPUs; cluster.nodes 3 - cluster.judge_nodes 1 = 2 node(s) x cluster.gpus_per_node 8 gives 16",
    ),
    "replicas-that-need-the-judges-node": (
        {"j": judge(8)},
        {"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
        {"nodes": 2, "judge_nodes": 1, "gpus_per_node": 8},
        "needs 16 GPUs; cluster.nodes 2 - cluster.judge_nodes 1 = 1 node(s) x cluster.gpus_per_node 8 gives 8",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_submit_dry_run_refuses_judge_nodes_that_cannot_work_naming_the_field(tmp_path, monkeypatch, case):
    judges_section, policy_vllm, cluster, said = REFUSALS[case]
    res = dry_run(tmp_path, monkeypatch, judges_section, policy_vllm, **cluster)
    assert res.exit_code == 2, res.output
    assert said in " ".join(res.output.split()), res.output


def test_submit_dry_run_shows_the_judges_step_on_the_last_node(tmp_path, monkeypatch):
    res = dry_run(
        tmp_path,
        monkeypatch,
        {"j": judge(8) | {"api_key_env": VAR}},
        {"tensor_parallel_size": 8},
        nodes=2,
        judge_nodes=1,
        gpus_per_node=8,
    )
    assert res.exit_code == 0, res.output
    out = res.output
    assert "# judge j: self-hosted on judge node NODE1, 8 GPU(s) of its own; key $" + VAR in out
    assert "# ---- the judges' server step in each job: 1 judge server(s) on 1 judge node(s): judge j on NODE1" in out
    assert "srun --overlap --kill-on-bad-exit=1 --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE1" in out
    assert os.environ.get(VAR, "unset") not in out
    # the policy, one server on the first node: started by the shard itself, no step of its own
    assert "the policy's server step" not in out


def test_a_one_node_job_keeps_its_judge_beside_the_policy(tmp_path, monkeypatch):
    res = dry_run(tmp_path, monkeypatch, {"j": judge(2)}, {"tensor_parallel_size": 2}, gpus_per_node=8)
    assert res.exit_code == 0, res.output
    assert "# judge j: self-hosted on the job's first node, 2 GPU(s) of its own, the last of the node's" in res.output
    assert "judges' server step" not in res.output


# ---------------------------------------------------------------- the judges' script, run for real by bash


def test_the_judges_script_serves_each_judge_with_its_key_and_names_the_one_that_exits(tmp_path: Path):
    """The rendered script run by bash as rank 0 of a judge node at 127.0.0.1, the judges the stand-in model
    server given vLLM's command line: each is ready with its own key (from the step's environment, never the
    script), and when one exits (status 0) the step ends and only that judge's check names it."""
    p = ports.free_port()
    q = next(x for x in iter(ports.free_port, None) if x != p)
    hosted = {
        name: JudgeConfig(
            vllm=VllmConfig(model=name, command=[sys.executable, str(harness.FAKE), "--judge"], device="cpu"),
            api_key_env=VAR if name == "a" else None,
        )
        for name in ("a", "b")
    }
    job = sl.JobNodes(("127.0.0.1",), 0)
    lay = sl.judge_layout(hosted, job, {"a": p, "b": q}, tmp_path, {})
    key = "judge-" + pysecrets.token_hex(8)
    for name in hosted:
        (tmp_path / "judges" / name / "logs").mkdir(parents=True)
    script = tmp_path / "judges" / sl.JUDGE_SCRIPT_NAME
    env = server_step.step_env({"PATH": os.environ["PATH"]}, None) | {sl.JUDGE_KEY_VAR + "a": key}
    proc = server_step.start_step(
        script,
        sl.judge_script(lay),
        job.hosts,
        False,
        False,
        ClusterConfig(),
        env,
        tmp_path / "logs" / judges.STEP_LOG,
        "judge servers",
    )
    step = judges.JudgeStep(proc, lay, script)
    try:
        vllm.wait_ready(proc, lay.roots[0], "a", key, 60)
        vllm.wait_ready(proc, lay.roots[1], "b", None, 60)
        refused = processes.http_get(lay.roots[0] + "/v1/models", timeout=10)
        assert refused is not None and refused[0] == 401  # judge a requires its key, taken from the environment
        assert key not in script.read_text()
        checks = {
            n: judges.OnJudgeNode(step, n, vllm.Liveness([r], 60, what=f"judge {n}")) for n, r in zip("ab", lay.roots)
        }
        assert checks["a"].problem() is None and checks["b"].problem() is None
        body = json.dumps({"faults": ["die:after=0"], "die_code": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(lay.roots[1] + "/_fault", body), timeout=30).read()
        try:
            urllib.request.urlopen(
                urllib.request.Request(
                    lay.roots[1] + "/v1/chat/completions",
                    json.dumps({"model": "b", "messages": [{"role": "user", "content": "x"}]}).encode(),
                    {"Content-Type": "application/json"},
                ),
                timeout=30,
            ).read()
        except OSError:
            pass  # it died answering
        assert proc.wait(timeout=120) == 1  # whatever the judge's status, the step fails
        assert step.gone() == {"b"}
        assert checks["a"].problem() is None  # not a's: b's check says it
        problem = checks["b"].problem()
        assert problem is not None and problem.startswith("judge b: the judges' server step exited"), problem
        assert "exited with status 0; stopping this node's servers" in proc.log_path.read_text()
    finally:
        step.stop()
    assert not vllm.port_answers("127.0.0.1", p)
