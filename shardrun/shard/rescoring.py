"""One shard of a re-score (`shardrun rescore`, docs/rescore.md): the source run's sealed rollouts of this shard
re-verified by NeMo Gym's own re-verification, with this run's Gym config, and sealed here. No policy is asked.

The work, the same for every launch mode (runtime.run_locked calls `Rescore.run` instead of collecting when the
plan's config has a `rescore` section: in a shard job, local or a Slurm array task, and in a warm worker, which
passes only its claim's checks and its record for the seal; no servers of its own):
- the source shard must be sealed under the plan the re-score was made from (its fingerprint recorded in
  `rescore.source_fingerprint`), its rollouts file checked against its seal (sha256);
- Gym's `gym eval reverify` (it starts the configured servers itself, checks each resources server's
  `/reverify_mode` and refuses one that is not stateless unless `--force`, POSTs each stored rollout to its resources
  server's `/verify`, writes the results and a failures sidecar) runs with the stack's settings (env.yaml, head port,
  shared server venvs: gym_stack.start) into a scratch directory, watched like a collector (the judges, the
  sandbox, the runner's checks, its log and output growing), with `+disable_aggregation=true` (the merge
  profiles the whole run); `--failed-only` is its `--judge-failed-only` (it reads the sidecar next to the rollouts file,
  `<stem>_failures.jsonl`: the source shard's failures file; the source's successes are carried through unchanged,
  only the judge-failed rollouts are verified again);
- a rollout Gym did not verify (the source's failures without a response) keeps the source's failure rows; a
  rollout whose verification failed now is recorded failed for good (`_ng_failure_terminal`), so the shard seals,
  and a later `rescore --failed-only` of this run verifies it again;
- the results replace the shard's rollouts and failures files atomically, then the shard is sealed (seal.py) with
  the ledger's counts. A re-score killed before its seal leaves no seal: the next attempt verifies the shard anew,
  and sealed shards are never verified again.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Sequence

import orjson

from shardrun.core.config import RunConfig
from shardrun.core.errors import ServerFailure, ShardFailed
from shardrun.plan.planner import Plan
from shardrun.rundir import ledger, seal, store
from shardrun.rundir.records import Seal, SealWorker
from shardrun.shard import gym_stack
from shardrun.shard import judges as judge_servers
from shardrun.shard import sandbox as sandboxes
from shardrun.shard import watchdog

SCRATCH = "rescore"
UNSAFE_PREFIX = "unsafe_"  # what Gym puts before its output's name when --force overrode its guard
# Gym's refusal of servers that are not stateless (rollout_reverification._guard_reverify_mode)
REFUSED = re.compile(r"Resource server\(s\)\s+(\[[^\]]*\])\s+have\s+reverify_mode=UNSUPPORTED\s+or\s+UNKNOWN")


def reverify_overrides(
    materialized: Path, rollouts: Path, output: Path, *, failed_only: bool, force: bool, parallel: int | None
) -> list[str]:
    """The Hydra overrides of Gym's re-verification for one shard (pure)."""
    return [
        f"+materialized_inputs_jsonl_fpath={materialized}",
        f"+rollouts_jsonl_fpath={rollouts}",
        f"+output_jsonl_fpath={output}",
        "+disable_aggregation=true",
        # no policy is asked: Gym must not wait for the model endpoint (the policy of the source run is gone)
        "+model_endpoint_readiness_timeout_seconds=0",
        "+overwrite=true",
        f"+force={'true' if force else 'false'}",
        f"+judge_failed_only={'true' if failed_only else 'false'}",
        *([f"+num_samples_in_parallel={parallel}"] if parallel else []),
    ]


def refusal(log_text: str) -> str | None:
    """Gym's refusal of resources servers that are not safe to re-verify statelessly, from its log (where the
    message may be wrapped over lines), said in shardrun's words; None when the log holds none (pure)."""
    found = REFUSED.search(log_text)
    if found is None:
        return None
    return (
        f"resources server(s) {found.group(1)} are not safe to re-verify statelessly "
        f"(Gym: reverify_mode unsupported or unknown)"
    )


