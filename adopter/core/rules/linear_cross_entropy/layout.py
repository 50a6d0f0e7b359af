"""How the written-out form lays the logits out for torch's cross entropy: the chain of subscripts
and methods from the logits' name to the cross entropy's ``(tokens, vocab)`` input
(:func:`chain`), and the order of it the kernel replays (:func:`layout`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from adopter.core.rules.linear_cross_entropy.names import int_literal, names_in, qualified
from adopter.core.rules.linear_cross_entropy.site import ExprRef, Layout, NotAMatch

FLOAT32 = ("torch.float32", "torch.float")


def _last_size_of(node: ast.AST, names: set[str]) -> ast.Name | None:
    """The Name of ``<n>.size(-1)`` / ``<n>.shape[-1]`` (``n`` in ``names``), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names and not node.keywords \
            and len(node.args) == 1 and int_literal(node.args[0]) == -1:
        return node.func.value
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
            and isinstance(node.value.value, ast.Name) and node.value.value.id in names \
            and int_literal(node.slice) == -1:
        return node.value.value
    return None


def _own_last_size(vocab: ast.AST, receiver: ast.AST) -> ast.AST | None:
    """``receiver`` itself when ``vocab`` is ``<receiver>.size(-1)`` / ``<receiver>.shape[-1]`` for
    a receiver that is not a plain name (handled by :func:`_last_size_of`), else None."""
    if isinstance(receiver, ast.Name):
        return None
    if isinstance(vocab, ast.Call) and isinstance(vocab.func, ast.Attribute) and vocab.func.attr == "size" \
            and not vocab.keywords and len(vocab.args) == 1 and int_literal(vocab.args[0]) == -1:
        inner = vocab.func.value
    elif isinstance(vocab, ast.Subscript) and isinstance(vocab.value, ast.Attribute) \
            and vocab.value.attr == "shape" and int_literal(vocab.slice) == -1:
        inner = vocab.value.value
    else:
        return None
    return inner if ast.dump(inner) == ast.dump(receiver) else None


def _rows_subscript(node: ast.Subscript) -> bool:
    """A subscript of slices with literal int bounds and at most one ``...``."""
    elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    dots = 0
    for e in elements:
        if isinstance(e, ast.Constant) and e.value is Ellipsis:
            dots += 1
        elif isinstance(e, ast.Slice):
            if any(b is not None and int_literal(b) is None for b in (e.lower, e.upper, e.step)):
                return False
        else:
            return False
    return dots <= 1


def chain(expr: ast.expr, names: set[str], imports: dict[str, str], local: set[str]) -> tuple[str, list, list]:
    """``(base name, ops in application order, Name nodes read)`` of an expression that lays out
    the logits: a name of ``names`` followed by subscripts of rows, ``.contiguous()``, ``.float()``
    (``.to(torch.float32)``), ``.view/.reshape(-1, V)``, ``.flatten(a, b)``; raises NotAMatch."""
    ops: list = []
    reads: list = []
    node = expr
    while True:
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Attribute) and len(node.args) == 2 \
                and not node.keywords and qualified(node.func, imports, local) == "einops.rearrange":
            pattern = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            if not (isinstance(pattern, str) and _classes_first_pattern(pattern)):
                raise NotAMatch("the logits are rearranged otherwise than (b, n, classes) -> (b, classes, n)")
            ops.append(("classes", ("rearrange", pattern)))
            node = node.args[0]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            if method in ("transpose", "permute") and not node.keywords:
                dims = tuple(int_literal(a) for a in node.args)
                if method == "transpose" and len(dims) == 2 and None not in dims and dims[0] % 3 != dims[1] % 3 \
                        and {dims[0] % 3, dims[1] % 3} == {1, 2} and all(-3 <= d <= 2 for d in dims):
                    ops.append(("classes", ("transpose", *dims)))
                elif method == "permute" and dims == (0, 2, 1):
                    ops.append(("classes", ("permute", *dims)))
                else:
                    raise NotAMatch(f"the logits reach the cross entropy through .{method}"
                                    f"({', '.join(map(ast.unparse, node.args))})")
            elif method in ("view", "reshape") and len(node.args) == 2 and not node.keywords \
                    and int_literal(node.args[0]) == -1:
                vocab = node.args[1]
                last = _last_size_of(vocab, names)
                own = _own_last_size(vocab, receiver)
                if own is not None:
                    # t.reshape(-1, t.size(-1)) with t an expression (an inlined helper's parameter)
                    reads += names_in(own, names)
                    ops.append((method, None))
                elif last is not None:
                    reads.append(last)
                    ops.append((method, None))
                elif names_in(vocab, names):
                    raise NotAMatch(f"the logits' .{method} reads them in {ast.unparse(vocab)}")
                else:
                    ops.append((method, vocab))
            elif method == "flatten" and len(node.args) <= 2 and all(k.arg in ("start_dim", "end_dim")
                                                                     for k in node.keywords):
                dims = dict(zip(("start_dim", "end_dim"), node.args))
                dims.update({k.arg: k.value for k in node.keywords})
                start = int_literal(dims.get("start_dim")) if "start_dim" in dims else 0
                end = int_literal(dims.get("end_dim")) if "end_dim" in dims else -1
                if start is None or end is None:
                    raise NotAMatch("the logits are flattened over dimensions that are not int literals")
                ops.append(("flatten", (start, end)))
            elif method == "contiguous" and not node.args and not node.keywords:
                ops.append(("contiguous", None))
            elif (method == "float" and not node.args and not node.keywords) or (
                    method == "to" and len(node.args) == 1 and not node.keywords
                    and qualified(node.args[0], imports, local) in FLOAT32):
                ops.append(("float", None))
            else:
                raise NotAMatch(f"the logits reach the cross entropy through .{method}(...)")
            node = receiver
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if not _rows_subscript(node):
                raise NotAMatch(f"the logits are indexed by {ast.unparse(node.slice)} (not slices of rows)")
            ops.append(("rows", node))
            node = node.value
        elif isinstance(node, ast.Name) and node.id in names:
            reads.append(node)
            return node.id, list(reversed(ops)), reads
        else:
            raise NotAMatch("the cross entropy's input is not the logits laid out as (tokens, vocab)")



