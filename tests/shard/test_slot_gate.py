"""The slot gate (shard/slot_gate.py): at most `slots` requests reach the policy at once, the rest wait in arrival
order; requests and responses pass unchanged; the request-seconds are summed. The upstream here is a small HTTP
server whose requests each wait until the test lets them go."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from shardrun.shard import slot_gate


class Upstream:
    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.go: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        up = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                name = json.loads(body)["name"]
                with up.lock:
                    event = up.go.setdefault(name, threading.Event())
                    up.arrived.append(name)
                event.wait(300)
                data = json.dumps({"name": name, "path": self.path, "auth": self.headers.get("Authorization")})
                self.send_response(201)
                self.send_header("X-Upstream", "yes")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def release(self, name: str) -> None:
        with self.lock:
            self.go.setdefault(name, threading.Event()).set()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    for name in list(up.go):
        up.release(name)
    up.server.shutdown()


def wait_until(what: str, check, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def post(url: str, name: str, out: dict) -> None:
    req = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer k"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            out[name] = (resp.status, resp.headers.get("X-Upstream"), json.loads(resp.read()))
    except urllib.error.HTTPError as e:
        out[name] = (e.code, None, e.read())


def test_at_most_slots_requests_reach_the_policy_and_the_rest_wait_in_order(upstream: Upstream) -> None:
    gate = slot_gate.Gate([upstream.url], 2)
    try:
        [url] = gate.urls
        assert url.endswith("/v1") and url != upstream.url
        out: dict = {}
        threads = []
        for i, name in enumerate("abcde"):
            t = threading.Thread(target=post, args=(url, name, out))
            t.start()
            threads.append(t)
            # each in line before the next is sent: arrival order is known
            wait_until(
                f"{name} admitted or queued", lambda i=i: gate.slots.in_flight() + len(gate.slots.queue) == i + 1
            )
        wait_until("two at the policy", lambda: len(upstream.arrived) == 2)
        assert upstream.arrived == ["a", "b"] and len(gate.slots.queue) == 3  # c, d, e wait at the gate
        upstream.release("b")
        wait_until("the first in line admitted", lambda: len(upstream.arrived) == 3)
        assert upstream.arrived == ["a", "b", "c"] and gate.slots.in_flight() == 2
        upstream.release("a")
        wait_until("the next in line admitted", lambda: len(upstream.arrived) == 4)
        assert upstream.arrived == ["a", "b", "c", "d"]
        for name in "cde":
            upstream.release(name)
        for t in threads:
            t.join(300)
        assert upstream.arrived == list("abcde")
        for name in "abcde":  # status, headers and body as the policy sent them; the path and key forwarded
            assert out[name] == (201, "yes", {"name": name, "path": "/v1/chat/completions", "auth": "Bearer k"})
        assert gate.slots.requests == 5 and gate.slots.peak == 2 and gate.slots.busy_s() > 0
        assert gate.problem() is None
    finally:
        gate.stop()


def test_no_limit_without_num_samples_in_parallel_and_502_when_the_policy_is_gone(upstream: Upstream) -> None:
    gate = slot_gate.Gate([upstream.url], None)
    try:
        out: dict = {}
        threads = [threading.Thread(target=post, args=(gate.urls[0], n, out)) for n in "xyz"]
        for t in threads:
            t.start()
        wait_until("all three at the policy", lambda: len(upstream.arrived) == 3)
        for n in "xyz":
            upstream.release(n)
        for t in threads:
            t.join(300)
        assert sorted(out) == ["x", "y", "z"] and all(v[0] == 201 for v in out.values())
        upstream.server.shutdown()
        upstream.server.server_close()
        post(gate.urls[0], "gone", out)
        assert out["gone"][0] == 502 and b"policy unreachable" in out["gone"][2]
        assert gate.slots.in_flight() == 0
    finally:
        gate.stop()


def test_slots_count_busy_seconds_of_finished_and_running_requests() -> None:
    now = [0.0]
    slots = slot_gate.Slots(3, clock=lambda: now[0])
    a = slots.acquire()
    now[0] = 2.0
    b = slots.acquire()
    now[0] = 5.0
    slots.release(a)  # 5 s
    assert slots.busy_s() == 5.0 + 3.0  # and b's 3 s so far
    now[0] = 6.0
    slots.release(b)
    assert slots.busy_s() == 9.0 and slots.requests == 2 and slots.in_flight() == 0


def test_a_request_left_unanswered_past_the_timeout_is_answered_504_and_the_next_one_goes_through(
    upstream: Upstream,
) -> None:
    """A judge's gate (no slot limit, its request_timeout_s): the upstream holds "hung" until the test ends, so the
    gate's own timeout is the only way that request ends. The client's kept-alive connection then carries a second
    request, which the gate sends upstream on a fresh connection and answers."""
    gate = slot_gate.Gate([upstream.url], None, timeout_s=0.5, what="judge j", setting="judges.j.request_timeout_s")
    try:
        parts = gate.urls[0].removeprefix("http://").split("/", 1)
        conn = http.client.HTTPConnection(parts[0], timeout=300)
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"name": "hung"}), headers=headers)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 504, body
        assert body["error"] == {
            "message": "gate: the judge j did not answer within 0.5 s (judges.j.request_timeout_s = 0.5)",
            "type": "timeout",
            "code": 504,
        }
        assert upstream.arrived == ["hung"] and gate.slots.in_flight() == 0
        upstream.release("next")
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"name": "next"}), headers=headers)
        resp = conn.getresponse()
        assert resp.status == 201 and json.loads(resp.read())["name"] == "next"
        conn.close()
        assert gate.describe_timeout().startswith("judge j behind a gate at http://127.0.0.1:")
    finally:
        gate.stop()
