"""A same-file helper of the written-out form, inlined: the expression ``helper(<call's arguments>)``
computes when the helper is straight-line once the call settles its ``if``s, or once run-time guards
of the rewrite settle them (litgpt's ``chunk_size == 0`` with the chunk size read off the config).
"""

from __future__ import annotations

import ast
import copy

from adopter.core.rules.linear_cross_entropy.layout import chain
from adopter.core.rules.linear_cross_entropy.site import NotAMatch
from adopter.core.syntax import walk


class _Substitute(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.expr]):
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            return self.env[node.id]
        return node


def _static_test(test: ast.expr, env: dict[str, ast.expr], tensors: set[str]) -> bool | None:
    """The value of an ``if`` test of the helper that the call settles, else None: a parameter bound
    to an int/str/bool/None constant compared with a constant (``chunk_size == 0``), or
    ``isinstance(<p>, list|tuple)`` of a parameter the call binds to the head's tensor (False)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _static_test(test.operand, env, tensors)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" \
            and len(test.args) == 2 and not test.keywords and isinstance(test.args[0], ast.Name) \
            and test.args[0].id in tensors:
        kinds = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
        if all(isinstance(k, ast.Name) and k.id in ("list", "tuple") for k in kinds):
            return False
        return None
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name):
        bound, other = env.get(test.left.id), test.comparators[0]
        if not (isinstance(bound, ast.Constant) and isinstance(other, ast.Constant)):
            return None
        a, b = bound.value, other.value
        if not all(x is None or type(x) in (int, bool, str) for x in (a, b)):
            return None
        op = test.ops[0]
        table = {ast.Eq: a == b, ast.NotEq: a != b, ast.Is: a is b, ast.IsNot: a is not b}
        if type(op) in table:
            return table[type(op)]
        if type(a) is int and type(b) is int:
            return {ast.Lt: a < b, ast.LtE: a <= b, ast.Gt: a > b, ast.GtE: a >= b}.get(type(op))
    return None


def _pure(expr: ast.expr) -> bool:
    """A name, a constant or an attribute chain on one (``self.config.loss_chunk_size``): evaluating
    it again at the same place gives the same value, so a guard may read it before the call does."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, (ast.Name, ast.Constant))


