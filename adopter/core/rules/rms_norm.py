"""RMSNorm: a class whose ``forward`` is a written-out RMSNorm becomes one guarded kernel call.

Rewrite (the codemod below), the whole body of ``forward`` — ``__init__``, the weight and the
state dict stay:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
 => return rms_norm(hidden_states, self.weight, self.variance_epsilon)

The library writes several forms that look alike and round differently; each recognized one is
rewritten with keyword arguments naming it (facts of the source, never of a configuration):
OLMo-2's ``(self.weight * h).to(input_dtype)`` => ``weight_before_cast=True``; Helium/Moshi's
``self.weight.to(torch.float32)`` => ``+ weight_fp32=True``; Gemma's ``output * (1.0 +
self.weight.float())`` => ``offset=1.0, weight_before_cast=True, weight_fp32=True``;
T5LayerNorm's cast to a half weight => ``cast_to_half_weight=True``. The others are refused
(``norm-variant``) with what differs: eps outside the square root, a bias, no float32 upcast,
a division by ``sqrt``, no weight, a forward that computes more than the norm.

``adopter.kernels.rms_norm`` decides at run time (tensor weight of the row size, numeric eps,
float32/half input, not traced) and otherwise runs the form's eager formula.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace

from adopter.core.codemod.base import Codemod, kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.match import MatchContext, Refusal
from adopter.core.match.source import parse_file, source_segment
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.structures import Match
from adopter.core.syntax import walk

KERNEL = "rms_norm"
CODE = "norm-variant"

_SQUARE = "torch.Tensor.pow|torch.pow|torch.Tensor.square|torch.square"
_MEAN = "torch.Tensor.mean|torch.mean"
DSL = f"""
# x * rsqrt(mean(h ** 2) + eps): the normalization every RMSNorm form shares
rule RMSNorm
forward:
    {_SQUARE}($h) -> $sq; {_MEAN}($sq) -> $var; $var + $eps -> $ve;
    torch.rsqrt|torch.Tensor.rsqrt($ve) -> $r; $x * $r -> $n

rule RMSNorm
forward:
    $h ** $k -> $sq; {_MEAN}($sq) -> $var; $var + $eps -> $ve;
    torch.rsqrt|torch.Tensor.rsqrt($ve) -> $r; $x * $r -> $n

# litgpt: torch.mean(x * x, dim=self.dim, keepdim=True)
rule RMSNorm
forward:
    $h * $h -> $sq; {_MEAN}($sq) -> $var; $var + $eps -> $ve;
    torch.rsqrt|torch.Tensor.rsqrt($ve) -> $r; $x * $r -> $n

# x / sqrt(mean(h ** 2) + eps): looks alike, refused (the kernel multiplies by rsqrt)
rule RMSNorm
forward:
    {_SQUARE}($h) -> $sq; {_MEAN}($sq) -> $var; $var + $eps -> $ve;
    torch.sqrt|torch.Tensor.sqrt($ve) -> $s; $x / $s -> $n

# x / (sqrt(mean(h ** 2)) + eps): eps outside the square root, refused
rule RMSNorm
forward:
    {_SQUARE}($h) -> $sq; {_MEAN}($sq) -> $var; torch.sqrt|torch.Tensor.sqrt($var) -> $s;
    $s + $eps -> $d; $x / $d -> $n

# the two look-alikes with the square written x * x, refused alike
rule RMSNorm
forward:
    $h * $h -> $sq; {_MEAN}($sq) -> $var; $var + $eps -> $ve;
    torch.sqrt|torch.Tensor.sqrt($ve) -> $s; $x / $s -> $n

rule RMSNorm
forward:
    $h * $h -> $sq; {_MEAN}($sq) -> $var; torch.sqrt|torch.Tensor.sqrt($var) -> $s;
    $s + $eps -> $d; $x / $d -> $n
