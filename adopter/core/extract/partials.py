"""``functools.partial``, resolved statically: what a call of a bound callable calls.

``partial(F.softmax, dim=-1)`` called with ``x`` calls ``F.softmax(x, dim=-1)``; a partial of a
partial binds the inner one's arguments first (``partial(partial(f, a, k=1), b, k=2)(x)`` is
``f(a, b, x, k=2)``: positional arguments in order, an outer keyword overriding an inner one,
the call's own keywords overriding both), and a partial of a name holding a partial (a
module-level ``attend = partial(...)``) goes through it. Extraction holds a partial wherever it
is made — ``self.fn = partial(...)`` in ``__init__`` (also through a local or a parameter's
default), a module-level name, ``partial(...)(x)`` in the body — and a call of it becomes the
call of the function it binds, with the bound arguments merged, so every rule sees
``F.softmax(x, dim=-1)`` whatever the spelling. The bound arguments are kept as the source
text they are (never evaluated where the call is: a name there may mean something else).
Anything not settled (``*args``/``**kwargs`` bound, a callee that is no name) resolves to None.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from adopter.core.syntax import dotted_name

# nesting followed at most (partials of partials of names holding partials...)
_MAX_DEPTH = 8


@dataclass(frozen=True)
class Bound:
    """A partial resolved: the callable it finally calls (an expression that is no partial) and
    the arguments bound to it, in the order a call passes them."""

    func: ast.expr
    args: tuple[ast.expr, ...]
    keywords: tuple[tuple[str, ast.expr], ...]


def is_partial(func: ast.expr, fqn: Callable[[str], str | None]) -> bool:
    """``func`` names ``functools.partial`` (however imported)."""
    d = dotted_name(func)
    return d is not None and (fqn(d) or d) == "functools.partial"


def unwrap(call: ast.expr, fqn: Callable[[str], str | None],
           named: Callable[[str], ast.expr | None] = lambda _name: None) -> Bound | None:
    """The :class:`Bound` of ``call`` when it is a ``functools.partial(...)`` call (``named``
    gives the partial a bare name holds, for ``partial(attend, ...)`` and the name itself);
    None otherwise or when the binding is not settled statically."""
    layers: list[ast.Call] = []  # outermost first
    cur = call
    seen: set[int] = set()
    while len(layers) <= _MAX_DEPTH:
        if type(cur) is ast.Name and layers:
            held = named(cur.id)
            if held is None or id(held) in seen:
                break
            seen.add(id(held))
            cur = held
            continue
        if type(cur) is not ast.Call or not is_partial(cur.func, fqn):
            break
        if not cur.args or any(type(a) is ast.Starred for a in cur.args) or any(k.arg is None for k in cur.keywords):
            return None
        layers.append(cur)
        cur = cur.args[0]
    if not layers or len(layers) > _MAX_DEPTH or type(cur) is ast.Call and is_partial(cur.func, fqn):
        return None
    args: list[ast.expr] = []
    keywords: dict[str, ast.expr] = {}
    for layer in reversed(layers):  # innermost first: its arguments come first
        args.extend(layer.args[1:])
        for k in layer.keywords:
            keywords.pop(k.arg, None)
            keywords[k.arg] = k.value
    return Bound(cur, tuple(args), tuple(keywords.items()))


def merge(bound_args: list, bound_keywords: list, args: list, keywords: list) -> tuple[list, list]:
    """A call's ``(positional, [(keyword, value)])`` with a partial's bound ones merged in, as
    ``functools.partial`` does: bound positionals first, a call keyword overriding a bound one."""
    given = {k for k, _v in keywords if k is not None}
    return list(bound_args) + list(args), [(k, v) for k, v in bound_keywords if k not in given] + list(keywords)
