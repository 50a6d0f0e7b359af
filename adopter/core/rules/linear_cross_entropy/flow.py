"""Where statements sit in one function and what runs after what, for both forms of the site: the
head's assignment, the blocks a statement is nested in, whether one statement always follows
another or excludes it, and the one check of what changes the logits between the head and the loss.

Every question is asked of one function's syntax tree (the analysis never changes it) through its
parent map, built once per function (:func:`parent_map`).
"""

from __future__ import annotations

import ast

from adopter.core.match import Refusal
from adopter.core.rules.linear_cross_entropy.site import NotAMatch
from adopter.core.syntax import per_node, walk


@per_node(64)  # (every Linear of a function asks for the same map: a file's dozens walked it again)
def parent_map(fn: ast.AST) -> dict[ast.AST, ast.AST]:
    """Each node of ``fn`` (but ``fn``) -> the node holding it."""
    out = {}
    for node in walk(fn):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def statement(node: ast.AST, parents: dict) -> ast.stmt:
    """The statement holding ``node`` (``node`` itself when it is one)."""
    while not isinstance(node, ast.stmt):
        node = parents[node]
    return node


def starts(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def ends(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset


def inside(node: ast.AST, container: ast.AST) -> bool:
    return starts(container) <= starts(node) and ends(node) <= ends(container)


def head_assignment(head_call: ast.Call, parents: dict) -> tuple[ast.Assign, str]:
    """``(statement, name)`` of ``<name> = <head_call>``; raises :class:`NotAMatch` otherwise."""
    head_stmt = statement(head_call, parents)
    if not (isinstance(head_stmt, ast.Assign) and head_stmt.value is head_call and len(head_stmt.targets) == 1
            and isinstance(head_stmt.targets[0], ast.Name)):
        raise NotAMatch("the Linear's output is not assigned to a plain name")
    return head_stmt, head_stmt.targets[0].id


# ---------------------------------------------------------------- what the logits go through


def transformed(node: ast.Name, stmt: ast.stmt, parents: dict, source_line) -> Refusal | None:
    """``logits-transformed`` when ``node``, a use of the logits' name between the head and the loss
    (in ``stmt``), rebinds the name or changes the tensor in place (a ``<name>.<op>_(...)`` method,
    an item assignment): the fused loss would take the head's output instead; else None."""
    name = node.id
    if isinstance(node.ctx, (ast.Store, ast.Del)):
        return Refusal("logits-transformed", f"line {stmt.lineno} rebinds {name} between the head and the "
                                             f"loss ({source_line(stmt.lineno)}): the fused loss would take "
                                             "the head's output")
    parent = parents.get(node)
    in_place = isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
    if in_place or (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)):
        return Refusal("logits-transformed", f"line {stmt.lineno} changes {name} in place between the head "
                                             f"and the loss ({source_line(stmt.lineno)})")
    return None


def packed(name: ast.Name, parents: dict) -> bool:
    """``name`` is packed into a returned structure: an element of a tuple/list/dict display or an
    argument of a ``...Output...(...)`` constructor (transformers' ModelOutput classes)."""
    parent = parents.get(name)
    if isinstance(parent, ast.keyword):
        parent = parents.get(parent)
        if not isinstance(parent, ast.Call):
            return False
    if isinstance(parent, (ast.Tuple, ast.List)) or (isinstance(parent, ast.Dict) and name in parent.values):
        return True
    if isinstance(parent, ast.Call) and parent.func is not name:
        func = parent.func
        callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return "Output" in callee
    return False


def returned(name: ast.Name, parents: dict) -> bool:
    """``return <name>``: the logits are the function's output as they are."""
    parent = parents.get(name)
    return isinstance(parent, ast.Return) and parent.value is name


# ---------------------------------------------------------------- blocks and paths


def block_path(stmt: ast.stmt, parents: dict) -> list[tuple[ast.AST, str, int]]:
    """``[(owner, field, index), ...]`` from the function body down to ``stmt``."""
    out = []
    node = stmt
    while node in parents:
        owner = parents[node]
        for name in ("body", "orelse", "finalbody"):
            block = getattr(owner, name, None)
            if isinstance(block, list) and node in block:
                out.append((owner, name, block.index(node)))
                break
        else:
            for handler in getattr(owner, "handlers", ()):
                if node is handler:
                    out.append((owner, "handlers", 0))
                    break
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            break
        node = owner
    return list(reversed(out))


def exclusive(a: ast.stmt, b: ast.stmt, parents: dict) -> bool:
    """``a`` and ``b`` lie in different branches of one ``if`` (and no loop repeats it): no run
    executes both."""
    pa, pb = block_path(a, parents), block_path(b, parents)
    for (oa, fa, _), (ob, fb, _) in zip(pa, pb):
        if oa is not ob:
            return False
        if fa != fb:
            if not isinstance(oa, ast.If):
                return False
            node = oa
            while node in parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node = parents[node]
                if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                    return False
            return True
    return False


def dominated(head: ast.stmt, stmt: ast.stmt, parents: dict) -> str:
    """"" when ``stmt`` runs after ``head`` on every path that reaches it from there: in ``head``'s
    block after it, or inside ``if`` statements that follow it there; else why not."""
    ph, ps = block_path(head, parents), block_path(stmt, parents)
    depth = len(ph) - 1
    if len(ps) <= depth or any(x[:2] != y[:2] or x[2] != y[2] for x, y in zip(ph[:depth], ps[:depth])):
        return f"line {stmt.lineno} is not in the block of the head (line {head.lineno}) or nested below it"
    if ps[depth][:2] != ph[depth][:2] or ps[depth][2] <= ph[depth][2]:
        return f"line {stmt.lineno} does not follow the head (line {head.lineno}) in its block"
    for owner, _, _ in ps[depth + 1:]:
        if not isinstance(owner, ast.If):
            return f"line {stmt.lineno} is inside a {type(owner).__name__.lower()} statement"
    return ""


def killed(read: ast.AST, head: ast.stmt, name: str, fn: ast.AST, parents: dict) -> bool:
    """A store of ``name`` after the head definitely runs between the head and ``read``."""
    r_stmt = statement(read, parents)
    for node in walk(fn):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store)):
            continue
        s_stmt = statement(node, parents)
        if starts(s_stmt) <= starts(head) or starts(s_stmt) >= starts(r_stmt) or inside(r_stmt, s_stmt):
            continue
        if exclusive(s_stmt, head, parents):
            continue
        # the store's block holds the read (at the store's level or below) after the store
        ps, pr = block_path(s_stmt, parents), block_path(r_stmt, parents)
        d = len(ps) - 1
        if len(pr) > d and all(x == y for x, y in zip(ps[:d], pr[:d])) and pr[d][:2] == ps[d][:2] \
                and pr[d][2] > ps[d][2]:
            return True
    return False
