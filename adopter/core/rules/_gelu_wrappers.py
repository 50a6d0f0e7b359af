"""Same-file activation modules that compute a GeLU of their input (read from the source's ``ast``,
never imported): LXMERT's ``class GeLU(nn.Module): forward = gelu(x)``, BLOOM's ``BloomGelu``
(``GeLUFunction.apply(x)``: a ``torch.autograd.Function`` whose forward is the tanh-approximate
GeLU written out as arithmetic and whose backward is its hand-written derivative).

A class qualifies only when every way it can compute is known:

* it derives from ``torch.nn.Module`` alone, defines ``forward(self, x)`` and at most an
  ``__init__`` that does nothing but ``super().__init__()``, and nothing else (no other method,
  no class attribute);
* ``forward`` is a single ``return`` of either a GeLU call on ``x`` alone (``F.gelu(x)`` with a
  literal ``approximate``, ``transformers.activations.gelu``/``gelu_new``...), an arithmetic
  expression of ``x`` (autograd derives it), or ``Fn.apply(x)`` of a same-file
  ``torch.autograd.Function`` whose ``forward`` and ``backward`` are interpreted here.

Arithmetic (written-out formulas, same-file helper functions) is checked numerically: the shared
evaluator (:mod:`adopter.core.symbolic`), its hooks reading a whitelist (numbers, ``+ - * / **``,
``tanh``/``erf``/``exp``/``sqrt`` of ``torch``/``math``, ``math.pi``, plain assignments, ``x[0]``
of a tuple, ``ctx.save_for_backward``/``ctx.saved_tensors``), evaluates it at sample points with
floats standing for tensors and compares with exact GeLU (erf) and with its tanh approximation; an autograd
Function's ``backward`` must give that GeLU's derivative. Anything outside the whitelist makes
the class unknown: it is then not a GeLU (no match), never a guess.
"""
from __future__ import annotations

import ast
import math
import re

from adopter.core.source_file import source_lines
from adopter.core.symbolic import Evaluator, Returned, Unknown, dotted, is_docstring, positional_parameters

