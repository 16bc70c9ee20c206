"""Hostile planning input: small files that would exhaust memory or time, hang, or plan what can never be merged.

Each refused case exits 2, names the file and line or the config key, writes nothing and changes no file. The
valid-but-unusual cases (a huge explicit task index, the deepest nesting allowed) plan in bounded memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hostilekit import invoke, refused

from tests import builders
from shardrun.core.gym_names import MATERIALIZED, MAX_JSON_DEPTH, MAX_REPEATS, MAX_TASK_INDEX


def row(i: int, **extra) -> dict:
    return {
        "responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}]},
        "agent_ref": {"name": "a"},
        **extra,
    }


def config_file(tmp: Path, rows: list[dict] | None = None, **settings) -> Path:
    """The run config (2 shards) of input.jsonl, which holds `rows` where given; `settings` are top-level keys."""
    inp = tmp / "input.jsonl"
    if rows is not None:
        inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return builders.write_config(tmp / "run.yaml", inp, tmp / "run", shards=2, **settings)


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


# -- indices and repeats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [MAX_TASK_INDEX + 1, 2**63, 2**64 - 1, 2**70])
def test_a_task_index_the_merge_cannot_hold_is_refused_with_its_line(tmp_path, unchanged, index):
    rows = [row(0, _ng_task_index=0), row(1, _ng_task_index=index)]
    cfg = config_file(tmp_path, rows)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "input.jsonl:2", "_ng_task_index")
    assert not (tmp_path / "run").exists()


def measured_plan(cfg: Path) -> tuple[subprocess.CompletedProcess, int]:
    """`shardrun plan --write` in a child process: its result and its peak resident memory in MiB. The peak is the
    child's own (VmHWM of its address space): getrusage's ru_maxrss keeps the forking parent's peak across exec, so
    it would count the test worker's memory too."""
    code = (
        "import re, sys\nfrom shardrun.cli import main\nsys.argv = ['shardrun', 'plan', sys.argv[1], "
        "'--write']\ntry:\n    main()\nfinally:\n    hwm = re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read())"
        "\n    print('maxrss', hwm.group(1), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, timeout=600)
    rss_kib = int(proc.stderr.rsplit("maxrss", 1)[1].split()[0])
    return proc, rss_kib // 1024


def test_a_huge_explicit_task_index_plans_in_memory_that_does_not_depend_on_it(tmp_path):
    # valid but unusual: 2^34 - 1 made `plan` use 4.2 GB when the index set was a bitmap as large as the index
    cfg = config_file(tmp_path, [row(0, _ng_task_index=17179869183), row(1, _ng_task_index=MAX_TASK_INDEX)])
    proc, peak_mib = measured_plan(cfg)
    assert proc.returncode == 0, proc.stderr
    assert peak_mib < 400, f"planning two rows took {peak_mib} MiB"
    shards = sorted((tmp_path / "run" / "shards").iterdir())
    tasks = {json.loads(line)["_ng_task_index"] for s in shards for line in (s / MATERIALIZED).read_text().splitlines()}
    assert tasks == {17179869183, MAX_TASK_INDEX}


def test_many_repeats_stream_in_bounded_memory(tmp_path):
    # valid but unusual: the largest repeat count planned for one task; rows are rendered and written in chunks
    cfg = config_file(tmp_path, [row(0)], num_repeats=MAX_REPEATS, sharding={"num_shards": 4})
    proc, peak_mib = measured_plan(cfg)
    assert proc.returncode == 0, proc.stderr
    assert peak_mib < 400, f"planning {MAX_REPEATS:,} rollouts of one task took {peak_mib} MiB"
    lines = sum(1 for s in (tmp_path / "run" / "shards").iterdir() for _ in (s / MATERIALIZED).open("rb"))
    assert lines == MAX_REPEATS


@pytest.mark.parametrize(
    "setting, key",
    [
        ({"num_repeats": 10**9}, "num_repeats"),
        ({"num_repeats": {"a": 3, "_default": MAX_REPEATS + 1}}, "num_repeats"),
        ({"seed_offset": 2**64}, "seed_offset"),
        ({"seed_offset": -1}, "seed_offset"),
        ({"sharding": {"num_shards": 10**12}}, "sharding.num_shards"),
        ({"cluster": {"nodes": 2**40}}, "cluster.nodes"),
        ({"cluster": {"array_parallelism": 10**10}}, "cluster.array_parallelism"),
        ({"gym": {"max_rollout_attempts": 10**7}}, "gym.max_rollout_attempts"),
    ],
)
def test_an_integer_out_of_its_range_is_refused_with_the_key(tmp_path, unchanged, setting, key):
    cfg = config_file(tmp_path, [row(0), row(1)], **setting)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), key)
    assert not (tmp_path / "run").exists()


