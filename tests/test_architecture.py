"""The house rules of docs/architecture.md hold for the code: its tree listing names exactly the modules there are,
its contract is the one import-linter checks, the layers are kept, and names are unique and shadow nothing."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "shardrun"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def code_block_after(heading: str) -> list[str]:
    """The lines of the first fenced block after the line `heading` in docs/architecture.md."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index(heading)
    opening = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
    return lines[opening + 1 : closing]


def modules_in_code() -> set[str]:
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and p.name != "__init__.py"
    }


def modules_in_tree_listing() -> set[str]:
    listed, package = set(), ""
    for line in code_block_after("## The tree"):
        name = line.strip().split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if name.endswith("/") and indent == 2:
            package = name
        elif name.endswith(".py") and name != "__init__.py":
            listed.add((package if indent == 4 else "") + name)
    return listed


def test_the_tree_listing_names_exactly_the_modules_there_are():
    listed, there = modules_in_tree_listing(), modules_in_code()
    assert listed == there, f"listed but missing: {sorted(listed - there)}; not listed: {sorted(there - listed)}"


def test_the_documented_contract_is_the_one_import_linter_checks():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    documented = [line.strip() for line in code_block_after("## The contract") if line.strip()]
    assert documented == contract["layers"]


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def test_each_stage_imports_only_from_the_stages_before_it():
    """The same rule as the import-linter contract, checked without it (so the fast tier shows a break too)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    order = [layer.split(".")[-1] for layer in reversed(contract["layers"]) if "|" not in layer]
    rank = {stage: i for i, stage in enumerate(order)}
    against = []
    for path in PACKAGE.rglob("*.py"):
        module = "shardrun." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        here = stage_of(module)
        if here not in rank:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardrun."):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("shardrun.")]
            for target in targets:
                there = stage_of(target if target.count(".") >= 2 else target + ".x")
                if there in rank and rank[there] > rank[here]:
                    against.append(f"{module} imports {target}")
    assert not against, "imports against the flow:\n" + "\n".join(sorted(set(against)))


def test_no_two_modules_share_a_name_and_none_shadows_the_standard_library():
    by_name = defaultdict(list)
    for module in modules_in_code():
        by_name[Path(module).stem].append(module)
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared
    shadowing = sorted(name for name in by_name if name in sys.stdlib_module_names)
    assert not shadowing


def test_no_two_classes_share_a_name():
    where = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not {name: places for name, places in where.items() if len(places) > 1}


def test_the_import_contract_is_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    if not lint_imports.exists():
        lint_imports = Path(shutil.which("lint-imports") or "lint-imports")
    done = subprocess.run([str(lint_imports)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Contracts: 2 kept, 0 broken", done.stdout), done.stdout


def cycles(graph: "grimp.ImportGraph") -> list[tuple[str, ...]]:
    """Each import that lies on a cycle, with the way back: (importer, imported, ..., importer) (grimp)."""
    found = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                found.append((importer, *back))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = grimp.ImportGraph()
    for importer, imported in [("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]:
        graph.add_import(importer=importer, imported=imported)
    graph.add_module("e")
    assert cycles(graph) == [("a", "b", "c", "a"), ("b", "c", "a", "b"), ("c", "a", "b", "c")]
    acyclic = grimp.ImportGraph()
    acyclic.add_import(importer="a", imported="b")
    assert cycles(acyclic) == []


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among shardrun's modules, at any depth, function-level imports included (grimp reads those
    too: a cycle hidden inside a function is still one): e.g. rundir/store.py imports records.py, never the other
    way round."""
    assert not cycles(grimp.build_graph("shardrun"))


TESTS = REPO / "tests"
ONE_WRITER = {  # what the shared test helpers write once (docs/architecture.md, Tests): name -> the module defining it
    "write_config": "builders.py",
    "seal_shard": "builders.py",
    "fake_policy": "fakes/harness.py",
    "free_port": "ports.py",
}
SEAL_CALLS = {"make_marker", "write_marker"}
SEAL_CALLS_ALLOWED = {
    "builders.py",  # the one writer of seals
    "rundir/test_cost.py",  # the cost of a marker it builds in memory: no seal written
    "rundir/test_seal_aside.py",  # writes back a seal the writer made (the shard sealed again)
}


def test_the_shared_test_helpers_have_one_writer_each():
    """A run config, the stand-in policy, a free port and a seal each have one definition in the shared helpers;
    an area binds it to its defaults (functools.partial), it never writes a second."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        where = path.relative_to(TESTS).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and ONE_WRITER.get(node.name, where) != where:
                found.append(f"{where}:{node.lineno} defines {node.name} (the one is in tests/{ONE_WRITER[node.name]})")
            called = node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if called in SEAL_CALLS and where not in SEAL_CALLS_ALLOWED:
                found.append(f"{where}:{node.lineno} calls seal.{called} (seal through builders.seal_shard)")
    assert found == []
