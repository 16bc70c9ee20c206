"""Free TCP ports, the one finder every test uses: each test area has its own range, so concurrent test sessions
on one machine do not scan the same ports."""

from __future__ import annotations

import itertools
import os
import socket

RUNTIME = range(21000, 22000)  # the stand-in policy of the runtime, e2e and launch tests (tests/fakes/harness.py)
VLLM = range(22000, 23000)  # the vLLM stand-in and the real vLLM (tests/shard/test_vllm*.py)
SLURM = range(23000, 24000)  # the stand-in policy of the tests on the local Slurm (tests/slurm/)
FAULTS = range(24000, 25000)  # the stand-in policy of the fault suite (tests/faults/)

_calls = itertools.count()


def free_port(ports: range = RUNTIME) -> int:
    """A port in `ports` that binds on 127.0.0.1 now. The scan starts at a place spread by the process id and by how
    many ports this process asked for before, so parallel sessions and successive calls start apart (wrapping
    around); which port that is does not matter to any test."""
    return _first_free(ports.start, ports.stop, os.getpid() * 7919 + next(_calls) * 97)


def _first_free(low: int, high: int, start: int) -> int:
    """The first port in [low, high) that binds on 127.0.0.1, scanning from low + start (wrapping around)."""
    size = high - low
    for k in range(size):
        port = low + (start + k) % size
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")
