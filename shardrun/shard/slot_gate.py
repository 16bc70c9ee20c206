"""The slot gate: a reverse proxy in front of a model server, admitting at most `slots` requests at once and
answering 504 for a request its upstream leaves unanswered past `timeout_s`.

Two users: a warm worker's policy (below), and each judge of a job (shard/judges.py: no slot limit, the judge's
`request_timeout_s`, so a judge that hangs becomes an HTTP error Gym records as a judge failure, never a hung rollout).

A warm worker's Gym stack talks to the policy through this gate (its URL is what env.yaml names), which forwards
every request unchanged (path, headers, body, status, response body) and holds the ones beyond `slots`
(`gym.num_samples_in_parallel`) in a first-come first-served queue. So the policy sees at most
`num_samples_in_parallel` requests in flight whatever runs behind it: the collector service's budget of
`num_samples_in_parallel x collector.rollouts_per_slot` rollouts (those beyond the slots run their other steps, or
wait here for a slot an answer frees), or several collector processes at once (collector.pipeline_shards), and while
one shard drains its slowest rollouts the next shard's fill the free slots (docs/workers.md).

It also measures what the policy was asked to do: the seconds each forwarded request took, summed (`request_s`,
in-flight requests counted up to now), from which the worker's slot occupancy follows (rundir/cost.py).

Standard library only (http.server threads, http.client upstream): a request thread blocks while it waits for a
slot, which is what a FIFO admission needs, and the policy's own latency dwarfs the proxy's.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import urlsplit

import orjson

HOST = "127.0.0.1"
UPSTREAM_TIMEOUT_S = 24 * 3600.0  # the policy's: the watchdog, not the gate, decides when a policy request hangs
HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}


class Slots:
    """At most `limit` holders at once (None: no limit), admitted in arrival order; their busy seconds summed."""

    def __init__(self, limit: int | None, clock=time.monotonic):
        self.limit, self.clock = limit, clock
        self.cond = threading.Condition()
        self.queue: deque[object] = deque()
        self.active: dict[object, float] = {}  # ticket -> start
        self.done_s = 0.0
        self.requests = 0
        self.peak = 0

    def acquire(self) -> object:
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            while self.queue[0] is not ticket or (self.limit is not None and len(self.active) >= self.limit):
                self.cond.wait()
            self.queue.popleft()
            self.active[ticket] = self.clock()
            self.peak = max(self.peak, len(self.active))
            self.cond.notify_all()  # the next in line may fit too
        return ticket

    def release(self, ticket: object) -> None:
        with self.cond:
            self.done_s += self.clock() - self.active.pop(ticket)
            self.requests += 1
            self.cond.notify_all()

    def busy_s(self) -> float:
        """Request-seconds so far: finished requests, and the in-flight ones up to now."""
        with self.cond:
            now = self.clock()
            return self.done_s + sum(now - t for t in self.active.values())

    def in_flight(self) -> int:
        with self.cond:
            return len(self.active)


class Gate:
    """One listening port per base URL of `what` (sharing one `Slots`); `urls` are what the Gym stack is given. A
    request unanswered after `timeout_s` seconds is answered 504, naming `setting` (the config key that sets it)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        slots: int | None,
        timeout_s: float = UPSTREAM_TIMEOUT_S,
        what: str = "policy",
        setting: str | None = None,
    ):
        self.slots = Slots(slots)
        self.what, self.timeout_s = what, timeout_s
        self.servers: list[ThreadingHTTPServer] = []
        self.urls: list[str] = []
        self.threads: list[threading.Thread] = []
        for base in base_urls:
            parts = urlsplit(base)
            server = ThreadingHTTPServer(
                (HOST, 0), handler_for(parts.scheme, parts.netloc, self.slots, timeout_s, what, setting)
            )
            server.daemon_threads = True
            self.servers.append(server)
            self.urls.append(f"http://{HOST}:{server.server_address[1]}{parts.path}")
        for server in self.servers:
            t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
            t.start()
            self.threads.append(t)

    def describe(self) -> str:
        return f"slot gate at {', '.join(self.urls)}: {self.slots.limit or 'unlimited'} request(s) at once"

    def describe_timeout(self) -> str:
        return f"{self.what} behind a gate at {', '.join(self.urls)} answering 504 after {self.timeout_s:g} s"

    def problem(self) -> str | None:
        dead = [u for u, t in zip(self.urls, self.threads) if not t.is_alive()]
        return f"the {self.what}'s gate stopped serving {', '.join(dead)}" if dead else None

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def handler_for(
    scheme: str, netloc: str, slots: Slots, timeout_s: float, what: str, setting: str | None
) -> type[BaseHTTPRequestHandler]:
    local = threading.local()

    def upstream(fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(local, "conn", None)
        if conn is None or fresh:
            drop()
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = local.conn = cls(netloc, timeout=timeout_s)
        return conn

    def drop() -> None:
        """Close this thread's upstream connection: after a failure its state is unknown (a timed-out request's
        answer may still arrive on it), so the next request opens a fresh one."""
        conn = getattr(local, "conn", None)
        local.conn = None
        if conn is not None:
            conn.close()

    def failure(e: BaseException) -> tuple[int, str]:
        if isinstance(e, TimeoutError):
            limit = f" ({setting} = {timeout_s:g})" if setting else ""
            return 504, f"gate: the {what} did not answer within {timeout_s:g} s{limit}"
        return 502, f"gate: {what} unreachable: {type(e).__name__}"

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            ticket = slots.acquire()
            try:
                resp, data = self.ask(body, headers)
            except (OSError, http.client.HTTPException) as e:
                drop()
                slots.release(ticket)  # before answering: the slot is free once the client hears back
                status, message = failure(e)
                kind = "timeout" if status == 504 else "upstream_unreachable"
                data = orjson.dumps({"error": {"message": message, "type": kind, "code": status}})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            except BaseException:
                drop()
                slots.release(ticket)
                raise
            slots.release(ticket)
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP_HEADERS and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def ask(self, body: bytes | None, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, bytes]:
            for attempt in range(2):  # a kept-alive upstream connection the policy closed: once more, afresh
                conn = upstream(fresh=attempt > 0)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    return resp, resp.read()
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    if attempt:
                        raise
            raise AssertionError("unreachable")

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = forward

    return Forward
