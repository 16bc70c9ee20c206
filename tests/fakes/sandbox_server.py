"""A NeMo-Skills-protocol code sandbox for tests: a stand-in at a seam shardrun does not own.

The real sandbox is NeMo-Skills' (nemo_skills/code_execution: nginx over uWSGI workers in the
nemo-skills-sandbox image); NeMo Gym's sandbox clients (ns_tools, math_formal_lean, competitive_coding_challenges)
speak its protocol, which this server answers:

- `GET /health` -> 200 `{"status": "healthy"}`.
- `POST /execute` with JSON `{generated_code, language, timeout, std_input?, max_output_characters?}` ->
  `{"process_status": "completed" | "error" | "timeout", "stdout", "stderr"}`. The code really runs, in a
  subprocess killed at `timeout` seconds: `python`/`ipython`/`python3` with this interpreter, `shell` with bash.
  `lean4` runs the command given with --lean4-command (the code on its stdin): there is no Lean here, so a test
  that drives math_formal_lean names a checker of its own and says so.

Every request is appended to --request-log (one JSON line: language, the code's sha256, process_status) so a test
can count what reached the sandbox; --pid-file gets this process's pid (a test kills it mid-run);
--delay-s makes each /execute take at least that long (a test keeps collection going while it kills).

Run: python tests/fakes/sandbox_server.py --port PORT [--request-log F] [--pid-file F] [--delay-s S]
     [--lean4-command CMD]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PYTHONS = ("python", "python3", "ipython")
MAX_OUTPUT = 1000


def run(cmd: list[str], stdin: str, timeout: float) -> dict:
    try:
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"process_status": "timeout", "stdout": "", "stderr": "Timed out\n"}
    status = "completed" if done.returncode == 0 else "error"
    return {"process_status": status, "stdout": done.stdout, "stderr": done.stderr}


def execute(body: dict, lean4_command: str | None) -> dict:
    code = str(body.get("generated_code", ""))
    language = str(body.get("language", "ipython"))
    timeout = float(body.get("timeout", 10.0))
    limit = int(body.get("max_output_characters", MAX_OUTPUT) or MAX_OUTPUT)
    if language in PYTHONS:
        out = run([sys.executable, "-c", code], str(body.get("std_input", "")), timeout)
    elif language == "shell":
        out = run(["bash", "-c", code], str(body.get("std_input", "")), timeout)
    elif language == "lean4" and lean4_command:
        out = run(shlex.split(lean4_command), code, timeout)
    else:
        out = {"process_status": "error", "stdout": "", "stderr": f"unsupported language {language!r}\n"}
    out["stdout"], out["stderr"] = out["stdout"][:limit], out["stderr"][:limit]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--request-log")
    ap.add_argument("--pid-file")
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--lean4-command")
    args = ap.parse_args()
    log_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            return None

        def send_json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_json(200, {"status": "healthy"})
            else:
                self.send_json(404, {"detail": "not found"})

        def do_POST(self) -> None:
            if self.path != "/execute":
                self.send_json(404, {"detail": "not found"})
                return
            t0 = time.monotonic()
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except ValueError:
                self.send_json(400, {"detail": "body is not JSON"})
                return
            out = execute(body, args.lean4_command)
            left = args.delay_s - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
            if args.request_log:
                line = {
                    "language": body.get("language"),
                    "code_sha256": hashlib.sha256(str(body.get("generated_code", "")).encode()).hexdigest(),
                    "process_status": out["process_status"],
                    "pid": os.getpid(),
                }
                with log_lock, open(args.request_log, "a") as f:
                    f.write(json.dumps(line) + "\n")
            self.send_json(200, out)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    if args.pid_file:
        tmp = args.pid_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, args.pid_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