# module-level activations of transformers.activations -> kernel mode
_ACTIVATION_FUNCS = {
    "gelu": "none", "gelu_python": "none",
    "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh",
    "gelu_accurate": "tanh",
}
_MATH = {"tanh": math.tanh, "erf": math.erf, "exp": math.exp, "sqrt": math.sqrt}
_SAMPLES = (-3.1, -1.7, -0.9, -0.35, 0.0, 0.2, 0.6, 1.3, 2.4, 4.1)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: float, mode: str) -> float:
    if mode == "tanh":
        return 0.5 * x * (1.0 + math.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _gelu_grad(x: float, mode: str) -> float:
    h = 1e-5
    return (_gelu(x + h, mode) - _gelu(x - h, mode)) / (2 * h)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


# what the autograd context stands for in an environment, and the key of what it saved
_CTX = "<ctx>"
_SAVED = "<saved>"


class _FormulaEvaluator(Evaluator[object]):
    """Evaluates whitelisted scalar arithmetic of same-file functions: values are floats (a
    tensor's value at one sample point), tuples of them, and :data:`_CTX`."""

    max_depth = 8

    def __init__(self, functions: dict[str, ast.FunctionDef], imports: dict[str, str]):
        self.functions = functions
        self.imports = imports

    def qualified(self, e: ast.expr) -> str | None:
        """``e``'s dotted name with its first part resolved through the file's imports."""
        name = dotted(e)
        if name is None:
            return None
        head, dot, rest = name.partition(".")
        return self.imports.get(head, head) + dot + rest

    def call_function(self, fn: ast.FunctionDef, args: list) -> object:
        params = positional_parameters(fn)
        if params is None or len(params) != len(args):
            raise Unknown(fn.name)
        if fn.decorator_list and not (len(fn.decorator_list) == 1 and self.qualified(fn.decorator_list[0])
                                      == "staticmethod"):
            raise Unknown(fn.name)
        return self.inline(fn, dict(zip(params, args)))

    def statement(self, st: ast.stmt, env: dict, rest: list[ast.stmt]) -> Returned | None:
        if isinstance(st, ast.Expr) and self._is_save_for_backward(st.value, env):
            env[_SAVED] = tuple(self.eval(a, env) for a in st.value.args)
            return None
        return super().statement(st, env, rest)

    @staticmethod
    def _is_save_for_backward(e: ast.expr, env: dict) -> bool:
        return (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "save_for_backward"
                and isinstance(e.func.value, ast.Name) and env.get(e.func.value.id) == _CTX and not e.keywords)

    def constant(self, e: ast.Constant, env: dict) -> object:
        if type(e.value) in (int, float):
            return float(e.value)
        raise Unknown(ast.unparse(e))

    def attribute(self, e: ast.Attribute, env: dict) -> object:
        if isinstance(e.value, ast.Name) and env.get(e.value.id) == _CTX and e.attr == "saved_tensors":
            if _SAVED not in env:
                raise Unknown(ast.unparse(e))
            return env[_SAVED]
        if self.qualified(e) == "math.pi":
            return math.pi
        raise Unknown(ast.unparse(e))

    def binop(self, e: ast.BinOp, env: dict) -> object:
        a, b = self.eval(e.left, env), self.eval(e.right, env)
        if not (isinstance(a, float) and isinstance(b, float)):
            raise Unknown(ast.unparse(e))
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b,
               ast.Div: lambda: a / b, ast.Pow: lambda: a ** b}
        if type(e.op) not in ops:
            raise Unknown(ast.unparse(e))
        try:
            return float(ops[type(e.op)]())
        except (ZeroDivisionError, OverflowError, TypeError):
            raise Unknown(ast.unparse(e)) from None

    def unaryop(self, e: ast.UnaryOp, env: dict) -> object:
        if not isinstance(e.op, (ast.USub, ast.UAdd)):
            raise Unknown(ast.unparse(e))
        v = self.eval(e.operand, env)
        if not isinstance(v, float):
            raise Unknown(ast.unparse(e))
        return -v if isinstance(e.op, ast.USub) else v

    def subscript(self, e: ast.Subscript, env: dict) -> object:
        if not (isinstance(e.slice, ast.Constant) and type(e.slice.value) is int):
            raise Unknown(ast.unparse(e))
        v = self.eval(e.value, env)
        if not isinstance(v, tuple) or not -len(v) <= e.slice.value < len(v):
            raise Unknown(ast.unparse(e))
        return v[e.slice.value]

    def call(self, e: ast.Call, env: dict) -> object:
        if e.keywords or any(isinstance(a, ast.Starred) for a in e.args):
            raise Unknown(ast.unparse(e))
        args = [self.eval(a, env) for a in e.args]
        name = self.qualified(e.func)
        if isinstance(e.func, ast.Name) and e.func.id in self.functions and e.func.id not in env:
            return self.call_function(self.functions[e.func.id], args)
        if name and name.split(".")[0] in ("torch", "math") and name.rsplit(".", 1)[-1] in _MATH \
                and name.count(".") == 1 and len(args) == 1 and isinstance(args[0], float):
            try:
                return float(_MATH[name.rsplit(".", 1)[-1]](args[0]))
            except (ValueError, OverflowError):
                raise Unknown(ast.unparse(e)) from None
        raise Unknown(ast.unparse(e))


def _only_docstring_or(body: list[ast.stmt], allowed) -> bool:
    for i, st in enumerate(body):
        if i == 0 and is_docstring(st):
            continue
        if not allowed(st):
            return False
    return True


def _is_super_init(st: ast.stmt) -> bool:
    if isinstance(st, ast.Pass):
        return True
    if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
        return False
    c = st.value
    return (isinstance(c.func, ast.Attribute) and c.func.attr == "__init__" and not c.args and not c.keywords
            and isinstance(c.func.value, ast.Call) and isinstance(c.func.value.func, ast.Name)
            and c.func.value.func.id == "super")


