"""gated_MLP: the gated MLP of LLMs (SwiGLU, GeGLU) — ``down(act(gate(x)) * up(x))``.

Rewrite (the codemod below), forward only — ``__init__`` and the projections stay:
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
 => down_proj = gated_mlp(self.gate_proj, self.up_proj, self.down_proj, self.act_fn, x)
(any operand order, split into statements, ``F.silu``/``nn.SiLU``/``F.gelu``/``nn.GELU``/
``ACT2FN[...]`` spellings; a functional activation's extra arguments follow ``x``:
``gated_mlp(self.w1, self.w3, self.w2, F.gelu, x, approximate="tanh")``). The packed form, one
``gate_up`` Linear whose output is split in two halves (Phi-3, GeGLU code, xformers' SwiGLU):
    gate, up_states = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(up_states * self.act(gate))
 => return gated_mlp_packed(self.gate_up_proj, self.down_proj, self.act, x, chunks=2, dim=-1, gate=0)
(``.chunk``/``torch.chunk`` -> ``chunks=``, ``.split``/``torch.split`` -> ``split=``, as written;
``gate=`` the half the activation reads: ``x, gate = ...chunk(2, dim=-1)`` is ``gate=1``).

``adopter.kernels.gated_mlp`` decides at run time: plain ``nn.Linear`` projections and an
activation the kernel computes (SiLU, exact or tanh GeLU — recognized by what the instance is, so
``ACT2FN[config.hidden_act]`` is SiLU for Llama and ``gelu_pytorch_tanh`` for Gemma) run the fused
``act(g) * u`` whose backward recomputes ``act(g)``; anything else (``hidden_act="relu"``) runs the
original expression. The activation key is never resolved into the source: when the source cannot
settle it the match is ``conditional`` (``needs-config``) and the trace settles it.

Which half of a packed projection is the gate is read from the source: the split's result is
unpacked into two names (``a, b = y.chunk(2, dim=-1)``) in the statement list that also holds
the statements reading them, with no store of either name in between; extraction does not carry
the data flow of a tuple unpacking, so this is checked on the ``ast`` (:func:`split_halves`).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.catalogue import TRANSFORMERS_GELUS
from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    arg_text,
    kernel_name,
    match_function,
    matched_exprs,
    module_handle,
    separate_calls,
)
from adopter.core.codemod.context import FileContext, Skip, simple_assign_target, stores
from adopter.core.codemod.edits import Edit
from adopter.core.dsl import Layer, TensorOp, Var
from adopter.core.match import MatchContext
from adopter.core.match.context import NotACandidate, Refusal
from adopter.core.match.source import function_ast
from adopter.core.match.source_uses import escaping_read
from adopter.core.rule import Rule, Runtime, RuntimeSite

# The key resolution shared with the GeLU rule (configuration defaults, getattr defaults,
# constructor parameter defaults, ``'a' if c else 'b'`` choices): only the set of keys the kernel
# computes differs.
from adopter.core.rules._activation_keys import (
    ACT2FN,
    GELU_KEYS,
    GELU_MODULES,
    KernelActivations,
    settle_activation_node,
)
from adopter.core.rules._common import LINEAR, intermediates_unused
from adopter.core.structures import Match
from adopter.core.syntax import walk

_TA = "transformers.activations."
SILU_MODULES = ("torch.nn.SiLU", _TA + "SiLUActivation")
ACT_FUNCTIONS = ("torch.nn.functional.silu", "torch.nn.functional.gelu")
# Activation keys whose ACT2FN entry the kernel computes: SiLU ("swish" is nn.SiLU) and GeLUs.
SILU_KEYS = frozenset({"silu", "swish"})
KERNEL_KEYS = SILU_KEYS | GELU_KEYS
ACTIVATIONS = "|".join(SILU_MODULES + GELU_MODULES + ACT_FUNCTIONS + (ACT2FN,))

_INIT = ("torch.nn.Linear($gate_in, $gate_out) -> $gate; torch.nn.Linear($up_in, $up_out) -> $up; "
         "torch.nn.Linear($down_in, $down_out) -> $down")
_GATE = "torch.nn.Linear@$gate($x) -> $g"
_UP = "torch.nn.Linear@$up($x) -> $u"
_ACT = f"{ACTIVATIONS}($g) -> $a"
_TAIL = "$a * $u -> $h; torch.nn.Linear@$down($h) -> $out"  # ``*`` matches either operand order

# One variant per order the three calls can run in (the matcher follows execution order):
# ``act(gate(x)) * up(x)``; ``up(x) * act(gate(x))``; ``g = gate(x); u = up(x); act(g) * u``.
DSL = "\n".join(
    f"rule gated_MLP\ninit:\n    {_INIT}\nforward:\n    {'; '.join(order)}; {_TAIL}\n"
    for order in ((_GATE, _ACT, _UP), (_UP, _GATE, _ACT), (_GATE, _UP, _ACT))
)

# The packed form: one ``gate_up`` Linear, its output split in two (``.chunk``/``.split``, method or
# function); the halves ``$g`` and ``$u`` are bound to names by a tuple unpacking, which extraction
# does not connect to the split: :func:`_packed_halves` proves it from the source.
SPLITS = ("torch.Tensor.chunk", "torch.chunk", "torch.Tensor.split", "torch.split")
_PACKED_INIT = "torch.nn.Linear($gate_up_in, $gate_up_out) -> $gate_up; torch.nn.Linear($down_in, $down_out) -> $down"
_PACKED = (f"torch.nn.Linear@$gate_up($x) -> $y; {'|'.join(SPLITS)}($y) -> $halves; {_ACT}; {_TAIL}")
DSL += f"rule gated_MLP\ninit:\n    {_PACKED_INIT}\nforward:\n    {_PACKED}\n"

DOC = """\
Fuses the activation-times-up product of a gated MLP (SwiGLU, GeGLU):
``down(act(gate(x)) * up(x))`` with three ``torch.nn.Linear`` modules bound in ``__init__``
(any attribute names: ``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``), the gate
and up projections reading the very same tensor, the product (``*``, either operand order)
the down projection's input, in one expression or split over statements. The activation is
``torch.nn.SiLU``, ``F.silu``, ``torch.nn.GELU``, ``F.gelu`` (any ``approximate``),
transformers' ``SiLUActivation`` and GeLU classes, or an activation looked up from a key
(``ACT2FN[config.hidden_act]``): a match when every configuration default of the key is one
the kernel computes (``silu``, ``swish``, the GeLU keys), not a match when none is (``relu``,
``quick_gelu``, ``gelu_10``...), ``conditional`` (``needs-config``) when the source does not
settle it — the trace checks the activation instance that runs. The intermediates (``g``,
``act(g)``, ``u``, the product) must be read nowhere else. Not a match: another operation
between the product and the down projection, an activation of the product (``act(g * u)``),
gate and up reading different tensors, a same-file activation class. The packed form: one
``gate_up`` Linear whose output is split in two along the last dimension (``.chunk(2, dim=-1)``,
``torch.chunk``, ``.split(n, dim=-1)``, ``torch.split``) and unpacked into two names, one the
activation's input (the gate, whichever half it is), the other the product's other operand
(Phi-3's ``gate, up = self.gate_up_proj(x).chunk(2, dim=-1)``; ``x, gate = ...`` as GeGLU code
writes it); a split without ``dim`` or with another ``dim`` than ``-1`` is ``refused``
(``dim-not-last``). The projections may be built by a same-file factory (``make_linear(d, h)``):
when the factory returns another class on some branch (a LoRA layer) the match is
``conditional`` and the trace settles it; same-file ``nn.Linear`` subclasses that only change
``__init__`` match as ``nn.Linear``. At run time the kernel fuses only projections that compute
``F.linear`` (plain ``nn.Linear``, or a subclass whose ``forward`` is exactly
``F.linear(x, self.weight.to(x.dtype), self.bias)``, or with ``self.bias.to(x.dtype) if self.bias
is not None else None``: a ``CastedLinear``; a noisy or LoRA subclass runs the original), of one gate/up width (for the packed form:
the two halves as the source splits them, equal, along the last dimension), and a SiLU/GeLU
instance; anything else runs the original expression. Parameters and the state dict are
unchanged. A biased-GeLU match on the gate of a matched gated MLP is not reported: the gated MLP
fuses it."""


# ---------------------------------------------------------------- preconditions


_PROJECTIONS = ("$gate", "$up", "$down", "$gate_up")


def _is_projection(match: Match, node) -> bool:
    """``node`` calls one of the matched projections (an ``nn.Linear``, or a same-file class the
    matcher took for one: its type is then that class's)."""
    if not isinstance(node, Layer) or node.module is None:
        return False
    return any(node.module == match.bindings.get(name) for name in _PROJECTIONS)


def _act_node(match: Match) -> Layer | None:
    return next((mn.node for mn in match.nodes if isinstance(mn.node, Layer)
                 and not _is_projection(match, mn.node) and mn.node.type not in SPLITS), None)


def _split_node(match: Match) -> Layer | None:
    return next((mn.node for mn in match.nodes if isinstance(mn.node, Layer) and mn.node.type in SPLITS), None)


# ---------------------------------------------------------------- packed gate_up: the halves

_TENSOR_KEYWORDS = ("input", "tensor")
_COUNT_KEYWORDS = ("chunks", "split_size", "split_size_or_sections")


@dataclass(frozen=True)
class Halves:
    """``a, b = <split call>``: what the source says about a packed projection's split."""

    stmt: ast.Assign
    call: ast.Call
    tensor: ast.expr  # the tensor split: the gate_up call itself or a name holding its output
    names: tuple[str, str]
    kind: str  # "chunks" (.chunk / torch.chunk) or "split" (.split / torch.split)
    count: ast.expr  # the number of chunks / the split size or sections, as written
    dim: ast.expr | None  # None: not written (dim 0)


def split_halves(call: ast.Call, stmt: ast.stmt | None) -> Halves | str:
    """The :class:`Halves` of ``stmt`` when it is ``a, b = call`` and ``call`` a chunk/split of one
    tensor; else why not."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.value is call):
        return "the split's result is not unpacked by a plain assignment"
    target = stmt.targets[0]
    if not (isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)):
        return "the split's result is not unpacked into two names"
    names = (target.elts[0].id, target.elts[1].id)
    if names[0] == names[1]:
        return "the split's halves are unpacked into one name"
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return "the split call unpacks arguments"
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in ("chunk", "split"):
        return "not a chunk/split call"
    args = list(call.args)
    keywords = {k.arg: k.value for k in call.keywords}
    method = not (isinstance(func.value, ast.Name) and func.value.id == "torch")
    if method:
        tensor = func.value
    else:
        tensor = args.pop(0) if args else next((keywords.pop(k) for k in _TENSOR_KEYWORDS if k in keywords), None)
    count = args.pop(0) if args else next((keywords.pop(k) for k in _COUNT_KEYWORDS if k in keywords), None)
    dim = args.pop(0) if args else keywords.pop("dim", None)
    if tensor is None or count is None or args or keywords:
        return "the split call has arguments the kernel does not take"
    kind = "chunks" if func.attr == "chunk" else "split"
    return Halves(stmt, call, tensor, names, kind, count, dim)


def _block_index(fn: ast.AST) -> dict[int, tuple[list[ast.stmt], int]]:
    """id(statement) -> (the statement list holding it, its index there)."""
    out: dict[int, tuple[list[ast.stmt], int]] = {}
    for node in walk(fn):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                for i, st in enumerate(block):
                    if isinstance(st, ast.stmt):
                        out[id(st)] = (block, i)
        for handler in getattr(node, "handlers", None) or ():
            for i, st in enumerate(handler.body):
                out[id(st)] = (handler.body, i)
    return out


def halves_reach(fn: ast.AST, halves: Halves, name: str, line: int) -> str | None:
    """None when the statement holding ``line`` reads ``name`` as the split's half: it follows
    the split's statement in the same statement list and no statement in between stores
    ``name``; else why not."""
    where = _block_index(fn).get(id(halves.stmt))
    if where is None:
        return "the split's statement is not in a block"
    block, index = where
    for st in block[index + 1:]:
        if st.lineno <= line <= (st.end_lineno or st.lineno):
            return None
        if name in stores(st):
            return f"{name!r} is assigned again at line {st.lineno} before it is read"
    return f"{name!r} is read outside the statements that follow the split"


def _literal(node: ast.expr | None):
    try:
        return ast.literal_eval(node) if node is not None else None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


_NOT_LITERAL = object()


def dim_refusal(halves: Halves) -> Refusal | None:
    if halves.dim is None:
        return Refusal("dim-not-last", "the split has no dim: it splits dimension 0, not the features")
    if _literal(halves.dim) != -1:
        return Refusal("dim-not-last", f"the split's dim={ast.unparse(halves.dim)} is not provably the last dimension")
    return None


def _find_call(fn: ast.AST, span) -> tuple[ast.Call | None, ast.stmt | None]:
    call = stmt = None
    for node in walk(fn):
        if isinstance(node, ast.Call) and (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset) == (
                span.line, span.col, span.end_line, span.end_col):
            call = node
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                node.lineno == (span.stmt_line or span.line) and node.col_offset <= span.col
                and (stmt is None or node.col_offset > stmt.col_offset)):
            stmt = node
    return call, stmt


def _packed_halves(ctx: MatchContext) -> str | None:
    """The packed form: the activation reads one half of the ``gate_up`` output's split and the
    product's other operand is the other half (checked on the source: see :func:`split_halves`),
    split along the last dimension (else ``refused``, ``dim-not-last``), and neither half is read
    anywhere else."""
    split = _split_node(ctx.match)
    if split is None:
        return None
    act, g, u = _act_node(ctx.match), ctx.binding("$g"), ctx.binding("$u")
    product = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, TensorOp)), None)
    if not (isinstance(g, Var) and isinstance(u, Var)) or act is None or product is None:
        return NotACandidate("the gate and up operands are not names")
    span = split.span
    if ctx.source is None or span is None or not span.function:
        return "the split's halves need the source to be told apart"
    fn = function_ast(ctx.source, span.function, span.line)
    call, stmt = _find_call(fn, span) if fn is not None else (None, None)
    if call is None:
        return "the split call is not found in the source"
    halves = split_halves(call, stmt)
    if isinstance(halves, str):
        return NotACandidate(halves)
    if g.name not in halves.names or u.name not in halves.names or g.name == u.name:
        return NotACandidate("the activation and the product do not read the two halves of the split")
    for name, reader in ((g.name, act), (u.name, product)):
        line = reader.span.line if reader.span is not None else 0
        why = halves_reach(fn, halves, name, line)
        if why is not None:
            return NotACandidate(why)
    refusal = dim_refusal(halves)
    if refusal is not None:
        return refusal
    matched = [mn.node for mn in ctx.match.nodes]
    for name in halves.names:
        line = escaping_read(ctx.source, split, Var(name, 1), matched)
        if line is not None:
            return f"the half {name!r} of the split is also read at line {line}"
    return None


KERNEL_ACTIVATIONS = KernelActivations(
    KERNEL_KEYS, "SiLU/GeLU", "neither SiLU nor GeLU", "{'silu', 'swish', 'gelu', 'gelu_pytorch_tanh', ...}")


def _activation_is_computed(ctx: MatchContext) -> str | None:
    """The activation looked up from a key is one the kernel computes (SiLU or a GeLU): plain
    match when every default of the key is such a key, not a match when none is, ``conditional``
    (``needs-config``) when the source does not settle it (a trace checks the instance)."""
    return settle_activation_node(ctx, _act_node(ctx.match), KERNEL_ACTIVATIONS)


# ---------------------------------------------------------------- codemod

KERNEL = "gated_mlp"
PACKED_KERNEL = "gated_mlp_packed"


def _inside(node: ast.AST, container: ast.AST) -> bool:
    return (node.lineno, node.col_offset) >= (container.lineno, container.col_offset) and (
        node.end_lineno, node.end_col_offset) <= (container.end_lineno, container.end_col_offset)


def _one_tensor_call(call: ast.expr, what: str) -> ast.Call:
    if not isinstance(call, ast.Call) or len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        raise Skip(f"the {what} projection must be a module called with one tensor")
    return call


def _activation_call(ctx: FileContext, match: Match, act: ast.expr, product: ast.expr) -> ast.Call:
    if not isinstance(act, ast.Call) or not act.args:
        raise Skip("the activation must be a call")
    if any(isinstance(a, ast.Starred) for a in act.args) or any(k.arg is None for k in act.keywords):
        raise Skip("the activation call unpacks arguments")
    if not isinstance(product, ast.BinOp) or not isinstance(product.op, ast.Mult):
        raise Skip("the product must be a `*` expression")
    local = ctx.same_file_callable(match.class_name, act)
    if local is not None:
        raise Skip(
            f"the activation is {local}, defined in this file: the kernel recognizes torch and transformers "
            "activations at run time and would always run the original code"
        )
    return act


class _PackedPlan(ChainPlan):
    """:class:`ChainPlan` whose chain also holds the split of a packed projection, the whole
    right-hand side of ``a, b = <split>``: that statement goes too, and both names are
    intermediates (read by matched code only)."""

    def __init__(self, ctx: FileContext, fn: ast.FunctionDef, calls: list[ast.expr], halves: Halves):
        super().__init__(ctx, fn, calls)
        self.halves = halves

    def _targets(self, stmt: ast.stmt) -> tuple[str, ...]:
        return self.halves.names if stmt is self.halves.stmt else super()._targets(stmt)


_PACKED_KEYWORDS = ("chunks", "split", "dim", "gate")


class GatedMLP(Codemod):
    rule = "gated_MLP"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        if _split_node(match) is not None:
            return self._packed(match, ctx, exprs, fn)
        if len(exprs) != 5:
            raise Skip("expected gate, activation, up, product and down")
        by_role = self._roles(match, exprs)
        gate = _one_tensor_call(by_role["gate"], "gate")
        up = _one_tensor_call(by_role["up"], "up")
        down = _one_tensor_call(by_role["down"], "down")
        act = _activation_call(ctx, match, by_role["act"], by_role["product"])
        separate_calls(gate, up, down, act)
        modules = [module_handle(ctx, gate, "gate projection"), module_handle(ctx, up, "up projection"),
                   module_handle(ctx, down, "down projection")]
        activation = arg_text(ctx, act.func)  # a reference or an ACT2FN[...] lookup, evaluated where it was
        extra = [arg_text(ctx, a) for a in act.args[1:]] + [f"{k.arg}={arg_text(ctx, k.value)}" for k in act.keywords]
        spec, kernel = kernel_name(ctx, KERNEL)
        # Execution order, outermost expressions only: a call nested in another matched expression
        # goes away with it; a matched expression of its own statement must be that statement's
        # whole right-hand side (ChainPlan checks), the down call is the anchor.
        ordered = [e for _, e in exprs[:-1]]
        outer = [e for e in ordered if not any(o is not e and _inside(e, o) for o in ordered + [down])]
        plan = ChainPlan(ctx, fn, outer + [down])
        plan.anchor_text = f"{kernel}({', '.join(modules + [activation, arg_text(ctx, gate.args[0])] + extra)})"
        plan.moved = [(gate.func, gate), (up.func, up), (down.func, down), (act.func, act), (gate.args[0], gate)]
        plan.moved += [(a, act) for a in act.args[1:]] + [(k.value, act) for k in act.keywords]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))

    def _packed(self, match: Match, ctx: FileContext, exprs, fn: ast.FunctionDef) -> Edit:
        """``a, b = gate_up(x).chunk(2, dim=-1); down(act(a) * b)`` (split into statements or not)
        -> ``gated_mlp_packed(gate_up, down, act, x, chunks=2, dim=-1, gate=0)``."""
        if len(exprs) != 5:
            raise Skip("expected gate_up, split, activation, product and down")
        roles: dict[str, ast.expr] = {}
        modules = {"gate_up": match.bindings.get("$gate_up"), "down": match.bindings.get("$down")}
        for node, expr in exprs:
            if isinstance(node, TensorOp):
                role = "product"
            elif _is_projection(match, node):
                role = next((r for r, m in modules.items() if m is not None and node.module == m), "?")
            else:
                role = "split" if isinstance(node, Layer) and node.type in SPLITS else "act"
            if role in roles or role == "?":
                raise Skip("cannot tell the gate_up and down projections apart")
            roles[role] = expr
        gate_up = _one_tensor_call(roles["gate_up"], "gate_up")
        down = _one_tensor_call(roles["down"], "down")
        act = _activation_call(ctx, match, roles["act"], roles["product"])
        split = roles["split"]
        if not isinstance(split, ast.Call):
            raise Skip("the split must be a call")
        halves = split_halves(split, ctx.statement_of(split))
        if isinstance(halves, str):
            raise Skip(halves)
        refusal = dim_refusal(halves)
        if refusal is not None:
            raise Skip(str(refusal))
        g, u = match.bindings.get("$g"), match.bindings.get("$u")
        if not (isinstance(g, Var) and isinstance(u, Var) and {g.name, u.name} == set(halves.names)):
            raise Skip("the activation and the product do not read the two halves of the split")
        for name, expr in ((g.name, act), (u.name, roles["product"])):
            why = halves_reach(fn, halves, name, expr.lineno)
            if why is not None:
                raise Skip(why)
        if halves.tensor is not gate_up and not (
                isinstance(halves.tensor, ast.Name)
                and simple_assign_target(ctx.statement_of(gate_up)) == halves.tensor.id
                and ctx.statement_of(gate_up).value is gate_up):
            raise Skip("the split does not read the gate_up projection's output")
        separate_calls(gate_up, down, act)
        clash = [k.arg for k in act.keywords if k.arg in _PACKED_KEYWORDS]
        if clash:
            raise Skip(f"the activation takes a keyword the kernel uses itself ({clash[0]}=)")
        handles = [module_handle(ctx, gate_up, "gate_up projection"), module_handle(ctx, down, "down projection")]
        activation = arg_text(ctx, act.func)
        positional = [arg_text(ctx, a) for a in act.args[1:]]
        keywords = [f"{halves.kind}={arg_text(ctx, halves.count)}", f"dim={arg_text(ctx, halves.dim)}",
                    f"gate={halves.names.index(g.name)}"]
        keywords += [f"{k.arg}={arg_text(ctx, k.value)}" for k in act.keywords]
        spec, kernel = kernel_name(ctx, PACKED_KERNEL)
        ordered = [e for _, e in exprs[:-1]]
        outer = [e for e in ordered if not any(o is not e and _inside(e, o) for o in ordered + [down])]
        plan = _PackedPlan(ctx, fn, outer + [down], halves)
        args = handles + [activation, arg_text(ctx, gate_up.args[0])] + positional + keywords
        plan.anchor_text = f"{kernel}({', '.join(args)})"
        plan.moved = [(gate_up.func, gate_up), (gate_up.args[0], gate_up), (down.func, down), (act.func, act),
                      (halves.count, split), (halves.dim, split)]
        plan.moved += [(a, act) for a in act.args[1:]] + [(k.value, act) for k in act.keywords]
        return Edit(rule=self.rule, forward=plan.build(), imports=(spec,))

    @staticmethod
    def _roles(match: Match, exprs) -> dict[str, ast.expr]:
        """gate / up / down / act / product expressions, by the module each matched call binds."""
        modules = {name: match.bindings.get(name) for name in ("$gate", "$up", "$down")}
        out: dict[str, ast.expr] = {}
        for node, expr in exprs:
            if isinstance(node, TensorOp):
                out["product"] = expr
            elif _is_projection(match, node):
                role = next((r for r, m in modules.items() if m is not None and node.module == m), None)
                if role is None or role[1:] in out:
                    raise Skip("cannot tell the gate, up and down projections apart")
                out[role[1:]] = expr
            else:
                out["act"] = expr
        if set(out) != {"gate", "up", "down", "act", "product"}:
            raise Skip("expected gate, activation, up, product and down")
        return out


# ---------------------------------------------------------------- runtime

# Activation instances the kernel computes, by class name (transformers' ACT2FN classes included).
_SILU_CLASSES = {"SiLU", "SiLUActivation"}
_GELU_CLASSES = {"GELU", *TRANSFORMERS_GELUS}


def _graph_activation(ops) -> str | None:
    """The functional SiLU/GeLU among traced ops (``silu``, ``gelu(approximate=...)``), or None."""
    for op in ops:
        if op.kind != "call_function":
            continue
        if op.name == "silu":
            return "silu"
        if op.name == "gelu":
            approx = op.kwargs.get("approximate") or (op.args[1] if len(op.args) > 1 else None) or "none"
            return f"gelu (approximate={approx!r})"
    return None


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    linears = [m for m in site.modules if isinstance(m, nn.Linear)]
    act_i = next((i for i, n in enumerate(site.nodes)
                  if isinstance(n, Layer) and not _is_projection(site.match, n) and n.type not in SPLITS), None)
    if act_i is None:
        return None, ""
    act_mod = site.modules[act_i]
    if act_mod is None:
        desc = _graph_activation(site.ops[act_i])
        if desc is None:
            return "the activation that runs is neither a SiLU nor a GeLU", ""
    else:
        name = type(act_mod).__name__
        if name not in _SILU_CLASSES | _GELU_CLASSES:
            return f"activation is {name}, neither a SiLU nor a GeLU the kernel computes", ""
        desc = f"{name}(approximate={act_mod.approximate!r})" if isinstance(act_mod, nn.GELU) else name
    facts = f"gated MLP, activation {desc}"
    if len(linears) == 3:
        gate = linears[0]
        facts += f"; Linear {gate.in_features}->{gate.out_features}->{linears[-1].out_features}"
    elif len(linears) == 2:
        gate_up, down = linears
        facts += (f"; packed gate_up Linear {gate_up.in_features}->{gate_up.out_features} (two halves)"
                  f"->{down.out_features}")
    own = sorted({type(m).__name__ for m in linears if type(m).forward is not nn.Linear.forward})
    if own:
        # a LoRA layer from a factory, a cast layer: the kernel decides at run time what it computes
        facts += f"; {', '.join(own)} with its own forward (the kernel checks it at run time)"
    return None, facts


RUNTIME = Runtime(
    check=_runtime_check,
    # No runtime-only sequence: a gated MLP is two branches joined by a product, which a layer
    # chain does not describe; static matches are confirmed by the trace.
    sequence=(),
    # Activations stay whole in a symbolic trace so the check sees which one runs.
    leaf_modules=(
        LINEAR, "torch.nn.modules.activation.SiLU", "torch.nn.modules.activation.GELU",
        "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.Tanh", "transformers.activations.",
    ),
)

@dataclass(frozen=True)
class _GatedMLPRule(Rule):
    # Matches of these rules lying wholly inside a gated-MLP match are not reported (the match
    # driver reads ``supersedes`` with getattr): a GeGLU's gate Linear + GeLU is the gated MLP's.
    supersedes: tuple[str, ...] = ()


RULE = _GatedMLPRule(
    name="gated_MLP",
    kernel="adopter.kernels.gated_mlp",
    doc=DOC,
    dsl=DSL,
    codemod=GatedMLP(),
    runtime=RUNTIME,
    fixtures="gated_MLP",
    preconditions=(intermediates_unused("$g", "$a", "$u", "$h", "$y"), _packed_halves, _activation_is_computed),
    # same-file ``nn.Linear`` subclasses that only change ``__init__`` are Linears (the kernel
    # checks at run time that each projection computes F.linear)
    match_subclasses=True,
    supersedes=("biased_GeLU",),
)
