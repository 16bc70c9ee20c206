"""Hostile round 3, a report and a merge at once (issue 34): the merge removes only its own temporary files (named
`.tmp-merge-...`), so a report paused while writing its page or a figure beside the merge's outputs keeps its
temporary file and renames it into place; a temp file a killed merge left is still removed by the next merge."""

from __future__ import annotations

import pytest
from hostilekit import invoke_bounded
from reportkit import input_row, planned_run, seal_shards

from shardrun.rundir import store


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


@pytest.fixture()
def sealed(tmp_path):
    run_dir, _ = planned_run(tmp_path, [input_row(i) for i in range(4)], num_repeats=2, num_shards=2)
    seal_shards(run_dir, reward)
    assert invoke_bounded("merge-and-profile", run_dir).exit_code == 0
    return run_dir


@pytest.mark.parametrize("target", ["report page", "a figure"])
def test_a_report_paused_while_a_merge_runs_keeps_its_temporary_file(sealed, target):
    path = store.report_path(sealed) if target == "report page" else store.report_figure_path(sealed, "mean_hist")
    with store.atomic_writer(path) as f:  # the report, paused half way through writing
        f.write(b"half")
        merged = invoke_bounded("merge-and-profile", sealed)
        assert merged.exit_code == 0, merged.output
        f.write(b" and the rest")
    assert path.read_bytes() == b"half and the rest"


def test_a_killed_merges_temporary_file_is_removed_by_the_next_merge(sealed):
    stale = store.merged_dir(sealed) / f"{store.MERGE_TMP_PREFIX}rollouts.jsonl.abc123"
    stale.write_bytes(b"left by a killed merge")
    assert invoke_bounded("merge-and-profile", sealed).exit_code == 0
    assert not stale.exists()
