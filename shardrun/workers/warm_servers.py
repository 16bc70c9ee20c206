"""A warm worker's servers: the policy and the Gym stack (started as a shard job starts them, shard/runtime.py), with
the slot gate between them (shard/slot_gate.py) and the collector service that collects shard after shard
(workers/collector_service.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from shardrun.core import gym_adapter
from shardrun.core.config import ClusterConfig, CollectorConfig, GymConfig, JudgeConfig, PolicyConfig, SandboxConfig
from shardrun.shard import gym_stack, policy, runtime
from shardrun.shard import sandbox as sandboxes
from shardrun.shard import slot_gate
from shardrun.workers import collector_service


@dataclass
class WarmServers:
    """The running servers (`base`, whose front is the gate) and, unless collector.service is off, the service."""

    base: runtime.Servers
    gate: slot_gate.Gate
    service: collector_service.CollectorService | None = None

    @property
    def endpoint(self) -> policy.PolicyEndpoint:
        return self.base.endpoint

    @property
    def stack(self) -> gym_stack.GymStack:
        return self.base.stack

    @property
    def sandbox(self) -> sandboxes.Sandbox | None:
        return self.base.sandbox

    @property
    def up_since(self) -> float:
        return self.base.up_since

    def problem(self) -> str | None:
        return self.base.problem() or (self.service.problem() if self.service else None)

    def groups(self) -> list[tuple[int, int]]:
        """The process groups of the servers started here (processes.Proc.group): a worker records them so that
        another worker on its host can reap them if it is SIGKILLed."""
        procs = self.base.procs() + ([self.service.proc] if self.service is not None else [])
        return [g for g in (p.group for p in procs) if g is not None]

    def stop(self) -> None:
        try:
            if self.service is not None:
                self.service.stop()
        finally:
            self.base.stop()


def start(
    policy_cfg: PolicyConfig,
    gym: GymConfig,
    collecting: CollectorConfig,
    run_dir: Path,
    place: gym_stack.StackPlace,
    log: Callable[[str], None],
    cluster: ClusterConfig | None = None,
    judges: Mapping[str, JudgeConfig] | None = None,
    sandbox: SandboxConfig | None = None,
) -> WarmServers:
    """Start the policy, the slot gate admitting gym.num_samples_in_parallel requests at once, the Gym stack behind
    it, with the run's judges (started first) and the sandbox beside it (given `sandbox`), and (collector.service)
    the collector service with `collector.rollouts_per_slot` rollouts in flight per slot
    of the gate; all ready, or none left running."""
    gates: list[slot_gate.Gate] = []

    def gate(urls: list[str]) -> slot_gate.Gate:
        gates.append(slot_gate.Gate(urls, gym.num_samples_in_parallel))
        return gates[-1]

    servers = WarmServers(
        runtime.start_servers(
            policy_cfg, gym, run_dir, place, log, front=gate, cluster=cluster, judges=judges, sandbox=sandbox
        ),
        gates[0],
    )
    if not collecting.service:
        return servers
    try:
        venv = gym_stack.gym_venv(gym, os.environ)
        servers.service = collector_service.start(
            gym_adapter.for_venv(venv),
            venv,
            servers.stack,
            gym,
            place.home,
            rollouts_per_slot=collecting.rollouts_per_slot,
        )
    except BaseException:
        servers.stop()
        raise
    limit = collector_service.budget(gym.num_samples_in_parallel, collecting.rollouts_per_slot)
    log(
        f"collector service started (pid {servers.service.proc.pid}): shard after shard, one budget of "
        f"{limit or 'unlimited'} rollout(s) in flight"
    )
    return servers
