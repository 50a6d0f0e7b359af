"""Helpers for the rewrite tests: hand-built attention matches (positions only)."""

from __future__ import annotations

import ast

from adopter.dsl import Layer, Span
from adopter.structures import Match, MatchedNode


def matmul_match(text: str, rule: str, function: str, class_name: str | None = None) -> Match:
    """A match whose nodes are the two matmuls (score and output) of ``function``."""
    tree = ast.parse(text)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function.split(".")[-1])
    calls = [
        n
        for n in ast.walk(fn)
        if (isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "matmul")
        or (isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult))
    ]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    nodes = []
    for index, call in enumerate(calls):
        stmt = next(s for s in ast.walk(fn) if isinstance(s, ast.stmt) and s.lineno <= call.lineno <= s.end_lineno
                    and not isinstance(s, (ast.FunctionDef, ast.If)))
        span = Span(call.lineno, call.col_offset, call.end_lineno, call.end_col_offset, function, stmt.lineno, stmt.end_lineno)
        nodes.append(MatchedNode(index, Layer("torch.matmul", span=span)))
    return Match(rule=rule, file="<test>", class_name=class_name, function=function, nodes=tuple(nodes))