def keys_in(path: Path) -> set[tuple[int, int]]:
    return {ledger.key_of(row) for row in store.iter_jsonl_objects(path)} if path.exists() else set()


def carried_failures(source_failures: Path, verified: set[tuple[int, int]]) -> list[dict]:
    """The source's failure rows of identities Gym did not verify now (they had no response to verify)."""
    if not source_failures.exists():
        return []
    return [row for row in store.iter_jsonl_objects(source_failures) if ledger.key_of(row) not in verified]


def final_failures(new_rows: list[dict]) -> list[dict]:
    """Gym's failure rows of this re-verification, each recorded failed for good (the shard is sealed with them;
    `rescore --failed-only` verifies them again)."""
    return [row | {ledger.TERMINAL_KEY: True} for row in new_rows]


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # Gym clears its output as it starts
        return -1


class Rescore:
    """One attempt at one shard of a re-score (the counterpart of runtime.Shard for a run with `rescore`)."""

    def __init__(
        self,
        run_dir: Path,
        index: int,
        plan: Plan,
        cfg: RunConfig,
        log,
        job_id: str | None,
        attempt: int,
        *,
        checks: Sequence[watchdog.Check] = (),
        worker: SealWorker | None = None,
    ):
        assert cfg.rescore is not None and cfg.gym is not None
        self.run_dir, self.index, self.plan, self.cfg, self.log = run_dir, index, plan, cfg, log
        self.job_id, self.attempt = job_id, attempt
        self.checks, self.worker = list(checks), worker  # a warm worker's: its claim and time limit; its record
        self.rescore, self.gym = cfg.rescore, cfg.gym
        self.source = Path(self.rescore.source_run)

    def check_source(self) -> Plan:
        source_plan = store.load_plan(self.source)
        if source_plan.fingerprint != self.rescore.source_fingerprint:
            raise ShardFailed(
                f"{self.source} holds another plan now (fingerprint {source_plan.fingerprint[:12]}…, the re-score "
                f"was made from {self.rescore.source_fingerprint[:12]}…); re-score it into a new run directory"
            )
        state = seal.check(self.source, source_plan, self.index, deep=True)
        if not state.sealed:
            raise ShardFailed(f"source shard {self.index} of {self.source} is not sealed: {state.reason}")
        return source_plan

    def run(self) -> Seal:
        started = time.time()
        self.check_source()
        scratch = store.shard_dir(self.run_dir, self.index) / SCRATCH
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        output = scratch / store.ROLLOUTS
        src_rollouts = store.rollouts_path(self.source, self.index)
        extra = reverify_overrides(
            store.materialized_path(self.source, self.index),
            src_rollouts,
            output,
            failed_only=self.rescore.failed_only,
            force=self.rescore.force,
            parallel=self.gym.num_samples_in_parallel,
        )
        policy = self.cfg.policy
        urls = policy.base_url if policy else None
        base_url = urls if isinstance(urls, str) or urls is None else (urls[0] if urls else None)
        t0 = time.monotonic()
        home = gym_stack.shard_place(self.run_dir, self.index).home
        # the verification's own services: the run's judges (a re-score that swaps the judge) and its sandbox
        box = sandboxes.start(self.cfg.sandbox, home, cluster=self.cfg.cluster_or_default) if self.cfg.sandbox else None
        judges: list[judge_servers.Judge] = []
        try:
            judges, _ = judge_servers.start_all(self.cfg.judges, home, None, self.cfg.cluster_or_default)
            stack = gym_stack.start(
                self.run_dir,
                self.index,
                self.gym,
                # no policy is asked: the model server's URL is only configured (a judge names its own server)
                [base_url or "http://127.0.0.1:9/v1"],
                None,
                (policy.model_name if policy else None) or "none",
                judges=[j.binding for j in judges],
                extra_env=box.gym_env if box is not None else None,
                command=lambda adapter, venv: adapter.reverify_command(venv),
                extra=extra,
            )
            try:
                rc = self.watch(stack.proc, judges, box, output)
            finally:
                stack.stop()  # the servers Gym started are left in its process group
            down = judge_servers.problem(judges) or (box.problem() if box is not None else None)
            if down:  # a verification against a dead judge or sandbox is not trusted: the shard runs again
                raise ServerFailure(f"{down}; the shard's re-verification is not kept")
        finally:
            try:
                judge_servers.stop_all(judges)
            finally:
                if box is not None:
                    box.stop()
        verify_s = time.monotonic() - t0
        if rc != 0:
            tail = stack.proc.tail()
            refused = refusal(tail)
            if refused:
                raise ShardFailed(f"refused: {refused}; `shardrun rescore --force` re-verifies them anyway")
            raise ShardFailed(f"Gym's re-verification failed ({stack.proc.describe_exit()}):\n{tail}")
        unsafe = scratch / (UNSAFE_PREFIX + store.ROLLOUTS)
        if unsafe.exists():
            self.log("forced: a resources server is not stateless; its rewards may differ from a fresh collection")
            output = unsafe
        if not output.exists():
            raise ShardFailed(f"Gym's re-verification wrote no {output.name} (log {stack.proc.log_path})")
        new_failures = output.with_name(output.stem + "_failures.jsonl")
        failure_rows = final_failures(list(store.iter_jsonl_objects(new_failures)) if new_failures.exists() else [])
        verified = keys_in(output) | {ledger.key_of(r) for r in failure_rows}
        failure_rows += carried_failures(store.failures_path(self.source, self.index), verified)
        self.install(output, failure_rows)
        return self.seal(started, verify_s)

    def watch(self, proc, judges: list[judge_servers.Judge], box: sandboxes.Sandbox | None, output: Path) -> int:
        """Wait for Gym's re-verification to end, checking the judges, the sandbox and the runner's checks (a warm
        worker's claim and time limit: ShardReleased stops it, nothing recorded) as a collection's watchdog does;
        it must show progress (its log or its output growing) at least every ready_timeout_s + 10 x
        stall_timeout_s (Gym starts its servers first, then verifies)."""

        def progress() -> list[tuple[str, int]]:  # the sizes of its log and of what it wrote (unsafe_ or not)
            return [(p.name, size_of(p)) for p in [proc.log_path, *sorted(output.parent.glob("*.jsonl"))]]

        checks = [
            *(watchdog.Check(f"judge {j.name}", j.endpoint.problem) for j in judges),
            *([watchdog.Check("sandbox", box.problem)] if box is not None else []),
            *self.checks,
        ]
        return watchdog.watch(
            proc,
            checks=checks,
            progress=progress,
            stall_timeout_s=self.gym.ready_timeout_s + self.gym.stall_timeout_s * 10,
            interval_s=self.gym.health_interval_s,
            log=self.log,
        )

    def install(self, output: Path, failure_rows: list[dict]) -> None:
        """The results into place: the failures first, then the rollouts by rename (both atomic)."""
        store.atomic_write_bytes(
            store.failures_path(self.run_dir, self.index), b"".join(orjson.dumps(r) + b"\n" for r in failure_rows)
        )
        with open(output, "rb") as f:
            os.fsync(f.fileno())
        os.replace(output, store.rollouts_path(self.run_dir, self.index))
        store.fsync_dir(store.shard_dir(self.run_dir, self.index))
        with contextlib.suppress(OSError):
            shutil.rmtree(store.shard_dir(self.run_dir, self.index) / SCRATCH)

    def seal(self, started: float, verify_s: float) -> Seal:
        book = ledger.load(self.run_dir, self.index, self.gym.max_rollout_attempts)
        if book.pending:
            shown = ", ".join(f"{t}:{r}" for t, r in book.pending[:5])
            raise ShardFailed(f"{len(book.pending)} planned rollouts were neither verified nor failed ({shown})")
        marker = seal.counted_marker(
            self.plan,
            self.index,
            book,
            store.rollouts_path(self.run_dir, self.index),
            started_at=started,
            finished_at=time.time(),
            host=socket.gethostname(),
            job_id=self.job_id,
            attempt=self.attempt,
            server_wait_s=0.0,
            collect_s=round(verify_s, 3),
            gpus=0,
            gym_version=self.plan.gym_version,
            worker=self.worker,
        )
        seal.write_marker(self.run_dir, self.index, marker)
        return marker