"""

DOC = """\
Replaces a written-out RMSNorm by one call of the fused kernel. A match is a class whose
``forward(self, x)`` is, as a whole, the float32 RMSNorm of its input: ``h = x.to(torch.float32)``
(or ``x.float()``), ``h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)`` (``** 2``,
``square()``, ``torch.mean(..., dim=-1)`` too, possibly in a same-class helper such as Gemma's
``self._norm(x.float())``), scaled by a weight attribute and cast back: Llama/Mistral/Qwen
``self.weight * h.to(input_dtype)`` (also ``.type_as(x)``, either operand order), OLMo-2
``(self.weight * h).to(input_dtype)``, Helium/Moshi ``self.weight.float()`` before the cast,
Gemma ``(1.0 + self.weight.float())`` before the cast, and T5LayerNorm's ``x * rsqrt(...)``
with ``if self.weight.dtype in [torch.float16, torch.bfloat16]: h = h.to(self.weight.dtype)``.
The rewrite passes the form as keyword arguments and reproduces its dtype semantics exactly
(bf16 input with a float32 weight gives a float32 result in Llama's form, a bf16 one in
OLMo-2's). Refused (``norm-variant``): eps outside the square root, ``x / sqrt(...)``, a bias
added to the result, no float32 upcast, no weight, a ``mean`` not over the last dimension
(``dim-not-last``), a forward that takes more inputs or computes more than the norm (gated,
grouped norms), a helper it calls that a same-file subclass overrides. Not a match: a centered
``(x - mean)`` normalization (LayerNorm), a norm in a function that is not a ``forward``.
``torch.nn.RMSNorm`` and ``F.rms_norm`` used directly are not rewritten: measured side by side in
one run (benchmarks/bench_rms_norm_forms.py --builtin-only, results/rms_norm_forms.json: CPU, 1
thread, 11 paired rounds, (8,128,768) and (2,128,4096), float32 and bfloat16; bitwise equal
outputs), the kernel over the built-in is a median wall ratio of 0.41-1.10 for forward+backward
(CPU-time ratio 0.57-0.94) with the per-round spread crossing 1.0 in 6 of 8 rows, and 1.33-1.93
for a no-grad float32 forward (0.95-1.09 in bfloat16): no win that holds on this shared machine,
and a loss for inference, so the user's built-in call stays."""


# ---------------------------------------------------------------- symbolic forward

# Values of a forward, evaluated symbolically from its ``ast`` (nothing is imported or run).


@dataclass(frozen=True)
class Sym:
    """``kind``: ``input`` (the forward's tensor), ``attr`` (``self.<name>``: ``name``), ``const``
    (``value``), ``dtype`` (``torch.<value>``), ``dtype_of`` (``args[0].dtype``), ``op`` (``name``
    applied to ``args`` with keyword ``kw``: ``pow``, ``mean``, ``rsqrt``, ``sqrt``, ``cast`` to
    ``args[1]``, a binary operator), ``weight_is_half`` (T5's test on ``args[0]``), ``select``
    (``args[1]`` if ``args[0]`` else ``args[2]``), ``branch`` (``args[0]`` if ``self.<value>`` else
    ``args[1]``: a conditional expression, or the values an ``if self.<value>:`` returns),
    ``unknown`` (``value``: the source text)."""

    kind: str
    value: object = None
    args: tuple = ()
    kw: tuple = ()
    node: ast.AST | None = field(default=None, compare=False, hash=False)
    text: str = field(default="", compare=False, hash=False)  # a constant as the source writes it

    def kwarg(self, name: str, position: int | None = None):
        for k, v in self.kw:
            if k == name:
                return v
        return self.args[position] if position is not None and position < len(self.args) else None


def _unknown(node: ast.AST) -> Sym:
    return Sym("unknown", ast.unparse(node), node=node)


_FLOAT_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                 "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}
_CAST_METHODS = {"float": "float32", "half": "float16", "bfloat16": "bfloat16", "double": "float64"}
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


@dataclass
class _Evaluator:
    """Evaluates one function body; ``methods`` are the class's other methods (inlined when a
    ``self.<method>(arg)`` call has one parameter and a body of assignments and one return)."""

    torch_names: set[str]
    methods: dict[str, ast.FunctionDef]
    source: str
    inlined: list[str] = field(default_factory=list)
    depth: int = 0

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

    def expr(self, node: ast.expr, env: dict[str, Sym]) -> Sym:
        if isinstance(node, ast.Name):
            return env.get(node.id, _unknown(node))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):  # bools too (keepdim)
            return Sym("const", node.value, node=node, text=source_segment(self.source, node) or "")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            inner = self.expr(node.operand, env)
            return Sym("const", -inner.value, node=node, text=source_segment(self.source, node) or "") \
                if inner.kind == "const" else _unknown(node)
        if isinstance(node, ast.Attribute):
            path = self.torch_path(node)
            if path is not None and path in _FLOAT_DTYPES:
                return Sym("dtype", _FLOAT_DTYPES[path], node=node)
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return Sym("attr", node.attr, node=node)
            if node.attr == "dtype":
                return Sym("dtype_of", args=(self.expr(node.value, env),), node=node)
            return _unknown(node)
        if isinstance(node, ast.IfExp) and _flag(node.test) is not None:
            # litgpt: ``(1 + self.weight) if self.add_unit_offset else self.weight``
            attr, negated = _flag(node.test)
            a, b = self.expr(node.body, env), self.expr(node.orelse, env)
            return Sym("branch", attr, (b, a) if negated else (a, b), node=node)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return Sym("op", _BINOPS[type(node.op)], (self.expr(node.left, env), self.expr(node.right, env)), node=node)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        return _unknown(node)

    def call(self, node: ast.Call, env: dict[str, Sym]) -> Sym:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return _unknown(node)
        args = tuple(self.expr(a, env) for a in node.args)
        kw = tuple((k.arg, self.expr(k.value, env)) for k in node.keywords)
        func = node.func
        path = self.torch_path(func)
        if path in ("rsqrt", "sqrt", "mean", "pow", "square"):
            return Sym("op", path, args, kw, node=node)
        # any other call: unknown, but what it is applied to stays visible (a norm inside it)
        other = Sym("unknown", ast.unparse(node), args + tuple(v for _, v in kw), node=node)
        if not isinstance(func, ast.Attribute):
            return other
        # self.<method>(arg): a same-class helper (Gemma's self._norm)
        if isinstance(func.value, ast.Name) and func.value.id == "self" and func.attr in self.methods:
            return self.inline(func.attr, node, args, kw)
        receiver = self.expr(func.value, env)
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

    def inline(self, name: str, node: ast.Call, args: tuple, kw: tuple) -> Sym:
        fn = self.methods[name]
        params = [a.arg for a in fn.args.args[1:]]
        opaque = Sym("opaque", name, node=node)  # a helper whose value is not followed
        if self.depth > 2 or kw or len(args) != 1 or len(params) != 1 or fn.args.vararg or fn.args.kwarg:
            return opaque
        inner = _Evaluator(self.torch_names, self.methods, self.source, self.inlined, self.depth + 1)
        result = inner.body(fn.body, {params[0]: args[0]})
        if result is None:
            return opaque
        self.inlined.append(name)
        return result

    def body(self, stmts: list[ast.stmt], env: dict[str, Sym]) -> Sym | None:
        """The returned value of a body of assignments, T5's ``if`` and one final ``return``."""
        env = dict(env)
        for i, st in enumerate(stmts):
            if i == 0 and isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                continue  # docstring
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                env[st.targets[0].id] = self.expr(st.value, env)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                env[st.target.id] = self.expr(st.value, env)
            elif isinstance(st, ast.If) and not st.orelse and self._half_test(st.test, env) is not None:
                # T5: the branch's assignments become ``select(test, then, else)`` values
                test = self._half_test(st.test, env)
                then_env = dict(env)
                for inner in st.body:
                    if not (isinstance(inner, ast.Assign) and len(inner.targets) == 1
                            and isinstance(inner.targets[0], ast.Name)):
                        return None
                    then_env[inner.targets[0].id] = self.expr(inner.value, then_env)
                for name in set(then_env) | set(env):
                    if then_env.get(name) != env.get(name):
                        env[name] = Sym("select", args=(test, then_env.get(name), env.get(name)))
            elif isinstance(st, ast.If) and _flag(st.test) is not None and _returns(st.body):
                # litgpt: ``if self.add_unit_offset: return a`` then ``return b`` (or ``else:``):
                # a ``branch`` value, each side a form of its own, chosen by the attribute at run time
                if st.orelse and (i != len(stmts) - 1 or not _returns(st.orelse)):
                    return None
                attr, negated = _flag(st.test)
                then = self.body(st.body, env)
                other = self.body(st.orelse or stmts[i + 1:], env)
                if then is None or other is None:
                    return None
                if negated:
                    then, other = other, then
                return Sym("branch", attr, (then, other), node=st.test)
            elif isinstance(st, ast.If) and _flag(st.test) is not None:
                # ``if self.add_unit_offset: h = h * (1 + self.weight)`` (assignments on either side):
                # each name the sides bind differently becomes a ``branch`` value
                attr, negated = _flag(st.test)
                sides = [self._assigned(st.body, env), self._assigned(st.orelse, env)]
                if sides[0] is None or sides[1] is None:
                    return None
                then_env, else_env = sides[::-1] if negated else sides
                for name in set(then_env) | set(else_env):
                    a, b = then_env.get(name), else_env.get(name)
                    if a != b:
                        if a is None or b is None:
                            return None  # bound on one side only
                        env[name] = Sym("branch", attr, (a, b), node=st.test)
            elif isinstance(st, ast.Return) and st.value is not None and i == len(stmts) - 1:
                return self.expr(st.value, env)
            else:
                return None
        return None

    def _assigned(self, stmts: list[ast.stmt], env: dict[str, Sym]) -> dict[str, Sym] | None:
        """``env`` after a block of plain ``name = value`` assignments (None for anything else)."""
        env = dict(env)
        for st in stmts:
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)):
                return None
            env[st.targets[0].id] = self.expr(st.value, env)
        return env

    def _half_test(self, test: ast.expr, env: dict[str, Sym]) -> Sym | None:
        """``self.<w>.dtype in [torch.float16, torch.bfloat16]`` (list, tuple or set, any order)."""
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.In)):
            return None
        left = self.expr(test.left, env)
        options = test.comparators[0]
        if left.kind != "dtype_of" or left.args[0].kind != "attr":
            return None
        if not isinstance(options, (ast.List, ast.Tuple, ast.Set)):
            return None
        dtypes = {self.expr(e, env) for e in options.elts}
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


