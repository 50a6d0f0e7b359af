"""The rule's DSL variants, one per form, and which of them a match is: the sum (``x * cos +
r * sin``), the complex product read as real (``view_as_real(z * freqs)``), or the parts joined
(``torch.stack``/``cat``/``concat``); with the matched nodes each form's reading starts from and the
syntax node at a matched node's position."""

from __future__ import annotations

import ast
from collections.abc import Iterable

from adopter.core.dsl import Layer, Span, TensorOp
from adopter.core.syntax import walk

DSL = """
rule rotary_embedding
forward:
    $x * $cos -> $a; $r * $sin -> $b; $a + $b -> $out

rule rotary_embedding
forward:
    $z * $freqs -> $p; torch.view_as_real($p) -> $out

rule rotary_embedding
forward:
    torch.stack|torch.cat|torch.concat($parts) -> $out
"""


def form_of(nodes: Iterable[object]) -> str:
    """Which variant matched: ``sum``, ``complex`` or ``pairs``."""
    for n in nodes:
        if isinstance(n, Layer) and n.type == "torch.view_as_real":
            return "complex"
        if isinstance(n, Layer):
            return "pairs"
    return "sum"


def sum_nodes(nodes: Iterable[object]) -> tuple[TensorOp | None, list[TensorOp]]:
    """(the sum, the two products) among a sum match's nodes."""
    nodes = list(nodes)
    add = next((n for n in nodes if isinstance(n, TensorOp) and n.op == "+"), None)
    products = [n for n in nodes if isinstance(n, TensorOp) and n.op == "*"]
    return add, products


def layer_node(nodes: Iterable[object]) -> Layer | None:
    """The call a complex or pairs match is anchored at (``view_as_real``, the stack)."""
    return next((n for n in nodes if isinstance(n, Layer)), None)


def position(node: ast.AST) -> tuple[int, int, int, int]:
    """A syntax node's position, as a :class:`Span`'s (lines 1-based, columns 0-based)."""
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def span_position(span: Span) -> tuple[int, int, int, int]:
    return span.line, span.col, span.end_line, span.end_col


def node_at(fn: ast.AST, span: Span, kind: type[ast.AST]) -> ast.AST | None:
    """The node of type ``kind`` in ``fn`` at exactly ``span``, else None."""
    want = span_position(span)
    for n in walk(fn):
        if isinstance(n, kind) and position(n) == want:
            return n
    return None
