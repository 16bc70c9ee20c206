"""SIGKILL a shard's whole process tree (the `shardrun submit`/`resume` command, its submitit job, the shard,
ng_run and Ray, the collector) at seeded random points of shard start, server start-up and mid-collection, against
real NeMo Gym and the stand-in policy server (the fake at the model seam; it answers slowly, so collection lasts
a few seconds, and always refuses one rollout, which must end in the failure sidecar every time).

A chaos loop on one small shard: start the normal command (`submit` or `resume`, chosen at random), wait until
the attempt reaches the targeted stage (from its shard.log), sleep a seeded random part of that stage's length
(measured on the uninterrupted reference run), kill the tree; the next command is the recovery of that kill. After
a mid-collection kill the test appends half a line to rollouts.jsonl, what a collector killed while writing leaves,
and the recovery must cut it. The last command runs to the end. Then every planned identity is in the merged output
exactly once (or, the refused one, in the failures), none invented, the merged files are byte-identical to the
uninterrupted run (rollouts: except the ids and created_at NeMo Gym makes up per call; merge_summary: except
timings), no finished rollout was asked of the model again, and no process of any attempt is left.

Kills per stage: SHARDRUN_FAULT_SHARD_KILLS="shard start,server start-up,mid-collection" (default below). Each
mid-collection kill costs a whole Gym stack start (15-60 s), so the default is what the CI budget allows;
docs/reliability.md says what ran.
"""

from __future__ import annotations

import os
import stat
import time
from collections import Counter
from pathlib import Path

import pytest

from shardrun.rundir import seal
from shardrun.rundir import store
from tests.faults import faultkit, gymkit
from tests.fakes import harness

pytestmark = [pytest.mark.gym, pytest.mark.slow, pytest.mark.timeout(3600)]

DEFAULT_KILLS = "20,6,3"


def quotas() -> dict[str, int]:
    n = [int(x) for x in os.environ.get("SHARDRUN_FAULT_SHARD_KILLS", DEFAULT_KILLS).split(",")]
    return dict(zip(gymkit.STAGES[:3], n))


