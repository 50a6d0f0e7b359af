"""The sum form, ``x * cos + rotate_half(x) * sin`` (either product first, either factor order):
the rotation operand is a call of a same-file function, a method or a ``@staticmethod`` whose
source is the half-split or the interleaved rotation (:mod:`.rotation`), or the half-split rotation
written inline in the calling function (litgpt's ``torch.cat((-x2, x1), dim=-1)`` of the halves of
``x`` by slicing); the same ``x`` is multiplied by cos. Read into :class:`RotaryParts`, what the
codemod passes ``rotary``/``rotary_interleaved`` and the statements it deletes."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.rules.rotary_embedding.rotation import HALF_SPLIT, rotation_layout, rotation_param
from adopter.core.rules.rotary_embedding.scope import class_def, method_def, module_function
from adopter.core.rules.rotary_embedding.site import (
    Facts,
    Site,
    pure,
    removable_run,
    statement_names,
    unsafe_operand,
)
from adopter.core.rules.rotary_embedding.values import InlineHalfSplitValues, NotTheRotation
from adopter.core.syntax import walk


@dataclass(frozen=True)
class RotaryParts:
    """``x * cos + rotate_half(x) * sin`` read from the source: the expressions' nodes."""

    expr: ast.BinOp
    x: ast.expr
    cos: ast.expr
    sin: ast.expr
    rotate_half: str | None  # what the rewrite passes as the rotation (None: the statements go)
    rotate_half_call: ast.expr  # the rotation operand in the sum
    layout: str = HALF_SPLIT
    delete: tuple[ast.stmt, ...] = ()

    @property
    def kernel(self) -> str:
        return "rotary" if self.layout == HALF_SPLIT else "rotary_interleaved"


@dataclass(frozen=True)
class _Candidate:
    """A rotation operand of the sum, before its source is checked: the tensor it rotates and how
    the rotation is reached (``function``/``method``/``static`` call, ``inline`` cat)."""

    node: ast.expr
    x: ast.expr
    form: str
    name: str  # function or method name; for inline: the rotated tensor's name ("" for a cat in the sum)
    owner: str = ""  # "self" / the class name for method calls
    cat: ast.Call | None = None


@dataclass(frozen=True)
class _Rotating:
    """A checked rotation operand: the layout, what the rewrite passes for it, what it deletes."""

    layout: str
    passed: str | None  # the rotation argument's text (None: the kernel's own, the statements deleted)
    delete: tuple[ast.stmt, ...] = ()


def _sliced_name(e: ast.expr, facts: Facts, depth: int = 0) -> str | None:
    """The name whose slice ``e`` is, following names assigned once (``x1`` -> ``x[..., :h]`` -> ``x``)."""
    if depth > 8:
        return None
    if isinstance(e, ast.UnaryOp):
        return _sliced_name(e.operand, facts, depth + 1)
    if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name):
        return e.value.id
    if isinstance(e, ast.Name) and e.id in facts.single and facts.single[e.id][2] is None:
        return _sliced_name(facts.single[e.id][1], facts, depth + 1)
    return None


