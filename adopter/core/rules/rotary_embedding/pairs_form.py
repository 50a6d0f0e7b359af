"""The pairs form: the two parts rotated in real numbers and joined, ``torch.stack((x1 * cos - x2 *
sin, x1 * sin + x2 * cos), dim=-1)`` (llama2.c; the parts inline or assigned just before, any order
of terms and factors) or ``torch.cat`` of the same parts. Read into :class:`PairParts`, what the
codemod passes ``rotary_pairs`` and the part statements it deletes; a flipped sign or factors paired
otherwise compute something else."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.match import NotACandidate
from adopter.core.rules.rotary_embedding.literals import last_dim_arg
from adopter.core.rules.rotary_embedding.site import Site, pure, removable_run, statement_names
from adopter.core.syntax import walk

Term = tuple[int, tuple[ast.expr, ast.expr]]  # (sign, the product's two factors)


def _terms(e: ast.expr, sign: int = 1) -> list[Term] | None:
    """``e`` as a signed sum of products of two factors (``a * b - c * d``), else None."""
    if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
        left, right = _terms(e.left, sign), _terms(e.right, -sign if isinstance(e.op, ast.Sub) else sign)
        return None if left is None or right is None else left + right
    if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
        return _terms(e.operand, -sign)
    if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
        factors = []
        for f in (e.left, e.right):
            while isinstance(f, ast.UnaryOp) and isinstance(f.op, ast.USub):
                sign, f = -sign, f.operand
            if isinstance(f, (ast.BinOp, ast.UnaryOp, ast.Constant, ast.BoolOp, ast.Compare, ast.IfExp)):
                return None
            factors.append(f)
        return [(sign, (factors[0], factors[1]))]
    return None


def _pair(a: ast.expr, b: ast.expr) -> tuple[str, str]:
    return tuple(sorted((ast.dump(a), ast.dump(b))))


_ANGLE_WORDS = ("cos", "sin", "freq", "theta", "angle", "rot")


def _solve(first: list[Term], second: list[Term]) -> tuple[ast.expr, ast.expr, ast.expr, ast.expr] | str:
    """(x1, x2, cos, sin) with ``first == x1*cos - x2*sin`` and ``second == x2*cos + x1*sin``."""
    plus = [f for s, f in first if s > 0]
    minus = [f for s, f in first if s < 0]
    if len(plus) != 1 or len(minus) != 1:
        return "its first part is not a difference of two products (x1 * cos - x2 * sin)"
    if any(s < 0 for s, _ in second):
        return "its second part is not a sum of two products (x1 * sin + x2 * cos): a flipped sign"
    want = sorted(_pair(*f) for _, f in second)
    found = []
    for x1, c in (plus[0], plus[0][::-1]):
        for x2, s in (minus[0], minus[0][::-1]):
            if sorted((_pair(x2, c), _pair(x1, s))) == want:
                found.append((x1, x2, c, s))
    if not found:
        return "its parts pair the factors otherwise than x1 * cos - x2 * sin and x1 * sin + x2 * cos"

    def angles(sol) -> int:
        return sum(any(w in ast.unparse(t).lower() for w in _ANGLE_WORDS) for t in sol[2:])

    return max(found, key=angles)


@dataclass(frozen=True)
class PairParts:
    """``torch.stack((x1*cos - x2*sin, x1*sin + x2*cos), dim=-1)`` (or ``torch.cat`` of the same
    parts) read from the source."""

    call: ast.Call
    x1: ast.expr
    x2: ast.expr
    cos: ast.expr
    sin: ast.expr
    join: str  # "stack" or "cat"
    delete: tuple[ast.stmt, ...] = ()


def _part_statement(e: ast.expr, site: Site) -> tuple[ast.expr, ast.stmt | None]:
    """A part of the stack: its expression (read from its assignment when it is a name assigned
    once) and that assignment."""
    assigned = site.facts.assigned_value(e)
    if assigned is not None and _terms(assigned[1]) is not None:
        return assigned[1], assigned[0]
    return e, None


def _pair_shape(call: ast.Call, site: Site) -> tuple[str, list[list[Term]], list[ast.stmt]] | None:
    """(join, the two parts' terms, their statements) when ``call`` stacks or concatenates two
    signed sums of two products, else None."""
    if site.names.is_(call.func, "stack"):
        join = "stack"
    elif site.names.is_(call.func, "cat", "concat"):
        join = "cat"
    else:
        return None
    seq = call.args[0] if call.args else None
    if not isinstance(seq, (ast.Tuple, ast.List)) or len(seq.elts) != 2:
        return None
    terms, stmts = [], []
    for elt in seq.elts:
        value, stmt = _part_statement(elt, site)
        t = _terms(value)
        if t is None or len(t) != 2:
            return None
        terms.append(t)
        if stmt is not None:
            stmts.append(stmt)
    return join, terms, stmts


def _sibling(stmt: ast.stmt, site: Site) -> bool:
    """A statement of another pairs rotation of the block (a part ``a * c - b * s`` assigned to a
    name, or a statement stacking two such parts): rewritten with it, stepped over."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        t = _terms(stmt.value)
        if t is not None and len(t) == 2:
            return True
    if isinstance(stmt, (ast.Assign, ast.Return, ast.Expr, ast.AugAssign, ast.AnnAssign)):
        return any(isinstance(n, ast.Call) and _pair_shape(n, site) is not None for n in walk(stmt))
    return False


def pair_parts(call: ast.Call, site: Site) -> PairParts | str:
    """Read ``call`` as the pairs rotation; a :class:`NotACandidate` when it stacks anything else."""
    shape = _pair_shape(call, site)
    if shape is None:
        return NotACandidate(f"{ast.unparse(call.func)} does not join two sums of products")
    join, (first, second), stmts = shape
    if not last_dim_arg(call, 1):
        return f"it {'stacks' if join == 'stack' else 'concatenates'} the rotated parts on another dimension than -1"
    solved = _solve(first, second)
    if isinstance(solved, str):
        return f"{ast.unparse(call)[:80]}: {solved}"
    x1, x2, cos, sin = solved
    for leaf in solved:
        if not pure(leaf):
            return f"{ast.unparse(leaf)} has calls: it cannot be evaluated once instead of twice"
    delete: list[ast.stmt] = []
    if stmts:
        names = set().union(*(statement_names(s) or set() for s in stmts))
        run = removable_run(site.facts, site.stmt, names, call, lambda s: _sibling(s, site)) \
            if site.stmt is not None else []
        missing = [s for s in stmts if not any(s is r for r in run)]
        if missing:
            return (f"line {missing[0].lineno} ({ast.unparse(missing[0])[:60]}) computes a rotated part that "
                    "other code reads, or not right before the stack: it cannot be removed")
        delete = [s for s in run if any(s is t for t in stmts)]
    return PairParts(call, x1, x2, cos, sin, join, tuple(delete))
