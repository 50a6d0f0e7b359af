"""Walking a syntax tree once: ``walk(node)`` is ``ast.walk(node)`` as a tuple, kept per node.

The rules ask the same questions of the same trees many times over (every ``nn.Linear`` of a file
is asked whether it is an LM head, every rotary candidate walks its function again), and
``ast.walk`` is a Python generator: the scan of transformers' modeling files spent half its time
there. The tuple of a node's descendants (``ast.walk`` order, the node first) is computed once and
kept while the cache holds it; analysis never changes a tree it walks (a rule that rewrites an
expression does so on a ``copy.deepcopy``), so the tuple stays true.

Shared between the rules: callers must not change the tree they walk.
"""
from __future__ import annotations

import ast

__all__ = ["walk"]

# id(node) -> (node, its walk); the node is held, so its id cannot be reused while cached
_WALKS: dict[int, tuple[ast.AST, tuple[ast.AST, ...]]] = {}
_MAX_WALKS = 8192  # a file's functions, statements and expressions asked about; dropped all at once


def _breadth_first(node: ast.AST) -> tuple[ast.AST, ...]:
    # ast.walk's order (a queue: the node, its children in field order, theirs...) without its
    # generator per node (iter_child_nodes over iter_fields): about three times faster
    out = [node]
    append, index = out.append, 0
    while index < len(out):
        current = out[index]
        index += 1
        for name in current._fields:
            value = getattr(current, name, None)
            if isinstance(value, ast.AST):
                append(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        append(item)
    return tuple(out)


def walk(node: ast.AST) -> tuple[ast.AST, ...]:
    """``tuple(ast.walk(node))``, computed once per node."""
    cached = _WALKS.get(id(node))
    if cached is not None and cached[0] is node:
        return cached[1]
    nodes = _breadth_first(node)
    if len(_WALKS) >= _MAX_WALKS:
        _WALKS.clear()
    _WALKS[id(node)] = (node, nodes)
    return nodes
