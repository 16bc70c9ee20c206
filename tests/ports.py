"""Free TCP ports inside a fixed range (each test area has its own range so concurrent sessions don't collide)."""

from __future__ import annotations

import socket


def free_port_in(low: int, high: int, start: int = 0) -> int:
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
