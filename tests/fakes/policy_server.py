"""Stand-in OpenAI-compatible policy server for tests (a fake at the one seam shardrun does not own: the model).

Run it as a subprocess:  python tests/fakes/policy_server.py --port 21001 [--model fake-model]
    [--correct-share 0.5] [--shares FILE] [--api-key KEY] [--delay SECONDS] [--request-log FILE] [--fault KIND:COND[,COND...]]
    [--answer-log FILE] [--tail-share P --tail-delay SECONDS] ...

It also stands in for a self-hosted vLLM (`policy.vllm.command: [python, tests/fakes/policy_server.py, ...]`): it
takes vLLM's `--served-model-name` and `--host`, ignores the flags it does not know, reads the key from VLLM_API_KEY,
and with `--startup-delay S` opens its port only after S seconds, as vLLM does once its model is loaded.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions (what NeMo Gym's vllm_model calls),
POST /v1/responses (what its openai_model calls: the same answers in the Responses API's shape), and
POST /_fault (JSON {"faults": ["KIND:COND", ...], "delay": SECONDS, "die_code": N}) to change a running server's
faults.

Answers are a pure function of the conversation and the request's `seed`: "What is a op b?" gets
`\\boxed{a op b}` (correct) or `\\boxed{a op b + 1}` for a deterministic share of (prompt, seed) pairs; other
prompts get a boxed hash. `--shares FILE` (a JSON object {"What is a op b?": share}) gives a question its own
share: a task's known pass rate (0: never solved, 1: always). A first turn that offers tools gets one call of the first tool (required string
arguments filled with "San Francisco"); once a tool result is in the conversation the answer is text.

Faults, for requests that match every condition (seed=N, match=SUBSTRING, nth=N: the N-th chat request, 1-based;
after=N: every request after the N-th; times=N: only the first N requests that meet the fault's other conditions,
so a fault can target "the first request for this prompt and seed" whatever order requests arrive in):  400 | 500 | garbage (200 with a non-JSON body) | hang (never answers) |
hold (answers normally once the faults are next changed through /_fault) | die (the whole server exits at once).

As a judge (`--judge`, standing in for a judge model: docs/judges.md), every answer is a verdict in the format
NeMo Gym's math_with_judge and equivalence_llm_judge prompts ask for: "[[A=B]]" when the last user message
contains one of the `--judge-equal SUBSTRING`s, "[[A!=B]]" otherwise, so a test decides which tasks the judge
passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ARITH = re.compile(r"What is (-?\d+) ([-+*]) (-?\d+)\?")
FAULT_KINDS = ("400", "500", "garbage", "hang", "hold", "die")


def parse_fault(spec: str) -> tuple[str, dict[str, str]]:
    kind, _, conds = spec.partition(":")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r} (known: {', '.join(FAULT_KINDS)})")
    cond = {}
    for part in filter(None, conds.split(",")):
        key, _, value = part.partition("=")
        if key not in ("seed", "match", "nth", "after", "times"):
            raise ValueError(f"unknown fault condition {key!r}")
        cond[key] = value
    return kind, cond


def prompt_text(messages: list[dict[str, Any]]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    content = users[-1] if users else ""
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def entry_prompt(body: dict[str, Any]) -> str:
    return prompt_text(body.get("messages") or [])


def is_correct(prompt: str, seed: Any, share: float) -> bool:
    h = hashlib.sha256(f"{prompt}|{seed}".encode()).hexdigest()
    return int(h[:8], 16) / 2**32 < share


def answer_text(prompt: str, seed: Any, share: float, shares: dict[str, float] | None = None) -> str:
    m = ARITH.search(prompt)
    if m and shares:
        share = shares.get(m.group(0), share)
    if not m:
        return (
            "The answer is \\boxed{" + str(int(hashlib.sha256(f"{prompt}|{seed}".encode()).hexdigest()[:4], 16)) + "}."
        )
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if not is_correct(prompt, seed, share):
        value += 1
    return "\\boxed{" + str(value) + "}"


def verdict(prompt: str, equal: list[str]) -> str:
    """A judge's answer: equivalent when the prompt holds one of the `equal` substrings, different otherwise."""
    if any(sub in prompt for sub in equal):
        return "The answers agree. My final verdict is equivalent [[A=B]]"
    return "The answers disagree. My final verdict is different [[A!=B]]"


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses API request's input as chat messages (a string is one user message; content parts keep their
    text)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for item in items or []:
        if isinstance(item, dict) and item.get("role"):
            content = item.get("content")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            out.append({"role": item["role"], "content": content})
    return out


