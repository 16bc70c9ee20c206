"""The docs and the README are tested: every command shown runs, the config reference is fresh, links resolve.

Convention (what a doc writer must follow; the harness refuses anything else):
- Commands go in ```bash blocks only (```sh, ```shell, ```console are refused so nothing hides from the test).
- Every ```bash block is preceded by an HTML comment saying how it is checked:
    <!-- doc-test: run -->                         each command must exit 0
    <!-- doc-test: fails exit=N output="TEXT" -->  earlier commands exit 0; the last exits N and prints TEXT
    <!-- doc-test: dry-run -->                     each `shardrun` command is run with --dry-run appended, exit 0
                                                   (commands that would submit jobs or start GPU servers)
    <!-- doc-test: help (reason) -->               `shardrun <cmd> --help` must exit 0 and list every --option
                                                   the shown command uses (commands that need a live run)
    <!-- doc-test: syntax (reason) -->             `bash -n` on the block and on each ./scripts/*.sh it calls
                                                   (set-up scripts that install packages)
- A ```yaml block preceded by <!-- doc-test: file=NAME --> is written to NAME in the workspace first.
- A ```python block preceded by <!-- doc-test: python --> is run in the workspace like a notebook cell: a page's
  python blocks run in order in one namespace, and an exception (a failing assert included) fails the page.
  (A ```python block without it is shown, not run.)

Each doc runs in a fresh workspace (a temp dir as the current directory) holding copies of examples/ and
cluster_configs/, data/prompts.jsonl (20,000 synthetic rows, for the 20k-prompt recipe) and, for every example
config examples/*/*.yaml, its run directory (runs/arith, runs/arith-vllm, ...) planned, every shard sealed with
synthesized rollouts (tests/reportkit.py) and merged by merge-and-profile, so the status, merge-and-profile,
report and select examples have a collected run to work on.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from reportkit import merge_run, seal_shards
from shardrun.core import config
from shardrun.core import config_docs
from shardrun.rundir import store
from shardrun.cli import app

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
TESTED = ["README.md"] + [f"docs/{p}" for p in PAGES]
SHELL_OPS = {"|", ">", ">>", "<", "&&", "||", ";", "2>&1"}
TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    directive: str | None
    line: int


FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->\s*$")


def blocks(text: str) -> list[Block]:
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        d = DIRECTIVE.match(prev.strip())
        out.append(Block(m.group(1), "\n".join(lines[start + 1 : j]), d.group(1) if d else None, start + 1))
        i = j + 1
    return out


def commands(code: str) -> list[str]:
    """Commands of a bash block: comment lines dropped, backslash continuations joined, trailing comments cut."""
    out, cur = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        out.append(_strip_comment(cur).strip())
        cur = ""
    return out


def _strip_comment(cmd: str) -> str:
    in_quote = None
    for n, ch in enumerate(cmd):
        if in_quote:
            in_quote = None if ch == in_quote else in_quote
        elif ch in "'\"":
            in_quote = ch
        elif ch == "#" and (n == 0 or cmd[n - 1].isspace()):
            return cmd[:n]
    return cmd


# ---------------------------------------------------------------- the workspace


def reward(t: int, r: int) -> float:
    """Task t % 5 == 0 never solved, == 4 always, otherwise r < t % 5 solved: every selection rule has work."""
    return 1.0 if r < t % 5 else 0.0


@pytest.fixture(scope="session")  # once per xdist worker, however its tests interleave with others
def collected(tmp_path_factory) -> Path:
    """A workspace template: examples, cluster configs, 20k prompts, and runs/arith planned, sealed and merged."""
    ws = tmp_path_factory.mktemp("docs-template")
    for d in ("examples", "cluster_configs"):
        shutil.copytree(REPO / d, ws / d)
    (ws / "data").mkdir()
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": "What is {i} + 1?"}]},
        "agent_ref": {"name": "math_with_judge_simple_agent"},
    }
    (ws / "data" / "prompts.jsonl").write_bytes(
        b"".join(orjson.dumps(row).replace(b"{i}", str(i).encode()) + b"\n" for i in range(20_000))
    )
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        for example in sorted((ws / "examples").glob("*/*.yaml")):  # each example's run dir, collected
            cfg = config.load(example)
            store.write_plan(cfg)
            seal_shards(cfg.run_dir, reward)
            merge_run(cfg.run_dir)
    finally:
        os.chdir(cwd)
    return ws


@pytest.fixture()
def workspace(collected, tmp_path, monkeypatch) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(collected, ws, symlinks=True)
    (ws / ".venv").symlink_to(REPO / ".venv")
    (ws / "scripts").symlink_to(REPO / "scripts")
    monkeypatch.chdir(ws)
    monkeypatch.setenv("PATH", f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return ws


# ---------------------------------------------------------------- running


def run(cmd: str, ws: Path) -> tuple[int, str]:
    """`shardrun ...` in-process through the CLI (fast); anything else, or with shell operators, through bash."""
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        pytest.fail(f"cannot parse {cmd!r}: {e}")
    if argv and argv[0] in ("shardrun", ".venv/bin/shardrun") and not SHELL_OPS & set(argv):
        res = CliRunner().invoke(app, argv[1:], catch_exceptions=False)
        return res.exit_code, res.output
    res = subprocess.run(["bash", "-c", cmd], cwd=ws, capture_output=True, text=True, timeout=TIMEOUT_S)
    return res.returncode, res.stdout + res.stderr


def check_run(cmds: list[str], ws: Path, where: str) -> None:
    for c in cmds:
        code, out = run(c, ws)
        assert code == 0, f"{where}: `{c}` exited {code}:\n{out}"


def check_fails(cmds: list[str], directive: str, ws: Path, where: str) -> None:
    m = re.fullmatch(r'fails exit=(\d+) output="(.*)"', directive)
    assert m, f"{where}: bad directive {directive!r}"
    check_run(cmds[:-1], ws, where)
    code, out = run(cmds[-1], ws)
    assert code == int(m.group(1)) and m.group(2) in out, (
        f"{where}: `{cmds[-1]}` should exit {m.group(1)} saying {m.group(2)!r}; exited {code}:\n{out}"
    )


def check_dry_run(cmds: list[str], ws: Path, where: str) -> None:
    for c in cmds:
        assert shlex.split(c)[0] in ("shardrun", ".venv/bin/shardrun"), f"{where}: dry-run is for shardrun: {c}"
    check_run([c + " --dry-run" for c in cmds], ws, where)


def check_help(cmds: list[str], ws: Path, where: str) -> None:
    for c in cmds:
        argv = shlex.split(c)
        assert argv[0] in ("shardrun", ".venv/bin/shardrun"), f"{where}: help mode is for shardrun: {c}"
        code, out = run(f"shardrun {argv[1]} --help", ws)
        assert code == 0, f"{where}: `shardrun {argv[1]} --help` exited {code}:\n{out}"
        for opt in (a.split("=", 1)[0] for a in argv[2:] if a.startswith("-")):
            assert opt in out, f"{where}: `{c}` uses {opt}, which `shardrun {argv[1]} --help` does not list"


def check_syntax(code: str, ws: Path, where: str) -> None:
    res = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
    assert res.returncode == 0, f"{where}: bash -n: {res.stderr}"
    for script in re.findall(r"(?:^|\s)(\./scripts/[\w.-]+\.sh)", code):
        path = REPO / script
        assert path.is_file(), f"{where}: {script} does not exist"
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, f"{where}: bash -n {script}: {res.stderr}"


def check_python(code: str, namespace: dict, where: str) -> None:
    """Run one python block in the page's namespace (the cells before it ran there already)."""
    try:
        exec(compile(code, where, "exec"), namespace)
    except Exception as e:
        pytest.fail(f"{where}: the python block raised {type(e).__name__}: {e}")


