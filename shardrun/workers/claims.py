"""Claims: which warm worker collects which shard (`shards/NNNNN/.claim`), safe on NFS and Lustre.

A claim is one file with two names: `.claim` (what everyone reads: JSON with the worker id, job id, host, pid,
claimed at and a random token) and its *handle* `.claim.<token>` (a hard link to the same inode). The rules:

- **Claim** a free shard: write the record to the handle (O_EXCL: the token is new), then `link(handle, .claim)`.
  `link` fails with EEXIST when `.claim` exists, on the NFS server as on a local disk, so exactly one worker wins.
- **Heartbeat**: the holder sets the handle's mtime to its clock every `heartbeat_s` (`utime`; it fails once the
  handle is gone). A claim whose mtime is older than `lease_s` is **stale**. The holder itself counts its claim as
  lost once its own last renewal is older than `lease_s - margin` (it stops working on the shard before anyone
  may take it over).
- **Release** or **take over**: whoever renames the claim's handle away first owns the right to remove `.claim`.
  The holder releases by renaming its handle (then unlinks `.claim`); another worker takes over a stale claim by
  renaming that claim's handle to a name of its own, re-checking on the renamed inode that it is still stale (it
  gives the handle back otherwise), unlinking `.claim` and claiming as above. A handle can be renamed away once,
  so a claim is released or taken over by exactly one worker, and a new `.claim` is created by exactly one.

No step needs an atomic "rename if unchanged": the only atomic operations relied on are O_EXCL create, `link`
(EEXIST) and `rename` (ENOENT once the source is gone), which NFSv3/v4 perform on the server and Lustre on its
metadata server. A reply lost and retransmitted over NFS can report EEXIST/ENOENT for an operation that did
succeed, so every such error is checked against the inode (`st_ino`) actually found. Staleness is read from an
fstat of a freshly opened `.claim` (close-to-open consistency revalidates the attributes) and compares the
holder's clock (the mtime it set) with the reader's: node clocks must agree to well within the lease (NTP).

`ClaimBook(run_dir, holder, lease_s)` is the one API; `clock` is injectable for tests. docs/workers.md has the
rules for users.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from shardrun.rundir import records, store

HANDLE_SEP = "."
TAKEN = ".taken-"
RELEASED = ".released"


@dataclass(frozen=True)
class Holder:
    """Who claims: written into every claim this worker makes."""

    worker_id: str
    job_id: str | None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True)
class ClaimInfo:
    """A claim as another process reads it."""

    index: int
    worker_id: str
    job_id: str | None
    host: str
    pid: int
    claimed_at: float
    token: str
    renewed_at: float  # the claim file's mtime: its holder's last heartbeat
    ino: int

    def age(self, now: float) -> float:
        return now - self.renewed_at

    def stale(self, now: float, lease_s: float) -> bool:
        return self.age(now) > lease_s

    def to_json(self) -> dict:
        return {
            "worker_id": self.worker_id,
            "job_id": self.job_id,
            "host": self.host,
            "pid": self.pid,
            "claimed_at": self.claimed_at,
            "renewed_at": self.renewed_at,
        }


@dataclass
class Claim:
    """A claim this process holds."""

    index: int
    token: str
    ino: int
    claimed_at: float
    renewed_at: float
    took_over: ClaimInfo | None = None  # the stale claim this one replaced


def handle_path(run_dir: Path, index: int, token: str) -> Path:
    return store.claim_path(run_dir, index).with_name(store.CLAIM + HANDLE_SEP + token)


def new_token() -> str:
    return secrets.token_hex(8)


class ClaimBook:
    """Claims on the shards of one run directory, made as `holder`."""

    def __init__(
        self,
        run_dir: Path,
        holder: Holder,
        lease_s: float,
        *,
        margin_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self.run_dir = Path(run_dir)
        self.holder = holder
        self.lease_s = float(lease_s)
        self.margin_s = self.lease_s / 6 if margin_s is None else float(margin_s)
        self.clock = clock

    # ------------------------------------------------------------ reading

    def read(self, index: int) -> ClaimInfo | None:
        return read(self.run_dir, index)

    def stale(self, info: ClaimInfo) -> bool:
        return info.stale(self.clock(), self.lease_s)

    # ------------------------------------------------------------ claiming

    def try_claim(self, index: int) -> Claim | None:
        """Claim shard `index`: a free one at once, a stale one by taking it over; None when another worker holds
        it (or won the race for it)."""
        info = self.read(index)
        if info is None:
            return self.create(index)
        if not self.stale(info):
            return None
        return self.take_over(info)

    def create(self, index: int, took_over: ClaimInfo | None = None) -> Claim | None:
        """Exclusive create: the record goes to a new handle, then link(handle, .claim) decides."""
        token = new_token()
        handle = handle_path(self.run_dir, index, token)
        now = self.clock()
        record = records.ClaimRecord(
            worker_id=self.holder.worker_id,
            job_id=self.holder.job_id,
            host=self.holder.host,
            pid=self.holder.pid,
            claimed_at=now,
            token=token,
        )
        fd = os.open(handle, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, orjson.dumps(record.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS) + b"\n")
            os.fsync(fd)
            os.utime(fd, (now, now))
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        target = store.claim_path(self.run_dir, index)
        try:
            os.link(handle, target)
        except FileExistsError:
            if inode(target) != ino:  # a retransmitted link can report EEXIST for its own success
                unlink_quietly(handle)
                return None
        except BaseException:
            if inode(target) != ino:
                unlink_quietly(handle)
            raise
        with contextlib.suppress(OSError):
            store.fsync_dir(target.parent)
        return Claim(index, token, ino, now, now, took_over)

    def take_over(self, info: ClaimInfo) -> Claim | None:
        """Take over a stale claim: rename its handle away (one worker can), re-check it on the renamed inode,
        remove `.claim`, create our own. None when another worker got there first or the claim was renewed."""
        judged = self.clock()
        handle = handle_path(self.run_dir, info.index, info.token)
        target = store.claim_path(self.run_dir, info.index)
        if not handle.exists() and not self.restore_handle(info, handle, target):
            return None
        taken = handle.with_name(handle.name + TAKEN + new_token())
        if not rename_once(handle, taken):
            return None  # released by its holder, or taken over by another worker
        st = stat_or_none(taken)
        now = self.clock()
        if st is None or st.st_ino != info.ino or now - st.st_mtime <= self.lease_s or now - judged > self.margin_s:
            # not the claim we judged stale, renewed since, or we stalled: leave it as it was
            if st is not None:
                rename_once(taken, handle)
            return None
        if inode(target) == info.ino:
            unlink_quietly(target)
        unlink_quietly(taken)
        return self.create(info.index, took_over=info)

    def restore_handle(self, info: ClaimInfo, handle: Path, target: Path) -> bool:
        """A `.claim` that has no other name left (its holder or a taker died after removing its renamed handle,
        or `sweep` removed that): give it its handle back (link; one process can), so the usual race decides."""
        st = stat_or_none(target)
        if st is None or st.st_ino != info.ino or st.st_nlink != 1:
            return False  # gone, replaced, or a release / take-over of it is under way (it holds another name)
        try:
            os.link(target, handle)
        except FileExistsError:
            return True  # someone restored it first
        except FileNotFoundError:
            return False
        if inode(handle) != info.ino:  # `.claim` was replaced meanwhile: that one is not ours to touch
            unlink_quietly(handle)
            return False
        return True

    # ------------------------------------------------------------ holding

    def lease_left(self, claim: Claim) -> float:
        return self.lease_s - self.margin_s - (self.clock() - claim.renewed_at)

    def held(self, claim: Claim) -> bool:
        """Still ours: not lapsed by our own clock, and its handle is still there (not taken over)."""
        return self.lease_left(claim) > 0 and inode(handle_path(self.run_dir, claim.index, claim.token)) == claim.ino

    def renew(self, claim: Claim) -> bool:
        """The heartbeat; False when the claim is lost (lapsed: never renewed back to life; or taken over)."""
        if self.lease_left(claim) <= 0:
            return False
        now = self.clock()
        handle = handle_path(self.run_dir, claim.index, claim.token)
        try:
            os.utime(handle, (now, now))
        except FileNotFoundError:
            return False
        if inode(handle) != claim.ino:
            return False
        claim.renewed_at = now
        return True

    def release(self, claim: Claim) -> bool:
        """Give the claim up; False when it is no longer ours (lapsed: it is left to go stale; or taken over)."""
        if self.lease_left(claim) <= 0:
            return False
        handle = handle_path(self.run_dir, claim.index, claim.token)
        gone = handle.with_name(handle.name + RELEASED)
        if not rename_once(handle, gone):
            return False
        target = store.claim_path(self.run_dir, claim.index)
        if inode(target) == claim.ino:
            unlink_quietly(target)
        unlink_quietly(gone)
        return True

    def sweep(self, index: int) -> int:
        """Remove what crashed claimers left: names of claim files older than two leases (handles never linked,
        renamed-away handles); the current `.claim` keeps its own. Returns how many names were removed."""
        shard = store.shard_dir(self.run_dir, index)
        current = inode(store.claim_path(self.run_dir, index))
        now = self.clock()
        n = 0
        for p in shard.glob(store.CLAIM + HANDLE_SEP + "*"):
            st = stat_or_none(p)
            if st is None or now - st.st_mtime <= 2 * self.lease_s:
                continue
            if st.st_ino == current and not (TAKEN in p.name or p.name.endswith(RELEASED)):
                continue  # the current claim's handle
            if unlink_quietly(p):
                n += 1
        return n


def read(run_dir: Path, index: int) -> ClaimInfo | None:
    """The shard's claim, or None when it has none (or it vanished while being read). The attributes come from an
    fstat of a fresh open (close-to-open consistency: no cached mtime on NFS). BadRecord when `.claim` is not a claim
    (records.ClaimRecord; its token names a file, so it is checked before use); NotRegularFile for a FIFO or a
    device in its place."""
    path = store.claim_path(run_dir, index)
    try:
        fd = store.open_regular_fd(path)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        raw = b""
        while chunk := os.read(fd, 1 << 16):
            raw += chunk
    finally:
        os.close(fd)
    return parse(index, records.parse_claim(path, raw), st.st_mtime, st.st_ino)


def parse(index: int, record: records.ClaimRecord, mtime: float, ino: int) -> ClaimInfo:
    return ClaimInfo(
        index=index,
        worker_id=record.worker_id,
        job_id=record.job_id,
        host=record.host,
        pid=record.pid,
        claimed_at=record.claimed_at,
        token=record.token,
        renewed_at=mtime,
        ino=ino,
    )


def inode(path: Path) -> int | None:
    st = stat_or_none(path)
    return st.st_ino if st is not None else None


def stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def unlink_quietly(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def rename_once(src: Path, dst: Path) -> bool:
    """rename(src, dst); False when src is gone (someone else renamed it first). dst names are unique to us, so an
    ENOENT with dst in place is a retransmitted rename that did succeed."""
    ino = inode(src)
    try:
        os.rename(src, dst)
        return True
    except FileNotFoundError:
        return ino is not None and inode(dst) == ino
    except OSError as e:
        if e.errno == errno.ESTALE:
            return False
        raise
