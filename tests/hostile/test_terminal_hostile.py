"""Hostile text from data: no control character from data reaches a terminal. An agent name, a failure reason, a
path (terminal escapes: OSC 52 writes the clipboard on many terminals; CSI clears the screen; C1 controls; a
bidirectional override) is shown escaped, the way Python writes it (`\\x1b`), in every human-readable output:
`plan`, `status`, the merge summary, select's summary, the report's text and HTML, errors. JSON outputs stay exact."""

from __future__ import annotations

import re

import orjson
import pytest
from hostilekit import invoke_bounded, refused
from reportkit import input_row, merge_run, planned_run, seal_shards

from shardrun.core import terminal
from shardrun.rundir import store

OSC52 = "\x1b]52;c;ZXZpbA==\x07"  # sets the clipboard to "evil"
CLEAR = "\x1b[2J"
C1_CSI = "\x9b31m"
BIDI = "\u202eexe.txt"
HOSTILE = {"OSC 52": OSC52, "CSI clear": CLEAR, "C1 CSI": C1_CSI, "bidi override": BIDI, "newline": "a\nb"}
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def clean(text: str) -> None:
    """No control character but the layout's newlines, no bidi override."""
    assert not RAW.search(text), repr(text)


def reward(t: int, r: int) -> float:
    return float((t + r) % 2 == 0)


def hostile_run(tmp_path, name: str, *, failed=frozenset()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [input_row(i, "agent_a" if i % 2 else name) for i in range(4)]
    run_dir, _ = planned_run(tmp_path, rows, num_repeats=2, num_shards=2)
    seal_shards(run_dir, reward, failed=set(failed))
    return run_dir


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_an_agent_name_is_escaped_in_plan_and_exact_in_its_json(tmp_path, unchanged, kind):
    name = "agent" + HOSTILE[kind]
    rows = [input_row(0, name), input_row(1, "agent_a")]
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (tmp_path / "run.yaml").write_text(f"input_jsonl: {tmp_path / 'in.jsonl'}\nrun_dir: {tmp_path / 'run'}\n")
    with unchanged(tmp_path):
        text = invoke_bounded("plan", tmp_path / "run.yaml")
        as_json = invoke_bounded("plan", tmp_path / "run.yaml", "--json")
    assert text.exit_code == 0 and as_json.exit_code == 0, text.output
    clean(text.output)
    assert f"agent {terminal.shown(name)}" in text.output
    assert name in orjson.loads(as_json.output)["agents"]  # exact


def test_status_and_merge_summary_escape_a_failure_reason_and_the_run_directory(tmp_path, unchanged):
    plain = hostile_run(tmp_path / "plain", "agent" + CLEAR, failed={(0, 1)})
    (tmp_path / "plain").rename(tmp_path / ("x" + OSC52))  # a run directory moved to a hostile name
    run_dir = tmp_path / ("x" + OSC52) / plain.name
    sidecar = store.failures_path(run_dir, 0)
    rows = [orjson.loads(line) for line in sidecar.read_bytes().splitlines()]
    for row in rows:  # a failure recorded for good, with a server's hostile error text
        row.pop("_ng_failure_class", None)
        row.update(error=OSC52 + "boom", _ng_failure_terminal=True)
    sidecar.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    with unchanged(tmp_path):
        status = invoke_bounded("status", run_dir)
        as_json = invoke_bounded("status", run_dir, "--json")
    assert status.exit_code == 0, status.output
    clean(status.output)
    assert terminal.shown(OSC52) in status.output and str(run_dir) not in status.output
    assert orjson.loads(as_json.output)["failed"][0]["reason"].startswith(OSC52)  # exact
    merged = invoke_bounded("merge-and-profile", run_dir)
    assert merged.exit_code == 0, merged.output
    clean(merged.output)
    assert terminal.shown(OSC52 + "boom") in merged.output and terminal.shown("agent" + CLEAR) in merged.output
    as_json = invoke_bounded("merge-and-profile", run_dir, "--json")
    assert orjson.loads(as_json.output)["failed"][0]["reason"] == OSC52 + "boom"


def test_select_summary_escapes_the_output_path_and_the_agent(tmp_path, unchanged):
    name = "agent" + C1_CSI
    run_dir = hostile_run(tmp_path, name)
    merge_run(run_dir)
    out = tmp_path / ("chosen" + CLEAR + ".jsonl")
    with unchanged(run_dir):
        done = invoke_bounded("select", run_dir, "-o", out, "--agent", name)
    assert done.exit_code == 0, done.output
    clean(done.output)
    assert terminal.shown(str(out)) in done.output and terminal.shown(name) in done.output


def test_report_text_and_html_escape_an_agent_name(tmp_path):
    name = "agent" + OSC52 + "<b>"
    run_dir = hostile_run(tmp_path, name)
    merge_run(run_dir)
    done = invoke_bounded("report", run_dir, "--no-sacct")
    assert done.exit_code == 0, done.output
    clean(done.output)
    assert terminal.shown(name) in done.output
    html = (store.merged_dir(run_dir) / "report.html").read_text()
    clean(html)
    assert name not in html and "&lt;b&gt;" in html


@pytest.mark.parametrize("kind", ["OSC 52", "C1 CSI", "bidi override"])
def test_an_error_naming_a_path_escapes_it(tmp_path, unchanged, kind):
    missing = tmp_path / ("run" + HOSTILE[kind])
    with unchanged(tmp_path):
        outcome = invoke_bounded("status", missing)
    refused(outcome, terminal.shown(str(missing)))
    clean(outcome.output)


def test_the_escaping_shows_each_character_as_python_writes_it():
    assert terminal.shown("a\x1bb\x07\x9b\u202e\n\t\\") == "a\\x1bb\\x07\\x9b\\u202e\\n\\t\\"
    assert terminal.shown_lines("row\x1b[2J\n\tnext") == "row\\x1b[2J\n\tnext"
    assert terminal.shown("ünïcödé 名前 ok") == "ünïcödé 名前 ok"