# -- nesting ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 1000])
def test_nesting_deeper_than_the_writer_supports_is_refused_with_the_line(tmp_path, unchanged, depth):
    inp = tmp_path / "input.jsonl"
    inp.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1, extra=nested(depth - 1))) + "\n")
    cfg = config_file(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), "input.jsonl:2", "nested")
    assert not (tmp_path / "run").exists()


def test_the_deepest_nesting_allowed_plans_and_writes(tmp_path):
    inp = tmp_path / "input.jsonl"
    inp.write_text(json.dumps(row(0, extra=nested(MAX_JSON_DEPTH - 1))) + "\n")
    cfg = config_file(tmp_path)
    outcome = invoke("plan", cfg, "--write")
    assert outcome.exit_code == 0, outcome.output
    assert (tmp_path / "run" / "plan.json").exists()


# -- files that are not files -----------------------------------------------------------------------------------


def test_a_fifo_as_input_is_refused_without_waiting_for_a_writer(tmp_path, unchanged):
    os.mkfifo(tmp_path / "input.jsonl")
    cfg = config_file(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg), "input.jsonl", "FIFO")


def test_a_directory_as_input_is_refused(tmp_path, unchanged):
    (tmp_path / "input.jsonl").mkdir()
    cfg = config_file(tmp_path)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg), "input.jsonl", "directory")


def test_a_fifo_as_config_is_refused_without_waiting_for_a_writer(tmp_path, unchanged):
    os.mkfifo(tmp_path / "run.yaml")
    with unchanged(tmp_path):
        refused(invoke("plan", tmp_path / "run.yaml"), "run.yaml", "not a regular file")


ALIAS_BOMB = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, unchanged):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 400
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with unchanged(tmp_path):
        refused(invoke("plan", cfg), "run.yaml", "aliases")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    assert grown_mib < 200


def test_a_config_with_a_few_aliases_is_fine(tmp_path):
    # valid but unusual: YAML anchors used the ordinary way
    (tmp_path / "input.jsonl").write_text(json.dumps(row(0)) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"input_jsonl: {tmp_path / 'input.jsonl'}\nrun_dir: {tmp_path / 'run'}\n"
        "sharding: &s {num_shards: 1}\nnum_repeats: &n 3\n"
    )
    outcome = invoke("plan", cfg, "--write")
    assert outcome.exit_code == 0, outcome.output


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"cluster": {"mem_gb": float("inf")}}, "cluster.mem_gb"),
        ({"cluster": {"mem_gb": 1e30}}, "cluster.mem_gb"),
        ({"cluster": {"merge_mem_gb": float("nan")}}, "cluster.merge_mem_gb"),
        ({"gym": {"ready_timeout_s": float("inf")}}, "gym.ready_timeout_s"),
    ],
)
def test_a_number_that_is_not_finite_or_beyond_its_range_is_refused(tmp_path, unchanged, settings, key):
    """mem_gb=.inf once ended `submit` in an OverflowError while the sbatch --mem value was rendered."""
    cfg = config_file(tmp_path, [row(0)], **settings)
    with unchanged(tmp_path):
        refused(invoke("plan", cfg, "--write"), key)
        refused(invoke("submit", cfg, "--dry-run"), key)
