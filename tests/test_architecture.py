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


def imports_among_modules() -> dict[str, set[str]]:
    """{module: the shardrun modules it imports}, function-level imports included (`from shardrun.rundir import
    store` imports the module shardrun.rundir.store)."""
    modules = {"shardrun." + ".".join(Path(m).with_suffix("").parts) for m in modules_in_code()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardrun"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among shardrun's modules, at any depth, function-level imports included (a cycle hidden
    inside a function is still one): e.g. rundir/store.py imports records.py, never the other way round."""
    assert not cycles(imports_among_modules())
