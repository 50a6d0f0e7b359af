"""Source-level check that a matched intermediate value is read nowhere else.

Extraction only records DL nodes, so a value that escapes through a plain statement —
``residual = hidden_states`` later added back, ``return out, dropped``, ``outputs +=
(attn,)`` — is invisible in the path. This re-reads the function's source (``ast``,
never executed) and looks for loads of the variable's name after its defining
statement and before the name is assigned again, outside the matched statements.
"""

from __future__ import annotations

import ast
from functools import lru_cache

from adopter.dsl import Node, Var
from adopter.rules._source import function_ast

# Reading only metadata is harmless: the fused kernel's input and output share it.
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"}
_META_METHODS = {"size", "dim", "ndimension", "numel", "nelement"}


def _metadata_only(parent: ast.AST | None, grandparent: ast.AST | None) -> bool:
    if isinstance(parent, ast.Attribute):
        if parent.attr in _META_ATTRS:
            return True
        if parent.attr in _META_METHODS and isinstance(grandparent, ast.Call) and grandparent.func is parent:
            return True
    return False


@lru_cache(maxsize=512)
def _name_index(source: str, qualname: str, hint_line: int) -> dict[str, tuple[list[tuple[int, int]], list[int]]] | None:
    """name -> (data loads (line, col), store lines) in one function, computed once."""
    fn = function_ast(source, qualname, hint_line)
    if fn is None:
        return None
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    index: dict[str, tuple[list[tuple[int, int]], list[int]]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            loads, stores = index.setdefault(node.id, ([], []))
            if isinstance(node.ctx, ast.Load):
                parent = parents.get(id(node))
                if _metadata_only(parent, parents.get(id(parent)) if parent is not None else None):
                    continue
                loads.append((node.lineno, node.col_offset))
            else:
                stores.append(node.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            index.setdefault(node.target.id, ([], []))[0].append((node.lineno, node.col_offset))
    return index


def escaping_read(source: str | None, producer: Node, value: Var, matched: list[Node]) -> int | None:
    """Line of a read of ``value`` outside the matched statements, or None.

    ``producer`` is the matched node defining ``value``. Temporaries introduced by
    extraction (``tmp_<n>``) have no name in the source and never escape this way.
    """
    if source is None or not isinstance(value, Var) or value.name.startswith("tmp_") or "." in value.name:
        return None
    span = producer.span
    if span is None or not span.function:
        return None
    index = _name_index(source, span.function, span.line)
    if index is None:
        return None
    def_end = span.stmt_end_line or span.end_line
    matched_ranges = [
        (n.span.stmt_line or n.span.line, n.span.stmt_end_line or n.span.end_line)
        for n in matched
        if n.span is not None and n.span.function == span.function
    ]
    loads, stores = index.get(value.name, ([], []))
    later_stores = sorted(line for line in stores if line > def_end)
    horizon = later_stores[0] if later_stores else 10**9
    for line, _col in sorted(loads):
        if line <= def_end or line > horizon:
            continue
        if any(lo <= line <= hi for lo, hi in matched_ranges):
            continue
        return line
    return None
