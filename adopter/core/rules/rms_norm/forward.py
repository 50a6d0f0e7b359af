"""Reading an RMSNorm class's ``forward``: its body evaluated symbolically from the ``ast``
(nothing is imported or run) on the shared evaluator (:mod:`adopter.core.symbolic`), same-class
helpers inlined (Gemma's ``self._norm``, those of same-file bases too), and the value it returns
classified (:mod:`adopter.core.rules.rms_norm.forms`).

The :class:`~adopter.core.symbolic.Sym` kinds of a forward: ``input`` (the forward's tensor),
``attr`` (``self.<name>``: ``name``), ``const`` (``value``), ``dtype`` (``torch.<value>``),
``dtype_of`` (``args[0].dtype``), ``op`` (``name`` applied to ``args`` with keyword ``kw``:
``pow``, ``mean``, ``rsqrt``, ``sqrt``, ``cast`` to ``args[1]``, a binary operator),
``weight_is_half`` (T5's test on ``args[0]``), ``select`` (``args[1]`` if ``args[0]`` else
``args[2]``), ``branch`` (``args[0]`` if ``self.<value>`` else ``args[1]``: a conditional
expression, or the values an ``if self.<value>:`` returns), ``opaque`` (a same-class helper whose
value is not followed: ``value`` its name), ``unknown`` (``value``: the source text; ``args``: what
a call it does not read is applied to, so that a norm inside it stays visible).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace

from adopter.core.match.source import parse_file, source_segment
from adopter.core.rules.rms_norm.forms import INPUT, L2_KERNEL, Form, _NotRMS, _Variant, classify, scaled_l2_norm_form
from adopter.core.symbolic import Evaluator, Returned, Sym, Unknown
from adopter.core.syntax import statements, walk

# ---------------------------------------------------------------- symbolic forward

_FLOAT_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                 "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}
_CAST_METHODS = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


@dataclass
class _Evaluator(Evaluator[Sym]):
    """Evaluates one function body; ``methods`` are the class's other methods (inlined when a
    ``self.<method>(arg)`` call has one parameter and a body of assignments and one return).
    What it does not read is an ``unknown`` value, never a failure: a body it does not read
    (:meth:`body`) is None."""

    torch_names: set[str]
    methods: dict[str, ast.FunctionDef]
    source: str
    inlined: list[str] = field(default_factory=list)
    functional_names: set[str] = field(default_factory=set)  # names of torch.nn.functional (``F``)
    max_depth = 3  # helpers inlined inside helpers

    def torch_path(self, node: ast.expr) -> str | None:
        """``rsqrt`` for ``torch.rsqrt``/``torch.nn.functional.x`` style names (``torch`` under
        any alias the file imports it as)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.torch_names:
            return ".".join(reversed(parts))
        return None

    # -- expressions
    def other(self, node: ast.expr, env: dict[str, Sym]) -> Sym:
        return Sym.unknown(node)

    def constant(self, node: ast.Constant, env: dict[str, Sym]) -> Sym:
        if isinstance(node.value, (int, float)):  # bools too (keepdim)
            return Sym("const", node.value, node=node, text=source_segment(self.source, node) or "")
        return Sym.unknown(node)

    def unaryop(self, node: ast.UnaryOp, env: dict[str, Sym]) -> Sym:
        if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            inner = self.eval(node.operand, env)
            return Sym("const", -inner.value, node=node, text=source_segment(self.source, node) or "") \
                if inner.kind == "const" else Sym.unknown(node)
        return Sym.unknown(node)

    def attribute(self, node: ast.Attribute, env: dict[str, Sym]) -> Sym:
        path = self.torch_path(node)
        if path is not None and path in _FLOAT_DTYPES:
            return Sym("dtype", _FLOAT_DTYPES[path], node=node)
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return Sym("attr", node.attr, node=node)
        if node.attr == "dtype":
            return Sym("dtype_of", args=(self.eval(node.value, env),), node=node)
        return Sym.unknown(node)

    def ifexp(self, node: ast.IfExp, env: dict[str, Sym]) -> Sym:
        if _flag(node.test) is None:
            return Sym.unknown(node)
        # litgpt: ``(1 + self.weight) if self.add_unit_offset else self.weight``
        attr, negated = _flag(node.test)
        a, b = self.eval(node.body, env), self.eval(node.orelse, env)
        return Sym("branch", attr, (b, a) if negated else (a, b), node=node)

    def binop(self, node: ast.BinOp, env: dict[str, Sym]) -> Sym:
        if type(node.op) not in _BINOPS:
            return Sym.unknown(node)
        return Sym("op", _BINOPS[type(node.op)], (self.eval(node.left, env), self.eval(node.right, env)), node=node)

    def call(self, node: ast.Call, env: dict[str, Sym]) -> Sym:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return Sym.unknown(node)
        args = tuple(self.eval(a, env) for a in node.args)
        kw = tuple((k.arg, self.eval(k.value, env)) for k in node.keywords)
        func = node.func
        path = self.torch_path(func)
        if path in ("rsqrt", "sqrt", "mean", "pow", "square"):
            return Sym("op", path, args, kw, node=node)
        if path == "nn.functional.normalize" or isinstance(func, ast.Attribute) and func.attr == "normalize" \
                and isinstance(func.value, ast.Name) and func.value.id in self.functional_names:
            # x-transformers: ``F.normalize(x, dim=-1) * self.scale * self.gamma``
            return Sym("op", "normalize", args, kw, node=node)
        # any other call: unknown, but what it is applied to stays visible (a norm inside it)
        other = Sym.unknown(node, args + tuple(v for _, v in kw))
        if not isinstance(func, ast.Attribute):
            return other
        # self.<method>(arg): a same-class helper (Gemma's self._norm)
        if isinstance(func.value, ast.Name) and func.value.id == "self" and func.attr in self.methods:
            return self.helper(func.attr, node, args, kw)
        receiver = self.eval(func.value, env)
        name = func.attr
        if name in ("rsqrt", "sqrt", "mean", "pow", "square"):
            return Sym("op", name, (receiver, *args), kw, node=node)
        if name in _CAST_METHODS and not args and not kw:
            return Sym("op", "cast", (receiver, Sym("dtype", _CAST_METHODS[name])), node=node)
        if name == "type_as" and len(args) == 1 and not kw:
            return Sym("op", "cast", (receiver, Sym("dtype_of", args=(args[0],))), node=node)
        if name in ("to", "type") and len(args) + len(kw) == 1 and (args or kw[0][0] == "dtype"):
            target = args[0] if args else kw[0][1]
            if target.kind in ("dtype", "dtype_of"):
                return Sym("op", "cast", (receiver, target), node=node)
        return replace(other, args=(receiver, *other.args))

    def helper(self, name: str, node: ast.Call, args: tuple, kw: tuple) -> Sym:
        """``self.<name>(arg)``: the value the helper returns, or ``opaque`` when it is not read."""
        fn = self.methods[name]
        params = [a.arg for a in fn.args.args[1:]]
        opaque = Sym("opaque", name, node=node)  # a helper whose value is not followed
        if kw or len(args) != 1 or len(params) != 1 or fn.args.vararg or fn.args.kwarg:
            return opaque
        try:
            result = self.inline(fn, {params[0]: args[0]})
        except Unknown:
            return opaque
        self.inlined.append(name)
        return result

    # -- statements
    @staticmethod
    def is_docstring(st: ast.stmt) -> bool:
        return isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)

    def body(self, stmts: list[ast.stmt], env: dict[str, Sym]) -> Sym | None:
        """The returned value of a body of assignments, T5's ``if`` and one final ``return``
        (None for any other body)."""
        try:
            return self.run(stmts, dict(env))
        except Unknown:
            return None

    def statement(self, st: ast.stmt, env: dict[str, Sym], rest: list[ast.stmt]) -> Returned[Sym] | None:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
            env[st.target.id] = self.eval(st.value, env)
            return None
        if isinstance(st, ast.If):
            return self.if_statement(st, env, rest)
        if isinstance(st, ast.Return) and rest:
            raise Unknown("a return before the body's end")
        return super().statement(st, env, rest)

    def if_statement(self, st: ast.If, env: dict[str, Sym], rest: list[ast.stmt]) -> Returned[Sym] | None:
        if not st.orelse and self._half_test(st.test, env) is not None:
            # T5: the branch's assignments become ``select(test, then, else)`` values
            test = self._half_test(st.test, env)
            then_env = self.assignments(st.body, env)
            for name in set(then_env) | set(env):
                if then_env.get(name) != env.get(name):
                    env[name] = Sym("select", args=(test, then_env.get(name), env.get(name)))
            return None
        if _flag(st.test) is None:
            raise Unknown(ast.unparse(st.test))
        attr, negated = _flag(st.test)
        if _returns(st.body):
            # litgpt: ``if self.add_unit_offset: return a`` then ``return b`` (or ``else:``):
            # a ``branch`` value, each side a form of its own, chosen by the attribute at run time
            if st.orelse and (rest or not _returns(st.orelse)):
                raise Unknown("statements after an if/else that returns")
            then = self.body(st.body, env)
            other = self.body(st.orelse or rest, env)
            if then is None or other is None:
                raise Unknown("a side of the branch is not read")
            if negated:
                then, other = other, then
            return Returned(Sym("branch", attr, (then, other), node=st.test))
        # ``if self.add_unit_offset: h = h * (1 + self.weight)`` (assignments on either side):
        # each name the sides bind differently becomes a ``branch`` value
        sides = [self._assigned(st.body, env), self._assigned(st.orelse, env)]
        if sides[0] is None or sides[1] is None:
            raise Unknown("a side of the branch is not a block of assignments")
        then_env, else_env = sides[::-1] if negated else sides
        for name in set(then_env) | set(else_env):
            a, b = then_env.get(name), else_env.get(name)
            if a != b:
                if a is None or b is None:
                    raise Unknown(f"{name} is bound on one side only")
                env[name] = Sym("branch", attr, (a, b), node=st.test)
        return None

    def _assigned(self, stmts: list[ast.stmt], env: dict[str, Sym]) -> dict[str, Sym] | None:
        """``env`` after a block of plain ``name = value`` assignments (None for anything else)."""
        try:
            return self.assignments(stmts, env)
        except Unknown:
            return None

    def _half_test(self, test: ast.expr, env: dict[str, Sym]) -> Sym | None:
        """``self.<w>.dtype in [torch.float16, torch.bfloat16]`` (list, tuple or set, any order)."""
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.In)):
            return None
        left = self.eval(test.left, env)
        options = test.comparators[0]
        if left.kind != "dtype_of" or left.args[0].kind != "attr":
            return None
        if not isinstance(options, (ast.List, ast.Tuple, ast.Set)):
            return None
        dtypes = {self.eval(e, env) for e in options.elts}
        if {d.value for d in dtypes if d.kind == "dtype"} != {"float16", "bfloat16"} or len(dtypes) != 2:
            return None
        return Sym("weight_is_half", args=(left.args[0],))


