"""Attention codemods (BertSelfAttention, T5Attention, GPT2Attention — paper Table 1, 1-3).

The eager core between the two matmuls of a match is interpreted statement by statement

    s = torch.matmul(q, k.transpose(-1, -2)) [* c | / c]     scores (scale optional)
    s = s * c  |  s = s / c  |  s /= c                       scale (before any additive term)
    if m is not None: s = s + m   |   s = s + m  |  s += m   additive mask, then bias
    s = softmax(s, dim=-1[, dtype=...])                      softmax (F./torch./tensor method)
    s = s.type(v.dtype) | .to(...) | .type_as(...) | .float() dtype casts (see below)
    s = F.dropout(s, p=P, training=T)  |  self.dropout(s)    dropout
    o = torch.matmul(s, v)                                   output

and replaced by one call ``o = attention(q, k, v, mask=m, bias=b, dropout_p=(P if T else 0.0),
scale=c, additive=True)`` (``additive``: ``m`` and ``b`` are added as the source adds them, whatever
their dtype). An ``if m is not None:`` around the mask add is absorbed (the kernel takes
``mask=None``). Casts are dtype round trips for the kernel (it returns the inputs' dtype), except
that a softmax the source computes in float32 (``softmax(s.float())``, ``s.to(torch.float32)`` as
the last cast before it, ``softmax(s, dtype=torch.float32)``) passes ``softmax_dtype=torch.float32``:
for float64 inputs the kernel then computes the softmax in float32 as the source does (half
precision and float32 inputs keep the fused path). The call names ``torch``, which the rewrite's
TorchScript guard imports where the module does not; a term added after such a cast (its dtype
decides the softmax's) skips the match. When the probabilities are read after the core (returned
as attention weights), the call passes ``need_weights=True`` and binds them. Anything else inside the
region (head masks, causal ``torch.where``, position-bias slicing) skips the match.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from adopter.core.codemod.base import (
    Codemod,
    arg_text,
    kernel_name,
    matched_exprs,
    pos,
)
from adopter.core.codemod.context import (
    FileContext,
    Skip,
    is_self_attr,
    literal,
    loads,
    simple_assign_target,
    stores,
)
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.structures import Match
from adopter.core.syntax import walk

CASTS = {"type", "to", "type_as", "float", "half", "bfloat16"}


def _func_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_matmul(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return True
    return isinstance(node, ast.Call) and _func_name(node.func) in ("matmul", "bmm") and len(node.args) == 2


def _matmul_operands(node: ast.AST) -> tuple[ast.expr, ast.expr]:
    if isinstance(node, ast.BinOp):
        return node.left, node.right
    return node.args[0], node.args[1]


def _strip_casts(node: ast.expr) -> ast.expr:
    """``x.float()``, ``x.type_as(y)``, ``x.to(dtype)`` ... -> ``x`` (dtype round trips)."""
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in CASTS
        and len(node.args) <= 1
        and not node.keywords
    ):
        node = node.func.value
    return node


_FLOAT32 = {"float32", "float"}  # torch.float32, torch.float


def _dtype_name(node: ast.expr) -> str | None:
    """"float32" for ``torch.float32``/``torch.float`` (however torch is named), else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in _FLOAT32:
        return "float32"
    return None