def test_sigkill_anywhere_in_a_shard_then_resume_or_submit_recovers_identically(
    tmp_path: Path, gym_reference, tag: str
):
    ref = gym_reference
    quota = quotas()
    ms = ref.milestones
    windows = {  # (milestone the stage starts at, its length on the reference run)
        "shard start": (None, ms[gymkit.POLICY_READY]),
        "server start-up": (gymkit.POLICY_READY, ms[gymkit.GYM_READY] - ms[gymkit.POLICY_READY]),
        "mid-collection": (gymkit.COLLECTING, ms[gymkit.SEALED] - ms[gymkit.COLLECTING]),
    }
    prompts = gymkit.prompt_and_seed(ref.run_dir)
    rng = faultkit.seeded(66)
    landed: Counter = Counter()
    used: Counter = Counter()
    env_yaml_seen = env_yaml_left = chains = kills = torn = cuts = 0
    run_dir = tmp_path / "run-0"
    cfg = ref.config(tmp_path / "run-0.yaml", run_dir)
    fresh = True
    for _attempt in range(3 * sum(quota.values()) + 10):
        todo = [s for s in quota if landed[s] < quota[s]]
        if not todo:
            break
        target = max(todo, key=lambda s: (quota[s] - landed[s]) / quota[s])
        command = ("submit", cfg) if fresh or rng.random() < 0.5 else ("resume", run_dir)
        used[command[0]] += 1
        fresh = False
        offset = len(gymkit.log_text(run_dir))
        done_before = set(faultkit.identities(store.rollouts_path(run_dir, 0))) if run_dir.exists() else set()
        requests_before = len(ref.fake.requests())
        proc = faultkit.start_cli(*command, log=tmp_path / "commands.log")
        milestone, length = windows[target]
        if milestone is not None:
            faultkit.wait_for(
                lambda: milestone in gymkit.log_text(run_dir)[offset:], 600, milestone, proc=proc, interval=0.02
            )

        def idle(until) -> None:
            """Wait for `until()` (or the command's end), checking env.yaml and the command lines meanwhile."""
            nonlocal env_yaml_seen
            while proc.poll() is None and not until():
                time.sleep(0.01)
                if os.path.exists(store.env_yaml_path(run_dir, 0)):
                    mode = stat.S_IMODE(os.stat(store.env_yaml_path(run_dir, 0)).st_mode)
                    assert mode == 0o600, oct(mode)
                    if not env_yaml_seen % 200:  # and no process of the shard has the key on its command line
                        assert not [
                            p for p in harness.tagged_processes(tag) if ref.key in faultkit.cmdline(p, limit=None)
                        ]
                    env_yaml_seen += 1

        if target == "mid-collection":  # a seeded point of the collection: once k more rollouts landed, k < left
            left = len(ref.planned) - len(ref.failed) - len(done_before)
            k = rng.randrange(0, max(left, 1))
            path = store.rollouts_path(run_dir, 0)
            idle(lambda: store.count_complete_lines(path) >= len(done_before) + k)
            delay = rng.uniform(0.0, 0.5)
        else:
            delay = rng.uniform(0.05, 0.9 * length)
        t_kill = time.monotonic() + delay
        idle(lambda: time.monotonic() >= t_kill)
        # no rollout finished before this attempt was asked of the model again
        again = {(r["prompt"], r["seed"]) for r in ref.fake.requests()[requests_before:]}
        assert not again & {prompts[k] for k in done_before}, "a finished rollout was run again"
        if proc.poll() is None:
            faultkit.kill_tree(proc, tag=tag)
            kills += 1
            stage = gymkit.stage_of(gymkit.log_text(run_dir)[offset:])
            landed[stage] += 1
            assert faultkit.leftovers(tag, also=run_dir) == [], f"kill {kills} ({stage}) left processes"
            env_yaml_left += store.env_yaml_path(run_dir, 0).exists()
            keys = (
                faultkit.identities(store.rollouts_path(run_dir, 0)) if store.rollouts_path(run_dir, 0).exists() else []
            )
            assert len(keys) == len(set(keys)) and set(keys) <= set(ref.planned), "duplicated or invented rollout"
            path = store.rollouts_path(run_dir, 0)
            if stage == "mid-collection" and path.exists() and path.read_bytes().endswith(b"\n"):
                with open(path, "ab") as f:  # the killed collector was writing a line: the recovery must cut it
                    f.write(b'{"responses_create_params": {"input": [{"content": "Solve')
                torn += 1
            continue
        # the command finished: this chain of kills is recovered; check it, and start a new run directory
        assert proc.returncode == 0, (tmp_path / "commands.log").read_text()[-3000:] + gymkit.log_text(run_dir)
        verify(run_dir, ref, tag)
        cuts += gymkit.log_text(run_dir).count("cut a torn last line")
        chains += 1
        run_dir = tmp_path / f"run-{chains}"
        cfg = ref.config(tmp_path / f"run-{chains}.yaml", run_dir)
        fresh = True

    # the last recovery runs to the seal, and is killed in its teardown: the shard is sealed and never runs again,
    # so nothing of the attempt (env.yaml with the key, processes) may outlive that kill
    command = ("submit", cfg) if fresh else ("resume", run_dir)
    used[command[0]] += 1
    offset = len(gymkit.log_text(run_dir))
    requests_before = len(ref.fake.requests())
    done_before = set(faultkit.identities(store.rollouts_path(run_dir, 0))) if run_dir.exists() else set()
    proc = faultkit.start_cli(*command, log=tmp_path / "commands.log")
    faultkit.wait_for(
        lambda: gymkit.SEALED in gymkit.log_text(run_dir)[offset:], 900, "the seal", proc=proc, interval=0.01
    )
    if proc.poll() is None:
        faultkit.kill_tree(proc, tag=tag)
        kills += 1
        landed[gymkit.stage_of(gymkit.log_text(run_dir)[offset:])] += 1
    else:  # the previous kill left every rollout collected: this attempt sealed without starting servers
        assert proc.returncode == 0, (tmp_path / "commands.log").read_text()[-3000:] + gymkit.log_text(run_dir)
        assert "sealing without starting servers" in gymkit.log_text(run_dir)[offset:]
        landed["sealed without servers (no teardown to kill)"] += 1
    again = {(r["prompt"], r["seed"]) for r in ref.fake.requests()[requests_before:]}
    assert not again & {prompts[k] for k in done_before}, "a finished rollout was run again"
    assert not store.env_yaml_path(run_dir, 0).exists(), "a sealed shard's env.yaml (it holds the key) outlived it"
    res = faultkit.cli("resume", run_dir, timeout=300)
    assert res.returncode == 0 and "every shard is sealed" in res.stdout, res.stdout + res.stderr
    checked = verify(run_dir, ref, tag)
    assert all(landed[s] >= quota[s] for s in quota), (dict(landed), quota)
    cuts += gymkit.log_text(run_dir).count("cut a torn last line")
    assert torn and cuts >= torn, (torn, cuts)  # every torn last line was cut by the attempt after it
    faultkit.counts_line(
        "shard kills",
        kills=kills,
        recovered_runs=chains + 1,
        identities_checked=checked * (chains + 1),
        commands=dict(used),
        env_yaml_0600_checks=env_yaml_seen,
        env_yaml_left_by_kills=env_yaml_left,
        torn_lines_written=torn,
        torn_lines_cut=cuts,
        **{s.replace(" ", "_").replace("-", "_").replace("/", "_"): landed[s] for s in landed},
    )


def verify(run_dir: Path, ref, tag: str) -> int:
    """The run is sealed and merges to exactly the reference's outputs; nothing is left running or on disk."""
    plan = store.load_plan(run_dir)
    assert seal.check(run_dir, plan, 0, deep=True).sealed
    keys = faultkit.identities(store.rollouts_path(run_dir, 0))
    assert len(keys) == len(set(keys)), "a rollout is twice in the shard's rollouts.jsonl"
    res = faultkit.cli("merge-and-profile", run_dir)
    assert res.returncode == 0, res.stderr
    got = faultkit.merged_outputs(run_dir, gym=True)
    for name in ref.merged:
        assert got[name] == ref.merged[name], f"merged {name} differs from the uninterrupted run"
    assert faultkit.without_server_ports(store.failures_path(run_dir, 0).read_bytes()) == faultkit.without_server_ports(
        store.failures_path(ref.run_dir, 0).read_bytes()
    )
    assert not store.env_yaml_path(run_dir, 0).exists()
    assert faultkit.leftovers(tag, also=run_dir) == []
    return faultkit.assert_exactly_once(run_dir, ref.planned, ref.failed)