def _candidate(e: ast.expr, site: Site) -> _Candidate | None:
    """``e`` read as a call of a rotation (without checking the rotation yet), or None."""
    if isinstance(e, ast.Call) and len(e.args) == 1 and not e.keywords and not isinstance(e.args[0], ast.Starred):
        func = e.func
        if site.names.is_(func, "cat", "concat"):
            pass  # a concatenation with one argument: read below
        elif isinstance(func, ast.Name):
            return _Candidate(e, e.args[0], "function", func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if site.cls is not None and site.first_param == owner and site.facts.bindings.get(owner) == 1:
                return _Candidate(e, e.args[0], "method", func.attr, owner)
            if owner not in site.facts.bindings and class_def(site.tree, owner) is not None:
                return _Candidate(e, e.args[0], "static", func.attr, owner)
            return None
    cat, name = e, ""
    if isinstance(e, ast.Name):
        assigned = site.facts.assigned_value(e)
        if assigned is None:
            return None
        cat, name = assigned[1], e.id
    if isinstance(cat, ast.Call) and site.names.is_(cat.func, "cat", "concat") and cat.args \
            and isinstance(cat.args[0], (ast.Tuple, ast.List)) and len(cat.args[0].elts) == 2:
        root = _sliced_name(cat.args[0].elts[1], site.facts)
        if root is not None:
            return _Candidate(e, ast.Name(id=root, ctx=ast.Load()), "inline", name, cat=cat)
    return None


def _check(cand: _Candidate, site: Site, replaced: ast.expr) -> _Rotating | str:
    """The rotation ``cand`` reaches, read from its source; or why it is not a rotation."""
    if cand.form == "function":
        if cand.name in site.facts.bindings:
            return f"{cand.name} is a parameter or local of the calling function"
        fn = module_function(site.tree, cand.name)
        if isinstance(fn, str):
            return fn
        layout, why = rotation_layout(fn, site.tree, "function")
        return _Rotating(layout, cand.name) if layout else why
    if cand.form in ("method", "static"):
        owner = site.cls if cand.form == "method" else class_def(site.tree, cand.owner)
        fn = method_def(site.tree, owner, cand.name)
        if isinstance(fn, str):
            return fn
        layout, why = rotation_layout(fn, site.tree, cand.form)
        if not layout and rotation_param(fn, cand.form) is None:
            why = (f"{owner.name}.{cand.name} is neither a @staticmethod nor a method that leaves self alone"
                   if cand.form == "method" else f"{owner.name}.{cand.name} is not a @staticmethod of one argument")
        return _Rotating(layout, f"{cand.owner}.{cand.name}") if layout else why
    return _check_inline(cand, site, replaced)


def _check_inline(cand: _Candidate, site: Site, replaced: ast.expr) -> _Rotating | str:
    """The half-split rotation of a name written in the calling function's statements: the
    rotation and the statements only it reads, or the rotated tensor handed over when one of them
    must stay."""
    root = cand.x.id
    reader = InlineHalfSplitValues(site.names, site.facts)
    try:
        got = reader.value(cand.cat, {root: "x"})
    except NotTheRotation as why:
        return f"the inline rotation {ast.unparse(cand.node)} is not the half-split rotation: {why}"
    if got != "rot":
        return f"the inline rotation {ast.unparse(cand.node)} is not the half-split rotation"
    names = set(reader.resolved) | ({cand.name} if cand.name else set())
    if not site.facts.bound_once(root) and not _unchanged_since(site, root, names):
        return f"{root} is assigned between its halves and the sum: the sum may read another value"
    run = removable_run(site.facts, site.stmt, names, replaced) if site.stmt is not None else []
    if cand.name and not any(cand.name in (statement_names(s) or ()) for s in run):
        return _Rotating(HALF_SPLIT, cand.name)  # its statement stays: the rotated tensor is handed over
    return _Rotating(HALF_SPLIT, None, tuple(run))


def _unchanged_since(site: Site, root: str, names: set[str]) -> bool:
    """The statements binding ``names`` and the sum's statement share a block, and nothing between
    the first of them and the sum binds ``root`` (the sum's own assignment binds after reading)."""
    if site.stmt is None:
        return False
    where = site.facts.block_of(site.stmt)
    if where is None:
        return False
    block, end = where
    starts = []
    for name in names:
        bound = site.facts.single.get(name)
        index = next((i for i, s in enumerate(block) if bound is not None and s is bound[0]), None)
        if index is None:
            return False
        starts.append(index)
    first = min(starts, default=end)
    return not any(isinstance(n, ast.Name) and n.id == root and not isinstance(n.ctx, ast.Load)
                   for stmt in block[first:end] for n in walk(stmt))


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def rotary_parts(expr: ast.AST, tree: ast.Module, enclosing: ast.AST | None, qualname: str = "") -> RotaryParts | str:
    """Read ``expr`` as ``x * cos + rotation(x) * sin`` (either product first, either factor
    order): the parts, or why it is not that computation. ``enclosing``: the function holding it
    (``qualname``: its qualified name, ``Cls.method`` for a method)."""
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)):
        return "the matched sum is not an addition"
    products = (expr.left, expr.right)
    if not all(isinstance(p, ast.BinOp) and isinstance(p.op, ast.Mult) for p in products):
        return "the addition's operands are not both products"
    site = Site.of(tree, enclosing, qualname, expr)
    why = "neither product is rotate_half(x) * sin with x the other product's factor"
    for rotated, plain in (products, products[::-1]):
        for call, sin in ((rotated.left, rotated.right), (rotated.right, rotated.left)):
            cand = _candidate(call, site)
            if cand is None:
                continue
            x = cand.x
            why = (f"{ast.unparse(call)} rotates another tensor than the one multiplied by cos "
                   f"({ast.unparse(plain)})")
            for x_there, cos in ((plain.left, plain.right), (plain.right, plain.left)):
                if not _same(x_there, x):
                    continue
                got = _check(cand, site, expr)
                if isinstance(got, str):
                    return got
                if not pure(x):
                    return f"x ({ast.unparse(x)}) has calls: it cannot be evaluated once instead of twice"
                if unsafe_operand(cos) or unsafe_operand(sin):
                    return "cos or sin assigns or yields"
                return RotaryParts(expr, x_there, cos, sin, got.passed, call, got.layout, got.delete)
    return why
