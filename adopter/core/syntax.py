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
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

__all__ = ["clear_file_caches", "descendants", "dotted_name", "mentioned_names", "per_file", "per_node", "statements",
           "walk"]

_MAX_WALKS = 8192  # a file's functions, statements and expressions asked about


# Fields that never hold a node (names, flags, constants' values): not read by the walk
_SCALAR_FIELDS = frozenset(("id", "attr", "name", "asname", "module", "level", "arg", "type_comment", "is_async",
                            "simple", "conversion", "kind", "tag", "rest"))
_NODE_FIELDS: dict[type, tuple[str, ...]] = {}


def _node_fields(cls: type) -> tuple[str, ...]:
    fields = tuple(n for n in cls._fields if n not in _SCALAR_FIELDS  # type: ignore[attr-defined]
                   and not (n == "value" and cls in (ast.Constant, ast.MatchSingleton))
                   and not (n == "names" and cls in (ast.Global, ast.Nonlocal)))
    _NODE_FIELDS[cls] = fields
    return fields


def _breadth_first(node: ast.AST) -> tuple[ast.AST, ...]:
    # ast.walk's order (a queue: the node, its children in field order, theirs...) without its
    # generator per node (iter_child_nodes over iter_fields), and reading only the fields that can
    # hold nodes: about four times faster
    out = [node]
    append, AST, node_fields = out.append, ast.AST, _NODE_FIELDS
    for current in out:  # (the list grows while it is read: the queue)
        cls = type(current)
        names = node_fields.get(cls)
        if names is None:
            names = _node_fields(cls)
        for name in names:
            value = getattr(current, name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, AST):
                        append(item)
            elif isinstance(value, AST):
                append(value)
    return tuple(out)


_BLOCK_FIELDS = frozenset(("body", "orelse", "finalbody", "handlers", "cases"))


def _statements(node: ast.AST) -> tuple[ast.stmt, ...]:
    # the statements of walk(node), in its order, reading only the fields that hold blocks: a
    # statement is never inside an expression, so the expressions (most of a tree) are not visited
    out: list[ast.stmt] = []
    queue = [node]
    for current in queue:
        for name in current._fields:
            block = getattr(current, name, None) if name in _BLOCK_FIELDS else None
            if type(block) is list:  # (a lambda's or an if-expression's body is one expression)
                for item in block:
                    queue.append(item)  # (an except handler or a match case holds statements)
                    if isinstance(item, ast.stmt):
                        out.append(item)
    return tuple(out)


def walk(node: ast.AST) -> tuple[ast.AST, ...]:
    """``tuple(ast.walk(node))``, computed once per node."""
    return _walk(node)


def statements(node: ast.AST) -> tuple[ast.stmt, ...]:
    """The statements in ``walk(node)`` (``node`` itself excluded), in its order, computed once per
    node: for the questions only statements answer (imports, assignments, function definitions)."""
    return _statements_kept(node)


def descendants(node: ast.AST) -> tuple[ast.AST, ...]:
    """``tuple(ast.walk(node))`` computed afresh, not kept: for a walk asked once of each of many
    small nodes (every assignment's value, every statement of a function), which would only push
    out of :func:`walk`'s cache the functions and classes asked about again and again."""
    return _breadth_first(node)


def mentioned_names(node: ast.AST) -> set[str]:
    """Every ``Name``'s id and ``Attribute``'s attribute name in ``node`` (itself included): what
    ``{n.id or n.attr for n in walk(node)}`` gives, in one pass that builds and keeps no walk (the
    names a function or an assignment mentions, asked once each)."""
    out: set[str] = set()
    add = out.add
    stack = [node]
    pop, push, AST, name_t, attribute_t, node_fields = stack.pop, stack.append, ast.AST, ast.Name, ast.Attribute, _NODE_FIELDS
    while stack:
        current = pop()
        cls = type(current)
        if cls is name_t:
            add(current.id)  # type: ignore[attr-defined]
            continue  # (its one other field is the context)
        if cls is attribute_t:
            add(current.attr)  # type: ignore[attr-defined]
        names = node_fields.get(cls)
        if names is None:
            names = _node_fields(cls)
        for field_name in names:
            value = getattr(current, field_name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, AST):
                        push(item)
            elif isinstance(value, AST):
                push(value)
    return out


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` of a name or a chain of attributes on a name; None for any other expression."""
    parts = []
    while type(node) is ast.Attribute:  # (type, not isinstance: hot in extraction)
        parts.append(node.attr)  # type: ignore[attr-defined]
        node = node.value  # type: ignore[attr-defined]
    if type(node) is ast.Name:
        parts.append(node.id)  # type: ignore[attr-defined]
        return ".".join(reversed(parts))
    return None


R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

# The caches whose entries belong to one analysed file (its trees, its text): dropped between files
# by :func:`clear_file_caches`, so a long run keeps no file's trees past its analysis.
_FILE_CACHES: list[Callable[[], None]] = []


def per_file(cached: F) -> F:
    """Register an ``lru_cache``d function keyed by a file's text or trees as a per-file cache."""
    _FILE_CACHES.append(cached.cache_clear)  # type: ignore[attr-defined]
    return cached


def clear_file_caches() -> None:
    """Drop every per-file cache (:func:`per_node` ones and those :func:`per_file` registered)."""
    for clear in _FILE_CACHES:
        clear()


def per_node(limit: int) -> Callable[[Callable[[Any], R]], Callable[[Any], R]]:
    """Keep a one-argument function's answer per node (by identity: equal trees are not shared), at
    most ``limit`` of them, dropped all at once: facts an analysis derives from a tree it never
    changes (a function's parent map, the names it binds). The node is held while its answer is,
    so its id cannot be reused. Callers must not change what they get."""
    def decorate(fn: Callable[[Any], R]) -> Callable[[Any], R]:
        kept: dict[int, tuple[Any, R]] = {}

        @wraps(fn)
        def cached(node: Any) -> R:
            hit = kept.get(id(node))
            if hit is not None and hit[0] is node:
                return hit[1]
            answer = fn(node)
            if len(kept) >= limit:
                kept.clear()
            kept[id(node)] = (node, answer)
            return answer

        cached.cache_clear = kept.clear  # type: ignore[attr-defined]
        _FILE_CACHES.append(kept.clear)
        return cached
    return decorate


_walk = per_node(_MAX_WALKS)(_breadth_first)
_statements_kept = per_node(_MAX_WALKS)(_statements)