def _classes_first_pattern(pattern: str) -> bool:
    """``"b n c -> b c n"``: three plain axes, the last two swapped (einops raises on any input that
    is not 3-D)."""
    left, arrow, right = pattern.partition("->")
    a, b = left.split(), right.split()
    return bool(arrow) and len(a) == 3 == len(set(a)) and all(x.isidentifier() for x in a) \
        and b == [a[0], a[2], a[1]]


def layout(ops: list, ref: Callable[[ast.expr], ExprRef]) -> Layout:
    """The :class:`Layout` of ``ops`` (application order), its expressions given by ``ref``; raises
    NotAMatch for an order the kernel does not replay exactly."""
    kinds = [k for k, _ in ops]
    if "classes" in kinds:
        # (b, n, vocab) logits with the classes moved to dim 1 and a (b, n) target: torch's cross
        # entropy over dim 1 is the per-token one of the (tokens, vocab) rows (the kernel checks the
        # shapes at run time and replays the source's op otherwise)
        if sorted(kinds) not in (["classes"], ["classes", "float"]):
            raise NotAMatch("the logits are laid out otherwise than one move of the classes to dim 1 "
                            "(and a .float())")
        return Layout(flatten=ops[kinds.index("classes")][1], upcast="float" in kinds)
    flat = [i for i, k in enumerate(kinds) if k in ("view", "reshape", "flatten")]
    if len(flat) != 1:
        raise NotAMatch("the logits are not flattened to (tokens, vocab) once" if not flat else
                        "the logits are flattened more than once")
    at = flat[0]
    before, after = kinds[:at], kinds[at + 1:]
    if any(kinds.count(k) > 1 for k in ("rows", "contiguous", "float")) or "rows" in after:
        raise NotAMatch("the logits' layout is not rows, contiguous, flatten, float")
    if "rows" in before and before.index("rows") != 0:
        raise NotAMatch("the logits are sliced after being changed")
    if "float" in before and "rows" in before:
        raise NotAMatch("the sliced logits are cast before being flattened")
    kind, value = ops[at]
    rows = _rows(ops[0][1], ref) if "rows" in before else None
    if kind == "flatten":
        flatten, vocab = value, None
    else:
        flatten, vocab = kind, (ref(value) if value is not None else None)
    return Layout(rows=rows, contiguous="contiguous" in before, flatten=flatten, vocab=vocab,
                  upcast="float" in kinds)


def _rows(sub: ast.Subscript, ref: Callable[[ast.expr], ExprRef]) -> tuple:
    """The elements of a rows subscript (:func:`_rows_subscript`): None for ``...``, else the slice's
    bounds."""
    elements = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
    return tuple(None if isinstance(e, ast.Constant) and e.value is Ellipsis else
                 tuple(ref(b) if b is not None else None for b in (e.lower, e.upper, e.step)) for e in elements)


def ce_input(call: ast.Call) -> tuple[ast.expr | None, list[ast.expr], list[ast.keyword]]:
    """``(input, other positional arguments, other keywords)`` of a cross entropy call."""
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0], list(call.args[1:]), list(call.keywords)
    for k in call.keywords:
        if k.arg == "input":
            return k.value, list(call.args), [o for o in call.keywords if o is not k]
    return None, [], []
