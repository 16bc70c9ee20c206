"""Copy each shard's rows into the merged row files while the merge goes on (when the shards allow it).

When every shard's planned identities come after those of the shards before it (a contiguous plan over tasks
in index order, the usual case), the merged files are the shards' rows shard after shard: the planned rows as
they are in each shard's materialized file, and the kept rollout rows of the shard sorted by identity. Then
each shard is handed to a copy process as soon as its scan arrives, while its bytes are still in the page
cache: the merge reads every shard file once from disk instead of twice, and the writing (mostly kernel and
disk time) overlaps the reading and then the profile. Otherwise (round-robin slicing, task indices out of
order) `end_of_shards` says so, the copy process stops, the partial output is cut back to nothing, and the
merge copies from the sorted table as before.

The copier is a forked process, not a thread, so that the merge may still fork its worker pools while it runs.
It is forked before anything else starts (no threads yet), dies with the merge (PR_SET_PDEATHSIG), takes its
jobs through a pipe (a line each, naming a scratch .npy file with the rows' offsets and lengths), writes
the merge's own temp files (inherited descriptors; O_DIRECT, see directio) and fsyncs them; its result comes back on a second
pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
import traceback
from pathlib import Path
from typing import IO, Callable

import numpy as np
import orjson

from shardrun.merge import shardread
from shardrun.merge.directio import DirectWriter
from shardrun.core.errors import RunDirError
from shardrun.merge.rowcopy import ByteSources, copy_rows
from shardrun.merge.shardread import ShardScan

PR_SET_PDEATHSIG = 1


class ShardStreamer:
    """Takes shard scans in shard order (`add`) and has them copied while they stay in identity order."""

    def __init__(self, materialized: IO[bytes], rollouts: IO[bytes], scratch: Callable[[str], Path]):
        self.outputs = {"materialized": materialized, "rollouts": rollouts}
        self.scratch = scratch
        self.in_order = True
        self.seconds = 0.0
        self._last: tuple[int, int] | None = None
        self._jobs = 0
        for f in self.outputs.values():
            f.flush()  # nothing buffered here while the child writes through the same descriptors
        jobs_r, self._jobs_w = os.pipe()
        self._result_r, result_w = os.pipe()
        self._pid = os.fork()
        if self._pid == 0:  # the copy process
            os.close(self._jobs_w)
            os.close(self._result_r)
            _child(jobs_r, result_w, {k: f.fileno() for k, f in self.outputs.items()})
        os.close(jobs_r)
        os.close(result_w)

    def __enter__(self) -> "ShardStreamer":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self.abandon()  # the outputs are thrown away: stop copying into them at once

    def add(self, scan: ShardScan) -> None:
        """Queue the shard's rows, or stop streaming for good if they are not after the previous shards'."""
        if not self.in_order:
            return
        planned = scan.planned
        task, rollout = planned.task, planned.rollout
        if not _ascending(task, rollout, self._last):
            self.in_order = False
            return
        if len(task):
            self._last = (int(task[-1]), int(rollout[-1]))
        self._send("materialized", planned.path, planned.offset, planned.length, None)
        r, res = scan.rollouts, scan.resolution
        order = np.lexsort((res.rollout, r.task[res.keep]))
        rows = res.keep[order]
        changed = res.rollout[order] != r.rollout[rows]
        self._send(
            "rollouts",
            r.source,
            r.offset[rows],
            r.length[rows],
            np.where(changed, res.rollout[order], -1) if changed.any() else None,
        )

    def end_of_shards(self) -> bool:
        """No more shards. True: the copies go on (`wait` for them); False: the shards were out of identity
        order, nothing was copied (the merged row files are empty) and the caller copies them itself."""
        if self.in_order:
            self._message({"end": True})
            return True
        self._message({"abort": True})
        self._wait()
        for f in self.outputs.values():
            f.seek(0)
            f.truncate()
        return False

    def wait(self) -> None:
        """Wait for the copies to be written and fsynced (if the shards were streamed); RunDirError if they
        failed."""
        self._wait()

    def abandon(self) -> None:
        """Stop the copy process at once (an error elsewhere: the outputs are thrown away)."""
        if self._pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._pid, 0)
            self._pid = 0
            self._close()

    def _send(
        self, out: str, source: Path, offset: np.ndarray, length: np.ndarray, rewrite_to: np.ndarray | None
    ) -> None:
        job = self.scratch(f"copy-{self._jobs:06d}.npy")
        self._jobs += 1
        rows = np.stack([offset, length, rewrite_to if rewrite_to is not None else np.full(len(offset), -1)])
        np.save(job, rows.astype(np.int64))
        self._message({"out": out, "source": str(source), "job": str(job)})

    def _message(self, msg: dict) -> None:
        try:
            os.write(self._jobs_w, orjson.dumps(msg) + b"\n")
        except BrokenPipeError:  # the copy process is gone: _wait says why
            pass

    def _wait(self) -> None:
        if not self._pid:
            return
        os.close(self._jobs_w)
        self._jobs_w = -1
        with os.fdopen(self._result_r, "rb") as f:
            self._result_r = -1
            data = f.read()
        _, status = os.waitpid(self._pid, 0)
        self._pid = 0
        result = orjson.loads(data) if data else {"ok": False, "error": f"the copy process ended ({status})"}
        self.seconds = result.get("seconds", 0.0)
        if not result["ok"]:
            raise RunDirError(f"copying the shards' rows into the merged files failed: {result['error']}")

    def _close(self) -> None:
        for fd in (self._jobs_w, self._result_r):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._jobs_w = self._result_r = -1


def _child(jobs_r: int, result_w: int, fds: dict[str, int]) -> None:
    """The copy process's whole life: copy jobs until told to end (then fsync) or abort; never returns."""
    code, result = 0, {"ok": True}
    tick = time.monotonic()
    try:
        parent = os.getppid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)
        outs = {k: DirectWriter(fd) for k, fd in fds.items()}
        ended = False
        with os.fdopen(jobs_r, "rb") as jobs:
            for line in jobs:
                msg = orjson.loads(line)
                if "abort" in msg:
                    ended = True
                    break
                if "end" in msg:
                    for k, f in outs.items():
                        f.close()
                        os.fsync(fds[k])
                    ended = True
                    break
                _copy(outs[msg["out"]], Path(msg["source"]), Path(msg["job"]))
        if not ended:
            raise RunDirError("the merge stopped sending shards before their end")
        result["seconds"] = time.monotonic() - tick
    except BaseException as e:
        code, result = 1, {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    try:
        os.write(result_w, orjson.dumps(result))
    finally:
        os._exit(code)


def _copy(out: IO[bytes], source: Path, job: Path) -> None:
    offset, length, to = np.load(job)
    job.unlink()
    breaks = to >= 0
    rewrite = None
    if breaks.any():

        def rewrite(position: int, line: bytes) -> bytes:
            return shardread.with_rollout(line, int(to[position]))

    with ByteSources([source]) as src:
        copy_rows(out, src, np.zeros(len(offset), np.int32), offset, length, rewrite, breaks if rewrite else None)


def _ascending(task: np.ndarray, rollout: np.ndarray, after: tuple[int, int] | None) -> bool:
    """Are the (task, rollout) pairs strictly ascending, and all after `after`?"""
    if not len(task):
        return True
    if after is not None and (int(task[0]), int(rollout[0])) <= after:
        return False
    dt = np.diff(task)
    return bool(((dt > 0) | ((dt == 0) & (np.diff(rollout) > 0))).all())
