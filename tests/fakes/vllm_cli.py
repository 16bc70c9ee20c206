"""A stand-in that takes vLLM's OpenAI server command line, for the fast tests of shardrun/shard/vllm.py's start-up,
readiness and stop logic (the real engine is exercised by the tests marked `vllm`).

    python tests/fakes/vllm_cli.py --model M --served-model-name NAME --host H --port P [any other vLLM flags]

FAKE_VLLM_MODE (environment) picks the behaviour:
  ok       serve /health 200 and /v1/models listing NAME (after FAKE_VLLM_DELAY seconds with the port closed)
  exit     print a line and exit with code 3 before opening the port
  dead     /health answers 503 (what vLLM does when its engine died)
  noname   /health 200 but /v1/models lists another model
It also writes its environment's TMPDIR, VLLM_CACHE_ROOT, VLLM_RPC_BASE_PATH and whether VLLM_API_KEY is set to
stdout (the log), and with VLLM_API_KEY set it answers /v1/models 401 without the matching bearer token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    for k in ("TMPDIR", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH"):
        print(f"fake-vllm env {k}={os.environ.get(k)}", flush=True)
    print(f"fake-vllm api key set: {bool(os.environ.get('VLLM_API_KEY'))}", flush=True)
    if mode == "exit":
        print("fake-vllm: engine failed to start (simulated)", flush=True)
        return 3
    time.sleep(float(os.environ.get("FAKE_VLLM_DELAY", "0")))
    key = os.environ.get("VLLM_API_KEY")
    listed = args.served_model_name if mode != "noname" else "some-other-model"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(503 if mode == "dead" else 200, b"")
            elif self.path == "/v1/models":
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    self._send(401, b'{"error": "unauthorized"}')
                else:
                    self._send(200, json.dumps({"object": "list", "data": [{"id": listed}]}).encode())
            else:
                self._send(404, b"")

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake-vllm serving {listed} on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