# ---------------------------------------------------------------- recognizing the forms


class _NotRMS(Exception):
    """Not an RMSNorm at all (plain precondition failure: no match)."""


class _Variant(Exception):
    """An RMSNorm-like form the kernel does not compute: refused with ``code``."""

    def __init__(self, reason: str, code: str = CODE):
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class Form:
    """A recognized RMSNorm forward: what the rewrite passes."""

    input: str  # the forward's tensor parameter
    weight: str  # ``self.<attr>``
    eps: str  # source text of eps
    keywords: tuple[tuple[str, str], ...] = ()  # the form (RMSNormForm fields that differ)
    inlined: tuple[str, ...] = ()  # same-class helpers the forward calls


INPUT = Sym("input")


def _is(sym: Sym, kind: str, value: object = None) -> bool:
    return sym.kind == kind and (value is None or sym.value == value)


def _op(sym: Sym, name: str) -> bool:
    return sym.kind == "op" and sym.value == name


def _operands(sym: Sym, name: str) -> list[tuple[Sym, Sym]]:
    """Both orders of a commutative binary op's operands."""
    if not _op(sym, name) or len(sym.args) != 2:
        return []
    a, b = sym.args
    return [(a, b), (b, a)] if name in ("*", "+") else [(a, b)]


def _is_cast(sym: Sym, dtype: Sym | str) -> Sym | None:
    """The value ``sym`` casts to ``dtype`` (a dtype name or a ``dtype_of`` symbol), or None."""
    if not _op(sym, "cast"):
        return None
    target = sym.args[1]
    if isinstance(dtype, str):
        return sym.args[0] if target.kind == "dtype" and target.value == dtype else None
    return sym.args[0] if target == dtype else None


