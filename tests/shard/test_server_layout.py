"""The policy's shapes (shard/server_layout.py): where each server of a job runs and how it is started, and the
refusals, with the fields named, before anything is submitted.

Golden files (tests/golden/shapes/): for each shape, with and without a container image, exactly what `submit
--dry-run` prints for it: the sbatch script of the shard array and the server step (its srun line and the script every
node runs). A change is deliberate: regenerate with SHARDRUN_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardrun.core.config import ClusterConfig, PolicyConfig, validate
from shardrun.core.errors import BadInput
from shardrun.launch import preflight, slurm
from shardrun.shard import server_layout as sl

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "shapes"
RUN_DIR = Path("/lustre/runs/shapes")
SHARD = RUN_DIR / "shards" / "00000"
PYTHON = "/opt/shardrun/.venv/bin/python"
MODEL = "/lustre/models/m"

SHAPES = {
    # 4 replicas of TP 4 on 2 nodes of 8 GPUs: two per node, each on its own port and half the GPUs
    "replicas": ({"tensor_parallel_size": 4, "replicas": 4}, None, {"nodes": 2, "gpus_per_node": 8}),
    # TP 8 x PP 2 = 16 GPUs: one server over 2 nodes (vLLM's own multi-node launch, headless second rank)
    "one-server-over-2-nodes": (
        {"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
        None,
        {"nodes": 2, "gpus_per_node": 8},
    ),
    # data parallel 16 of TP 1 over 2 nodes: 8 local ranks each, the second node headless from rank 8
    "data-parallel-over-2-nodes": ({"data_parallel_size": 16}, None, {"nodes": 2, "gpus_per_node": 8}),
    # 2 replicas of TP 8 behind vllm-router on the first node
    "router": ({"tensor_parallel_size": 8, "replicas": 2}, "vllm-router", {"nodes": 2, "gpus_per_node": 8}),
}
CONTAINER = {
    "containers": {"shardrun": "/images/shardrun.sqsh", "vllm": "/images/vllm-openai.sqsh"},
    "container_python": "/opt/venv/bin/python3",
    "mounts": ["/lustre:/lustre"],
}


def run_config(vllm: dict, router: str | None, cluster: dict):
    return validate(
        {
            "input_jsonl": "/lustre/data/in.jsonl",
            "run_dir": str(RUN_DIR),
            "agent_name": "math",
            "num_repeats": 4,
            "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
            "policy": {"vllm": {"model": MODEL, "port": 8000, **vllm}, "router": router},
            "cluster": {"executor": "slurm", "time_limit": "04:00:00", **cluster},
        }
    )


def rendered(cfg) -> str:
    sp = slurm.slurm_plan(cfg, RUN_DIR, "f" * 64, range(8), max_array_size=1001, merge_job=False)
    out = []
    for title, script in slurm.slurm_scripts(sp, RUN_DIR, python=PYTHON):
        out += [f"# ==== sbatch script for {title}", script.rstrip("\n")]
    out += slurm.server_step_preview(cfg, RUN_DIR, str(SHARD))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("container", [False, True], ids=["plain", "container"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_golden_job_scripts_for_each_shape(shape, container):
    vllm, router, cluster = SHAPES[shape]
    cfg = run_config(vllm, router, {**cluster, **(CONTAINER if container else {})})
    assert preflight.gpu_problems(cfg) == []
    text = rendered(cfg)
    path = GOLDEN / f"{shape}{'-container' if container else ''}.txt"
    if os.environ.get("SHARDRUN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} changed; SHARDRUN_UPDATE_GOLDEN=1 to accept"
    # the shard runs once per job, on its first node; the servers' step spans every node
    assert "--nodes=1 --ntasks=1" in text
    assert "srun --overlap --kill-on-bad-exit=1 --nodes=2 --ntasks=2 --ntasks-per-node=1" in text
    if container:
        assert "--container-image=/images/vllm-openai.sqsh" in text  # the servers' image
        assert "--container-image=/images/shardrun.sqsh" in text  # the shard's
        assert "/opt/venv/bin/python3 -u -m submitit.core._submit" in text


def layout_of(vllm: dict, hosts=("n1", "n2"), gpus=8, router=None, concurrency=None, time_limit_s=None):
    policy = PolicyConfig(vllm={"model": MODEL, **vllm}, router=router)
    return sl.layout(policy, sl.JobNodes(tuple(hosts), gpus, time_limit_s, concurrency), 8000, SHARD, {})


def test_replicas_fill_nodes_in_turn_with_their_own_ports_and_gpus():
    lay = layout_of({"tensor_parallel_size": 2, "replicas": 4})
    assert [(s.replica, s.node, s.gpus) for s in lay.launches] == [
        (0, 0, (0, 2)),
        (1, 1, (0, 2)),
        (2, 0, (2, 2)),
        (3, 1, (2, 2)),
    ]
    assert lay.urls == ["http://n1:8000/v1", "http://n2:8000/v1", "http://n1:8001/v1", "http://n2:8001/v1"]
    assert [s.cmd[s.cmd.index("--host") + 1] for s in lay.launches] == ["n1", "n2", "n1", "n2"]
    assert len({s.log for s in lay.launches}) == 4  # a log each


def test_one_replica_per_node_keeps_the_gpus_slurm_gave():
    lay = layout_of({"tensor_parallel_size": 8, "replicas": 2})
    assert [s.gpus for s in lay.launches] == [None, None]
    assert "$(gpus" not in sl.node_script(lay)


def test_one_server_over_two_nodes_uses_vllms_multi_node_flags():
    lay = layout_of({"tensor_parallel_size": 8, "pipeline_parallel_size": 2})
    head, other = lay.launches
    assert lay.urls == ["http://n1:8000/v1"]
    for s, rank in ((head, "0"), (other, "1")):
        c = list(s.cmd)
        assert c[c.index("--nnodes") + 1] == "2" and c[c.index("--node-rank") + 1] == rank
        assert c[c.index("--master-addr") + 1] == "n1"
    assert "--headless" not in head.cmd and "--headless" in other.cmd


def test_data_parallel_over_two_nodes_has_headless_ranks_from_the_local_size():
    lay = layout_of({"data_parallel_size": 16})
    head, other = (list(s.cmd) for s in lay.launches)
    assert head[head.index("--data-parallel-size-local") + 1] == "8"
    assert head[head.index("--data-parallel-address") + 1] == "n1"
    assert "--headless" in other and other[other.index("--data-parallel-start-rank") + 1] == "8"
    assert "--data-parallel-start-rank" not in head


def test_router_settings_are_the_recipes_and_its_timeout_stays_below_the_walltime():
    lay = layout_of({"tensor_parallel_size": 8, "replicas": 2}, router="vllm-router", concurrency=96, time_limit_s=3600)
    assert lay.urls == ["http://n1:9000/v1"]
    assert lay.roots == ["http://n1:8000", "http://n2:8000", "http://n1:9000"]
    r = list(lay.router.cmd)
    assert r[r.index("--worker-urls") + 1 : r.index("--worker-urls") + 3] == ["http://n1:8000", "http://n2:8000"]
    assert r[r.index("--request-timeout-secs") + 1] == "1800"  # half of a 1-hour job, below the recipe's 3600
    assert r[r.index("--health-check-timeout-secs") + 1] == "60"
    assert r[r.index("--health-failure-threshold") + 1] == "10"
    assert r[r.index("--queue-size") + 1] == "96" and "--disable-circuit-breaker" in r


def test_one_node_binds_as_configured_and_is_reached_over_loopback():
    lay = layout_of({"replicas": 2}, hosts=("here",), gpus=0)
    assert lay.urls == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    assert all("CUDA_VISIBLE_DEVICES" not in dict(s.env) for s in lay.launches)


def test_the_script_never_holds_the_api_key():
    lay = layout_of({"replicas": 2, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
    text = sl.node_script(lay)
    assert "VLLM_API_KEY" not in text and "--api-key" not in text
    assert "VLLM_CPU_KVCACHE_SPACE=1" in text


def slurm_cfg(vllm: dict, cluster: dict, router=None):
    return run_config(vllm, router, cluster)


@pytest.mark.parametrize(
    "vllm, cluster, expected",
    [
        (
            {"tensor_parallel_size": 8},
            {"nodes": 2, "gpus_per_node": 2},
            "policy.vllm.tensor_parallel_size 8 x pipeline_parallel_size 1 needs 8 GPUs; cluster.nodes 2 x "
            "cluster.gpus_per_node 2 gives 4",
        ),
        (
            {"tensor_parallel_size": 4},
            {"nodes": 1, "gpus_per_node": 0},
            "cluster.gpus_per_node: 0, so the Slurm job has no GPU",
        ),
        (
            {"tensor_parallel_size": 4, "replicas": 3},
            {"nodes": 1, "gpus_per_node": 8},
            "policy.vllm.replicas 3 x tensor_parallel_size 4 x pipeline_parallel_size 1 needs 12 GPUs",
        ),
        (
            {"tensor_parallel_size": 12},
            {"nodes": 2, "gpus_per_node": 8},
            "policy.vllm: a server over 2 nodes uses every GPU of each (cluster.gpus_per_node 8), so tensor x "
            "pipeline x data parallel size must be 16, not 12",
        ),
        (
            {"tensor_parallel_size": 16, "data_parallel_size": 2},
            {"nodes": 4, "gpus_per_node": 8},
            "one server across nodes takes either data parallel ranks or tensor/pipeline ranks",
        ),
        (
            {"tensor_parallel_size": 3, "replicas": 3},
            {"nodes": 2, "gpus_per_node": 5},
            "policy.vllm.replicas 3 of 3 GPU(s) each: 2 node(s) of 5 GPUs hold 2",
        ),
    ],
    ids=[
        "tp8-on-2-gpus-per-node",
        "no-gpus",
        "replicas-over-gpus",
        "span-not-whole-nodes",
        "dp-and-tp-across",
        "packing",
    ],
)
def test_refusals_name_the_fields(vllm, cluster, expected):
    problems = preflight.gpu_problems(slurm_cfg(vllm, cluster))
    assert any(expected in p for p in problems), problems


def test_layout_refuses_a_shape_that_does_not_fit():
    with pytest.raises(BadInput) as e:
        layout_of({"tensor_parallel_size": 8, "replicas": 2}, hosts=("n1",), gpus=8, router=None)
    assert "policy.vllm.replicas 2 of 8 GPU(s) each: 1 node(s) of 8 GPUs hold 1" in str(e.value)


def test_cpu_on_purpose_still_checks_the_nodes():
    cfg = slurm_cfg({"device": "cpu", "replicas": 3, "nodes_per_replica": 1}, {"nodes": 2, "gpus_per_node": 0})
    assert preflight.gpu_problems(cfg) == []
    cfg = slurm_cfg({"device": "cpu", "replicas": 2, "nodes_per_replica": 2}, {"nodes": 2, "gpus_per_node": 0})
    assert any("needs 4 nodes; cluster.nodes is 2" in p for p in preflight.gpu_problems(cfg))


def test_cluster_time_limit_is_one_definition():
    assert (
        ClusterConfig(time_limit="01:30:00").shard_time_minutes()
        == 90
        == slurm.shard_time_minutes(ClusterConfig(time_limit="01:30:00"))
    )


@pytest.mark.parametrize(
    "vllm, cluster, named",
    [
        ({"tensor_parallel_size": 8}, {"nodes": 1, "gpus_per_node": 2}, "cluster.gpus_per_node 2 gives 2"),
        ({"replicas": 2}, {"nodes": 2, "gpus_per_node": 0}, "cluster.gpus_per_node: 0, so the Slurm job has no GPU"),
        (
            {"tensor_parallel_size": 8},
            {"nodes": 1, "gpus_per_node": 8, "containers": {"shardrun": "/images/x.sqsh"}},
            "cluster.container_python: not set",
        ),
    ],
    ids=["tp8-on-2-gpus", "self-hosted-without-gpus", "image-without-interpreter"],
)
def test_submit_dry_run_exits_2_naming_the_field(tmp_path: Path, monkeypatch, vllm, cluster, named):
    from typer.testing import CliRunner

    from shardrun.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"responses_create_params": {"input": "1+1?"}, "agent_ref": {"name": "a"}}\n')
    (tmp_path / "model").mkdir()
    cfg = {
        "input_jsonl": "in.jsonl",
        "run_dir": str(tmp_path / "run"),
        "num_repeats": 2,
        "gym": {"config_paths": ["resources_servers/math_with_judge/configs/math_with_judge.yaml"]},
        "policy": {"vllm": {"model": str(tmp_path / "model"), **vllm}},
        "cluster": {"executor": "slurm", **cluster},
    }
    (tmp_path / "run.yaml").write_text(json.dumps(cfg))
    out = CliRunner().invoke(app, ["submit", "run.yaml", "--dry-run"])
    assert out.exit_code == 2, out.output
    assert named in out.output, out.output
    assert "srun --overlap" not in out.output and not (tmp_path / "run").exists()