def check_block(b: Block, ws: Path, where: str) -> None:
    cmds = commands(b.code)
    mode = (b.directive or "").split(" ", 1)[0]
    if mode == "run":
        check_run(cmds, ws, where)
    elif mode == "fails":
        check_fails(cmds, b.directive, ws, where)
    elif mode == "dry-run":
        check_dry_run(cmds, ws, where)
    elif mode == "help":
        check_help(cmds, ws, where)
    elif mode == "syntax":
        check_syntax(b.code, ws, where)
    else:
        pytest.fail(
            f"{where}: a ```bash block needs a <!-- doc-test: run|fails|dry-run|help|syntax --> line "
            f"before it (got {b.directive!r})"
        )


@pytest.mark.parametrize("page", TESTED)
def test_every_command_shown_runs(page, workspace):
    path = REPO / page
    if not path.exists():
        pytest.fail(f"{page} is missing")
    n = 0
    namespace: dict = {"__name__": "__doc_test__"}
    for b in blocks(path.read_text()):
        where = f"{page}:{b.line}"
        assert b.lang not in ("sh", "shell", "console", "zsh", "shell-session"), (
            f"{where}: write commands in ```bash blocks (the harness checks those)"
        )
        m = re.fullmatch(r"file=(\S+)", b.directive or "")
        if m:
            target = workspace / m.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code + "\n")
        if b.lang == "bash":
            check_block(b, workspace, where)
            n += 1
        elif b.lang == "python" and b.directive == "python":
            check_python(b.code, namespace, where)
    if page in ("README.md", "docs/quickstart.md", "docs/recipes.md", "docs/troubleshooting.md"):
        assert n, f"{page} shows no commands? the harness found no ```bash block"