def _fp32_input(sym: Sym) -> bool:
    return _is_cast(sym, "float32") == INPUT


def _squared(sym: Sym) -> Sym | None:
    """``b`` of ``b.pow(2)``, ``b ** 2``, ``b.square()``, ``b * b``."""
    if (_op(sym, "pow") or _op(sym, "**")) and len(sym.args) == 2 and sym.args[1].kind == "const" \
            and sym.args[1].value == 2:
        return sym.args[0]
    if _op(sym, "square") and len(sym.args) == 1:
        return sym.args[0]
    if _op(sym, "*") and len(sym.args) == 2 and sym.args[0] == sym.args[1]:
        return sym.args[0]
    return None


def _mean_of_squares(sym: Sym) -> tuple[Sym, tuple[tuple[str, str], ...]]:
    """``(b, keywords)`` of ``mean(b ** 2, dim, keepdim=True)``; raises when it is not a norm's
    mean. ``dim`` is ``-1``, or a ``self.<attr>`` the rewrite passes on (``dim=self.dim``: litgpt's
    norm reads it from an attribute, which the kernel checks is the last dimension at run time)."""
    if not _op(sym, "mean"):
        raise _NotRMS("no mean of squares")
    base = _squared(sym.args[0]) if sym.args else None
    if base is None:
        raise _NotRMS("the mean is not of squares")
    if _op(base, "-"):
        raise _NotRMS("the squares are of a centered value (a LayerNorm)")
    dim = sym.kwarg("dim", 1) or sym.kwarg("axis")
    keepdim = sym.kwarg("keepdim", 2)
    keywords: tuple[tuple[str, str], ...] = ()
    if dim is not None and dim.kind == "attr":
        keywords = (("dim", f"self.{dim.value}"),)
    elif dim is None or dim.kind != "const" or dim.value != -1:
        shown = "no dim" if dim is None else f"dim={ast.unparse(dim.node) if dim.node is not None else dim.value}"
        raise _Variant(f"the mean of squares is over {shown}, not provably the last dimension", "dim-not-last")
    if keepdim is None or keepdim.kind != "const" or keepdim.value is not True:
        raise _Variant("the mean of squares does not keep its dimension")
    return base, keywords


