"""Default values of configuration attributes, read statically from the sibling
``configuration_<model>.py`` of a scanned ``modeling_<model>.py`` (parsed with ``ast``,
never imported). Used to tell which activation ``ACT2FN[config.hidden_act]`` names by
default."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=256)
def _defaults_of_file(path: str) -> dict[str, frozenset]:
    """attribute -> set of literal default values over every class in the file."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return {}
    found: dict[str, set] = {}

    def note(name: str, value_node: ast.AST | None):
        if value_node is None:
            return
        try:
            value = ast.literal_eval(value_node)
        except Exception:
            # activation_fn_key(default="silu") and similar wrappers
            if isinstance(value_node, ast.Call):
                for kw in value_node.keywords:
                    if kw.arg == "default":
                        note(name, kw.value)
                        return
            value = None
        found.setdefault(name, set()).add(value if isinstance(value, (str, int, float, bool)) else None)

    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                note(stmt.target.id, stmt.value)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        note(t.id, stmt.value)
            elif isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                args = stmt.args
                pos = args.posonlyargs + args.args
                for a, d in zip(pos[len(pos) - len(args.defaults):], args.defaults):
                    note(a.arg, d)
                for a, d in zip(args.kwonlyargs, args.kw_defaults):
                    note(a.arg, d)
    return {k: frozenset(v) for k, v in found.items()}


def config_defaults(modeling_file: str, attr: str) -> frozenset | None:
    """All default values of ``attr`` in the configuration file next to ``modeling_file``
    (None inside the set when one is not a literal); None when there is no such file/attr."""
    p = Path(modeling_file)
    if not p.name.startswith("modeling_"):
        return None
    candidates = [p.with_name("configuration_" + p.name[len("modeling_"):])]
    candidates += sorted(p.parent.glob("configuration_*.py"))
    for c in candidates:
        if c.is_file():
            d = _defaults_of_file(str(c))
            if attr in d:
                return d[attr]
    return None