def _note_casts(core: "_Core", node: ast.expr) -> None:
    """Record in ``core.cast`` the dtype of the outermost cast of ``node`` (a chain of casts of the
    scores before the softmax: the last one applied decides the dtype)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CASTS):
        return
    attr = node.func.attr
    kw = {k.arg: k.value for k in node.keywords}
    if attr == "float":
        core.cast = "float32"
    elif attr in ("to", "type") and (node.args or "dtype" in kw):
        core.cast = _dtype_name(node.args[0] if node.args else kw["dtype"])
    else:  # .half(), .bfloat16(), .type_as(t), .to(t.dtype): a round trip, as before
        core.cast = None


def _add_term(core: "_Core", term: ast.expr, line: int) -> None:
    if core.cast == "float32":
        # (float64 scores cast to float32, then a float64 mask added: the softmax is in float64 again,
        # over scores rounded to float32; what a float32 mask leaves float32)
        raise Skip(f"line {line}: a term added to scores cast to float32: the softmax's dtype depends on its dtype")
    core.additive.append(term)


def _bound_in(fn: ast.AST) -> set[str]:
    """Names a function binds locally (parameters, assignments, imports, global/nonlocal)."""
    out = set()
    for node in walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out |= set(node.names)
    return out


def _reads(node: ast.AST, name: str) -> bool:
    return name in loads(node)


@dataclass
class _Core:
    q: ast.expr | None = None
    k: ast.expr | None = None
    v: ast.expr | None = None
    scale: str | None = None
    additive: list[ast.expr] = field(default_factory=list)
    softmax: bool = False
    # the dtype the scores were last cast to before the softmax: "float32" (``.float()``,
    # ``.to(torch.float32)``), None for none or a dtype not known here (a round trip: ``.type_as(q)``)
    cast: str | None = None
    softmax_dtype: str | None = None  # "float32" when the source computes the softmax in float32
    dropout: str | None = None
    output: str | None = None
    names: list[str] = field(default_factory=list)  # every score/probability name in order


class _AttentionCodemod(Codemod):
    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        # The match may include context in a caller (the q/k/v projections in forward);
        # only the core between the two matmuls is rewritten, in the function holding it.
        exprs = matched_exprs(match, ctx, single_function=False)
        matmuls = [e for _, e in exprs if _is_matmul(e)]
        if len(matmuls) < 2:
            raise Skip("match does not include both attention matmuls")
        fn = ctx.enclosing_function(matmuls[-1])
        if fn is None or ctx.enclosing_function(matmuls[0]) is not fn:
            raise Skip("the attention matmuls are in different functions")
        first_stmt, last_stmt = ctx.statement_of(matmuls[0]), ctx.statement_of(matmuls[-1])
        _, _, block = ctx.block_of(first_stmt)
        if last_stmt not in block:
            raise Skip("the attention core is not in one block")
        region = block[block.index(first_stmt) : block.index(last_stmt) + 1]
        core = _Core()
        consumed: list[ast.stmt] = []
        for stmt in region:
            if self._step(ctx, core, stmt, is_last=stmt is last_stmt):
                consumed.append(stmt)
            else:
                names = set(core.names)
                if (loads(stmt) | stores(stmt)) & names:
                    raise Skip(f"line {stmt.lineno} uses the attention scores in a way the kernel does not cover")
        if core.output is None or core.v is None or not core.softmax:
            raise Skip("the region does not end in softmax(...) @ value")
        # Values moved to the final statement must not change in between.
        moved = [core.q, core.k, core.v] + core.additive
        read = set()
        for e in moved:
            read |= loads(e)
        for stmt in region[:-1]:
            if stmt not in consumed and stores(stmt) & read:
                raise Skip(f"line {stmt.lineno} rebinds {', '.join(sorted(stores(stmt) & read))} inside the attention core")
        weights = core.names[-1]
        need_weights = self._read_after(ctx, fn, last_stmt, weights, core.output)
        for name in core.names[:-1]:
            if name != weights and name != core.output and self._read_after(ctx, fn, last_stmt, name, core.output):
                raise Skip(f"intermediate {name!r} is read after the attention core")
        spec, local = kernel_name(ctx, "attention")
        kwargs = []
        if core.additive:
            kwargs.append(f"mask={arg_text(ctx, core.additive[0])}")
        if len(core.additive) > 1:
            if len(core.additive) > 2:
                raise Skip("more than two additive terms on the scores")
            kwargs.append(f"bias={arg_text(ctx, core.additive[1])}")
        if core.dropout:
            kwargs.append(f"dropout_p={core.dropout}")
        kwargs.append(f"scale={core.scale or '1.0'}")
        # the masks are what the source added to the scores (a bool one adds 1.0): not keep-masks
        kwargs.append("additive=True")
        if need_weights:
            kwargs.append("need_weights=True")
        if core.softmax_dtype == "float32":
            # (``torch`` is the module here: the TorchScript guard around the call reads it too)
            if "torch" in _bound_in(fn):
                raise Skip("the softmax is computed in float32 and `torch` is a local name here")
            kwargs.append("softmax_dtype=torch.float32")
        call = f"{local}({arg_text(ctx, core.q)}, {arg_text(ctx, core.k)}, {arg_text(ctx, core.v)}, {', '.join(kwargs)})"
        lhs = f"{core.output}, {weights}" if need_weights else core.output
        deletes = [pos(ctx, s) for s in consumed if s is not last_stmt]
        forward = ForwardEdit(
            statements=tuple(pos(ctx, s) for s in consumed),
            anchor=pos(ctx, last_stmt),
            statement_edits=(StatementEdit(pos(ctx, last_stmt), f"{lhs} = {call}"),),
            delete=tuple(deletes),
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    # ------------------------------------------------------------ interpretation

    def _read_after(self, ctx: FileContext, fn: ast.AST, last: ast.stmt, name: str, output: str) -> bool:
        """Is ``name`` read after ``last`` before being rebound in the same block?"""
        _, _, block = ctx.block_of(last)
        following = block[block.index(last) + 1 :]
        for stmt in following:
            if name in loads(stmt):
                return True
            if simple_assign_target(stmt) == name:
                return False
        # Reads after the block (enclosing blocks) count too.
        for node in walk(fn):
            if (
                isinstance(node, ast.Name)
                and node.id == name
                and isinstance(node.ctx, ast.Load)
                and node.lineno > (block[-1].end_lineno or 0)
            ):
                return True
        return False

    def _step(self, ctx: FileContext, core: _Core, stmt: ast.stmt, is_last: bool) -> bool:
        """Interpret one statement; True when it is part of the core."""
        if isinstance(stmt, ast.If):
            return self._conditional_mask(ctx, core, stmt)
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            if not core.names or name != core.names[-1]:
                return False
            other = stmt.value
            if _reads(other, name):
                raise Skip(f"line {stmt.lineno}: unsupported update of {name}")
            if core.softmax:  # (``p += m``/``p *= c`` on the probabilities: no mask or scale of the scores)
                raise Skip(f"line {stmt.lineno}: an update of the probabilities after softmax")
            if isinstance(stmt.op, ast.Add):
                _add_term(core, other, stmt.lineno)
            elif isinstance(stmt.op, (ast.Mult, ast.Div)):
                self._scale(ctx, core, stmt.op, other)
            else:
                raise Skip(f"line {stmt.lineno}: unsupported operator on the scores")
            return True
        target = simple_assign_target(stmt)
        if target is None:
            return False
        value = stmt.value
        if not core.names:
            self._scores(ctx, core, value)
            core.names.append(target)
            return True
        current = core.names[-1]
        if not _reads(value, current):
            return False
        if is_last:
            if not _is_matmul(value):
                raise Skip(f"line {stmt.lineno}: the output is not a plain matmul with the value")
            w, v = _matmul_operands(value)
            if not (isinstance(w, ast.Name) and w.id == current) or _reads(v, current):
                raise Skip(f"line {stmt.lineno}: the output matmul does not read the probabilities")
            core.v, core.output = v, target
            return True
        self._transform(ctx, core, value, current, stmt)
        core.names.append(target)
        return True

    def _scores(self, ctx: FileContext, core: _Core, value: ast.expr) -> None:
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)) and _is_matmul(value.left):
            self._scale(ctx, core, value.op, value.right)
            value = value.left
        if not _is_matmul(value):
            raise Skip(f"line {value.lineno}: scores are not a matmul of query and transposed key")
        q, kt = _matmul_operands(value)
        if not (
            isinstance(kt, ast.Call)
            and isinstance(kt.func, ast.Attribute)
            and kt.func.attr == "transpose"
            and len(kt.args) == 2
            and {literal(a) for a in kt.args} in ({-1, -2}, {2, 3})
        ):
            raise Skip(f"line {value.lineno}: key is not transposed over its last two dims")
        core.q, core.k = q, kt.func.value

    def _scale(self, ctx: FileContext, core: _Core, op: ast.operator, factor: ast.expr) -> None:
        if core.additive:
            raise Skip("the scores are scaled after the mask is added")
        text = arg_text(ctx, factor)
        if not isinstance(factor, (ast.Name, ast.Attribute, ast.Constant, ast.Call)):
            text = f"({text})"
        new = text if isinstance(op, ast.Mult) else f"1.0 / {text}"
        core.scale = new if core.scale is None else f"{core.scale} * {new}"

    def _transform(self, ctx: FileContext, core: _Core, value: ast.expr, current: str, stmt: ast.stmt) -> None:
        line = stmt.lineno
        outer = value
        value = _strip_casts(value)
        if isinstance(value, ast.Name) and value.id == current:
            if not core.softmax:
                _note_casts(core, outer)
            return  # a pure dtype cast of the scores
        if isinstance(value, ast.BinOp):
            left_is = isinstance(value.left, ast.Name) and value.left.id == current
            right_is = isinstance(value.right, ast.Name) and value.right.id == current
            other = value.right if left_is else value.left
            if not (left_is or right_is) or _reads(other, current):
                raise Skip(f"line {line}: unsupported expression on the scores")
            if isinstance(value.op, ast.Add):
                if core.softmax:
                    raise Skip(f"line {line}: addition after softmax")
                _add_term(core, other, line)
                return
            if isinstance(value.op, (ast.Mult, ast.Div)) and left_is and not core.softmax:
                self._scale(ctx, core, value.op, other)
                return
            raise Skip(f"line {line}: unsupported operator on the scores (head mask?)")
        if not isinstance(value, ast.Call):
            raise Skip(f"line {line}: unsupported expression on the scores")
        name = _func_name(value.func)
        receiver = value.func.value if isinstance(value.func, ast.Attribute) else None
        on_current = isinstance(receiver, ast.Name) and receiver.id == current
        first = _strip_casts(value.args[0]) if value.args else None
        first_is = isinstance(first, ast.Name) and first.id == current
        attr = is_self_attr(value.func)
        if name in ("softmax", "adopter_softmax") and attr is None and (first_is or on_current):
            if core.softmax:
                raise Skip(f"line {line}: second softmax")
            args = list(value.args[1:] if first_is else value.args)
            kw = {k.arg: k.value for k in value.keywords}
            dim = kw.get("dim", args[0] if args else None)
            if literal(dim) not in (-1, 3):
                raise Skip(f"line {line}: softmax is not over the last dim")
            if first_is:
                _note_casts(core, value.args[0])
            # ``dtype=``, or positional after dim (torch.softmax(s, dim, dtype), s.softmax(dim, dtype),
            # F.softmax(s, dim, _stacklevel, dtype)): the softmax casts its input to it
            given = [kw["dtype"]] if "dtype" in kw else args[1:]
            given = [d for d in given if not (isinstance(d, ast.Constant) and isinstance(d.value, (int, type(None))))]
            if given:
                core.cast = _dtype_name(given[-1])
            core.softmax_dtype = core.cast
            core.softmax = True
            return
        if name in CASTS and on_current:
            if not core.softmax:
                _note_casts(core, value)
            return  # dtype round trips; the kernel returns the value dtype
        if name == "dropout" and first_is and attr is None:
            if not core.softmax:
                raise Skip(f"line {line}: dropout before softmax")
            kw = {k.arg: k.value for k in value.keywords}
            p = kw.get("p", value.args[1] if len(value.args) > 1 else None)
            training = kw.get("training", value.args[2] if len(value.args) > 2 else None)
            if p is None:
                p_text = "0.5"
            else:
                p_text = arg_text(ctx, p)
            training_text = arg_text(ctx, training) if training is not None else "True"
            core.dropout = f"({p_text} if {training_text} else 0.0)"
            return
        if attr is not None and first_is and len(value.args) == 1:
            owner = ctx.enclosing_class_name(value)
            stores_ = ctx.class_attr_stores(owner, attr) if owner else []
            ctor = None
            for s in stores_:
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call):
                    ctor = _func_name(s.value.func)
            if ctor == "Dropout" and core.softmax:
                core.dropout = f"(self.{attr}.p if self.training else 0.0)"
                return
            raise Skip(f"line {line}: self.{attr}(...) on the scores is not a known Dropout")
        raise Skip(f"line {line}: {ast.unparse(value.func)}(...) on the scores is not supported")

    def _conditional_mask(self, ctx: FileContext, core: _Core, stmt: ast.If) -> bool:
        """``if m is not None: s = s + m`` (no else) -> additive ``m`` (the kernel skips None)."""
        if not core.names:
            return False
        current = core.names[-1]
        if stmt.orelse or len(stmt.body) != 1:
            if current in loads(stmt) | stores(stmt):
                raise Skip(f"line {stmt.lineno}: a branch inside the attention core")
            return False
        test, inner = stmt.test, stmt.body[0]
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
        ):
            if current in loads(stmt) | stores(stmt):
                raise Skip(f"line {stmt.lineno}: a condition other than `is not None` inside the attention core")
            return False
        tested = ast.dump(test.left)
        addend = None
        if isinstance(inner, ast.AugAssign) and isinstance(inner.op, ast.Add) and isinstance(inner.target, ast.Name):
            if inner.target.id == current:
                addend = inner.value
        elif simple_assign_target(inner) == current and isinstance(inner.value, ast.BinOp) and isinstance(inner.value.op, ast.Add):
            b = inner.value
            if isinstance(b.left, ast.Name) and b.left.id == current:
                addend = b.right
            elif isinstance(b.right, ast.Name) and b.right.id == current:
                addend = b.left
        if addend is None or ast.dump(addend) != tested:
            raise Skip(f"line {stmt.lineno}: conditional update of the scores is not `+ mask` under `mask is not None`")
        if core.softmax:
            raise Skip(f"line {stmt.lineno}: mask added after softmax")
        _add_term(core, addend, stmt.lineno)
        return True


class BertSelfAttentionCodemod(_AttentionCodemod):
    rule = "BertSelfAttention"


class T5AttentionCodemod(_AttentionCodemod):
    rule = "T5Attention"


class GPT2AttentionCodemod(_AttentionCodemod):
    rule = "GPT2Attention"