def _eps_text(sym: Sym) -> str:
    """``self.<attr>`` or the number as the source writes it (``1e-6``)."""
    if sym.kind == "attr":
        return f"self.{sym.value}"
    if sym.kind == "const":
        return sym.text or repr(sym.value)
    raise _Variant(f"eps {sym.value if sym.kind == 'unknown' else sym.kind} is not an attribute or a number")


@dataclass(frozen=True)
class _Norm:
    """``factor * rsqrt(mean(base ** 2) + eps)``: ``upcast`` when ``base`` is the float32 input
    (False: the input itself, normalized in its own dtype); ``keywords``: ``dim=self.<attr>``."""

    factor: Sym
    eps: str
    upcast: bool
    keywords: tuple[tuple[str, str], ...] = ()


def _normalized(sym: Sym) -> _Norm:
    """The norm ``sym`` is (``a * rsqrt(mean(f ** 2, -1, keepdim=True) + eps)`` with ``f`` the
    float32 input or the input); raises for what is no such product (refusing the look-alikes)."""
    for a, r in _operands(sym, "*"):
        if _op(r, "rsqrt") and len(r.args) == 1:
            for var, eps in _operands(r.args[0], "+"):
                if _op(var, "mean"):
                    base, keywords = _mean_of_squares(var)
                    upcast = _check_base(base, a)
                    return _Norm(a, _eps_text(eps), upcast, keywords)
            if _op(r.args[0], "mean"):
                _mean_of_squares(r.args[0])
                raise _Variant("no eps inside the square root")
    if _op(sym, "/") and len(sym.args) == 2:
        a, d = sym.args
        if _op(d, "sqrt"):
            for var, _ in _operands(d.args[0], "+"):
                if _op(var, "mean"):
                    _mean_of_squares(var)
                    raise _Variant("divides by sqrt(mean + eps) where the kernel multiplies by rsqrt (other rounding)")
        for s, _ in _operands(d, "+"):
            if _op(s, "sqrt") and s.args and _op(s.args[0], "mean"):
                _mean_of_squares(s.args[0])
                raise _Variant("eps is added outside the square root: x / (sqrt(mean(x**2)) + eps)")
    raise _NotRMS("no x * rsqrt(mean(x**2) + eps)")


def _check_base(base: Sym, factor: Sym) -> bool:
    """The squares are of the float32 input and the factor is the float32 or the plain input
    (True), or both are the input itself: no upcast (False)."""
    if base == INPUT:
        if factor != INPUT:
            raise _Variant("the value normalized is not the input the variance is computed from")
        return False
    if not _fp32_input(base):
        raise _Variant("the squared value is not the forward's input (cast to float32 or not)")
    if factor != base and factor != INPUT:
        raise _Variant("the value normalized is not the input the variance is computed from")
    return True