def _single_return(fn: ast.FunctionDef) -> ast.expr | None:
    body = [st for i, st in enumerate(fn.body) if not (i == 0 and is_docstring(st))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return body[0].value
    return None


def _formula_mode(fn_eval) -> str | None:
    """The GeLU mode a scalar function computes at every sample point, or None."""
    try:
        values = [fn_eval(x) for x in _SAMPLES]
    except Unknown:
        return None
    for mode in ("none", "tanh"):
        if all(isinstance(v, float) and _close(v, _gelu(x, mode)) for x, v in zip(_SAMPLES, values)):
            return mode
    return None


class _TopLevel:
    """Top-level ``class``/``def`` statements of a file, parsed one by one on demand (the scan
    reads every transformers file: parsing whole files here would double its cost)."""

    def __init__(self, source: str):
        self.lines = source_lines(source)
        self.starts: dict[str, list[int]] = {}
        for m in _TOP_DEF.finditer(source):
            self.starts.setdefault(m.group(2), []).append(source.count("\n", 0, m.start()))
        self._parsed: dict[str, ast.AST | None] = {}

    def get(self, name: str, kind: type) -> ast.AST | None:
        if name not in self._parsed:
            self._parsed[name] = self._parse(name)
        node = self._parsed[name]
        return node if isinstance(node, kind) else None

    def _parse(self, name: str) -> ast.AST | None:
        starts = self.starts.get(name, [])
        if len(starts) != 1:
            return None  # absent or defined twice: which one runs depends on order
        first = last = starts[0]
        while first > 0 and self.lines[first - 1].startswith("@"):
            first -= 1
        last += 1
        while last < len(self.lines) and (not self.lines[last].strip() or self.lines[last][:1] in (" ", "\t", "#")
                                          or self.lines[last].startswith((")", "]", "}"))):
            last += 1
        text = "\n".join(self.lines[first:last])
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
        if len(tree.body) != 1:
            return None
        node = tree.body[0]
        ast.increment_lineno(node, first)
        return node


class _Names(dict):
    """``name -> node`` view over :class:`_TopLevel` for one node kind."""

    def __init__(self, top: _TopLevel, kind: type):
        super().__init__()
        self.top, self.kind = top, kind

    def __contains__(self, name) -> bool:
        return self.top.get(name, self.kind) is not None

    def __getitem__(self, name):
        node = self.top.get(name, self.kind)
        if node is None:
            raise KeyError(name)
        return node


_TOP_DEF = re.compile(r"^(class|def)\s+([A-Za-z_][A-Za-z_0-9]*)", re.M)
# a forward whose first statement (after a docstring) is ``return``: the only shape a GeLU module has
_RETURN_FORWARD = re.compile(
    r"def forward\(self, \w+(?:: [\w.]+)?\)(?: -> [\w.]+)?:\n"
    r"(?:\s+(?:\"\"\"|\'\'\'|\"|\')[\s\S]*?(?:\"\"\"|\'\'\'|\"|\')\s*\n)?\s+return ")
# a module-level function of one parameter
_ONE_ARG_DEF = re.compile(r"^def (\w+)\(\w+(?:: [\w.]+)?\)(?: -> [\w.]+)?:", re.M)


class _Analyzer:
    def __init__(self, top: _TopLevel, imports: dict[str, str], bases: dict[str, tuple[str, ...]]):
        self.classes = _Names(top, ast.ClassDef)
        self.functions = _Names(top, ast.FunctionDef)
        self.imports = imports
        self.bases = bases
        self.formulas = _FormulaEvaluator(self.functions, imports)

    def module_mode(self, cls: ast.ClassDef) -> str | None:
        if self.bases.get(cls.name) != ("torch.nn.Module",) or cls.decorator_list or cls.keywords:
            return None
        methods = {}
        for i, st in enumerate(cls.body):
            if i == 0 and is_docstring(st):
                continue
            if not isinstance(st, ast.FunctionDef) or st.decorator_list or st.name in methods:
                return None
            methods[st.name] = st
        if set(methods) - {"__init__", "forward"} or "forward" not in methods:
            return None
        init = methods.get("__init__")
        if init is not None and (len(init.args.args) != 1 or init.args.vararg or init.args.kwarg
                                 or init.args.kwonlyargs or not _only_docstring_or(init.body, _is_super_init)):
            return None
        fwd = methods["forward"]
        params = positional_parameters(fwd)
        if params is None or len(params) != 2:
            return None
        x = params[1]
        ret = _single_return(fwd)
        if ret is None:
            return None
        return self.expr_mode(ret, x)

    def expr_mode(self, e: ast.expr, x: str) -> str | None:
        if isinstance(e, ast.Call) and len(e.args) == 1 and isinstance(e.args[0], ast.Name) and e.args[0].id == x \
                and not isinstance(e.args[0], ast.Starred):
            name = self.formulas.qualified(e.func) or ""
            if name == "torch.nn.functional.gelu":
                kw = {k.arg: k.value for k in e.keywords}
                if set(kw) - {"approximate"}:
                    return None
                if "approximate" not in kw:
                    return "none"
                v = kw["approximate"]
                return v.value if isinstance(v, ast.Constant) and v.value in ("none", "tanh") else None
            if name.startswith("transformers.activations.") and not e.keywords:
                return _ACTIVATION_FUNCS.get(name.rsplit(".", 1)[-1])
            if (isinstance(e.func, ast.Attribute) and e.func.attr == "apply" and isinstance(e.func.value, ast.Name)
                    and e.func.value.id in self.classes and not e.keywords):
                return self.autograd_mode(self.classes[e.func.value.id])
        # a written-out formula of x: autograd differentiates it, the forward values decide
        return _formula_mode(lambda v: self.formulas.eval(e, {x: v}))

    def autograd_mode(self, cls: ast.ClassDef) -> str | None:
        if self.bases.get(cls.name) != ("torch.autograd.Function",) or cls.decorator_list or cls.keywords:
            return None
        methods = {}
        for i, st in enumerate(cls.body):
            if i == 0 and is_docstring(st):
                continue
            if not isinstance(st, ast.FunctionDef) or st.name in methods:
                return None
            methods[st.name] = st
        if set(methods) != {"forward", "backward"}:
            return None
        fwd, bwd = methods["forward"], methods["backward"]

        def forward(v):
            env = {}
            return self._call_with_ctx(fwd, v, env)

        mode = _formula_mode(forward)
        if mode is None:
            return None
        # backward(ctx, g) with what forward saved must be g * d gelu / dx
        for xv in _SAMPLES:
            for g in (1.0, 0.37):
                env: dict = {}
                try:
                    self._call_with_ctx(fwd, xv, env)
                    got = self._call_with_ctx(bwd, g, env)
                except Unknown:
                    return None
                if not isinstance(got, float) or not _close(got, g * _gelu_grad(xv, mode)):
                    return None
        return mode

    def _call_with_ctx(self, fn: ast.FunctionDef, value: float, env: dict) -> object:
        """Run a ``@staticmethod def f(ctx, value)``; ``env`` carries what ``ctx`` saved."""
        params = positional_parameters(fn)
        if (params is None or len(params) != 2
                or len(fn.decorator_list) != 1 or self.formulas.qualified(fn.decorator_list[0]) != "staticmethod"):
            raise Unknown(fn.name)
        local = {params[0]: _CTX, params[1]: value}
        if _SAVED in env:
            local[_SAVED] = env[_SAVED]
        out = self.formulas.run(fn.body, local)
        if _SAVED in local:
            env[_SAVED] = local[_SAVED]
        return out


def _rebound_at_module_level(source: str, name: str, imports: dict[str, str]) -> bool:
    if name in imports:
        return True
    return re.search(rf"^{re.escape(name)}\s*(?::[^=\n]+)?=", source, re.M) is not None


def gelu_functions(source: str | None, imports: dict[str, str], bases: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Same-file module-level functions ``def f(x): return <GeLU of x>`` (ESM's ``gelu``, the erf
    formula written out): function name -> mode. Extraction inlines their body; the matcher
    folds it back into one GeLU call (see ``Rule.inlined_functions``)."""
    if not source or not ("erf(" in source or "tanh(" in source or "gelu(" in source):
        return {}
    names = [m.group(1) for m in _ONE_ARG_DEF.finditer(source)]
    if not names:
        return {}
    top = _TopLevel(source)
    an = _Analyzer(top, imports, bases)
    out = {}
    for name in dict.fromkeys(names):
        fn = top.get(name, ast.FunctionDef)
        if fn is None or _rebound_at_module_level(source, name, imports):
            continue
        params = positional_parameters(fn)
        if fn.decorator_list or params is None or len(params) != 1:
            continue
        ret = _single_return(fn)
        if ret is None:
            continue
        mode = an.expr_mode(ret, params[0])
        if mode is not None:
            out[name] = mode
    return out


def gelu_module_classes(source: str | None, imports: dict[str, str], bases: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Same-file ``nn.Module`` classes computing a GeLU of their input: class name -> mode
    (``"none"`` exact erf, ``"tanh"``). ``imports``/``bases`` come from the file's structures."""
    if not source:
        return {}
    hits = [m.start() for m in _RETURN_FORWARD.finditer(source)]
    if not hits:
        return {}
    top = _TopLevel(source)
    an = _Analyzer(top, imports, bases)
    out = {}
    for pos in hits:
        line = source.count("\n", 0, pos)
        owner = None
        for name, starts in top.starts.items():
            for st in starts:
                if st <= line and (owner is None or st > owner[1]):
                    owner = (name, st)
        if owner is None or bases.get(owner[0]) != ("torch.nn.Module",):
            continue
        cls = top.get(owner[0], ast.ClassDef)
        if cls is None:
            continue
        mode = an.module_mode(cls)
        if mode is not None:
            out[cls.name] = mode
    return out
