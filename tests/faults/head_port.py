"""A Gym venv whose first stack start finds its head server's port taken: the race of issue 20 (another process,
in CI one of Ray's, binds the port shardrun chose before Gym's head server does), made deterministic.

`port_taken_venv(real, tmp)` builds a venv in `tmp` that is the real one (pyvenv.cfg, lib and every bin entry are
links to it) but for the stack's entry point (`gym` for 0.7, `ng_run` for 0.4): a script that, on the first start
of a Gym stack in the test (an atomic mkdir decides which), starts a process that serves HTTP on the head server's
port (`+head_server.port=N` on the command line) and waits until it listens, then execs the real entry point.
Gym's own head server then fails to bind it ([Errno 98] ... address already in use), printed by Gym as it prints
it. The port holder lives in ng_run's process group, so stopping that stack stops it too. Nothing of shardrun is
faked.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from shardrun.core.gym_adapter import for_venv

# answers HTTP on the port (501 to anything), as the head server of another shard's stack on the node would:
# ng_run's own wait for its head server then passes, its servers start, and it exits with "Head server finished
# unexpectedly!" many lines after the bind error, as in issue 20
HOLDER = """\
import os, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
class Quiet(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Quiet)  # bound and listening
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(sys.argv[1])
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
threading.Timer(900, server.shutdown).start()
server.serve_forever()
"""


@dataclass(frozen=True)
class PortTaken:
    venv: Path  # point gym.venv (or $SHARDRUN_GYM_VENV) here
    mark: Path  # exists once a start was given a taken port; `held` in it names the port

    @property
    def port(self) -> int | None:
        held = self.mark / "held"
        return int(held.read_text()) if held.exists() else None


def port_taken_venv(real: Path, tmp: Path) -> PortTaken:
    real = Path(real).resolve()
    venv, mark = tmp / "gym-venv-port-taken", tmp / "head-port-taken"
    (venv / "bin").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry)
    entry_point = Path(for_venv(real).stack_command(real)[0]).name
    for entry in (real / "bin").iterdir():
        if entry.name != entry_point:
            (venv / "bin" / entry.name).symlink_to(entry)
    holder = tmp / "hold_port.py"
    holder.write_text(HOLDER)
    q = shlex.quote
    script = venv / "bin" / entry_point
    script.write_text(
        f"""#!/bin/bash
# tests/faults/head_port.py: the first Gym stack started in this test finds its head server's port taken
port=""
for a in "$@"; do case "$a" in +head_server.port=*) port="${{a#*=}}" ;; esac; done
if [ -n "$port" ] && mkdir {q(str(mark))} 2>/dev/null; then
  {q(sys.executable)} {q(str(holder))} "$port" {q(str(mark / "held"))} &
  for _ in $(seq 1 1200); do [ -e {q(str(mark / "held"))} ] && break; sleep 0.1; done
fi
exec {q(str(real / "bin" / entry_point))} "$@"
"""
    )
    script.chmod(0o755)
    return PortTaken(venv, mark)