def _scale(sym: Sym, before_cast: bool) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(weight attribute, form keywords)`` of a scale: ``self.w``, ``self.w.float()``,
    ``offset + ...`` (Gemma, litgpt), ``(offset + self.w).float()`` (only before the cast back)."""
    if sym.kind == "attr":
        return sym.value, ()
    inner = _is_cast(sym, "float32")
    if inner is not None and inner.kind == "attr":
        return inner.value, (("weight_fp32", "True"),)
    for c, rest in _operands(sym, "+"):
        if c.kind == "const":
            weight, keywords = _scale(rest, before_cast)
            if keywords not in ((), (("weight_fp32", "True"),)):
                break
            return weight, (("offset", repr(float(c.value))),) + keywords
    if inner is not None and before_cast:
        # (1.0 + self.weight).float() * n: the sum rounds in the weight's dtype; the product with
        # the float32 n promotes it exactly as the cast does
        for c, rest in _operands(inner, "+"):
            if c.kind == "const" and rest.kind == "attr":
                return rest.value, (("offset", repr(float(c.value))),)
    if _op(sym, "-") and any(a.kind == "attr" for a in sym.args):
        raise _Variant("the scale subtracts from the weight")
    raise _Variant(f"the scale {_shown(sym)} is not a weight attribute (optionally float32, plus a constant)")


def _shown(sym: Sym) -> str:
    if sym == INPUT:
        return "its input unchanged"
    return ast.unparse(sym.node) if sym.node is not None else sym.kind


def _input_dtype(sym: Sym) -> bool:
    return sym == Sym("dtype_of", args=(INPUT,))


_NO_UPCAST = (("upcast", "False"),)

# each keyword's value when the rewrite leaves it out (the kernel's defaults)
_DEFAULTS = {"offset": "0.0", "weight_before_cast": "False", "weight_fp32": "False",
             "cast_to_half_weight": "False", "upcast": "True", "dim": "-1"}


def classify(result: Sym) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """``(weight, eps, keywords)`` of a recognized RMSNorm value; raises :class:`_Variant` or
    :class:`_NotRMS`."""
    flags = _branch_flags(result)
    if flags:
        return _classify_branches(result, flags)
    # the ``+ self.bias`` of a bias-carrying norm, reported as such
    for a, b in _operands(result, "+"):
        if b.kind == "attr" and _contains_plain_norm(a):
            raise _Variant(f"adds self.{b.value} to the scaled norm (a bias the kernel does not add)")
    # Llama: scale * n.to(input_dtype) (Meta-llama/torchtitan: self._norm(x.float()).type_as(x) * w)
    for s, cast in _operands(result, "*"):
        inner = _is_cast(cast, Sym("dtype_of", args=(INPUT,)))
        if inner is not None and _contains_norm(inner):
            norm = _normalized(inner)
            if norm.factor == INPUT and norm.upcast:
                raise _Variant("scales x * rstd cast back, with x not the float32 copy")
            weight, keywords = _scale(s, before_cast=False)
            return weight, norm.eps, keywords + _upcast(norm) + norm.keywords
    # OLMo-2, Gemma, Helium: (scale * n).to(input_dtype)
    inner = _is_cast(result, Sym("dtype_of", args=(INPUT,)))
    if inner is not None:
        if _is_normalized(inner):
            raise _Variant("no weight (an unweighted RMSNorm)")
        for s, n in _operands(inner, "*"):
            if _contains_norm(n) and not _contains_norm(s):
                norm = _normalized(n)
                if norm.factor == INPUT and norm.upcast:
                    raise _Variant("x * rstd with x not the float32 copy, cast back")
                weight, keywords = _scale(s, before_cast=True)
                return weight, norm.eps, keywords + (("weight_before_cast", "True"),) + _upcast(norm) + norm.keywords
    # T5LayerNorm: self.w * (h.to(self.w.dtype) if self.w.dtype is half else h), h = x * rstd
    for w, sel in _operands(result, "*"):
        if w.kind == "attr" and sel.kind == "select":
            test, then, other = sel.args
            if test.args[0] == w and then is not None and _is_cast(then, Sym("dtype_of", args=(w,))) == other:
                norm = _normalized(other)
                if norm.factor != INPUT or not norm.upcast:
                    raise _Variant("T5's form, normalizing the float32 copy instead of the input, or without "
                                   "the float32 variance")
                return w.value, norm.eps, (("cast_to_half_weight", "True"),) + norm.keywords
    # no upcast, no cast: scale * (x * rsqrt(mean(x ** 2) + eps)), all in the input's dtype
    for s, n in _operands(result, "*"):
        if _contains_norm(n) and not _contains_norm(s) and _is_normalized(n):
            norm = _normalized(n)
            if norm.upcast:
                raise _Variant("scales the float32 norm and never casts back to the input dtype")
            weight, keywords = _scale(s, before_cast=False)
            return weight, norm.eps, keywords + _NO_UPCAST + norm.keywords
    if _is_normalized(result):
        raise _Variant("no weight and no cast back (an unweighted RMSNorm)")
    helper = _opaque(result)
    if helper is not None:
        raise _Variant(f"calls self.{helper}, whose body is not a sequence of assignments and a return "
                       "(branches): the form cannot be read")
    if _contains_plain_norm(result):
        raise _Variant(f"the forward returns {_shown(result)}, which computes more than the RMSNorm of its input")
    raise _NotRMS("the forward does not return an RMSNorm of its input")


def _upcast(norm: _Norm) -> tuple[tuple[str, str], ...]:
    return () if norm.upcast else _NO_UPCAST


def _branch_flags(sym: Sym | None) -> set[str]:
    """The attributes the ``branch`` values inside ``sym`` test."""
    if not isinstance(sym, Sym):
        return set()
    found = {sym.value} if sym.kind == "branch" else set()
    for a in list(sym.args) + [v for _, v in sym.kw]:
        found |= _branch_flags(a)
    return found


def _resolve(sym: Sym | None, attr: str, value: bool) -> Sym | None:
    """``sym`` with every branch on ``self.<attr>`` replaced by its side for ``value``."""
    if not isinstance(sym, Sym):
        return sym
    if sym.kind == "branch" and sym.value == attr:
        return _resolve(sym.args[0] if value else sym.args[1], attr, value)
    if not sym.args and not sym.kw:
        return sym
    return replace(sym, args=tuple(_resolve(a, attr, value) for a in sym.args),
                   kw=tuple((k, _resolve(v, attr, value)) for k, v in sym.kw))


def _classify_branches(result: Sym, flags: set[str]) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """litgpt's ``if self.add_unit_offset: return n * (1 + self.weight)`` / ``return n * self.weight``
    (or ``weight = (1 + self.weight) if self.add_unit_offset else self.weight``): each side a form
    over the same weight and eps; a keyword whose value differs becomes a conditional expression on
    the attribute (``offset=1.0 if self.add_unit_offset else 0.0``), read at run time as the
    source's ``if`` reads it."""
    if len(flags) > 1:
        raise _Variant(f"the forward branches on {', '.join(f'self.{f}' for f in sorted(flags))}: one flag at most")
    (attr,) = flags
    sides = []
    for value in (True, False):
        side = _resolve(result, attr, value)
        try:
            sides.append(classify(side))
        except _NotRMS:
            raise _Variant(f"with self.{attr} {value} the forward returns {_shown(side)}, "
                           "not an RMSNorm of its input") from None
    (w1, e1, k1), (w2, e2, k2) = sides
    if (w1, e1) != (w2, e2):
        raise _Variant(f"the sides of `self.{attr}` scale by different weights or use different eps")
    when_true, when_false = dict(k1), dict(k2)
    keywords = []
    for key in [k for k in _DEFAULTS if k in when_true or k in when_false]:
        a, b = when_true.get(key, _DEFAULTS[key]), when_false.get(key, _DEFAULTS[key])
        if key == "cast_to_half_weight" and a != b:
            raise _Variant(f"one side of `self.{attr}` is T5's form, the other not")
        keywords.append((key, a if a == b else f"{a} if self.{attr} else {b}"))
    return w1, e1, tuple(keywords)


