"""The package layering of docs/architecture.md ("Layers"), checked.

Every import between conveyor's top-level packages (module-level, function-level and
TYPE_CHECKING imports alike, read statically with ast) must be an edge of ``ALLOWED``; the
table has no cycle, so neither do the packages; nor do the modules, inside a package included. The doc's table is parsed and must equal this
one. Each package also imports alone in a fresh interpreter, which catches a cycle between its
modules that only bites when it is imported first. An import inside a function says why it is not at
the top of its module, in one of LAZY_REASON's forms (an optional dependency, or a heavy one kept out of
a light entry point).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "conveyor"

# unit -> the units it may import. Bottom first; every unit may import only units listed
# above it, so the table is acyclic (test_the_table_is_a_layering). docs/architecture.md mirrors it.
ALLOWED: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    "errors": (),
    "config_fields": (),
    "paths": (),
    "tokenizer": (),
    "routing": (),
    "lora": (),   # LoRARequest (torch-free) and PEFT adapters read into tensors; no conveyor imports
    "sampling": ("errors", "paths"),   # paths: the GGUF sampling-metadata cache (sampling/defaults.py)
    "request": ("lora", "sampling"),
    "kv": ("lora", "request", "routing"),
    "scheduler": ("config_fields", "kv", "lora", "request", "sampling"),
    "spec": ("request", "scheduler"),   # speculative decoding's proposers and per-step choice (torch-free)
    "config": ("config_fields", "scheduler", "spec"),
    "model": ("lora", "paths", "tokenizer"),
    "runner": ("kv", "lora", "model", "sampling", "scheduler"),
    "parallel": ("kv", "model", "runner"),
    "core": ("errors", "lora", "request", "sampling", "scheduler"),   # the torch-free step, loop, stats, trace, wire types
    "frontend": ("core", "errors", "lora", "request", "sampling", "scheduler", "tokenizer"),   # caller's side, no torch
    "engine": ("config", "core", "errors", "frontend", "kv", "lora", "model", "parallel", "paths", "request", "routing",
               "runner", "sampling", "scheduler", "spec", "tokenizer"),
    "transport": ("config", "core", "engine", "frontend", "kv", "lora", "model", "routing", "sampling"),
    "sim": ("config", "core", "kv", "lora", "paths", "request", "routing", "runner", "sampling",
            "scheduler", "spec"),   # runner/state.py
    "plot": ("core",),
    "profile": ("core", "engine", "model", "sampling", "scheduler"),
    "server": ("config", "config_fields", "core", "engine", "errors", "frontend", "lora", "parallel", "request", "sampling",
               "scheduler", "tokenizer", "transport"),
    "ray": ("config", "core", "engine", "frontend", "kv", "lora", "model", "routing", "sampling", "scheduler", "server",
            "transport"),
    "bench": (),
    "cli": ("bench", "config", "engine", "paths", "plot", "profile", "ray", "sampling", "server", "sim"),
    "__main__": ("cli",),
    "conveyor": ("config", "engine", "frontend", "lora", "sampling", "scheduler"),   # the package's lazy top-level names
}.items()}

# Imports that go against the table, each with the reason it cannot be restructured away:
# (importing module, imported module) -> why. None today; keep it that way.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layer a conveyor module belongs to: its top-level package or module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (REPO / rel).with_suffix(".py").exists() or (REPO / rel / "__init__.py").exists()


def imported_modules(path: Path) -> Iterator[tuple[str, int]]:
    """(conveyor module, line) for every import in the file, at any depth (functions included)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from conveyor.x import y` imports the module conveyor.x.y when y is one
            targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "conveyor" or t.startswith("conveyor."):
                yield t, node.lineno


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(unit, unit) -> where: every import from one unit into another."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        for target, line in imported_modules(path):
            a, b = unit_of(src), unit_of(target)
            if a != b and (src, target) not in EXCEPTIONS:
                edges.setdefault((a, b), []).append(f"{src}:{line} imports {target}")
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_every_unit_has_a_place_in_the_table():
    units = {unit_of(module_name(p)) for p in SRC.rglob("*.py")}
    assert units - set(ALLOWED) == set(), "a new package: give it its place in ALLOWED and in docs/architecture.md"
    assert set(ALLOWED) - units == set(), "a unit of the table no longer exists"


def test_the_table_is_a_layering():
    order = list(ALLOWED)
    for unit, allowed in ALLOWED.items():
        later = [u for u in allowed if order.index(u) >= order.index(unit)]
        assert not later, f"{unit} may import {later}, listed at or after it: the table must go bottom-up"
    assert find_cycle({u: set(a) for u, a in ALLOWED.items()}) is None


def test_imports_follow_the_layers():
    wrong = [f"{a} -> {b}: " + "; ".join(where[:3]) for (a, b), where in sorted(import_edges().items())
             if b not in ALLOWED.get(a, ())]
    assert not wrong, "imports against the layering (docs/architecture.md, Layers):\n" + "\n".join(wrong)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in import_edges():
        graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def test_no_cycle_between_modules():
    """Inside a package too: every import counts, function-level ones included (a loop that a function-level
    import hides still makes one module depend on another that depends on it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = module_name(path)
        graph.setdefault(src, set()).update(t for t, _ in imported_modules(path) if t != src)
    cycle = find_cycle(graph)
    assert cycle is None, "module cycle: " + " -> ".join(cycle)


# Why an import may sit inside a function, on its line or on a comment line right above it (a run of
# imports without other statements between them shares the comment above its first one):
#   # lazy: optional dependency (ray)
#   # lazy: keeps torch out of the CLI's start-up
#   # lazy: would import a cycle (a -> b -> a)
LAZY_REASON = re.compile(r"#\s*lazy: (optional dependency \([^)]+\)|keeps .+ out of .+|would import a cycle \(.+ -> .+\))")

def function_level_imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, ast.stmt | None]]:
    """(import, the statement just before it in the same block) for every import inside a function."""
    def blocks(node: ast.AST, in_function: bool) -> Iterator[tuple[list[ast.stmt], bool]]:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block, in_function
        for handler in getattr(node, "handlers", ()):
            yield handler.body, in_function
        for case in getattr(node, "cases", ()):
            yield case.body, in_function

    todo = [(tree, False)]
    while todo:
        node, in_function = todo.pop()
        for block, inside in blocks(node, in_function):
            for i, stmt in enumerate(block):
                if inside and isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    yield stmt, block[i - 1] if i else None
                todo.append((stmt, inside or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))))


def unexplained_lazy_imports(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), str(path))
    explained: set[ast.stmt] = set()
    out = []
    for stmt, before in sorted(function_level_imports(tree), key=lambda p: p[0].lineno):
        own = any(LAZY_REASON.search(lines[n - 1]) for n in range(stmt.lineno, stmt.end_lineno + 1))
        above = LAZY_REASON.fullmatch(lines[stmt.lineno - 2].strip()) is not None
        if own or above or before in explained:
            explained.add(stmt)
        else:
            out.append(f"{path.relative_to(REPO)}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}")
    return out


def test_every_function_level_import_says_why():
    """An import belongs at the top of its module; inside a function only for a reason that is stated (an optional
    dependency; a heavy one kept out of a light entry point, e.g. torch out of the CLI or the torch-free core)."""
    missing = [line for path in sorted(SRC.rglob("*.py")) for line in unexplained_lazy_imports(path)]
    assert not missing, ("imports inside functions without a '# lazy: <reason>' comment (move them to the top of "
                         "the module, or give the reason):\n" + "\n".join(missing))


def test_every_exception_is_still_needed():
    for src, target in EXCEPTIONS:
        path = SRC.parent / (src.replace(".", "/") + ".py")
        assert any(t == target for t, _ in imported_modules(path)), f"{src} no longer imports {target}"


def doc_table() -> dict[str, frozenset[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):   # `unit` (a note) | `a`, `b` (a note), ...
            unit = re.match(r"`([^`]+)`", cells[0]).group(1)
            table[unit] = frozenset(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1])))
    return table


def test_the_doc_mirrors_the_table():
    assert doc_table() == ALLOWED


def unit_modules() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        m = module_name(path)
        if m != "conveyor.__main__":
            out.setdefault(unit_of(m), []).append(m)
    return out


@pytest.mark.slow
def test_each_package_imports_alone():
    """A fresh interpreter per unit imports its modules (and nothing of conveyor before them)."""
    def run(modules: list[str]) -> tuple[list[str], subprocess.CompletedProcess]:
        code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
        return modules, subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                                       timeout=300, cwd=REPO)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, unit_modules().values()))
    failed = [f"{mods[0]}...: {res.stderr.strip().splitlines()[-1:]}" for mods, res in results if res.returncode]
    assert not failed, "\n".join(failed)
