"""The README's "Your cluster, your checkpoint" section, run command by command on the real local Slurm (the cluster
the session fixture starts), each command checked against the lines the README shows under it (`#>`).

Nothing is copied from the README into this file: the test reads the section's blocks (the `cp` of the cluster
config, the keys to edit, the run config `my-run.yaml`, the commands with their `#>` lines), so the README and the
test cannot drift. The commands run as written, in a workspace holding copies of examples/ and cluster_configs/.

What differs from a real cluster, and why:
- No GPU here, so no checkpoint is served: the run config's `policy.vllm` (a self-hosted checkpoint) is replaced by
  a pre-hosted `policy.base_url`, the stand-in endpoint tests/fakes/policy_server.py -- the only fake, at the one
  seam shardrun does not own (the model server); it is not a model, its answers are canned.
- `gym.venv` is this machine's Gym venv, and the README's cluster edits (account, partition, GPUs, container,
  mounts, set-up lines) take the local cluster's values; the one node here is small (2 cores), so the example's
  64 CPUs and 512 GB per job become 1 CPU and 2 GB, and at most 2 shards (2 Gym stacks) run at once, not 64.
Slurm, sbatch, the Gym stack and shardrun are all real.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_helpers import ended_state, fake_policy, launches, scancel_names
from test_docs import Block, blocks
from tests.fakes import harness

pytestmark = [pytest.mark.slurm, pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Your cluster, your checkpoint"
# the README's edits of the copied cluster config, as they must be on this machine's one-node Slurm
LOCAL_EDITS = {
    "account": None,
    "partition": os.environ.get("SLURM_LOCAL_PARTITION", "debug"),
    "gpus_per_node": 0,
    "containers": {},
    "mounts": [],
    "setup": [],
}
LOCAL_NODE = {"cpus_per_task": 1, "mem_gb": 2, "array_parallelism": 2}
TIMEOUT_S = {"status": 1200}  # --watch returns once every shard is sealed; the others return at once


def section_blocks() -> list[Block]:
    text = (REPO / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return blocks(text[start : end if end >= 0 else len(text)])


def one(found: list[Block], what: str) -> Block:
    assert len(found) == 1, f"README.md {SECTION!r}: expected one block with {what}, found {len(found)}"
    return found[0]


def steps(code: str) -> list[tuple[str, list[str]]]:
    """(command, the `#>` lines shown under it), in order."""
    out: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("#>"):
            assert out, f"a `#>` line before any command: {line!r}"
            out[-1][1].append(line[2:].strip())
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append((line.strip(), []))
    return out


def squeeze(s: str) -> str:
    return " ".join(s.split())


def shows(expected: str, output: str) -> bool:
    """Some line of the output holds the expected line (runs of spaces as one; `…` stands for anything)."""
    pattern = ".*?".join(re.escape(part) for part in squeeze(expected).split("…"))
    return any(re.search(pattern, squeeze(line)) for line in output.splitlines())


def test_shows_matches_lines_with_wildcards() -> None:
    out = "shards             4 (contiguous)\n  array 0: --array=0-3%4  shards 0-3\n"
    assert shows("shards 4 (contiguous)", out)
    assert shows("array 0: --array=0-3%… shards 0-3", out)
    assert not shows("shards 5 (contiguous)", out)
    assert not shows("shards … 0-4", out)


def failed_jobs(run_dir: Path) -> str:
    """The end of every job log that ends in an error (what the assertion says when a job failed)."""
    tails = []
    for log in sorted((run_dir / "jobs").glob("*_log.out")):
        lines = log.read_text(errors="replace").splitlines()
        if any("error" in line.lower() for line in lines[-5:]):
            tails.append(f"--- {log.name}\n" + "\n".join(lines[-25:]))
    return "\n".join(tails)


def run(cmd: str, ws: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    if argv[0] == "shardrun":
        argv = [sys.executable, "-m", "shardrun.cli", *argv[1:]]
    else:
        argv = ["bash", "-c", cmd]
    timeout = TIMEOUT_S.get(shlex.split(cmd)[1] if cmd.startswith("shardrun ") else "", 300)
    return subprocess.run(argv, cwd=ws, capture_output=True, text=True, timeout=timeout)


def test_readme_cluster_section_runs_on_slurm(tmp_path: Path, slurm_cluster, gym_venv, monkeypatch) -> None:
    from shardrun.shard import gym_stack

    monkeypatch.setenv(harness.API_KEY_ENV, harness.API_KEY)
    monkeypatch.setenv(gym_stack.VENV_ENV, str(gym_venv))
    found = section_blocks()
    copy = one([b for b in found if b.lang == "bash" and b.directive == "run"], "the cluster config's copy")
    edits = one([b for b in found if b.lang == "yaml" and (b.directive or "").startswith("shown")], "the edits")
    run_cfg = one([b for b in found if b.lang == "yaml" and b.directive == "file=my-run.yaml"], "my-run.yaml")
    cmds = one([b for b in found if b.lang == "bash" and (b.directive or "").startswith("help")], "the commands")

    ws = tmp_path / "ws"
    ws.mkdir()
    for d in ("examples", "cluster_configs"):
        shutil.copytree(REPO / d, ws / d)
    transcript: list[str] = []

    # the cluster config: copied as the README says, then the README's keys edited to this cluster's values
    (copy_cmd,) = [c for c, _ in steps(copy.code)]
    res = run(copy_cmd, ws)
    assert res.returncode == 0, res.stderr
    cluster_file = ws / "cluster_configs" / "my-cluster.yaml"
    cluster = yaml.safe_load(cluster_file.read_text())
    shown = yaml.safe_load(edits.code)
    assert set(shown) == set(LOCAL_EDITS), f"the README edits {sorted(shown)}; this test knows {sorted(LOCAL_EDITS)}"
    assert all(k in cluster for k in shown), "the README edits keys that slurm-example.yaml does not have"
    assert cluster["executor"] == "slurm"
    cluster_file.write_text(yaml.safe_dump(cluster | LOCAL_EDITS | LOCAL_NODE))

    # the run config: the README's, with the stand-in endpoint for the checkpoint and this machine's Gym venv
    cfg = yaml.safe_load(run_cfg.code)
    assert cfg["policy"]["vllm"]["model"] == "/path/to/checkpoint" and cfg["cluster"] == "my-cluster"
    run_dir = ws / cfg["run_dir"]
    names: tuple[str, ...] = ()
    with fake_policy(tmp_path) as fake:
        cfg["policy"] = {"base_url": fake.base_url, "model_name": "fake-model", "api_key_env": harness.API_KEY_ENV}
        cfg["gym"]["venv"] = str(gym_venv)
        (ws / "my-run.yaml").write_text(yaml.safe_dump(cfg))
        try:
            missing = []
            for cmd, expected in steps(cmds.code):
                if cmd.startswith("shardrun merge-and-profile"):
                    # submit queued a merge job that runs when the arrays end: let it finish before merging again
                    rec = launches(run_dir)[-1]
                    state = ended_state(rec["merge_job_id"], 600, "the merge job")
                    assert state == "COMPLETED", f"the merge job ended {state}:\n{failed_jobs(run_dir)}"
                res = run(cmd, ws)
                out = res.stdout + res.stderr
                transcript.append(f"$ {cmd}\n{out}")
                assert res.returncode == 0, f"`{cmd}` exited {res.returncode}:\n{out}"
                if cmd.startswith("shardrun submit") and "--dry-run" not in cmd:
                    rec = launches(run_dir)[-1]
                    names = (rec["tag"], rec["merge_job_name"])
                missing += [f"`{cmd}` does not print {line!r}" for line in expected if not shows(line, out)]
        finally:
            (tmp_path / "transcript.txt").write_text("\n".join(transcript))
            scancel_names(*names)
    assert not missing, (
        "\n".join(missing) + f"\n\nwhat they printed ({tmp_path / 'transcript.txt'}):\n" + "\n".join(transcript)
    )
    assert (run_dir / "merged" / "report.html").is_file()
    rows = (ws / "curriculum.jsonl").read_text().splitlines()
    assert rows and all("shardrun_stats" in r for r in rows)