# ---------------------------------------------------------------- the harness itself can fail


def test_harness_parses_directives_and_continuations():
    text = "x\n<!-- doc-test: run -->\n```bash\n# c\nshardrun plan a.yaml \\\n  k=v  # note\n```\n```yaml\na: 1\n```\n"
    bs = blocks(text)
    assert [(b.lang, b.directive) for b in bs] == [("bash", "run"), ("yaml", None)]
    assert commands(bs[0].code) == ["shardrun plan a.yaml    k=v"]
    assert commands("echo 'a # b'  # c") == ["echo 'a # b'"]


def test_harness_catches_a_wrong_command(workspace):
    with pytest.raises(AssertionError, match="exited 2"):
        check_run(["shardrun plan examples/arith/plan-only.yaml no_such_key=1"], workspace, "t")
    with pytest.raises(AssertionError, match="does not list"):
        check_help(["shardrun select runs/arith --no-such-option"], workspace, "t")
    with pytest.raises(AssertionError, match="should exit 2"):
        check_fails(["shardrun plan examples/arith/plan-only.yaml"], 'fails exit=2 output="x"', workspace, "t")


def test_harness_runs_python_blocks_in_order_in_one_namespace(workspace):
    namespace: dict = {}
    check_python("from shardrun import api\nplan = api.load_plan('runs/arith')", namespace, "t:1")
    check_python("assert plan.num_tasks > 0", namespace, "t:2")  # a later cell sees the earlier ones
    with pytest.raises(pytest.fail.Exception, match="t:3: the python block raised AssertionError"):
        check_python("assert plan.num_tasks == 0", namespace, "t:3")


# ---------------------------------------------------------------- reference, links, index


def test_config_reference_is_generated_from_the_models():
    assert (DOCS / "config-reference.md").read_text() == config_docs.reference(), (
        "docs/config-reference.md is stale: run `python -m shardrun.core.config_docs`"
    )


def test_config_reference_lists_every_key():
    text = config_docs.reference()
    for prefix, model in [
        ("", config.RunConfig),
        ("sharding.", config.ShardingConfig),
        ("gym.", config.GymConfig),
        ("policy.", config.PolicyConfig),
        ("policy.vllm.", config.VllmConfig),
        ("cluster.", config.ClusterConfig),
    ]:
        for name in model.model_fields:
            assert f"| `{prefix}{name}` |" in text


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("page", TESTED)
def test_relative_links_resolve(page):
    path = REPO / page
    for target, _anchor in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        assert (path.parent / target).exists(), f"{page}: link to {target} does not resolve"


def test_index_links_every_page():
    index = (DOCS / "index.md").read_text()
    linked = {t for t, _ in LINK.findall(index)}
    assert {p for p in PAGES if p != "index.md"} <= linked, "docs/index.md must link every page in docs/"
