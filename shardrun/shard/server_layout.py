"""Where a job's policy servers run and how each is started (pure): the shapes of docs/policy.md.

A job has `nodes` (hostnames, the first is where the shard or warm worker runs Gym and the collector) with
`gpus_per_node` GPUs each. `policy.vllm` asks for `replicas` independent servers of tensor x pipeline x data parallel
size GPUs each. A server fits one node, or spans `nodes_per_replica` nodes with vLLM's own multi-node launch:

- replicas: server k runs on node k mod N (several per node where the GPUs allow), each on its own port and GPUs;
  the collector gets every server's base URL (Gym's `vllm_model` takes a list), or one `vllm-router` on the first
  node in front of them (`policy.router`);
- one server across nodes (tensor x pipeline parallel size above a node's GPUs): `--nnodes K --node-rank k
  --master-addr HEAD --master-port P`, `--headless` on every rank but the head;
- data parallel across nodes: `--data-parallel-size D --data-parallel-size-local L --data-parallel-address HEAD
  --data-parallel-rpc-port P` on the head, `--headless --data-parallel-start-rank k*L` on the others.

`node_script` renders the one script every node of the server step runs (`srun --kill-on-bad-exit=1`, one task
per node; the node's rank from SLURM_NODEID): it starts that node's servers and exits 1 as soon as any of them
exits, with status 0 too (vLLM exits 0 when its engine dies), so the step ends and the job fails as a server
failure. The API key is never in it: the servers take VLLM_API_KEY from the step's environment.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from shardrun.core.config import JudgeConfig, PolicyConfig, VllmConfig
from shardrun.core.errors import BadInput
from shardrun.rundir import store
from shardrun.shard import vllm

JUDGES_DIR = "judges"  # SHARD (or worker) dir / judges / NAME: a self-hosted judge's scratch and logs/vllm.log
JUDGE_SCRIPT_NAME = "judge-servers.sh"  # SHARD / judges / this: the script of the judges' server step
JUDGE_KEY_VAR = "SHARDRUN_JUDGE_KEY_"  # + a judge's name: its key, in the judges' step environment only
DP_RPC_OFFSET = 100  # --data-parallel-rpc-port: the server's port + this
MASTER_OFFSET = 200  # --master-port of a server across nodes: the server's port + this
ROUTER_OFFSET = 1000  # the router's port by default: the policy's port + this
ROUTER_REQUEST_TIMEOUT_S = 3600  # NVIDIA's recipe: finite ("86400 meant never" inside a 4 h job)
SCRIPT_NAME = "policy-servers.sh"


@dataclass(frozen=True)
class JobNodes:
    """The job the servers run in: its nodes (the first runs Gym and the collector), their GPUs, its time limit
    and concurrency (for the router's timeouts and queue)."""

    hosts: tuple[str, ...]
    gpus_per_node: int
    time_limit_s: int | None = None
    concurrency: int | None = None

    @property
    def spans_nodes(self) -> bool:
        return len(self.hosts) > 1


@dataclass(frozen=True)
class ServerLaunch:
    """One process of one server: replica `replica`'s rank `rank` (0 serves the API), on node `node`."""

    replica: int
    rank: int
    node: int
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    log: Path
    gpus: tuple[int, int] | None = None  # (first, count) of the node's GPUs; None: all the step gives
    label: str | None = None  # the server's name in the script and its messages (a judge's: its name)
    key_var: str | None = None  # VLLM_API_KEY from this variable of the step's environment (a judge's own key)

    @property
    def name(self) -> str:
        if self.label is not None:
            return self.label
        return f"r{self.replica}" + (f"-n{self.rank}" if self.rank else "")


@dataclass(frozen=True)
class ServerLayout:
    nodes: JobNodes
    model_name: str
    launches: tuple[ServerLaunch, ...]
    replica_roots: tuple[str, ...]  # each server's head, http://host:port (health and /v1/models)
    router: ServerLaunch | None = None
    router_root: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def urls(self) -> list[str]:
        """What the collector is given (.../v1): the router's, else every server's."""
        roots = [self.router_root] if self.router_root else list(self.replica_roots)
        return [r + "/v1" for r in roots]

    @property
    def roots(self) -> list[str]:
        """Everything to health-check: each server's head, then the router."""
        return list(self.replica_roots) + ([self.router_root] if self.router_root else [])

    def on_node(self, node: int) -> list[ServerLaunch]:
        return [s for s in self.launches + ((self.router,) if self.router else ()) if s.node == node]

    @property
    def used_nodes(self) -> int:
        return 1 + max(s.node for s in self.launches)


@dataclass(frozen=True)
class JudgeLayout:
    """The self-hosted judges on the job's judge nodes (cluster.judge_nodes): one server each, in config order."""

    nodes: JobNodes  # the judge nodes only
    launches: tuple[ServerLaunch, ...]  # label: the judge's name
    roots: tuple[str, ...]  # each judge's http://host:port, in the same order
    model_names: tuple[str, ...]

    def describe(self) -> str:
        """One line for the shard's log and `submit --dry-run`."""
        where = ", ".join(f"judge {s.name} on {self.nodes.hosts[s.node]}" for s in self.launches)
        return f"{len(self.launches)} judge server(s) on {len(self.nodes.hosts)} judge node(s): {where}"


def place_judges(gpus: Mapping[str, int], nodes: int, gpus_per_node: int) -> dict[str, tuple[int, int]]:
    """Each judge's (node, first GPU) on `nodes` judge nodes of `gpus_per_node` GPUs each (0: none), in the order
    given (each judge's GPUs within one node): the judges go to the nodes in turn, each to the first node from its
    turn on with its GPUs free; where that leaves one out, they are packed instead (each to the first node with
    room), so several share a node where its GPUs allow. A judge that fits nowhere is left out (the caller names
    it). Pure."""

    def fill(spread: bool) -> dict[str, tuple[int, int]]:
        free = [gpus_per_node] * nodes
        out: dict[str, tuple[int, int]] = {}
        for k, (name, g) in enumerate(gpus.items()):
            for i in range(nodes):
                node = ((k if spread else 0) + i) % nodes
                if g <= free[node]:
                    out[name] = (node, gpus_per_node - free[node])
                    free[node] -= g
                    break
        return out

    spread = fill(True)
    return spread if len(spread) == len(gpus) else max(spread, fill(False), key=len)


def judge_layout(
    judges: Mapping[str, JudgeConfig],
    job: JobNodes,
    ports: Mapping[str, int],
    home: Path,
    env: Mapping[str, str],
) -> JudgeLayout:
    """Every self-hosted judge (`judges`, in config order) on the judge nodes `job`, each bound to its node's
    hostname on its port (`ports`); a judge with a key (`api_key_env`) takes VLLM_API_KEY from JUDGE_KEY_VAR + its
    name in the step's environment. BadInput when one does not fit, or two on one node ask for the same port. Pure."""
    servers = {name: j.vllm for name, j in judges.items() if j.vllm is not None}
    gpus = {name: judges[name].gpus for name in servers}
    placed = place_judges(gpus, len(job.hosts), job.gpus_per_node)
    left = [name for name in servers if name not in placed]
    if left:
        raise BadInput(
            "the self-hosted judges do not fit their nodes",
            [
                f"judges.{name}.vllm needs {gpus[name]} GPU(s) on one node; {len(job.hosts)} judge node(s) of "
                f"{job.gpus_per_node} GPU(s) leave no room for it"
                for name in left
            ],
        )
    launches: list[ServerLaunch] = []
    roots: list[str] = []
    taken: dict[tuple[int, int], str] = {}
    for name, v in servers.items():
        node, first = placed[name]
        port = ports[name]
        if (node, port) in taken:
            raise BadInput(
                f"judges.{taken[node, port]} and judges.{name} are both on judge node {job.hosts[node]} at port "
                f"{port}; give each its own judges.NAME.vllm.port (or none: a free one is chosen)"
            )
        taken[node, port] = name
        host = job.hosts[node]
        _, cache = store.vllm_scratch_dirs(home / JUDGES_DIR / name)
        g = gpus[name]
        share = (first, g) if g and g < job.gpus_per_node else None
        launches.append(
            ServerLaunch(
                0,
                0,
                node,
                tuple(vllm.build_command(v, host, port, env)),
                tuple(v.env.items()) + (("VLLM_CACHE_ROOT", str(cache)),),
                store.vllm_log_path(home / JUDGES_DIR / name),
                share,
                label=name,
                key_var=JUDGE_KEY_VAR + name if judges[name].api_key_env else None,
            )
        )
        roots.append(vllm.root_url(host, port))
    names = tuple(vllm.served_name(v) for v in servers.values())
    return JudgeLayout(job, tuple(launches), tuple(roots), names)


def judge_script(lay: JudgeLayout) -> str:
    """The script every judge node of the judges' server step runs (pure; golden-tested)."""
    return step_script(lay.nodes.hosts, lay.launches, "judge", "no judge here")


def gpus_per_server(v: VllmConfig) -> int:
    return v.tensor_parallel_size * v.pipeline_parallel_size * v.data_parallel_size


def nodes_per_server(v: VllmConfig, gpus_per_node: int) -> int:
    if v.nodes_per_replica is not None:
        return v.nodes_per_replica
    if gpus_per_node <= 0:
        return 1
    return max(1, math.ceil(gpus_per_server(v) / gpus_per_node))


def shape_problems(
    v: VllmConfig, router: str | None, nodes: int, gpus_per_node: int, nodes_key: str = "cluster.nodes"
) -> list[str]:
    """What makes the shape impossible on `nodes` nodes of `gpus_per_node` GPUs (0: CPUs or not known), with the
    keys to change (`nodes_key`: what gives the policy its nodes). The GPU total (`preflight.gpu_problems`) is
    checked beside this."""
    out = []
    span = nodes_per_server(v, gpus_per_node)
    g = gpus_per_server(v)
    name = f"policy.vllm.replicas {v.replicas}"
    if span > 1:
        tp_pp = v.tensor_parallel_size * v.pipeline_parallel_size
        if v.data_parallel_size > 1 and tp_pp > 1 and gpus_per_node and tp_pp > gpus_per_node:
            out.append(
                f"policy.vllm: data_parallel_size {v.data_parallel_size} with tensor x pipeline parallel size "
                f"{tp_pp} above cluster.gpus_per_node {gpus_per_node}: one server across nodes takes either data "
                f"parallel ranks or tensor/pipeline ranks over the nodes, not both; lower one of them"
            )
        elif gpus_per_node and g != span * gpus_per_node:
            out.append(
                f"policy.vllm: a server over {span} nodes uses every GPU of each (cluster.gpus_per_node "
                f"{gpus_per_node}), so tensor x pipeline x data parallel size must be {span * gpus_per_node}, "
                f"not {g}; change the parallel sizes or policy.vllm.nodes_per_replica"
            )
        elif v.data_parallel_size > 1 and v.data_parallel_size % span:
            out.append(
                f"policy.vllm: data_parallel_size {v.data_parallel_size} does not split evenly over "
                f"nodes_per_replica {span} nodes"
            )
        if v.replicas * span > nodes:
            out.append(f"{name} x {span} node(s) per server needs {v.replicas * span} nodes; {nodes_key} is {nodes}")
    elif gpus_per_node:
        per_node = gpus_per_node // g
        if per_node and v.replicas > nodes * per_node:
            out.append(
                f"{name} of {g} GPU(s) each: {nodes} node(s) of {gpus_per_node} GPUs hold {nodes * per_node}; "
                f"raise cluster.nodes or lower the replicas"
                + (f" ({nodes_key} is {nodes})" if nodes_key != "cluster.nodes" else "")
            )
    if router is not None and v.replicas < 1:
        out.append("policy.router needs at least one replica")
    return out


def layout(
    policy: PolicyConfig,
    job: JobNodes,
    port: int,
    shard_dir: Path,
    env: Mapping[str, str],
) -> ServerLayout:
    """Every server process of the job (pure). BadInput when the shape does not fit the job."""
    v = policy.vllm
    if v is None:
        raise BadInput("policy.vllm: no self-hosted policy to lay out")
    problems = shape_problems(v, policy.router, len(job.hosts), job.gpus_per_node)
    if problems:
        raise BadInput("the self-hosted policy does not fit its job", problems)
    span = nodes_per_server(v, job.gpus_per_node)
    g = gpus_per_server(v)
    local = not job.spans_nodes  # every server beside Gym: bind as configured, reach over loopback
    bind = (lambda node: v.host) if local else (lambda node: job.hosts[node])
    reach = (lambda node: vllm.connect_host(v.host)) if local else (lambda node: job.hosts[node])
    launches: list[ServerLaunch] = []
    roots: list[str] = []
    logs = store.vllm_log_path(shard_dir)
    _, cache = store.vllm_scratch_dirs(shard_dir)
    on_node: dict[int, int] = {}  # servers placed on a node so far (their port and GPU slot)
    for r in range(v.replicas):
        if span == 1:
            node = r % len(job.hosts)
            slot = on_node.get(node, 0)
            on_node[node] = slot + 1
            p = port + slot
            share = (slot * g, g) if job.gpus_per_node and job.gpus_per_node // g > 1 else None
            cmd = vllm.build_command(v, bind(node), p, env)
            launches.append(server(r, 0, node, cmd, v, cache, logs, share))
            roots.append(vllm.root_url(reach(node), p))
            continue
        first = r * span
        head = job.hosts[first]
        for k in range(span):
            node = first + k
            cmd = vllm.build_command(v, bind(node), port, env) + across_nodes(v, span, k, head, port, job)
            launches.append(server(r, k, node, cmd, v, cache, logs, None))
        roots.append(vllm.root_url(reach(first), port))
    router = router_root = None
    if policy.router is not None:
        o = policy.router_options
        rport = o.port or port + ROUTER_OFFSET
        cmd = list(o.command) + router_args(policy, job, bind(0), rport, roots)
        router = ServerLaunch(-1, 0, 0, tuple(cmd), (), logs.with_name("vllm-router.log"))
        router_root = vllm.root_url(reach(0), rport)
    return ServerLayout(job, vllm.served_name(v), tuple(launches), tuple(roots), router, router_root)


def server(
    r: int, k: int, node: int, cmd: Sequence[str], v: VllmConfig, cache: Path, logs: Path, gpus: tuple[int, int] | None
) -> ServerLaunch:
    name = f"r{r}" + (f"-n{k}" if k else "")
    env = tuple(v.env.items()) + (("VLLM_CACHE_ROOT", str(cache / name)),)
    return ServerLaunch(r, k, node, tuple(cmd), env, logs.with_name(f"vllm-{name}.log"), gpus)


def across_nodes(v: VllmConfig, span: int, k: int, head: str, port: int, job: JobNodes) -> list[str]:
    """vLLM's own multi-node flags for rank `k` of a server over `span` nodes whose first node is `head`."""
    if v.data_parallel_size > 1:
        local = v.data_parallel_size // span
        args = [
            "--data-parallel-size-local",
            str(local),
            "--data-parallel-address",
            head,
            "--data-parallel-rpc-port",
            str(port + DP_RPC_OFFSET),
        ]
        return args + (["--headless", "--data-parallel-start-rank", str(k * local)] if k else [])
    args = [
        "--nnodes",
        str(span),
        "--node-rank",
        str(k),
        "--master-addr",
        head,
        "--master-port",
        str(port + MASTER_OFFSET),
    ]
    return args + (["--headless"] if k else [])


def router_args(policy: PolicyConfig, job: JobNodes, host: str, port: int, roots: Sequence[str]) -> list[str]:
    """vllm-router in front of the replicas, with NVIDIA's recipe's settings: long health timeouts, a finite request
    timeout below the walltime, no circuit breaker, a queue as deep as the job's concurrency."""
    o = policy.router_options
    timeout = o.request_timeout_s or ROUTER_REQUEST_TIMEOUT_S
    if o.request_timeout_s is None and job.time_limit_s:
        timeout = max(60, min(timeout, job.time_limit_s // 2))
    queue = o.queue_size if o.queue_size is not None else (job.concurrency or 256)
    args = ["--worker-urls", *roots, "--policy", o.policy, "--host", host, "--port", str(port)]
    args += [
        "--request-timeout-secs",
        str(timeout),
        "--health-check-timeout-secs",
        str(o.health_timeout_s),
        "--health-check-interval-secs",
        str(o.health_interval_s),
        "--health-failure-threshold",
        str(o.health_failures),
        "--max-concurrent-requests",
        str(max(1, queue)),
        "--queue-size",
        str(queue),
        "--worker-startup-timeout-secs",
        str(o.startup_timeout_s),
    ]
    if not o.circuit_breaker:
        args.append("--disable-circuit-breaker")
    return args + list(o.extra_args)


# ---------------------------------------------------------------- the script every node runs

RANK_VAR = "SHARDRUN_NODE_RANK"

PREAMBLE = """\
#!/usr/bin/env bash
# Written by shardrun: the {servers} of one job. Every node of the server step runs this script (one task per
# node: srun --kill-on-bad-exit=1); a node's rank is ${rank_var}, else SLURM_NODEID. Each server's output is appended to
# its log. When any server exits, with any status (vLLM exits 0 when its engine dies), the node says which, stops its
# other servers and exits 1, which ends the step on every node and fails the job as a server failure.
set -uo pipefail
rank=${{{rank_var}:-${{SLURM_NODEID:?not in a Slurm step and {rank_var} unset}}}}
scratch=$(mktemp -d "${{TMPDIR:-/tmp}}/shardrun-vllm-XXXXXX")
pids=()
names=()
finish() {{
  trap - TERM INT
  kill -TERM "${{pids[@]}}" 2>/dev/null
  wait
  rm -rf "$scratch"
  exit "$1"
}}
trap 'finish 1' TERM INT
# gpus FIRST COUNT: that slice of the GPUs this step sees (CUDA_VISIBLE_DEVICES as Slurm set it)
gpus() {{
  local all
  IFS=, read -ra all <<<"${{CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(($1 + $2 - 1)))}}"
  local IFS=,
  echo "${{all[*]:$1:$2}}"
}}
# serve NAME LOG COMMAND...: start one server in the background with its own scratch directory
serve() {{
  local name=$1 log=$2
  shift 2
  mkdir -p "$scratch/$name"
  echo "[shardrun] $(date -u +%FT%TZ) starting $name on $(hostname)" >>"$log"
  TMPDIR="$scratch/$name" VLLM_RPC_BASE_PATH="$scratch/$name" "$@" </dev/null >>"$log" 2>&1 &
  pids+=($!)
  names+=("$name")
}}
"""

EPILOGUE = """\
if [ ${{#pids[@]}} -eq 0 ]; then
  sleep infinity &
  pids+=($!)
  names+=("(none)")
fi
wait -n
rc=$?
gone=()
for i in "${{!pids[@]}}"; do
  kill -0 "${{pids[$i]}}" 2>/dev/null || gone+=("${{names[$i]}}")
done
echo "[shardrun] {what} ${{gone[*]:-?}} on $(hostname) (node $rank) exited with status $rc; stopping this node's servers" >&2
finish 1
"""


def node_script(lay: ServerLayout) -> str:
    """The script every node of the policy's server step runs (pure; golden-tested)."""
    servers = list(lay.launches) + ([lay.router] if lay.router else [])
    return step_script(lay.nodes.hosts, servers, "policy server", "no server here (Gym and the collector only)")


def step_script(hosts: Sequence[str], servers: Sequence[ServerLaunch], what: str, idle: str) -> str:
    """The script every node of a server step over `hosts` runs: each node starts its `servers` (`what` names them
    in the step's log: "policy server r1", "judge NAME"; `idle` is said of a node without one). A server with a
    `key_var` gets VLLM_API_KEY from that variable of the step's environment, so no key is ever in the script or on
    a command line. Pure; golden-tested."""
    lines = [PREAMBLE.format(rank_var=RANK_VAR, servers=what + "s"), 'case "$rank" in']
    for node, host in enumerate(hosts):
        here = [s for s in servers if s.node == node]
        lines.append(f"  {node})  # {host}")
        if not here:
            lines.append(f"    : # {idle}")
        for s in here:
            name = "router" if s.replica < 0 else s.name
            words = [f"{k}={shlex.quote(val)}" for k, val in s.env]
            if s.gpus is not None:
                words.append(f'CUDA_VISIBLE_DEVICES="$(gpus {s.gpus[0]} {s.gpus[1]})"')
            prefix = ("env " + " ".join(words) + " ") if words else ""
            key = f'VLLM_API_KEY="${{{s.key_var}:?not set in the server step environment}}" ' if s.key_var else ""
            lines.append(f"    {key}serve {name} {shlex.quote(str(s.log))} {prefix}{shlex.join(s.cmd)}")
        lines.append("    ;;")
    lines.append('  *) echo "[shardrun] no node $rank in this job" >&2; exit 2 ;;')
    lines.append("esac")
    return "\n".join(lines) + "\n" + EPILOGUE.format(what=what)


def describe(lay: ServerLayout) -> str:
    """One line for the shard's log and `submit --dry-run`."""
    per = lay.launches
    servers = len(lay.replica_roots)
    span = max(s.rank for s in per) + 1
    what = f"{servers} policy server(s)" + (f" over {span} nodes each" if span > 1 else "")
    where = f"on {lay.used_nodes} of {len(lay.nodes.hosts)} node(s)"
    front = f", behind vllm-router at {lay.router_root}" if lay.router_root else ""
    return f"{what} {where}{front}: {', '.join(lay.urls)}"
