"""The collector service's spool files (workers/spool.py): each read through its model, and what is not its model
is never trusted (a garbled exit fails the round, a garbled answer to a lend lends nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardrun.workers import collector_service, spool


class LiveService(collector_service.CollectorService):
    """Only the spool is read here: the service's process is taken as alive."""

    def alive(self) -> bool:
        return True


def round_in(tmp_path: Path) -> collector_service.Round:
    service = LiveService(proc=None, spool=tmp_path)  # type: ignore[arg-type]
    return collector_service.Round(service, "shard-3-0", tmp_path / "collector.log")


def test_a_round_is_running_until_its_exit_record_and_ends_with_its_code(tmp_path):
    r = round_in(tmp_path)
    assert r.poll() is None
    spool.write(r.path(spool.EXIT), spool.RoundExit(rc=-15))
    assert r.poll() == -15
    assert not any(r.path(s).exists() for s in spool.ROUND_FILES)  # its files are cleared


@pytest.mark.parametrize("raw", [b'{"rc": "0"}', b'{"code": 0}', b"{", b"[]"])
def test_a_garbled_exit_record_ends_the_round_as_failed_and_says_so_in_its_log(tmp_path, raw):
    r = round_in(tmp_path)
    r.path(spool.EXIT).write_bytes(raw)
    assert r.poll() == 1
    assert "exit record is unreadable" in r.log_path.read_text()


@pytest.mark.parametrize("raw", [b'{"rows": [[1]]}', b'{"rows": [[-1, 2]]}', b'{"rows": "all"}', b"nope"])
def test_a_garbled_answer_to_a_lend_lends_nothing(tmp_path, raw):
    r = round_in(tmp_path)
    r.path(spool.LENT).write_bytes(raw)

    def answered() -> None:  # the service answers after the ask (lend removes an old answer first)
        r.path(spool.LENT).write_bytes(raw)

    import threading

    t = threading.Timer(0.2, answered)
    t.start()
    try:
        assert r.lend(0.5, timeout=30) == []
    finally:
        t.cancel()


def test_an_answer_to_a_lend_is_read_as_identities(tmp_path):
    r = round_in(tmp_path)
    import threading

    t = threading.Timer(0.2, lambda: spool.write(r.path(spool.LENT), spool.LentRows(rows=[(4, 1), (4, 2)])))
    t.start()
    try:
        assert r.lend(0.5, timeout=30) == [(4, 1), (4, 2)]
    finally:
        t.cancel()
    assert spool.read(r.path(spool.LEND), spool.LendAsk) == spool.LendAsk(fraction=0.5)


def test_a_round_s_job_is_written_as_its_model(tmp_path):
    service = LiveService(proc=None, spool=tmp_path)  # type: ignore[arg-type]
    shard = tmp_path / "shard"
    r = service.submit(tmp_path, 0, view=shard, log_path=tmp_path / "c.log")
    job = spool.read(r.path(spool.RUN), spool.RoundJob)
    assert job is not None and job.input.endswith("rollouts_materialized_inputs.jsonl")
    assert job.log == str((tmp_path / "c.log").resolve())


def test_slots_names_only_well_formed_rounds():
    report = spool.SlotsReport(started=["shard-3-0", "shard-x-1", "other", "shard-12-5"])
    assert report.shards_started() == {3, 12}
