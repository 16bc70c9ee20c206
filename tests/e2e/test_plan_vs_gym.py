"""The planned rows equal, byte for byte, what NeMo Gym itself materializes for one unsharded run.

Uses the real nemo-gym packages of every supported version (their row preprocessing, offline: no servers needed);
the run is planned with that version's venv, whose semantics the planner follows (0.7's agent_name routes every row).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import orjson
import pytest

from shardrun.core import config
from shardrun.rundir import store
from tests.planning_helpers import row

pytestmark = pytest.mark.gym
SCRIPT = Path(__file__).parent.parent / "gym_scripts" / "preprocess.py"


def gym_rows(gym_venv: Path, inp: Path, out: Path, repeats, agent: str | None) -> bytes:
    cmd = [str(gym_venv / "bin" / "python"), str(SCRIPT), str(inp), str(out), json.dumps(repeats)]
    subprocess.run(cmd + ([agent] if agent else []), check=True, capture_output=True, timeout=120)
    return out.read_bytes()


def inputs() -> list[dict]:
    rows = [row(i, agent="math" if i % 3 else "tools") for i in range(12)]
    rows[4]["agent_ref"] = None
    del rows[4]["agent_ref"]  # falls back to agent_name
    rows[5]["responses_create_params"]["metadata"] = {"extra_body": json.dumps({"top_k": 3}), "k": "v"}
    rows[6]["responses_create_params"]["temperature"] = 0.3
    rows[7]["_ng_rollout_index"] = 42  # always overwritten, as Gym does
    return rows


def explicit_inputs() -> list[dict]:
    # Gym numbers implicit tasks among rows without an explicit index, shardrun by line position (so identical
    # lines stay distinct tasks); with every index explicit both must agree exactly.
    return [row(i, agent="math", _ng_task_index=1000 - 7 * i) for i in range(6)]


@pytest.mark.parametrize(
    "rows,repeats,slicing,shards",
    [
        (inputs, 3, "contiguous", 4),
        (inputs, {"math": 4, "_default": 2}, "contiguous", 5),
        (inputs, 2, "round_robin", 3),
        (explicit_inputs, 3, "contiguous", 2),
    ],
)
def test_planned_rows_equal_gyms_materialized_rows(
    tmp_path, gym_venv_each, monkeypatch, rows, repeats, slicing, shards
):
    gym_venv = gym_venv_each
    monkeypatch.setenv("SHARDRUN_GYM_VENV", str(gym_venv))
    inp = tmp_path / "input.jsonl"
    inp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows()))
    cfg = config.validate(
        {
            "input_jsonl": str(inp),
            "run_dir": str(tmp_path / "run"),
            "num_repeats": repeats,
            "agent_name": "tools",
            "sharding": {"num_shards": shards, "slicing": slicing},
        }
    )
    plan, _ = store.write_plan(cfg)
    ours = [store.materialized_path(cfg.run_dir, s.index).read_bytes() for s in plan.shards]
    theirs = gym_rows(gym_venv, inp, tmp_path / "gym.jsonl", repeats, "tools")
    if slicing == "contiguous":
        assert b"".join(ours) == theirs  # same rows, same bytes, same order
    else:
        assert sorted(b"".join(ours).splitlines()) == sorted(theirs.splitlines())