def _guardable(test: ast.expr, env: dict[str, ast.expr], from_call: set[str]) -> bool:
    """A test the call does not settle but that the rewritten source can evaluate at run time in
    the call's place: a parameter the call binds to a pure expression (:func:`_pure`) compared with
    a constant (``chunk_size == 0`` with ``chunk_size=self.config.loss_chunk_size``), or its ``not``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _guardable(test.operand, env, from_call)
    return isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
        and test.left.id in from_call and _pure(env[test.left.id]) \
        and isinstance(test.comparators[0], ast.Constant) \
        and (test.comparators[0].value is None or type(test.comparators[0].value) in (int, bool, str)) \
        and type(test.ops[0]) in (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _settle_branches(body: list[ast.stmt], env: dict[str, ast.expr], tensors: set[str],
                     assume: dict | None = None, open_tests: list | None = None,
                     from_call: set[str] = frozenset()) -> list[ast.stmt]:
    """``body`` with each ``if`` whose test the call settles (:func:`_static_test`, read before any
    statement rebinds what it tests), or whose value ``assume`` fixes (``id(test) -> bool``: a
    run-time guard of the rewrite, see :func:`inline_helper`), replaced by the branch that runs; a
    branch ending in ``return`` ends the body there. Any other ``if`` stays (the helper is then not
    straight-line); those a guard could decide are appended to ``open_tests``."""
    assume = {} if assume is None else assume
    out: list[ast.stmt] = []
    rebound: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.If):
            tested = {n.id for n in walk(stmt.test) if isinstance(n, ast.Name)}
            value = None if tested & rebound else _static_test(stmt.test, env, tensors)
            if value is None and not tested & rebound:
                if id(stmt.test) in assume:
                    value = assume[id(stmt.test)]
                elif open_tests is not None and _guardable(stmt.test, env, from_call):
                    open_tests.append(stmt.test)
            if value is not None:
                taken = _settle_branches(list(stmt.body if value else stmt.orelse), env, tensors, assume,
                                         open_tests, from_call)
                out += taken
                if taken and isinstance(taken[-1], ast.Return):
                    return out
                continue
        out.append(stmt)
        rebound |= {n.id for n in walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(stmt, ast.Return):
            return out
    return out


def inline_helper(helper: ast.FunctionDef, call: ast.Call, tensors: set[str] = frozenset(),
                  accept=None) -> tuple[ast.expr, list[ast.expr]]:
    """``(expr, guards)``: the expression ``helper(<call's arguments>)`` computes, the helper's
    parameters replaced by the call's argument expressions (the call's own nodes) and its locals by
    their values, when every test in ``guards`` (expressions of the call's arguments) is true at run
    time; raises NotAMatch unless the helper is straight-line once its ``if``s are settled: a
    docstring, single-name assignments each read later, one ``return``.

    ``guards`` is empty when the call settles every ``if`` (constants). Otherwise the tests the call
    leaves open but the rewrite can evaluate in its place (:func:`_guardable`: litgpt's ``if
    chunk_size == 0`` with the chunk size read off the config) are assumed true or false, at most
    three, until one assumption makes the helper straight-line and ``accept(expr)`` holds (the
    caller: torch's cross entropy); the rewrite then runs the fused kernel only under those guards
    and the original call otherwise."""
    a = helper.args
    if a.vararg or a.kwarg or helper.decorator_list:
        raise NotAMatch(f"helper {helper.name} takes *args/**kwargs or is decorated")
    params = [p.arg for p in a.posonlyargs + a.args]
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    if any(isinstance(x, ast.Starred) for x in call.args) or any(k.arg is None for k in call.keywords) \
            or len(call.args) > len(params):
        raise NotAMatch(f"the call of {helper.name} unpacks arguments")
    env: dict[str, ast.expr] = dict(zip(params, call.args))
    for k in call.keywords:
        if k.arg in env or k.arg not in params + [p.arg for p in a.kwonlyargs]:
            raise NotAMatch(f"the call of {helper.name} does not bind")
        env[k.arg] = k.value
    from_call = set(env)  # a default is evaluated where the helper is defined: never a guard
    for name in params + [p.arg for p in a.kwonlyargs]:
        if name not in env:
            if name not in defaults:
                raise NotAMatch(f"the call of {helper.name} misses {name}")
            env[name] = copy.deepcopy(defaults[name])
    body = list(helper.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]

    def straight(settled: list[ast.stmt]) -> ast.expr:
        if not settled or not isinstance(settled[-1], ast.Return) or settled[-1].value is None:
            raise NotAMatch(f"helper {helper.name} does not end in one return")
        assigned: list[str] = []
        for stmt in settled[:-1]:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)):
                raise NotAMatch(f"helper {helper.name} is not straight-line (line {stmt.lineno}: "
                                f"{type(stmt).__name__.lower()})")
            assigned.append(stmt.targets[0].id)
        for i, name in enumerate(assigned):
            later = settled[i + 1:]
            if not any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                       for s in later for n in walk(s)):
                raise NotAMatch(f"helper {helper.name} assigns {name} and never reads it")
        local_env = dict(env)
        for stmt in settled[:-1]:
            local_env[stmt.targets[0].id] = _Substitute(local_env).visit(copy.deepcopy(stmt.value))
        return _Substitute(local_env).visit(copy.deepcopy(settled[-1].value))

    def attempt(assume: dict[int, tuple[ast.expr, bool]]) -> tuple[ast.expr, list[ast.expr]]:
        open_tests: list[ast.expr] = []
        settled = _settle_branches(body, env, tensors, {k: v for k, (_, v) in assume.items()}, open_tests,
                                   from_call)
        try:
            expr = straight(settled)
            if assume and accept is not None and not accept(expr):
                raise NotAMatch(f"helper {helper.name} does not return torch's cross entropy under "
                                "any run-time guard")
        except NotAMatch:
            if not open_tests or len(assume) >= 3:
                raise
            test = open_tests[0]
            for value in (True, False):
                try:
                    return attempt({**assume, id(test): (test, value)})
                except NotAMatch:
                    pass
            raise
        guards = []
        for test, value in assume.values():
            guard = _Substitute({p: env[p] for p in from_call}).visit(copy.deepcopy(test))
            guards.append(guard if value else ast.UnaryOp(op=ast.Not(), operand=guard))
        return expr, guards

    return attempt({})


def tensor_params(helper: ast.FunctionDef, call: ast.Call, logits: set[str]) -> set[str]:
    """The helper's parameters the call binds to the head's output (a tensor, never a list)."""
    a = helper.args
    params = [p.arg for p in a.posonlyargs + a.args]
    bound = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
    out = set()
    for name, value in bound:
        try:
            base, _, _ = chain(value, logits, {}, set())
        except NotAMatch:
            continue
        out.add(name) if base in logits else None
    return out
