"""Hostile round 3, a blend of many labels (issue 34): the merge writes each label's profile files label by label
(closed, and renamed into place with the run's outputs at the end), so the files it holds open do not grow with the
labels: a blend of 120 labels merges under `ulimit -n 64` (it held ~4 files open per label: "Too many open
files"), and so a blend of 10,000 labels within the usual 1,024."""

from __future__ import annotations

import resource
import subprocess
import sys

import orjson

from shardrun.rundir import store
from tests.blendkit import make_blend_run
from tests.builders import rollout_row, seal_shard

LABELS = 120
LIMIT = 64

MERGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from shardrun.cli import main
sys.argv = ["shardrun", "merge-and-profile", sys.argv[1]]
main()
"""


def test_a_blend_of_more_labels_than_open_files_merges(tmp_path):
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > LIMIT
    labels = [(f"l{i:04d}", "a", 1) for i in range(LABELS)]
    run = make_blend_run(tmp_path, labels, num_repeats=1, num_shards=2)
    for i in range(run.num_shards):
        rows = [rollout_row(m, text_chars=10) for m in run.materialized(i)]
        store.rollouts_path(run.run_dir, i).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        store.failures_path(run.run_dir, i).write_bytes(b"")
        seal_shard(run, i)
    done = subprocess.run(
        [sys.executable, "-c", MERGE, str(run.run_dir), str(LIMIT)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Too many open files" not in done.stderr
    labels_json = orjson.loads(store.labels_path(run.run_dir).read_bytes())
    assert [x["label"] for x in labels_json["labels"]] == [label for label, _, _ in labels]
    assert all(x["collected"] == 1 for x in labels_json["labels"])
    for label, _, _ in labels[:: LABELS // 10]:
        assert (store.by_label_dir(run.run_dir, label)).is_dir()
    leftovers = [p for p in store.merged_dir(run.run_dir).rglob(store.TMP_PREFIX + "*")]
    assert not leftovers, leftovers[:5]