def _flag(test: ast.expr) -> tuple[str, bool] | None:
    """``(attr, negated)`` of an ``if self.<attr>:`` / ``if not self.<attr>:`` test."""
    negated = False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, True
    if isinstance(test, ast.Attribute) and isinstance(test.value, ast.Name) and test.value.id == "self":
        return test.attr, negated
    return None


def _returns(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return) and body[-1].value is not None


# ---------------------------------------------------------------- the class's forward


def _functional_names(tree: ast.Module) -> set[str]:
    """Names the file binds to ``torch.nn.functional`` (``import torch.nn.functional as F``,
    ``from torch.nn import functional as F``)."""
    names = set()
    for st in tree.body:
        if isinstance(st, ast.Import):
            names |= {a.asname for a in st.names if a.name == "torch.nn.functional" and a.asname}
        elif isinstance(st, ast.ImportFrom) and st.module == "torch.nn" and not st.level:
            names |= {a.asname or a.name for a in st.names if a.name == "functional"}
    return names


def _torch_names(tree: ast.Module) -> set[str]:
    names = {"torch"}
    for st in tree.body:
        if isinstance(st, ast.Import):
            names |= {a.asname or a.name for a in st.names if a.name == "torch"}
    return names


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef | None:
    """The last definition of class ``name`` (also one nested in an ``if``/``try`` block)."""
    found = None
    for c in statements(tree):
        if isinstance(c, ast.ClassDef) and c.name == name:
            found = c
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