def _is_normalized(sym: Sym) -> bool:
    """``sym`` is ``a * rsqrt(mean(f ** 2) + eps)`` (a look-alike raises its refusal)."""
    try:
        _normalized(sym)
    except _NotRMS:
        return False
    return True


def _opaque(sym: Sym | None) -> str | None:
    if not isinstance(sym, Sym):
        return None
    if sym.kind == "opaque":
        return str(sym.value)
    return next((h for h in map(_opaque, sym.args) if h is not None), None)


def _contains_norm(sym: Sym | None) -> bool:
    if sym is None or not isinstance(sym, Sym):
        return False
    if _op(sym, "rsqrt") or _op(sym, "sqrt"):
        return True
    return any(_contains_norm(a) for a in sym.args)


def _contains_plain_norm(sym: Sym) -> bool:
    """``sym`` holds an RMSNorm's ``a * rsqrt(...)``; raises a look-alike's refusal (``_Variant``)
    met on the way. False for centered (LayerNorm) normalizations only."""
    if not _contains_norm(sym) or not isinstance(sym, Sym):
        return False
    return _is_normalized(sym) or any(_contains_plain_norm(a) for a in sym.args if isinstance(a, Sym))


# ---------------------------------------------------------------- the class's forward


def _torch_names(tree: ast.Module) -> set[str]:
    names = {"torch"}
    for st in tree.body:
        if isinstance(st, ast.Import):
            names |= {a.asname or a.name for a in st.names if a.name == "torch"}
    return names