def response_object(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion's text answer in the Responses API's shape (what openai_model validates)."""
    text = chat["choices"][0]["message"].get("content") or ""
    usage = chat["usage"]
    return {
        "id": "resp_" + chat["id"].removeprefix("chatcmpl-"),
        "object": "response",
        "created_at": chat["created"],
        "model": model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def tool_call(tool: dict[str, Any], seed: Any) -> dict[str, Any]:
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    args = {
        p: "San Francisco"
        for p in params.get("required", [])
        if (params.get("properties", {}).get(p) or {}).get("type", "string") == "string"
    }
    return {
        "id": f"call_{seed}_{fn.get('name')}",
        "type": "function",
        "function": {"name": fn.get("name"), "arguments": json.dumps(args)},
    }


def completion(
    body: dict[str, Any],
    model: str,
    share: float,
    shares: dict[str, float] | None = None,
    judge_equal: list[str] | None = None,
) -> dict[str, Any]:
    messages = body.get("messages") or []
    seed = body.get("seed")
    prompt = prompt_text(messages)
    tools = body.get("tools") or []
    if judge_equal is not None:  # a judge: a verdict, whatever is asked
        text = verdict(prompt, judge_equal)
        message = {"role": "assistant", "content": text}
        finish = "stop"
    elif tools and not any(m.get("role") == "tool" for m in messages):
        message = {"role": "assistant", "content": None, "tool_calls": [tool_call(tools[0], seed)]}
        finish, text = "tool_calls", json.dumps(message["tool_calls"])
    else:
        text = answer_text(prompt, seed, share, shares)
        message = {"role": "assistant", "content": text}
        finish = "stop"
    prompt_tokens = max(1, sum(len(str(m.get("content") or "")) for m in messages) // 4)
    completion_tokens = max(1, len(text) // 4)
    digest = hashlib.sha256(json.dumps([messages, seed], sort_keys=True).encode()).hexdigest()[:24]
    return {
        "id": f"chatcmpl-{digest}",
        "object": "chat.completion",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class State:
    def __init__(self, args: argparse.Namespace):
        self.model = args.model
        self.share = args.correct_share
        self.shares = json.loads(open(args.shares).read()) if args.shares else None
        self.api_key = args.api_key
        self.set_faults(args.fault)
        self.log_path = args.request_log
        self.delay = args.delay
        self.die_code = args.die_code
        self.tail_share, self.tail_delay = args.tail_share, args.tail_delay
        self.answer_log = args.answer_log
        self.judge_equal: list[str] | None = args.judge_equal if args.judge else None
        self.count = 0
        self.lock = threading.Lock()

    def set_faults(self, specs: list[str]) -> None:
        self.generation = getattr(self, "generation", 0) + 1  # the held requests (of an earlier one) go on
        self.faults = [parse_fault(f) for f in specs]
        self.matched = [0] * len(self.faults)  # per fault: requests that met its conditions (for `times`)

    def next_request(self) -> int:
        with self.lock:
            self.count += 1
            return self.count

    def fault_for(self, n: int, body: dict[str, Any]) -> str | None:
        prompt = prompt_text(body.get("messages") or [])
        with self.lock:
            for i, (kind, cond) in enumerate(self.faults):
                if "seed" in cond and str(body.get("seed")) != cond["seed"]:
                    continue
                if "match" in cond and cond["match"] not in prompt:
                    continue
                if "nth" in cond and n != int(cond["nth"]):
                    continue
                if "after" in cond and n <= int(cond["after"]):
                    continue
                self.matched[i] += 1
                if "times" in cond and self.matched[i] > int(cond["times"]):
                    continue
                return kind
        return None

    def in_tail(self, body: dict[str, Any]) -> bool:
        """A deterministic `tail_share` of (prompt, seed) pairs takes `tail_delay` seconds more (a heavy tail)."""
        if not self.tail_share:
            return False
        h = hashlib.sha256(f"tail|{entry_prompt(body)}|{body.get('seed')}".encode()).hexdigest()
        return int(h[:8], 16) / 2**32 < self.tail_share

    def answered(self, entry: dict[str, Any]) -> None:
        if self.answer_log:
            with self.lock, open(self.answer_log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def log(self, entry: dict[str, Any]) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, payload: Any, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self) -> bool:
        key = self.state.api_key
        return key is None or self.headers.get("Authorization") == f"Bearer {key}"

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models" and not self.authorized():
            self._send(401, {"error": {"message": "bad api key", "type": "authentication_error"}})
        elif self.path == "/v1/models":
            self._send(
                200,
                {"object": "list", "data": [{"id": self.state.model, "object": "model", "owned_by": "shardrun-tests"}]},
            )
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/_fault":
            self.state.set_faults(body.get("faults", []))
            self.state.delay = float(body.get("delay", self.state.delay))
            self.state.die_code = int(body.get("die_code", self.state.die_code))
            self._send(200, {"faults": body.get("faults", []), "delay": self.state.delay})
            return
        if self.path not in ("/v1/chat/completions", "/v1/responses"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        responses = self.path == "/v1/responses"
        if responses:  # the same answers; the conditions and the log read the input as chat messages
            body = {**body, "messages": responses_messages(body)}
        st = self.state
        n = st.next_request()
        auth_ok = self.authorized()
        generation = st.generation  # before the faults are read: a change after it releases a hold
        fault = st.fault_for(n, body)
        st.log(
            {
                "n": n,
                "seed": body.get("seed"),
                "prompt": prompt_text(body.get("messages") or []),
                "model": body.get("model"),
                "tools": bool(body.get("tools")),
                "auth_ok": auth_ok,
                "served_by": f"{socket.gethostname()}:{self.server.server_address[1]}",
                "route": self.path,
                "fault": fault,
                "t": time.time(),
            }
        )
        if not auth_ok:
            self._send(401, {"error": {"message": "bad api key", "type": "authentication_error"}})
        elif fault == "die":
            os._exit(self.state.die_code)
        elif fault == "hang":
            while True:
                time.sleep(3600)
        elif fault in ("400", "500"):
            self._send(
                int(fault),
                {"error": {"message": f"injected {fault}", "type": "invalid_request_error", "code": int(fault)}},
            )
        elif fault == "garbage":
            self._send(200, None, raw=b"<html>not json")
        else:
            t0 = time.time()
            while fault == "hold" and st.generation == generation:
                time.sleep(0.05)
            delay = st.delay + (st.tail_delay if st.in_tail(body) else 0.0)
            if delay:
                time.sleep(delay)
            # t1 is stamped before the answer is sent: once it is sent the client may release its slot and open the
            # next request, so a t1 taken after the send could overlap that request's t0 on a loaded machine
            t1 = time.time()
            chat = completion(body, st.model, st.share, st.shares, st.judge_equal)
            self._send(200, response_object(chat, st.model) if responses else chat)
            st.answered({"n": n, "seed": body.get("seed"), "prompt": entry_prompt(body), "t0": t0, "t1": t1})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--correct-share", type=float, default=0.5)
    p.add_argument("--shares", default=None, help='JSON file {"What is a op b?": share}: per-question shares')
    p.add_argument("--api-key", default=None, help="require this Bearer key (401 otherwise)")
    p.add_argument("--delay", type=float, default=0.0, help="seconds to wait before each (good) answer")
    p.add_argument("--request-log", default=None, help="append one JSON line per chat request")
    p.add_argument(
        "--answer-log", default=None, help="append one JSON line per answered request (its start t0 and end t1)"
    )
    p.add_argument("--tail-share", type=float, default=0.0, help="share of (prompt, seed) pairs that take longer")
    p.add_argument("--tail-delay", type=float, default=0.0, help="seconds more for those (a heavy-tailed latency)")
    p.add_argument("--fault", action="append", default=[], help="KIND:COND[,COND...] (see module doc)")
    p.add_argument("--judge", action="store_true", help="answer as a judge: every answer is a verdict")
    p.add_argument("--judge-equal", action="append", default=[], help="with --judge: [[A=B]] for a prompt holding this")
    p.add_argument(
        "--die-code", type=int, default=17, help="the die fault's exit status (vLLM exits 0 when its engine dies)"
    )
    p.add_argument("--served-model-name", default=None, help="as vLLM: the model name clients use (wins over --model)")
    p.add_argument(
        "--startup-delay", type=float, default=0.0, help="seconds before the port opens (a model loading, as vLLM)"
    )
    # as policy.vllm.command the stand-in gets vLLM's command line: the flags it does not know are ignored
    args, _unknown = p.parse_known_args(argv)
    args.model = args.served_model_name or args.model
    args.api_key = args.api_key or os.environ.get("VLLM_API_KEY")
    time.sleep(args.startup_delay)
    Handler.state = State(args)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"fake policy server on http://{args.host}:{args.port}/v1 model={args.model}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