# bases that define no helper a norm's forward could call
_PLAIN_BASES = frozenset({"object", "Module", "nn.Module", "torch.nn.Module"})


def _resolved_methods(tree: ast.Module, cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    """The methods ``self.<name>`` reaches in ``cls``: its own, then those of its same-file bases in
    the order Python looks them up (depth first, left to right: the MRO of single inheritance and
    of these simple hierarchies). The walk stops at a base that is neither a same-file class nor
    ``nn.Module``: what it defines is unknown, so no method after it is taken."""
    out: dict[str, ast.FunctionDef] = {}
    seen: set[str] = set()

    def visit(c: ast.ClassDef) -> bool:
        seen.add(c.name)
        for name, fn in _methods(c).items():
            out.setdefault(name, fn)
        for b in c.bases:
            base = _class_node(tree, b.id) if isinstance(b, ast.Name) else None
            if base is not None and base.name not in seen and base is not c:
                if not visit(base):
                    return False
            elif (ast.unparse(b) if base is None else "") not in _PLAIN_BASES:
                return False
        return True

    visit(cls)
    return out


def analyze_forward(source: str, class_name: str) -> Form:
    """The recognized form of ``class_name.forward``; raises :class:`_Variant`/:class:`_NotRMS`."""
    tree = parse_file(source)
    cls = _class_node(tree, class_name) if tree is not None else None
    forward = _methods(cls).get("forward") if cls is not None else None
    if forward is None:
        raise _NotRMS(f"{class_name} defines no forward")
    methods = _resolved_methods(tree, cls)  # helpers of same-file bases too (torchtitan-style hierarchies)
    params = forward.args
    names = [a.arg for a in params.posonlyargs + params.args]
    if len(names) != 2 or params.vararg or params.kwarg or params.kwonlyargs:
        shown = ", ".join(names[1:4] + (["..."] if len(names) > 4 or params.vararg or params.kwarg
                                         or params.kwonlyargs else []))
        raise _Variant(f"forward({shown}) takes more than the one tensor it normalizes (a gated norm, or a norm "
                       "inside a larger forward): the rewrite replaces a norm class's whole forward")
    helpers = {k: v for k, v in methods.items() if k not in ("forward", "__init__")}
    evaluator = _Evaluator(_torch_names(tree), helpers, source, functional_names=_functional_names(tree))
    result = evaluator.body(forward.body, {names[1]: INPUT})
    if result is None:
        if _mentions_norm(forward):
            raise _Variant("the forward has statements besides the norm's assignments and its return "
                           "(branches, loops, other calls)")
        raise _NotRMS("the forward is not a sequence of assignments and a return")
    inlined = tuple(dict.fromkeys(evaluator.inlined))
    l2 = scaled_l2_norm_form(result)
    if l2 is not None:  # x-transformers: F.normalize(x, dim=-1) * self.scale * self.gamma
        factors, keywords = l2
        return Form(input=names[1], weight="", eps="", keywords=keywords, inlined=inlined, kernel=L2_KERNEL,
                    factors=factors)
    weight, eps, keywords = classify(result)
    return Form(input=names[1], weight=f"self.{weight}", eps=eps, keywords=keywords, inlined=inlined)


def _mentions_norm(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in ("rsqrt", "sqrt") for n in walk(fn))


def _overriding_subclasses(tree: ast.Module, class_name: str, names: tuple[str, ...]) -> list[str]:
    """Same-file subclasses of ``class_name`` (direct or not) that override one of ``names``."""
    classes = [c for c in statements(tree) if isinstance(c, ast.ClassDef)]
    out: list[str] = []
    seen = {class_name}
    parents = [class_name]
    while parents:
        parent = parents.pop(0)
        for c in classes:
            if c.name not in seen and any(isinstance(b, ast.Name) and b.id == parent for b in c.bases):
                seen.add(c.name)
                parents.append(c.name)
                hit = set(_methods(c)) & set(names)
                if hit:
                    out.append(f"{c.name}.{sorted(hit)[0]}")
    return out