def _class_node(tree: ast.Module, name: str) -> ast.ClassDef | None:
    """The last definition of class ``name`` (also one nested in an ``if``/``try`` block)."""
    found = None
    for c in walk(tree):
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
    evaluator = _Evaluator(_torch_names(tree), helpers, source)
    result = evaluator.body(forward.body, {names[1]: INPUT})
    if result is None:
        if _mentions_norm(forward):
            raise _Variant("the forward has statements besides the norm's assignments and its return "
                           "(branches, loops, other calls)")
        raise _NotRMS("the forward is not a sequence of assignments and a return")
    weight, eps, keywords = classify(result)
    return Form(input=names[1], weight=f"self.{weight}", eps=eps, keywords=keywords,
                inlined=tuple(dict.fromkeys(evaluator.inlined)))


def _mentions_norm(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in ("rsqrt", "sqrt") for n in walk(fn))


def _overriding_subclasses(tree: ast.Module, class_name: str, names: tuple[str, ...]) -> list[str]:
    """Same-file subclasses of ``class_name`` (direct or not) that override one of ``names``."""
    classes = [c for c in walk(tree) if isinstance(c, ast.ClassDef)]
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


# ---------------------------------------------------------------- precondition


def rms_norm_form(ctx: MatchContext) -> str | None:
    """The match lies in a class's ``forward`` whose whole body is a recognized RMSNorm form;
    a look-alike is refused (``norm-variant``, ``dim-not-last``), anything else is no match."""
    m = ctx.match
    if not m.class_name or m.function != "forward" or not ctx.source:
        return "not in a class's forward (the rewrite replaces a norm class's forward)"
    try:
        form = analyze_forward(ctx.source, m.class_name)
    except _NotRMS as exc:
        return str(exc)
    except _Variant as exc:
        return Refusal(exc.code, str(exc))
    if form.inlined:
        tree = parse_file(ctx.source)
        overriding = _overriding_subclasses(tree, m.class_name, form.inlined)
        if overriding:
            return Refusal(CODE, f"{', '.join(overriding)} overrides the helper the forward calls: "
                                 "the rewritten forward would not call it")
    return None


# ---------------------------------------------------------------- codemod


class RMSNormCodemod(Codemod):
    rule = "RMSNorm"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        if not match.class_name or match.function != "forward":
            raise Skip("not a class's forward")
        try:
            form = analyze_forward(ctx.text, match.class_name)
        except (_NotRMS, _Variant) as exc:
            raise Skip(str(exc)) from None
        cls = ctx.classes.get(match.class_name)
        forward = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None) \
            if cls is not None else None
        if forward is None:
            raise Skip(f"{match.class_name}.forward not found")
        body = list(forward.body)
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
            body = body[1:]  # the docstring stays
        spec, kernel = kernel_name(ctx, KERNEL)
        args = [form.input, form.weight, form.eps] + [f"{k}={v}" for k, v in form.keywords]
        statements = tuple(pos(ctx, s) for s in body)
        return Edit(
            rule=self.rule,
            forward=ForwardEdit(
                statements=statements,
                anchor=statements[-1],
                statement_edits=(StatementEdit(statements[-1], f"return {kernel}({', '.join(args)})"),),
                delete=statements[:-1],
            ),
            imports=(spec,),
        )


# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    """The traced ``mean`` reduces the last dimension with ``keepdim`` (its constant arguments
    as the trace recorded them), and the norm ran in a module instance (the rewrite is per class)."""
    if not site.instance and site.match.class_name:
        return "the norm did not run inside a module instance", ""
    for node, ops in zip(site.nodes, site.ops):
        for op in ops:
            if op.name != "mean":
                continue
            dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else None)
            if dim is not None and dim not in (-1, [-1], (-1,)):
                shapes = op.input_shapes[0] if op.input_shapes else None
                last = len(shapes) - 1 if shapes else None
                if dim not in (last, [last], (last,)):
                    return f"the traced mean reduces dim {dim}, not the last", ""
    return None, f"RMSNorm of {site.instance or site.match.class_name}"


RUNTIME = Runtime(check=_runtime_check)

RULE = Rule(
    name="RMSNorm",
    kernel="adopter.kernels.rms_norm",
    doc=DOC,
    dsl=DSL,
    codemod=RMSNormCodemod(),
    runtime=RUNTIME,
    fixtures="RMSNorm",
    preconditions=(rms_norm_form,),
    # a Gemma norm's nodes lie in the ``_norm`` helper its forward calls: the match stays with
    # the forward (the class the rewrite changes)
    rehome=False,
)
