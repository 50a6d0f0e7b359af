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
T5LayerNorm's cast to a half weight => ``cast_to_half_weight=True``. x-transformers'
``F.normalize(x, dim=-1) * self.scale * self.gamma`` => ``scaled_l2_norm(x, self.scale, self.gamma)``
(another kernel: the L2 norm clamped by eps, see ``adopter.kernels.guarded_l2_norm``). The others are refused
(``norm-variant``) with what differs: eps outside the square root, a bias, a float32 norm never
cast back, a division by ``sqrt``, no weight, a forward that computes more than the norm (the form
without any upcast or cast is rewritten with ``upcast=False``).

``adopter.kernels.rms_norm`` decides at run time (tensor weight of the row size, numeric eps,
float32/half input, not traced) and otherwise runs the form's eager formula.

The rule's parts: this module (DSL, doc, precondition, codemod, runtime check), reading the
class's ``forward`` (:mod:`~adopter.core.rules.rms_norm.forward`, on the shared symbolic evaluator)
and recognizing the forms in the value it returns (:mod:`~adopter.core.rules.rms_norm.forms`).
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import Codemod, kernel_name, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.dsl import Layer, TensorOp, Var
from adopter.core.match import MatchContext, NotACandidate, Refusal
from adopter.core.match.source import parse_file
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules.rms_norm.forms import CODE, INPUT, Form, _NotRMS, _Variant, classify
from adopter.core.rules.rms_norm.forward import _overriding_subclasses, analyze_forward
from adopter.core.structures import Match
from adopter.core.symbolic import Sym

__all__ = ["CODE", "DOC", "DSL", "INPUT", "KERNEL", "RULE", "Form", "RMSNormCodemod", "Sym", "analyze_forward",
           "classify", "rms_norm_form"]

KERNEL = "rms_norm"

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

# F.normalize(x, dim=-1) * scale * gamma (x-transformers): an L2 norm scaled, the scaled_l2_norm kernel
rule RMSNorm
forward:
    torch.nn.functional.normalize($h) -> $n; $n * $s -> $m

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
OLMo-2's). The form with no float32 upcast and no cast, all in the input's dtype (mamba-style
``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight``), is rewritten with
``upcast=False``. Refused (``norm-variant``): eps outside the square root, ``x / sqrt(...)``, a bias
added to the result, a float32 norm scaled and never cast back, no weight, a ``mean`` not over the last dimension
(``dim-not-last``), a forward that takes more inputs or computes more than the norm (gated,
grouped norms), a helper it calls that a same-file subclass overrides.
x-transformers' RMSNorm, a forward returning ``F.normalize(x, dim=-1) * self.scale * self.gamma``
(``p=2``; the factors attributes, numbers or arithmetic of them such as ``(self.gamma + 1.0)``,
none, one or several, in any order and grouping, either operand order; ``eps=`` given or not;
``F.normalize(x.float(), ...)`` and a ``.type_as(x)`` of the product too), is rewritten to
``scaled_l2_norm(x, self.scale, self.gamma[, eps=..., upcast=True, cast_back=True])``: a kernel
computing what ``F.normalize`` computes — each row divided by ``max(||x||_2, eps)``, not by
``sqrt(mean(x ** 2) + eps)`` — then the source's factors in the source's order, read at every
call (the scale need not be ``sqrt(d)``). Refused (``norm-variant``): a cast between the products,
a factor read from anything but the module and constants. Not a match: an ``F.normalize`` with
``p`` other than 2 or over another dim than the last, a centered
``(x - mean)`` normalization (LayerNorm, also ConvNeXt's channels-first one written out over
dim 1), an ``F.normalize`` inside a larger forward (cosine-similarity attention), a norm in a
function that is not a ``forward``. The scaled L2 kernel runs fused (the same ops as the source,
multiplied in place, a backward from the input and one norm per row) where the CPU calibration
measured it faster (``benchmarks/calibrate_kernels.py --kernels scaled_l2_norm``, 1 thread:
training from ~100K elements, no-grad from ~800K; a half input normalized in its own dtype, whose
float32 backward costs more, on a curve of its own: bfloat16 no-grad from ~4M, training never). Side by
side with the source module (benchmarks/bench_scaled_l2_norm.py, results/scaled_l2_norm.md, 1
thread): float32 forward+backward 0.41-0.70x the source's time at 0.8-1M elements (no-grad
0.55-0.91x), 1.3-1.4x at 16K; bfloat16 normalized in bfloat16 1.23-1.28x in training. Elsewhere, and under torch.func, forward AD, jit.trace and fx, the source's own
``F.normalize`` and products run.
``torch.nn.RMSNorm`` and ``F.rms_norm`` used directly are not rewritten: measured side by side in
one run (benchmarks/bench_rms_norm_forms.py --builtin-only, results/rms_norm_forms.json: CPU, 1
thread, 11 paired rounds, (8,128,768) and (2,128,4096), float32 and bfloat16; bitwise equal
outputs), the kernel over the built-in is a median wall ratio of 0.41-1.10 for forward+backward
(CPU-time ratio 0.57-0.94) with the per-round spread crossing 1.0 in 6 of 8 rows, and 1.33-1.93
for a no-grad float32 forward (0.95-1.09 in bfloat16): no win that holds on this shared machine,
and a loss for inference, so the user's built-in call stays."""


# ---------------------------------------------------------------- precondition


_MEANS = ("torch.Tensor.mean", "torch.mean")


def _centered(ctx: MatchContext, value) -> bool:
    """``value`` is ``x - mean(x)`` (or ``x - u`` with ``u = x.mean(...)``): a centered input,
    what a LayerNorm squares and divides, never an RMSNorm's."""
    producers = ctx.producers()
    node = producers.get((value.name, value.version)) if isinstance(value, Var) else None
    if not isinstance(node, TensorOp) or node.op != "-" or len(node.args) != 2:
        return False
    centre, sub = node.args[0].value, node.args[1].value
    mean = producers.get((sub.name, sub.version)) if isinstance(sub, Var) else None
    return isinstance(mean, Layer) and mean.type in _MEANS and bool(mean.args) and mean.args[0].value == centre


def rms_norm_form(ctx: MatchContext) -> str | None:
    """The match lies in a class's ``forward`` whose whole body is a recognized RMSNorm form;
    a look-alike is refused (``norm-variant``, ``dim-not-last``), anything else is no match —
    a centered normalization (ConvNeXt's channels-first LayerNorm: ``(x - u).pow(2).mean(1)``,
    ``(x - u) / sqrt(s + eps)``) is a LayerNorm, not a near-miss of an RMSNorm."""
    m = ctx.match
    if any(_centered(ctx, ctx.binding(name)) for name in ("$h", "$x")):
        # not a candidate: no line in any report, refused or not (issue 35)
        return NotACandidate("the squared input is centered (x - mean(x)): a LayerNorm, not an RMSNorm")
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
        spec, kernel = kernel_name(ctx, form.kernel)
        args = form.arguments()
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
