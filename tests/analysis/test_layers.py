"""The package's layers, checked on the import graph (module-level *and* function-level imports):

    adopter.core      analysis core: DSL, extraction, structures, matching, rules, edit planning
    adopter.kernels   what rewritten code calls (imports nothing else of adopter but the catalogue)
    adopter.catalogue  what the kernels accept, as data (imports nothing): rules and kernels read it
    adopter.configs   shipped model configs (data)
    adopter.tracing   builds on core              \\ siblings: neither imports the other
    adopter.rewrite   builds on core              /
    everything else   orchestration (optimize, verify, gate, CLI): the only modules importing them all

No module imports one of a higher layer, and no import cycle exists between modules.
Every package directory is listed in setup.cfg, so a regular install has all of them.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Package -> directory, as setup.cfg's package_dir maps them.
PACKAGE_DIRS = {
    "adopter": ROOT / "adopter",
    "adopter.tracing": ROOT / "tracing",
    "adopter.rewrite": ROOT / "rewrite",
    "adopter.kernels": ROOT / "kernels",
}

# What each layer may import (besides itself).
ALLOWED = {
    "catalogue": {"catalogue"},
    "core": {"core", "catalogue"},
    "kernels": {"kernels", "catalogue"},
    "configs": {"configs"},
    "tracing": {"tracing", "core", "configs", "kernels", "catalogue"},
    "rewrite": {"rewrite", "core", "kernels", "catalogue"},
    "top": {"top", "core", "kernels", "configs", "tracing", "rewrite", "catalogue"},
}


def layer_of(module: str) -> str:
    for prefix, layer in (
        ("adopter.catalogue", "catalogue"),
        ("adopter.core", "core"),
        ("adopter.kernels", "kernels"),
        ("adopter.configs", "configs"),
        ("adopter.tracing", "tracing"),
        ("adopter.rewrite", "rewrite"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "top"


def all_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed package tree."""
    out: dict[str, Path] = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            rel = path.relative_to(directory).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            # sub-packages mapped elsewhere (adopter/... never holds tracing/rewrite/kernels)
            if package == "adopter" and parts and f"adopter.{parts[0]}" in PACKAGE_DIRS:
                continue
            out[name] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of the tree that ``name`` imports anywhere in its file (functions included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        for target in targets:
            # the longest known module the import names (``adopter.core.rules.x.y`` -> its module)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_upward_or_sideways_import():
    bad = []
    for module, targets in import_graph().items():
        for target in targets:
            if layer_of(target) not in ALLOWED[layer_of(module)]:
                bad.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not bad, "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_function_level_and_upward_imports(tmp_path):
    # the checks above can fail: a function-level upward import and a cycle are found
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from adopter.optimizing.optimize import optimize\n    return optimize\n")
    modules = {"adopter.core.m": module, "adopter.optimizing.optimize": module}
    assert imports_of("adopter.core.m", module, modules) == {"adopter.optimizing.optimize"}
    assert layer_of("adopter.optimizing.optimize") not in ALLOWED[layer_of("adopter.core.m")]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_every_package_directory_is_installed():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    packages = {name for name, path in all_modules().items() if path.name == "__init__.py"}
    assert packages <= listed, f"packages missing from setup.cfg: {sorted(packages - listed)}"
