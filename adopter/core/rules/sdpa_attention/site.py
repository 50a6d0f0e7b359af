"""What a written-out attention computes, read statement by statement from its syntax tree.

The region runs from the statement holding the scores product to the statement holding the output
product, in one block of one function. Each statement is interpreted over a small symbolic state
(:class:`Scores`, then :class:`Probs`) bound to the names it assigns:

    s = q @ k.transpose(-2, -1)  |  torch.matmul(q, kᵀ)  |  torch.einsum('bhid,bhjd->bhij', q, k)
    s = s * c  |  s / c  |  s *= c                                 one scale (before any mask)
    s = s + m  |  s += m  |  if <test>: s = s + m                  one additive mask
    s = s.masked_fill(b, float('-inf'))  |  torch.masked_fill(...)  boolean fills, each optionally
        under its own `if <test>:`; the value -inf or -torch.finfo(s.dtype).max (also through a
        name bound to it in the region): all before or all after the additive mask
    if <test>: <names> = ...; s = s.masked_fill(b, v)  |  s = s + m   a mask built in the branch, reading
        the scores only as their last two sizes or device (``i, j = s.shape[-2:]``); also such
        assignments outside a branch: kept in place, those reads taken from the query and key;
        a condition calling a function (``if exists(mask):``) or reading a name the branch
        rebinds (``mask = rearrange(mask, ...)``): the mask bound in the branch itself
    p = softmax(s, dim=-1)  (F./torch./tensor method)              the softmax, over the last dim
    p = self.drop(p)  |  F.dropout(p, p=P, training=T)             dropout of the probabilities
    o = p @ v  |  torch.matmul(p, v)  |  torch.einsum('bhij,bhjd->bhid', p, v)   (inside any expression)

nested in one expression or spread over statements. :func:`interpret` returns the
:class:`Attention` (the syntax nodes the codemod moves into the kernel call) or raises
:class:`NotCovered` with a precision code where one applies (``probs-read``: the scores or
probabilities are read besides the output product; ``probs-dtype``: a cast or ``dtype=`` around
the softmax, another math than SDPA's; ``dim-not-last``). ``candidate=False`` marks a region whose
data flow is not attention at all (the softmax does not read the scores product, the output does
not read the probabilities): the rule drops it without a report.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from adopter.core.extract.partials import unwrap
from adopter.core.syntax import per_node, statements, walk

MATMUL_FUNCS = ("matmul",)
SOFTMAX_FUNCS = ("softmax",)
CASTS = {"type", "to", "type_as", "float", "half", "bfloat16", "double"}


class NotCovered(Exception):
    def __init__(self, reason: str, code: str = "", candidate: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.candidate = candidate


@dataclass
class Scores:
    """The scores as the region computes them, up to the softmax."""

    q: ast.expr
    key: ast.expr  # kᵀ for a matmul, k for an einsum
    einsum: str = ""  # the scores equation, as written ("" for a matmul)
    scale: tuple[str, ast.expr] | None = None  # ("mul" | "div", factor)
    mask: ast.expr | None = None
    mask_test: ast.expr | None = None
    # the boolean fills in order: (mask, value, test); value LOWEST for -torch.finfo(<scores>.dtype).max
    fills: list[tuple[ast.expr, ast.expr | str, ast.expr | None]] = field(default_factory=list)
    fill_first: bool = False  # the fills come before the additive mask
    # the softmax has read them: a later scale, mask or fill of the same name is not the softmax's
    read: bool = False


# A fill value that is the most negative finite number of the scores' own dtype, as the source
# writes it (``-torch.finfo(s.dtype).max``, ``torch.finfo(s.dtype).min``): passed to the kernel as
# this string, since the scores are not computed where the call is.
LOWEST = "lowest"


@dataclass
class _Lowest:
    """A name bound to ``-torch.finfo(<scores>.dtype).max`` inside the region."""


@dataclass
class Probs:
    """The softmax of :class:`Scores`, then its dropout."""

    scores: Scores
    dropout: tuple | None = None  # ("module", expr) | ("functional", p, training)
    # the softmax computed in float32 (``softmax(s.float())``, ``softmax(s, dtype=torch.float32)``),
    # then cast back: ("to", expr) for ``.to(expr)``, ("type_as", expr) for ``.type_as(expr)``
    upcast: bool = False
    cast_back: tuple[str, ast.expr] | None = None


@dataclass
class _Upcast:
    """``s.float()`` / ``s.to(torch.float32)`` of :class:`Scores`: only a softmax may read it."""

    scores: Scores


@dataclass
class Attention:
    """A covered written-out attention (syntax nodes of the parsed file)."""

    scores: Scores
    dropout: tuple | None
    v: ast.expr
    out_einsum: str
    output: ast.expr  # the output product (replaced by the kernel call)
    last: ast.stmt  # the statement holding it
    upcast: bool  # the softmax computed in float32 ...
    cast_back: tuple[str, ast.expr] | None  # ... and cast back (see Probs)
    consumed: list[ast.stmt] = field(default_factory=list)  # statements deleted (before ``last``)
    names: list[str] = field(default_factory=list)  # names holding scores/probabilities
    moved: list[ast.expr] = field(default_factory=list)  # expressions evaluated at the call instead
    # statements of the region kept in place (a mask built under an ``if`` from the scores' shape,
    # the ``if`` itself), their reads of the scores' shape rewritten: see :meth:`_Interpreter._built_mask`
    kept: list[ast.stmt] = field(default_factory=list)
    inner_deleted: list[ast.stmt] = field(default_factory=list)  # the scores' update inside a kept ``if``
    shape_reads: list[tuple[ast.expr, str]] = field(default_factory=list)  # (read, "rows" | "cols" | "last2" | "device")
    # (the scores' update inside a kept ``if``, the mask or bias it applies): the update becomes
    # ``<fresh name> = <mask>`` where it is, the name bound to None in place of the scores' product
    # (the region's first statement) (:meth:`_Interpreter._conditional`); the call reads the name
    bound: list[tuple[ast.stmt, ast.expr]] = field(default_factory=list)


@per_node(64)
def dropout_attrs(cls: ast.ClassDef | None) -> frozenset[str]:
    """Attributes ``self.<a> = ...Dropout(...)`` of the class (any method)."""
    out = set()
    for node in walk(cls) if cls is not None else ():
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "Dropout":
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        out.add(t.attr)
    return frozenset(out)


@per_node(8)
def _imported_names(module: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it imports, over the whole file (read once per file: every
    candidate of the file asks)."""
    local = {}
    for node in statements(module):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                local[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                local[a.asname or a.name.partition(".")[0]] = a.asname and a.name or a.name.partition(".")[0]
    return local


def softmax_partials(cls: ast.ClassDef | None, module: ast.AST | None) -> dict[str, dict[str, ast.expr]]:
    """The softmax partials of ``cls`` (see :func:`_softmax_partials`), read once per class: every
    candidate of the class asks, and a class node belongs to one module."""
    if cls is None:
        return {}
    kept = _partials_of_class(cls)
    hit = kept.get(id(module))
    if hit is None or hit[0] is not module:
        hit = kept[id(module)] = (module, _softmax_partials(cls, module))
    return hit[1]


@per_node(64)
def _partials_of_class(cls: ast.ClassDef) -> dict[int, tuple[ast.AST | None, dict[str, dict[str, ast.expr]]]]:
    """id(module) -> (module, :func:`_softmax_partials` of ``cls`` read with its imports), filled
    by :func:`softmax_partials`."""
    return {}


def _softmax_partials(cls: ast.ClassDef | None, module: ast.AST | None) -> dict[str, dict[str, ast.expr]]:
    """Attributes ``self.<a> = partial(F.softmax, dim=-1)`` of the class (any method; ``partial``
    from ``functools`` however imported), with the keywords bound: a call ``self.<a>(x)`` is
    ``softmax(x, **keywords)``. An attribute also bound to anything else in the class, or bound
    with positional or unpacked arguments, is left out (not read)."""
    if cls is None:
        return {}
    local = _imported_names(module) if module is not None else {}

    def fqn(dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        return f"{local[head]}.{rest}".rstrip(".") if head in local else None

    out: dict[str, dict[str, ast.expr]] = {}
    other = set()  # attributes also bound to something else (or to another softmax partial)
    for node in walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            attr = _self_attr(target)
            if attr is None:
                continue
            bound = unwrap(node.value, fqn) if isinstance(node, ast.Assign) and len(targets) == 1 and isinstance(
                node.value, ast.Call) else None
            root = bound.func.value if bound is not None and isinstance(bound.func, ast.Attribute) else None
            if (bound is None or bound.args or _func_name(bound.func) not in SOFTMAX_FUNCS or root is None
                    or _func_name(root) not in ("F", "functional", "torch", "special")):
                other.add(attr)
                continue
            keywords = dict(bound.keywords)
            if attr in out and {k: ast.dump(v) for k, v in out[attr].items()} != {
                    k: ast.dump(v) for k, v in keywords.items()}:
                other.add(attr)
            out[attr] = keywords
    return {attr: kw for attr, kw in out.items() if attr not in other}


def _is_float32(node: ast.expr | None) -> bool:
    """``torch.float32`` / ``torch.float``."""
    return (isinstance(node, ast.Attribute) and node.attr in ("float32", "float")
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _func_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _stores(stmt: ast.AST) -> set[str]:
    return {n.id for n in walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def _is_neg_inf(node: ast.expr) -> bool:
    """``float('-inf')``, ``-float('inf')``, ``-math.inf``, ``-torch.inf``, ``float("-inf")``."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = node.operand
        if isinstance(inner, ast.Call) and _func_name(inner.func) == "float" and len(inner.args) == 1:
            return str(_literal(inner.args[0])).lower() in ("inf", "infinity")
        return isinstance(inner, ast.Attribute) and inner.attr == "inf"
    if isinstance(node, ast.Call) and _func_name(node.func) == "float" and len(node.args) == 1:
        return str(_literal(node.args[0])).lower() in ("-inf", "-infinity")
    return False


def einsum_roles(equation: str) -> tuple[str, str] | None:
    """("scores" | "output", prefix) when ``equation`` is a batched ``q kᵀ`` (``PiD,PjD->Pij``) or
    ``p v`` (``Pij,PjD->PiD``) with one batch prefix of letters, else None."""
    eq = equation.replace(" ", "")
    if "..." in eq or eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2 or not all(s.isalpha() for s in (*ops, out)):
        return None
    a, b = ops
    if not (len(a) == len(b) == len(out) >= 3) or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    prefix = a[:-2]
    if b[:-2] != prefix or out[:-2] != prefix:
        return None
    i, x = a[-2:]
    j, y = b[-2:]
    if y == x and out[-2:] == i + j:  # P i d, P j d -> P i j
        letters = (i, j, x)
        role = "scores"
    elif x == j and out[-2:] == i + y:  # P i j, P j d -> P i d
        letters = (i, j, y)
        role = "output"
    else:
        return None
    if len(set(letters) | set(prefix)) != len(prefix) + 3:
        return None
    return role, prefix


class _Interpreter:
    def __init__(self, first: ast.expr, last: ast.expr, is_dropout_module, softmax_attrs=None):
        self.first = first
        self.last_node = last
        self.is_dropout_module = is_dropout_module  # (attr name) -> bool
        self.softmax_attrs = softmax_attrs or {}  # attr -> keywords bound by partial(F.softmax, ...)
        self.env: dict[str, Scores | Probs] = {}
        self.moved: list[ast.expr] = []
        self.read_at: list[tuple[ast.expr, int]] = []  # (moved expression, index in the region where read)
        self.at = 0
        self.result: tuple | None = None
        self.kept: list[ast.stmt] = []
        self.inner_deleted: list[ast.stmt] = []
        self.bound: list[tuple[ast.stmt, ast.expr]] = []
        self.shape_reads: list[tuple[ast.expr, str]] = []
        # names the region's block binds to a permute swapping a key's last two dims before the
        # region, not rebound since (whisper's ``k = k.view(...).permute(0, 2, 3, 1)``; ``q @ k``)
        self.permuted_keys: set[str] = set()

    # ------------------------------------------------------------ expressions

    def tracked(self, node: ast.AST) -> bool:
        return bool(_loads(node) & set(self.env))

    def relevant(self, node: ast.AST) -> bool:
        """``node`` reads the scores/probabilities or holds one of the two products."""
        return self.tracked(node) or any(n is self.first or n is self.last_node for n in walk(node))

    def value(self, node: ast.expr):
        """The symbolic value of ``node``: a Scores, a Probs, or None when it reads no tracked
        name and holds neither product."""
        if node is self.first:
            return self._scores_product(node)
        if node is self.last_node:
            return self._output(node)
        if isinstance(node, ast.Name) and node.id in self.env:
            return self.env[node.id]
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        if not self.tracked(node) and not any(n is self.first or n is self.last_node for n in walk(node)):
            return None
        raise NotCovered(f"line {node.lineno}: {ast.unparse(node)[:60]!r} on the attention scores is not covered")

    def _plain(self, node: ast.expr, what: str) -> ast.expr:
        """An operand moved into the call: it must not read the scores or probabilities."""
        if self.tracked(node) or any(n is self.first or n is self.last_node for n in walk(node)):
            raise NotCovered(f"line {node.lineno}: the {what} reads the attention scores", candidate=False)
        self.moved.append(node)
        self.read_at.append((node, self.at))
        return node

    def _scores_product(self, node: ast.expr) -> Scores:
        batched = False  # (``torch.bmm``: operands of rank 3, or the source raises)
        if isinstance(node, ast.BinOp):
            q, key = node.left, node.right
        elif _func_name(node.func) == "baddbmm":
            return self._baddbmm(node)
        elif _func_name(node.func) == "einsum":
            eq = _literal(node.args[0]) if node.args else None
            if not isinstance(eq, str) or len(node.args) != 3 or node.keywords:
                raise NotCovered(f"line {node.lineno}: an einsum of the scores not written as einsum('eq', q, k)")
            role = einsum_roles(eq)
            if role is None or role[0] != "scores":
                raise NotCovered(f"line {node.lineno}: einsum {eq!r} is not a batched q·kᵀ", candidate=False)
            return Scores(self._plain(node.args[1], "query"), self._plain(node.args[2], "key"), einsum=eq)
        else:
            q, key = _matmul_operands(node)
            batched = _func_name(node.func) == "bmm"
        self._transposed_key(node, key, batched)
        return Scores(self._plain(q, "query"), self._plain(key, "key"))

    def _transposed_key(self, node: ast.expr, key: ast.expr, batched: bool) -> None:
        """The right operand of the scores product is a key transposed over its last two dims: the
        kernel takes it as multiplied (its ``key.transpose(-2, -1)`` is then the key SDPA reads,
        exactly, whatever the operand), so this decides only that the product is an attention's."""
        if not (_is_transposed_key(key, batched) or isinstance(key, ast.Name) and key.id in self.permuted_keys):
            raise NotCovered(f"line {node.lineno}: the key operand is not transposed over its last two dims",
                             candidate=False)

    def _baddbmm(self, node: ast.Call) -> Scores:
        """``torch.baddbmm(input, q, kᵀ, beta=b, alpha=a)`` (or ``input.baddbmm(q, kᵀ, ...)``) is
        ``b * input + a * (q @ kᵀ)``: with ``beta=0`` the input is ignored (torch does not propagate
        NaN or inf from it), so the scores are ``(q @ kᵀ) * a`` — the same bits on CPU in float32,
        bfloat16 and float16 (the kernel's source ops compute that product). Another ``beta``
        (not written: 1) is not covered: ``a * (q @ kᵀ) + input`` rounds once in baddbmm, twice as
        separate ops (bfloat16 on CPU: 0.03 apart), and the rank-3 operands never run fused anyway."""
        method = isinstance(node.func, ast.Attribute) and not (
            isinstance(node.func.value, ast.Name) and node.func.value.id == "torch")
        names = ("batch1", "batch2") if method else ("input", "batch1", "batch2")
        kw = {k.arg: k.value for k in node.keywords}
        if None in kw or any(isinstance(a, ast.Starred) for a in node.args) or len(node.args) > len(names) \
                or kw.keys() - {*names, "beta", "alpha"}:
            raise NotCovered(f"line {node.lineno}: a baddbmm of the scores with arguments not covered")
        operands = dict(zip(names, node.args)) | {n: kw[n] for n in names if n in kw}
        if method:
            operands["input"] = node.func.value
        if len(operands) != 3:
            raise NotCovered(f"line {node.lineno}: a baddbmm of the scores with arguments not covered")
        bias, q, key = operands["input"], operands["batch1"], operands["batch2"]
        beta = _literal(kw["beta"]) if "beta" in kw else 1
        if type(beta) not in (int, float) or beta != 0:
            raise NotCovered(f"line {node.lineno}: baddbmm with beta other than 0 (beta * input added to the "
                             "scores in one rounding) is not covered")
        if not _ignorable(bias):
            raise NotCovered(f"line {node.lineno}: the ignored input of baddbmm (beta=0) is an expression the "
                             "rewrite would not evaluate")
        self._transposed_key(node, key, True)
        scores = Scores(self._plain(q, "query"), self._plain(key, "key"))
        if "alpha" in kw:
            self._scale(scores, "mul", kw["alpha"])
        return scores

    def _output(self, node: ast.expr) -> None:
        if isinstance(node, ast.Call) and _func_name(node.func) == "einsum":
            eq = _literal(node.args[0]) if node.args else None
            role = einsum_roles(eq) if isinstance(eq, str) else None
            if role is None or role[0] != "output" or len(node.args) != 3 or node.keywords:
                raise NotCovered(f"line {node.lineno}: the output einsum is not a batched p·v", candidate=False)
            probs, v, out_eq = node.args[1], node.args[2], eq
        else:
            probs, v = _matmul_operands(node)
            out_eq = ""
        p = self.value(probs)
        if not isinstance(p, Probs):
            raise NotCovered(f"line {node.lineno}: the output product does not read the softmax's probabilities",
                             candidate=False)
        if p.upcast and p.cast_back is None:
            raise NotCovered(f"line {node.lineno}: the softmax computed in float32 is not cast back before the "
                             "output product", "probs-dtype")
        if p.scores.einsum and not out_eq or out_eq and not p.scores.einsum:
            raise NotCovered(f"line {node.lineno}: one product is an einsum, the other a matmul")
        if out_eq and einsum_roles(out_eq)[1] != einsum_roles(p.scores.einsum)[1]:
            raise NotCovered(f"line {node.lineno}: the einsums' batch dimensions differ")
        self.result = (p, self._plain(v, "value"), out_eq)
        return None

    def _binop(self, node: ast.BinOp):
        if isinstance(node.op, ast.MatMult) and self.relevant(node):
            raise _another_product(node)
        left, right = self.value(node.left), self.value(node.right)
        if left is None and right is None:
            return None
        if isinstance(left, _Upcast) or isinstance(right, _Upcast):
            raise NotCovered(f"line {node.lineno}: an operation on the scores cast to float32", "probs-dtype")
        if isinstance(left, Probs) or isinstance(right, Probs):
            raise NotCovered(f"line {node.lineno}: an operation on the probabilities (a head mask?) is not covered")
        if isinstance(node.op, (ast.Mult, ast.Div)) and isinstance(left, Scores) and right is None:
            return self._scale(left, "mul" if isinstance(node.op, ast.Mult) else "div", node.right)
        if isinstance(node.op, ast.Mult) and isinstance(right, Scores) and left is None:
            return self._scale(right, "mul", node.left)
        if isinstance(node.op, ast.Add) and (left is None) != (right is None):
            scores = left if left is not None else right
            return self._add(scores, node.right if left is not None else node.left, None)
        raise NotCovered(f"line {node.lineno}: {ast.unparse(node)[:60]!r} on the scores is not covered")

    def _scale(self, s: Scores, kind: str, factor: ast.expr, *, line: int = 0) -> Scores:
        _not_after_softmax(s, factor)
        if s.scale is not None:
            raise NotCovered(f"line {factor.lineno}: the scores are scaled twice")
        if s.mask is not None or s.fills:
            raise NotCovered(f"line {factor.lineno}: the scores are scaled after the mask")
        s.scale = (kind, self._plain(factor, "scale"))
        return s

    def _add(self, s: Scores, term: ast.expr, test: ast.expr | None) -> Scores:
        _not_after_softmax(s, term)
        if s.mask is not None:
            raise NotCovered(f"line {term.lineno}: a second additive term on the scores")
        s.mask, s.mask_test = self._plain(term, "mask"), test
        s.fill_first = bool(s.fills)
        if test is not None:
            self.moved.append(test)
            self.read_at.append((test, self.at))
        return s

    def _lowest(self, node: ast.expr) -> bool:
        """``node`` is ``-torch.finfo(<scores>.dtype).max`` / ``torch.finfo(<scores>.dtype).min``, or
        a name bound to it in the region."""
        if isinstance(node, ast.Name):
            return isinstance(self.env.get(node.id), _Lowest)
        negated = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
        inner = node.operand if negated else node
        if not (isinstance(inner, ast.Attribute) and inner.attr == ("max" if negated else "min")):
            return False
        call = inner.value
        if not (isinstance(call, ast.Call) and _func_name(call.func) == "finfo" and len(call.args) == 1
                and not call.keywords and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"):
            return False
        arg = call.args[0]
        return (isinstance(arg, ast.Attribute) and arg.attr == "dtype" and isinstance(arg.value, ast.Name)
                and isinstance(self.env.get(arg.value.id), Scores))

    def _fill(self, s: Scores, mask: ast.expr, value: ast.expr, test: ast.expr | None) -> Scores:
        _not_after_softmax(s, mask)
        if s.mask is not None and s.fill_first:
            raise NotCovered(f"line {mask.lineno}: masked_fill on both sides of the additive mask")
        value = LOWEST if self._lowest(value) else self._plain(value, "fill value")
        s.fills.append((self._plain(mask, "fill mask"), value, test))
        if test is not None:
            self.moved.append(test)
            self.read_at.append((test, self.at))
        return s

    def _call(self, node: ast.Call):
        name = _func_name(node.func)
        receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
        receiver_value = self.value(receiver) if receiver is not None and self.relevant(receiver) else None
        args = list(node.args)
        kw = {k.arg: k.value for k in node.keywords}
        if any(isinstance(a, ast.Starred) for a in args) or None in kw:
            if self.tracked(node):
                raise NotCovered(f"line {node.lineno}: a call unpacking arguments on the scores")
            return None
        first = self.value(args[0]) if args and receiver_value is None and self.relevant(args[0]) else None
        subject = receiver_value if receiver_value is not None else first
        if subject is None:
            if self.relevant(node):
                raise NotCovered(f"line {node.lineno}: {ast.unparse(node.func)}(...) on the scores is not covered")
            return None
        rest = args if receiver_value is not None else args[1:]
        if name in ("matmul", "bmm", "baddbmm", "einsum", "mm"):
            raise _another_product(node)
        attr = _self_attr(node.func)
        if name in CASTS:
            return self._cast(node, name, subject, rest, kw, receiver_value is not None)
        bound = self.softmax_attrs.get(attr) if attr is not None and receiver_value is None else None
        if bound is not None and isinstance(subject, (Scores, _Upcast)):  # self.attn_fn = partial(F.softmax, ...)
            kw = {**bound, **kw}
            name = "softmax"
        elif name in SOFTMAX_FUNCS and isinstance(subject, (Scores, _Upcast)):
            if receiver is not None and receiver_value is None and _func_name(receiver) not in ("F", "functional",
                                                                                                 "torch", "special"):
                raise NotCovered(f"line {node.lineno}: {ast.unparse(node.func)} is not torch's softmax")
        if name in SOFTMAX_FUNCS and isinstance(subject, (Scores, _Upcast)):
            dim = kw.get("dim", rest[0] if rest else None)
            upcast = isinstance(subject, _Upcast)
            if len(rest) > 1 or kw.keys() - {"dim", "dtype"}:
                raise NotCovered(f"line {node.lineno}: the softmax is computed in another dtype", "probs-dtype")
            if "dtype" in kw:
                if not _is_float32(kw["dtype"]):
                    raise NotCovered(f"line {node.lineno}: the softmax is computed in another dtype", "probs-dtype")
                upcast = True
            if dim is None or _literal(dim) != -1:
                raise NotCovered(f"line {node.lineno}: the softmax is not over dim=-1", "dim-not-last")
            scores = subject.scores if isinstance(subject, _Upcast) else subject
            scores.read = True
            return Probs(scores, upcast=upcast)
        if name in ("masked_fill", "masked_fill_") and isinstance(subject, Scores):
            mask = kw.get("mask", rest[0] if rest else None)
            value = kw.get("value", rest[1] if len(rest) > 1 else None)
            if mask is None or value is None or len(rest) > 2:
                raise NotCovered(f"line {node.lineno}: masked_fill without mask and value")
            return self._fill(subject, mask, value, None)
        if attr is not None and isinstance(subject, Probs) and len(args) == 1 and not kw:
            if not self.is_dropout_module(attr):
                raise NotCovered(f"line {node.lineno}: self.{attr}(...) on the probabilities is not an nn.Dropout")
            if subject.dropout is not None:
                raise NotCovered(f"line {node.lineno}: a second dropout")
            subject.dropout = ("module", node.func)
            self.moved.append(node.func)
            self.read_at.append((node.func, self.at))
            return subject
        if isinstance(subject, _Upcast):
            raise NotCovered(f"line {node.lineno}: the scores cast to float32 feed another op than the softmax",
                             "probs-dtype")
        if name == "dropout" and isinstance(subject, Probs) and receiver_value is None:
            if _func_name(receiver) not in ("F", "functional") if receiver is not None else True:
                raise NotCovered(f"line {node.lineno}: {ast.unparse(node.func)} is not F.dropout")
            if subject.dropout is not None:
                raise NotCovered(f"line {node.lineno}: a second dropout")
            p = kw.get("p", rest[0] if rest else None)
            training = kw.get("training", rest[1] if len(rest) > 1 else None)
            if kw.keys() - {"p", "training", "inplace"} or len(rest) > 3 or _literal(kw.get("inplace")) is True \
                    or (len(rest) > 2 and _literal(rest[2]) is not False):
                raise NotCovered(f"line {node.lineno}: F.dropout with arguments the kernel does not take")
            # (None: not written, F.dropout's defaults p=0.5, training=True)
            p = self._plain(p, "dropout p") if p is not None else None
            training = self._plain(training, "dropout training") if training is not None else None
            subject.dropout = ("functional", p, training)
            return subject
        raise NotCovered(f"line {node.lineno}: {ast.unparse(node.func)}(...) on the attention scores is not covered")

    def _cast(self, node: ast.Call, name: str, subject, rest: list, kw: dict, method: bool):
        """The one cast pattern covered: the scores cast up to float32 right into the softmax
        (``softmax(s.float())``, or the softmax's ``dtype=torch.float32``) and its probabilities
        cast back right after it (``.type_as(t)``, ``.to(x)``), before any dropout. Any other cast
        is another math than SDPA's (``probs-dtype``)."""
        refuse = NotCovered(f"line {node.lineno}: a cast of the attention scores or probabilities other than the "
                            "softmax in float32 cast back (the source's softmax dtype is another math than SDPA's)",
                            "probs-dtype")
        if not method or kw:  # (``s.float()``, not ``torch.Tensor.float(s)``)
            raise refuse
        if isinstance(subject, Scores):
            if (name == "float" and not rest) or (name in ("to", "type") and len(rest) == 1 and _is_float32(rest[0])):
                return _Upcast(subject)
            raise refuse
        if (isinstance(subject, Probs) and subject.upcast and subject.cast_back is None and subject.dropout is None
                and name in ("to", "type_as") and len(rest) == 1):
            subject.cast_back = (name, self._plain(rest[0], "cast"))
            return subject
        raise refuse

    # ------------------------------------------------------------ statements

    def statement(self, stmt: ast.stmt) -> bool:
        """Interpret ``stmt``; True when it belongs to the attention (deleted or rewritten)."""
        if isinstance(stmt, ast.If):
            return self._conditional(stmt)
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in self.env:
            s = self.env[stmt.target.id]
            if not isinstance(s, Scores):
                raise NotCovered(f"line {stmt.lineno}: an update of the probabilities")
            if self.tracked(stmt.value):
                raise NotCovered(f"line {stmt.lineno}: an update of the scores by themselves")
            if isinstance(stmt.op, ast.Add):
                self._add(s, stmt.value, None)
            elif isinstance(stmt.op, (ast.Mult, ast.Div)):
                self._scale(s, "mul" if isinstance(stmt.op, ast.Mult) else "div", stmt.value)
            else:
                raise NotCovered(f"line {stmt.lineno}: an update of the scores that is not covered")
            return True
        if _holds(stmt, self.last_node):  # the output product, anywhere in its statement
            self.value(self.last_node)
            inside = {id(n) for n in walk(self.last_node)}
            if any(isinstance(n, ast.Name) and n.id in self.env and isinstance(n.ctx, ast.Load) and id(n) not in inside
                   for n in walk(stmt)):
                raise NotCovered(f"line {stmt.lineno}: the attention scores or probabilities are read here besides "
                                 "the output product", "probs-read")
            return True
        if not _holds(stmt, self.first) and not self.tracked(stmt):
            return False
        reads = self._shape_only(stmt)
        if reads is not None:  # ``i, j = s.shape[-2:]``: kept, read from the query and key instead
            self.kept.append(stmt)
            self.shape_reads += reads
            return False
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            if self._lowest(stmt.value) and not isinstance(stmt.value, ast.Name):  # mask_value = -finfo(s.dtype).max
                self.env[stmt.targets[0].id] = _Lowest()
                return True
            value = self.value(stmt.value)
            if isinstance(value, _Upcast):
                raise NotCovered(f"line {stmt.lineno}: the scores cast to float32 are kept", "probs-dtype")
            if isinstance(value, (Scores, Probs)):
                self.env[stmt.targets[0].id] = value
                return True
        raise NotCovered(f"line {stmt.lineno}: the attention scores or probabilities are read here besides the "
                         "output product", "probs-read")

    def _conditional(self, stmt: ast.If) -> bool:
        """``if <test>: s = s + m`` / ``s = s.masked_fill(b, v)`` (no else): the term is passed as
        ``(m if <test> else None)``. Statements before the update in the branch that build the mask
        (:meth:`_built_mask`) stay where they are; the branch then stays, less the update.

        Where ``<test>`` evaluated again at the call could differ from, or do more than, its one
        evaluation in the source (it calls a function: ``if exists(mask):``; the branch rebinds a
        name it reads: ``mask = rearrange(mask, ...)``), the branch stays and its update becomes
        ``<fresh name> = m`` (:attr:`Attention.bound`): the condition runs once, where it was, and
        the mask is the value the source's update read, when the branch ran, None when it did not."""
        if not self.tracked(stmt):
            if any(n is self.first or n is self.last_node for n in walk(stmt)):
                raise NotCovered(f"line {stmt.lineno}: a product of the attention under a branch")
            return False
        if self.tracked(stmt.test) or stmt.orelse or not stmt.body:
            raise NotCovered(f"line {stmt.lineno}: a branch inside the attention", "branch-straddle")
        *building, update = stmt.body
        reads, stored = self._built_mask(building) if building else ([], set())
        in_place = bool(stored & _loads(stmt.test)) or any(isinstance(n, ast.Call) for n in walk(stmt.test))
        applied = self._conditional_update(update, stmt.test)
        if applied is None:
            if building:
                raise NotCovered(f"line {stmt.lineno}: a branch inside the attention whose last statement is not "
                                 "`+ mask` or `masked_fill` of the scores", "branch-straddle")
            raise NotCovered(f"line {stmt.lineno}: a conditional update of the scores that is not `+ mask` or "
                             "`masked_fill` under a test")
        term, value = applied
        if value is not None and _loads(value) & stored:
            # (the fill value is evaluated at the call whether the branch ran or not)
            raise NotCovered(f"line {stmt.lineno}: the fill value reads "
                             f"{', '.join(sorted(_loads(value) & stored))}, bound in its branch", "branch-straddle")
        if in_place:  # the condition and the mask evaluated where the source evaluates them, once
            self.moved = [e for e in self.moved if e is not term and e is not stmt.test]
            self.read_at = [(e, i) for e, i in self.read_at if e is not term and e is not stmt.test]
            self.bound.append((update, term))
        elif not building:
            return True
        else:
            self.inner_deleted.append(update)
        self.kept.append(stmt)
        self.shape_reads += reads
        return False

    def _conditional_update(self, inner: ast.stmt, test: ast.expr) -> tuple[ast.expr, ast.expr | None] | None:
        """When ``inner`` is ``s += m``, ``s = s + m`` or ``s = s.masked_fill(b, v)`` of the scores
        (then taken as the term under ``test``): the term (``m`` or ``b``) and the fill value (``v``
        as written; None for an added mask or a value the region bound to the scores' lowest);
        None otherwise."""
        if isinstance(inner, ast.AugAssign) and isinstance(inner.op, ast.Add) and isinstance(inner.target, ast.Name):
            s = self.env.get(inner.target.id)
            if isinstance(s, Scores) and not self.tracked(inner.value):
                self._add(s, inner.value, test)
                return inner.value, None
        if isinstance(inner, ast.Assign) and len(inner.targets) == 1 and isinstance(inner.targets[0], ast.Name):
            name = inner.targets[0].id
            s = self.env.get(name)
            v = inner.value
            if isinstance(s, Scores) and s.mask is None and isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add):
                for mine, other in ((v.left, v.right), (v.right, v.left)):
                    if isinstance(mine, ast.Name) and mine.id == name and not self.tracked(other):
                        self._add(s, other, test)
                        return other, None
            if (isinstance(s, Scores) and isinstance(v, ast.Call) and _func_name(v.func) == "masked_fill"
                    and isinstance(v.func, ast.Attribute) and isinstance(v.func.value, ast.Name)
                    and v.func.value.id == name and len(v.args) == 2 and not v.keywords
                    and not self.tracked(v.args[0]) and (self._lowest(v.args[1]) or not self.tracked(v.args[1]))):
                self._fill(s, v.args[0], v.args[1], test)
                return v.args[0], None if s.fills[-1][1] == LOWEST else v.args[1]
        return None

    def _built_mask(self, building: list[ast.stmt]) -> tuple[list[tuple[ast.expr, str]], set[str]]:
        """The statements of a branch before its update of the scores, which build the mask
        (x-transformers' ``i, j = sim.shape[-2:]``, ``causal_mask = torch.ones((i, j), ...).triu(j - i
        + 1)``): assignments to names that read the scores only through the last two sizes of their
        shape or their device (:meth:`_shape_only`). They stay in the branch, those reads taken from
        the query and key (the scores are not computed). Returns the shape reads and the names the
        statements bind (none holding the scores or probabilities)."""
        straddle = "branch-straddle"
        reads: list[tuple[ast.expr, str]] = []
        stored: set[str] = set()
        for st in building:
            found = self._shape_only(st) if self.tracked(st) else []
            if found is None or not _assigns_names(st) or any(
                    n is self.first or n is self.last_node for n in walk(st)):
                raise NotCovered(f"line {st.lineno}: a branch inside the attention that reads the scores "
                                 "other than their shape or device, or binds other than names", straddle)
            reads += found
            stored |= _stores(st)
        if stored & set(self.env):
            raise NotCovered(f"line {building[0].lineno}: a branch inside the attention binds "
                             f"{', '.join(sorted(stored & set(self.env)))}", straddle)
        return reads, stored

    def _shape_only(self, stmt: ast.stmt) -> list[tuple[ast.expr, str]] | None:
        """The reads of the scores in ``stmt``, an assignment to names, when every read of a tracked
        name is one of the scores' last two sizes (``s.shape[-1]``, ``s.shape[-2]``,
        ``s.shape[-2:]``, ``s.size(-1)``, ``s.size(-2)``) or their device, and the query and key as
        written can be evaluated again where the statement is (names, attributes, a transpose of
        one), and it binds no name holding the scores or probabilities; None otherwise."""
        if (not _assigns_names(stmt) or _holds(stmt, self.first) or _holds(stmt, self.last_node)
                or _stores(stmt) & set(self.env)):
            return None
        forms = {}
        for node in walk(stmt):
            found = _shape_form(node)
            if found is not None:
                forms[id(found[0])] = (node, found[1])
        reads = []
        for node in walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.env:
                s = self.env[node.id]
                if id(node) not in forms or not isinstance(s, Scores) or not (
                        _reevaluable(s.q) and _reevaluable(s.key)):
                    return None
                reads.append(forms[id(node)])
        return reads

def _not_after_softmax(s: Scores, node: ast.expr) -> None:
    """A scale, mask or fill of scores the softmax has already read changes nothing the attention
    computes: it is not the kernel's to take."""
    if s.read:
        raise NotCovered(f"line {node.lineno}: the scores are updated after the softmax read them")


def _another_product(node: ast.expr) -> NotCovered:
    """The scores or probabilities feed a product other than the matched output product: the
    matched pair is not one attention (the sub-sequence pattern pairs a softmax with every later
    product; the one reading the probabilities is matched on its own)."""
    return NotCovered(f"line {node.lineno}: the scores or probabilities feed another product first",
                      candidate=False)


def _assigns_names(stmt: ast.stmt) -> bool:
    """``stmt`` is an assignment whose targets are names (or tuples/lists of names)."""
    if isinstance(stmt, ast.AnnAssign):
        return stmt.value is not None and isinstance(stmt.target, ast.Name)
    if not isinstance(stmt, ast.Assign):
        return False

    def names(target: ast.expr) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            return all(names(e) for e in target.elts)
        return isinstance(target, ast.Name)

    return all(names(t) for t in stmt.targets)


def _shape_form(node: ast.AST) -> tuple[ast.Name, str] | None:
    """(the name, "rows" | "cols" | "last2" | "device") when ``node`` is ``<name>.shape[-2]``,
    ``.shape[-1]``, ``.shape[-2:]``, ``.size(-2)``, ``.size(-1)`` or ``.device``."""
    if isinstance(node, ast.Attribute) and node.attr == "device" and isinstance(node.value, ast.Name):
        return node.value, "device"
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape"
            and isinstance(node.value.value, ast.Name)):
        index = node.slice
        if isinstance(index, ast.Slice):
            if index.upper is None and index.step is None and index.lower is not None and _literal(index.lower) == -2:
                return node.value.value, "last2"
            return None
        kind = {-1: "cols", -2: "rows"}.get(_literal(index))
        return (node.value.value, kind) if kind else None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size"
            and isinstance(node.func.value, ast.Name) and len(node.args) == 1 and not node.keywords):
        kind = {-1: "cols", -2: "rows"}.get(_literal(node.args[0]))
        return (node.func.value, kind) if kind else None
    return None


def _reevaluable(node: ast.expr) -> bool:
    """A name, an attribute of one, or its transpose over the last two dims (``k.transpose(-2, -1)``,
    ``k.mT``): evaluated a second time (for the scores' shape) it is the same tensor and runs no
    module or random draw."""
    if isinstance(node, ast.Call) and _is_transposed_key(node, batched=True):  # (a pure view of it)
        node = node.func.value
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _self_attr(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        return func.attr
    return None


def _matmul_operands(node: ast.expr) -> tuple[ast.expr, ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if isinstance(node, ast.Call) and not node.keywords:
        if _func_name(node.func) == "matmul" and isinstance(node.func, ast.Attribute) and len(node.args) == 1 and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            return node.func.value, node.args[0]
        if _func_name(node.func) == "matmul" and len(node.args) == 2:
            return node.args[0], node.args[1]
        if _func_name(node.func) == "bmm" and isinstance(node.func, ast.Attribute):  # (rank 3: matmul's product)
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                if len(node.args) == 2:
                    return node.args[0], node.args[1]
            elif len(node.args) == 1:
                return node.func.value, node.args[0]
    raise NotCovered(f"line {node.lineno}: a product that is not q @ kᵀ / torch.matmul", candidate=False)


def _is_transposed_key(node: ast.expr, batched: bool = False) -> bool:
    """``k.transpose(-2, -1)``, ``k.mT``, ``k.transpose(2, 3)`` (``k.transpose(1, 2)`` too where
    ``batched``: an operand of ``torch.bmm``, rank 3), or a permute swapping the key's last two dims
    (:func:`_swapping_permute`)."""
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        return True
    if _swapping_permute(node):
        return True
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "transpose"
            and len(node.args) == 2 and not node.keywords):
        return False
    return {_literal(a) for a in node.args} in ({-1, -2}, {2, 3}, *([{1, 2}] if batched else []))


def _swapping_permute(node: ast.expr) -> bool:
    """``x.permute(a, b, c, d)`` (or of three dims; the dims as a tuple too) with literal dims whose
    last two come from ``x`` in reversed order (``permute(0, 1, 3, 2)``; whisper's ``permute(0, 2, 3,
    1)`` of ``(b, S, h, E)``): the result is ``x.permute(a, b, d, c)`` — the key, its sequence dim
    before its feature dim as in ``x`` — transposed over its last two dims. ``permute(0, 2, 1, 3)``
    keeps ``x``'s order: no transposed key."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "permute"
            and node.args and not node.keywords):
        return False
    dims = _literal(node.args[0]) if len(node.args) == 1 else tuple(_literal(a) for a in node.args)
    if not isinstance(dims, (tuple, list)) or len(dims) not in (3, 4) or not all(type(d) is int for d in dims):
        return False
    n = len(dims)
    dims = [d % n if -n <= d < n else None for d in dims]
    return sorted(d for d in dims if d is not None) == list(range(n)) and dims[-2] > dims[-1]


def _permuted_keys(before: list[ast.stmt]) -> set[str]:
    """The names whose last binding in ``before`` (the statements of the region's block before it)
    is ``name = x.permute(...)`` swapping the key's last two dims (:func:`_swapping_permute`), a
    statement of the block itself (a binding under a branch or loop leaves another value on
    another path: any later store of the name, anywhere, drops it)."""
    found: set[str] = set()
    for st in before:
        stored = _stores(st)
        found -= stored
        if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                and _swapping_permute(st.value)):
            found.add(st.targets[0].id)
    return found


def _ignorable(node: ast.expr) -> bool:
    """An expression whose evaluation the rewrite may leave out (the ignored input of a ``beta=0``
    baddbmm): a name, an attribute of one, or a fresh tensor (``torch.empty(...)``, ``zeros``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
            node.func.value, ast.Name) and node.func.value.id == "torch" and node.func.attr in (
            "empty", "zeros", "ones", "empty_like", "zeros_like", "ones_like"):
        return not any(isinstance(n, ast.Call) for a in (*node.args, *node.keywords) for n in walk(a))
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _in_loop(fn: ast.AST, block: list[ast.stmt]) -> bool:
    """Whether the statement list ``block`` lies inside a ``for``/``while`` of ``fn``."""
    for node in walk(fn):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and any(_holds(node, st) for st in block[:1]):
            return True
    return False


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.Match,
             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _holds(stmt: ast.stmt, node: ast.AST) -> bool:
    return id(node) in _node_ids(stmt)


@per_node(256)
def _statement_nodes(fn: ast.AST) -> tuple[ast.AST, ...]:
    """``fn`` and the statements (and except handlers, match cases) under it: the nodes that hold
    statement lists, found without walking a single expression."""
    out: list[ast.AST] = []
    stack = [fn]
    while stack:
        node = stack.pop()
        out.append(node)
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, name, None)
            if isinstance(children, list):
                stack.extend(c for c in reversed(children)
                             if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)))
    return tuple(out)


@per_node(4096)
def _node_ids(stmt: ast.AST) -> frozenset[int]:
    """The ids of the nodes under ``stmt`` (held with ``stmt``, so none is reused): the region search
    asks of each statement of a function whether it holds a node, once per candidate."""
    return frozenset(map(id, walk(stmt)))


@per_node(256)
def _simple_statements_holding(fn: ast.AST) -> dict[int, tuple[ast.stmt, list[ast.stmt]]]:
    """id of each node under ``fn`` -> the innermost statement holding it that is not an
    ``if``/loop/``with``/``try``/``def`` (a region's ends), and the statement list it is in; read
    once per function (every candidate of the function asks where its two products are)."""
    out: dict[int, tuple[ast.stmt, list[ast.stmt]]] = {}
    for node in _statement_nodes(fn):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if not isinstance(stmts, list):
                continue
            for st in stmts:
                if isinstance(st, ast.stmt) and not isinstance(st, (ast.If, ast.For, ast.While, ast.With, ast.Try,
                                                                    ast.FunctionDef)):
                    # (statements come outer before inner: the innermost holder is written last)
                    here = (st, stmts)
                    for node_id in _node_ids(st):
                        out[node_id] = here
    return out


def interpret(fn: ast.AST, first: ast.expr, last: ast.expr, is_dropout_module, softmax_attrs=None) -> Attention:
    """The :class:`Attention` from the scores product ``first`` to the output product ``last``
    (nodes of ``fn``), or :class:`NotCovered`."""
    holders = _simple_statements_holding(fn)
    first_stmt, block = holders.get(id(first), (None, None))
    last_stmt = holders.get(id(last), (None, None))[0]
    if first_stmt is None or last_stmt is None or last_stmt not in block:
        raise NotCovered("the two products of the attention are not in one block", "branch-straddle")
    region = block[block.index(first_stmt): block.index(last_stmt) + 1]
    it = _Interpreter(first, last, is_dropout_module, softmax_attrs)
    it.permuted_keys = _permuted_keys(block[:block.index(first_stmt)])
    consumed = []
    for index, stmt in enumerate(region):
        it.at = index
        if it.statement(stmt):
            consumed.append(stmt)
    if it.result is None:
        raise NotCovered("the region does not end in the output product", candidate=False)
    probs, v, out_eq = it.result
    names = sorted({n for st in consumed for n in _stores(st)} - _stores(last_stmt)
                   | {n for n in it.env if n not in _stores(last_stmt)})
    # values moved to the call must not change between where they were read and the call
    for expr, index in it.read_at:
        read = _loads(expr)
        for st in region[index + 1:-1]:
            if st not in consumed and _stores(st) & read:
                raise NotCovered(f"line {st.lineno} rebinds {', '.join(sorted(_stores(st) & read))} between its "
                                 "read in the attention and the output product")
    following = block[block.index(last_stmt) + 1:]
    if _in_loop(fn, block):  # (a read before the region is one of the previous iteration's value)
        following = following + block[:block.index(first_stmt)]
    for name in names:
        for st in following:
            if name in _loads(st):
                raise NotCovered(f"line {st.lineno}: {name!r} (attention scores or probabilities) is read after "
                                 "the output product", "probs-read")
            if name in _stores(st) and not isinstance(st, _COMPOUND):
                break  # (rebound on every path: a rebinding under `if`/a loop leaves the old value on another)
        for node in walk(fn):  # reads outside the block: after it, or earlier in an enclosing loop
            if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load) and not any(
                    _holds(st, node) for st in block):
                raise NotCovered(f"line {node.lineno}: {name!r} (attention scores or probabilities) is read "
                                 "outside the attention", "probs-read")
    return Attention(probs.scores, probs.dropout, v, out_eq, last, last_stmt, probs.upcast, probs.cast_back,
                     [st for st in consumed if st is not last_stmt], names, it.moved, it.kept, it.inner_deleted,
                     it.shape_reads, it.bound)
