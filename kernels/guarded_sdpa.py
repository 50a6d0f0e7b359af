"""Guarded written-out attention: ``softmax(q @ kᵀ * scale + mask) [dropout] @ v`` as one
``F.scaled_dot_product_attention`` where that is the same computation and pays, the source's own
ops otherwise.

The rewrite (rule ``sdpa_attention``) passes what the source wrote, evaluated where the call is:
the query, the key *as the source multiplies it* (``k.transpose(-2, -1)``; ``k`` itself for an
einsum, with both equations in ``einsum=``), the value, one scale (``scale=`` multiplied,
``divisor=`` divided), one additive ``mask``, the boolean fills (``masked_fill``):
``fill`` with its ``fill_value``, or tuples of them in the source's order (a fill ``None``: its
``if`` did not run; the value ``"lowest"``: the source's ``-torch.finfo(scores.dtype).max``),
``fill_first`` when the source fills before it adds, the softmax's dtype
(``softmax_float32=True`` when the source computes it in float32 — ``softmax(s.float())``,
``softmax(s, dtype=torch.float32)`` — and casts the probabilities back: ``probs_type_as=t`` for
``.type_as(t)``, ``probs_to=x`` for ``.to(x)``), and the dropout: the user's module
(``dropout=self.attn_drop``) or ``F.dropout``'s ``dropout_p``/``dropout_training``.

The fused path runs only when it provably computes what the source computes:

* query, key, value plain floating tensors of one dtype and device, rank 4, the key
  ``(B, H, D, S)`` as multiplied (``(B, H, S, D)`` for an einsum), equal batch and head sizes
  (grouped-query attention: the source repeats the keys itself, so they are equal); or rank 3,
  heads folded into the batch (``torch.bmm``: fairseq, diffusers), viewed as one head (the masks
  of rank 3 likewise) for the checks and the fused call, the output viewed back (the source's
  ops, where they run, run on the tensors as given);
* a mask that is a tensor of the query's dtype (or bool, added as 1.0 where True as ``s + m``
  adds it) of rank 2-4 broadcasting to the scores without changing their shape; a bool fill
  broadcasting likewise, whose value is ``-inf`` or the scores' ``-finfo.max`` (another
  finite value: the source's ops run); with ``-finfo.max`` no query row may have every key filled
  or masked with ``-inf`` (the source's softmax of it is uniform: read on the masks, source ops); a scale that is a Python number or a one-element tensor
  recording no gradient;
* a softmax the source computes in float32 and casts back only where both casts are identities:
  query/key/value float32 and the cast back to float32 on the query's device (in bfloat16 the
  source rounds a float32 softmax, which SDPA does not compute bitwise: the source's ops run);
* no random numbers drawn: SDPA's dropout does not draw the numbers ``nn.Dropout`` draws on the
  probabilities, so training with ``p > 0`` runs the source's ops with the user's dropout (the same
  numbers, seeded as the original); a dropout module runs fused only as a plain ``nn.Dropout``
  without hooks (:func:`~adopter.kernels.guard_checks.plain_reason`), in eval mode or at ``p == 0``
  (a plain one is ``F.dropout(p, module.p, module.training, module.inplace)``: the source's ops call
  that, drawing the numbers the module draws);
* not under global module hooks, ``torch.jit.trace``, ``torch.func`` transforms, forward AD
  (:func:`~adopter.kernels.policy.mode_reason`) or a proxy-tensor trace (``make_fx``,
  ``torch.export``), nor while torch.compile traces (inductor fuses the source's ops itself, and
  the check below needs the data); TorchScript compiles the source's statements the rewrite keeps
  under ``torch.jit.is_scripting()``;
* SDPA gives 0 where softmax makes NaN (a fully masked or NaN row): a query row of the fused output
  that sums to 0 or NaN sends the call to the source's ops (the check of ``ops/attention.py``), as
  does, in half precision, a row masked by a finite additive mask only;
* it pays: the calibrated cost model (``kernels/cost.py``, shipped ``calibration/cpu.json``:
  ``benchmarks/calibrate_kernels.py --kernels sdpa``) by the scores' size, grad mode and thread
  count; half precision is calibrated apart. No backend policy keeps CPU off it (on one or two
  threads the source's ops at prototype sizes such as 1x2x16x16, SDPA from ViT sizes on).

**One decision, eager or in a graph.** Everything above is decided at run time by one function
(:func:`_guarded`), which an eager call runs directly and an fx graph runs as the custom op
``torch.ops.adopter.sdpa`` (:data:`SCHEMA`): under ``torch.fx`` symbolic tracing (Proxy
arguments) the call is recorded as that one node, so the traced graph makes the call eager makes,
fused or not, with the same numbers (timm's fx tests compare the two at 1e-5; the source's ops in
the graph differed from eager SDPA by its float32 rounding). The op takes no module: a plain
``nn.Dropout`` becomes its ``training`` and ``p`` read by ``get_attr`` nodes at run time (the
graph module's ``train()``/``eval()`` switch them), so TorchScript compiles the graph
(``torch.ops`` calls are scriptable). Its kernel is ``CompositeImplicitAutograd``: it runs the
Python decision on the tensors it is given, with autograd, ``torch.func`` and forward AD seeing the
ops it calls (the source's ops under a transform, the fused Function otherwise), ``torch.compile``
and ``torch.export`` tracing the source's ops through it. The source's ops stay in the graph where
the call has no place in the op: a dropout module that is not a plain ``nn.Dropout`` of the traced
model (or global hooks while tracing: the graph calls the module so the hooks see it), arguments
whose run-time type the graph does not tell (a scale Proxy neither shape arithmetic nor a tensor,
say). (Not seen by a graph: hooks put on the dropout module after tracing.) The op is registered
when this module is imported (``adopter.kernels.sdpa`` imports it): a saved TorchScript or exported
program that calls it loads after ``import adopter.kernels.guarded_sdpa``.

Forward and backward go through :func:`adopter.kernels.ops.attention.run_fused` (SDPA's own
backward; a double backward differentiates the eager ops).
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .guard_checks import context_reason, global_hooks, plain_reason, record_fallback
from .ops.attention import HALF_DTYPES, attention_eager, attention_sdpa, finitely_masked_row, run_fused, suspect_row
from .ops.common import is_proxy
from .policy import mode_reason, policy_reason
from .telemetry import record

__all__ = ["SCHEMA", "sdpa"]

KERNEL = "sdpa"

# ``fill_value`` of a fill the source writes ``-torch.finfo(<scores>.dtype).max``: the most negative
# finite number of the scores' dtype (the scores are not computed where the call is).
LOWEST = "lowest"


def _original(q, key, v, scale, divisor, mask, fills, fill_first, dropout, dropout_p, dropout_training,
              dropout_inplace, einsum, softmax_float32, probs_to, probs_type_as):
    """What the source's statements compute, in its order (``fills``: (mask, value) pairs; the
    dropout the user's module, or ``F.dropout(p, dropout_p, dropout_training, dropout_inplace)``)."""
    s = torch.einsum(einsum[0], q, key) if einsum else torch.matmul(q, key)
    if scale is not None:
        s = s * scale
    if divisor is not None:
        s = s / divisor
    if fill_first:
        for m, value in fills:
            s = s.masked_fill(m, torch.finfo(s.dtype).min if value == LOWEST else value)
    if mask is not None:
        s = s + mask
    if not fill_first:
        for m, value in fills:
            s = s.masked_fill(m, torch.finfo(s.dtype).min if value == LOWEST else value)
    if softmax_float32:  # the source's softmax in float32, cast back before the dropout
        p = F.softmax(s, dim=-1, dtype=torch.float32)
        p = p.type_as(probs_type_as) if probs_type_as is not None else p.to(probs_to)
    else:
        p = F.softmax(s, dim=-1)
    if dropout is not None:
        p = dropout(p)
    elif dropout_p is not None:
        p = F.dropout(p, dropout_p, dropout_training, dropout_inplace)
    return torch.einsum(einsum[1], p, v) if einsum else torch.matmul(p, v)


def _fills(fill, fill_value) -> list[tuple[Any, Any]]:
    """The source's fills in order as (mask, value): ``fill``/``fill_value`` one each or tuples of
    as many; a mask None is a fill whose ``if`` did not run (left out)."""
    if isinstance(fill, tuple):
        values = fill_value if isinstance(fill_value, tuple) else (fill_value,) * len(fill)
        return [(m, value) for m, value in zip(fill, values, strict=True) if m is not None]
    return [] if fill is None else [(fill, fill_value)]


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() and not (
            value.requires_grad and torch.is_grad_enabled()) and type(value) is torch.Tensor:
        return float(value)
    return None


def _dropout_reason(dropout_p, dropout_training) -> str:
    if dropout_p is None or not dropout_training:
        return ""
    p = _number(dropout_p)
    if p is None or p != 0:
        return "training with dropout: SDPA would draw other random numbers than the source's dropout"
    return ""


def _broadcasts(term: torch.Tensor, scores: tuple[int, ...]) -> bool:
    return 2 <= term.dim() <= 4 and all(m in (1, n) for m, n in zip(term.shape[::-1], scores[::-1]))


def _operands_reason(q, key, v, mask, fills, einsum) -> str:
    if not all(type(t) is torch.Tensor for t in (q, key, v)) or not q.is_floating_point():
        return "query/key/value are not plain floating-point tensors"
    if not q.dim() == key.dim() == v.dim() == 4 or not q.dtype == key.dtype == v.dtype:
        return "query/key/value differ in rank or dtype, or are not (batch, heads, seq, head_dim)"
    if not q.device == key.device == v.device:
        return "query/key/value on different devices"
    if q.device.type == "meta":  # (no data: the output check below reads it)
        return "meta tensors"
    b, h, q_len, d = q.shape
    k_shape = key.shape if einsum else (*key.shape[:2], key.shape[3], key.shape[2])
    if tuple(k_shape[:2]) != (b, h) or k_shape[3] != d or tuple(v.shape[:3]) != (b, h, k_shape[2]):
        return "key/value shapes the products broadcast or reject"
    scores = (b, h, q_len, k_shape[2])
    if mask is not None:
        if type(mask) is not torch.Tensor or mask.device != q.device or not _broadcasts(mask, scores):
            return "a mask that is not a tensor broadcasting to the scores on the query's device"
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            return f"a {mask.dtype} mask added to {q.dtype} scores"
    lowest = torch.finfo(q.dtype).min
    for m, value in fills:
        if type(m) is not torch.Tensor or m.dtype != torch.bool or m.device != q.device \
                or not _broadcasts(m, scores):
            return "a fill mask that is not a bool tensor broadcasting to the scores"
        # -inf, or the scores' most negative finite number (-finfo.max): exp of it less a row's
        # maximum is 0 wherever the row keeps a finite score; a fully masked row is checked apart
        if not (value == LOWEST or isinstance(value, float) and value in (-math.inf, lowest)):
            return "a fill value other than -inf or the scores' -finfo(dtype).max (a masked score's softmax differs)"
    return ""


def _blocked_row(fills, mask, q_len: int, k_len: int) -> bool:
    """Whether some query row has every key filled or masked with -inf: the source's softmax of a
    row filled with -finfo.max is uniform over it, SDPA's is not (a -inf fill alone is caught by
    the output check, the source giving NaN). Read on the masks, broadcast over (…, q_len, k_len)."""
    blocked = None
    for m, _ in fills:
        blocked = m if blocked is None else blocked | m
    if mask is not None and mask.dtype != torch.bool:
        inf = mask == -math.inf
        blocked = inf if blocked is None else blocked | inf
    if blocked is None:
        return False
    return bool(blocked.expand(*blocked.shape[:-2], q_len, k_len).all(-1).any())


def _casts_reason(q, softmax_float32, probs_to, probs_type_as) -> str:
    """The source's float32 softmax cast back is SDPA's softmax only where both casts are identities:
    the scores float32 already (query/key/value float32: their dtype is checked one) and the cast
    back to float32 on the query's device."""
    if not softmax_float32:
        return ""
    if q.dtype != torch.float32:
        return "the source computes the softmax in float32 and rounds it back: in another dtype SDPA differs"
    target = probs_type_as if probs_type_as is not None else probs_to
    if type(target) is torch.Tensor:
        if target.dtype != torch.float32 or target.device != q.device:
            return "the probabilities are cast to another dtype or device than the query's"
        return ""
    if target is not torch.float32:
        return "the probabilities are cast to something other than torch.float32"
    return ""


_PROXY_MODE = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)


def _tracing_reason() -> str:
    """A proxy-tensor trace (``make_fx``, ``torch.export``, AOTAutograd) records the ops a call
    runs: the data-dependent checks would be baked into the graph."""
    if _PROXY_MODE is not None and torch._C._get_dispatch_mode(_PROXY_MODE) is not None:
        return "a proxy-tensor trace (make_fx, torch.export): the trace records the source's ops"
    return ""


def sdpa(q: Any, key: Any, v: Any, *, scale: Any = None, divisor: Any = None, mask: Any = None,
         fill: Any = None, fill_value: Any = None, fill_first: bool = False, dropout: Any = None,
         dropout_p: Any = None, dropout_training: Any = True, einsum: tuple[str, str] | None = None,
         softmax_float32: bool = False, probs_to: Any = None, probs_type_as: Any = None) -> Any:
    """The written-out attention the source computed (module doc), fused where provably equal."""
    fills = _fills(fill, fill_value)
    if torch.compiler.is_compiling():  # (before anything dynamo would not trace)
        return _original(q, key, v, scale, divisor, mask, fills, fill_first, dropout, dropout_p, dropout_training,
                         False, einsum, softmax_float32, probs_to, probs_type_as)
    if any(is_proxy(a) for a in (q, key, v, scale, divisor, mask, dropout_p, dropout_training, probs_to,
                                 probs_type_as, *(m for m, _ in fills), *(x for _, x in fills))):
        return _in_graph(q, key, v, scale, divisor, mask, fills, fill_first, dropout, dropout_p, dropout_training,
                         einsum, softmax_float32, probs_to, probs_type_as)
    inplace = False
    if dropout is not None:
        # a plain nn.Dropout is F.dropout(p, module.p, module.training, module.inplace); any other
        # module (or global hooks, which see it called) is called by the source's ops
        why = plain_reason(dropout, nn.Dropout) or ("global module hooks" if global_hooks() else "")
        if why:
            record_fallback(KERNEL, f"the dropout module: {why}")
            return _original(q, key, v, scale, divisor, mask, fills, fill_first, dropout, None, None, False,
                             einsum, softmax_float32, probs_to, probs_type_as)
        dropout_p, dropout_training, inplace = dropout.p, dropout.training, dropout.inplace
    return _guarded(q, key, v, scale, divisor, mask, fills, fill_first, dropout_p, dropout_training, inplace, einsum,
                    softmax_float32, probs_to, probs_type_as)


def _guarded(q, key, v, scale, divisor, mask, fills, fill_first, dropout_p, dropout_training, dropout_inplace,
             einsum, softmax_float32, probs_to, probs_type_as):
    """The decision (module doc) and the path it takes: eager calls and the graph's op
    (:func:`_op_kernel`) both run this, with a functional dropout."""
    args = (q, key, v, scale, divisor, mask, fills, fill_first, None, dropout_p, dropout_training, dropout_inplace,
            einsum, softmax_float32, probs_to, probs_type_as)
    folded = einsum is None and all(type(t) is torch.Tensor and t.dim() == 3 for t in (q, key, v))
    if folded:  # (batch * heads, L, E): one head of a batch of batch * heads
        q, key, v = q.unsqueeze(1), key.unsqueeze(1), v.unsqueeze(1)
        mask = _one_head(mask)
        fills = [(_one_head(m), value) for m, value in fills]
    reason = (context_reason(q, key, v, mask, *(m for m, _ in fills))
              or mode_reason()  # (before any read of the data)
              or _tracing_reason()
              or _operands_reason(q, key, v, mask, fills, einsum)
              or _casts_reason(q, softmax_float32, probs_to, probs_type_as)
              or _dropout_reason(dropout_p, dropout_training))
    factor = 1.0
    if not reason:
        for value, invert in ((scale, False), (divisor, True)):
            if value is None:
                continue
            number = _number(value)
            if number is None or not math.isfinite(number) or (invert and number == 0):
                reason = "a scale that is not a finite number (a tensor recording a gradient, say)"
                break
            factor = factor / number if invert else factor * number
    if not reason:
        k_len = key.shape[-2] if einsum else key.shape[-1]
        # (half precision calibrated apart: the written-out bf16 matmuls are slow on CPU, where SDPA
        # pays from far smaller sizes than in float32)
        reason = policy_reason(KERNEL, q, size=lambda: q.shape[0] * q.shape[1] * q.shape[2] * k_len,
                               variant=lambda: "half" if q.dtype in HALF_DTYPES else "")
    if reason:
        record_fallback(KERNEL, reason)
        return _original(*args)
    k = key if einsum else key.transpose(-2, -1)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.to(q.dtype)  # (``s + m`` adds 1.0 where True: a summand, never a keep-mask)
    if any(value != -math.inf for _, value in fills) and _blocked_row(fills, mask, q.shape[2], k.shape[2]):
        record_fallback(KERNEL, "a query row has every key filled with -finfo.max (the source's softmax is uniform)")
        return _original(*args)
    filled = None
    for m, _ in fills:
        filled = m if filled is None else filled | m
    if filled is not None:  # one mask: -inf where filled, the additive mask elsewhere (bool keep-mask alone)
        attn_mask = ~filled if mask is None else torch.where(filled, -math.inf, mask)
    else:
        attn_mask = mask
    if q.dtype in HALF_DTYPES and mask is not None and finitely_masked_row(q, k, mask, None):
        record_fallback(KERNEL, "a query row is masked by a finite mask in half precision")
        return _original(*args)
    out = run_fused(attention_sdpa, attention_eager, q, k, v, attn_mask, None, 0.0, factor, False)
    if suspect_row(out):
        record_fallback(KERNEL, "a query row came out NaN or zero: maybe a fully masked (all -inf) or NaN row, "
                                "which softmax makes NaN")
        return _original(*args)
    record(KERNEL, "torch")
    return out.squeeze(1) if folded else out


def _one_head(term: Any) -> Any:
    """A mask of rank-3 scores ``(batch * heads, L, S)`` as one of rank-4 scores with one head."""
    return term.unsqueeze(-3) if type(term) is torch.Tensor and term.dim() == 3 else term


# ---------------------------------------------------------------- the same call as one graph node
#
# Every argument of the call in a typed slot: a number or a tensor for the scale and the divisor
# (whichever the source passes), the fills' values as floats with a flag for the scores' lowest
# number, the dropout functional, ``probs_to`` a dtype or a tensor.

SCHEMA = ("sdpa(Tensor q, Tensor key, Tensor v, Scalar? scale, Tensor? scale_tensor, Scalar? divisor, "
          "Tensor? divisor_tensor, Tensor? mask, Tensor[] fill, float[] fill_value, bool[] fill_lowest, "
          "bool fill_first, Scalar? dropout_p, bool dropout_training, bool dropout_inplace, str[] einsum, "
          "bool softmax_float32, ScalarType? probs_dtype, Tensor? probs_to, Tensor? probs_type_as) -> Tensor")

def _registered() -> bool:
    try:
        return torch.ops.adopter.sdpa.default is not None
    except (AttributeError, RuntimeError):
        return False


# once per process: this module imported a second time under another name (a test or tool putting
# the repository's kernels/ on sys.path) finds the op the first copy registered, the same code
_DEFINE = not _registered()
_LIBRARY = torch.library.Library("adopter", "FRAGMENT")  # (adopter::linear_cross_entropy shares the namespace)
if _DEFINE:
    _LIBRARY.define(SCHEMA)


def _op_kernel(q, key, v, scale, scale_tensor, divisor, divisor_tensor, mask, fill, fill_value, fill_lowest,
               fill_first, dropout_p, dropout_training, dropout_inplace, einsum, softmax_float32, probs_dtype,
               probs_to, probs_type_as):
    """``adopter::sdpa``: the slots back into the call's arguments, then :func:`_guarded` (run with
    autograd: CompositeImplicitAutograd)."""
    fills = [(m, LOWEST if lowest else value) for m, value, lowest in zip(fill, fill_value, fill_lowest, strict=True)]
    return _guarded(q, key, v, scale if scale_tensor is None else scale_tensor,
                    divisor if divisor_tensor is None else divisor_tensor, mask, fills, fill_first, dropout_p,
                    dropout_training, dropout_inplace, tuple(einsum) or None, softmax_float32,
                    probs_dtype if probs_to is None else probs_to, probs_type_as)


if _DEFINE:
    _LIBRARY.impl("sdpa", _op_kernel, "CompositeImplicitAutograd")
OP = torch.ops.adopter.sdpa

# what a graph's value is at run time, read off the node that makes it: "tensor", "number",
# "shape" (a tensor's shape or size()), "dtype", "" (not known)
_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
               operator.mod, operator.neg, operator.pos)
_NOT_TENSOR_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "type",
                                 "element_size", "is_floating_point", "is_contiguous", "get_device", "stride",
                                 "storage_offset", "data_ptr", "__len__", "__bool__"})


def _attribute(root: nn.Module, target: str) -> Any:
    """``root``'s attribute at the dotted ``target``, read off the modules' own dicts (while fx
    traces, a module's ``__getattr__`` hands out Proxies of its parameters); None when absent."""
    found: Any = root
    for name in target.split("."):
        if not isinstance(found, nn.Module):
            return getattr(found, name, None)
        found = next((d[name] for d in (found._parameters, found._buffers, found._modules, vars(found))
                      if name in d), None)
    return found


def _kind(value: Any, root: nn.Module) -> str:
    if isinstance(value, torch.fx.Proxy):
        value = value.node
    if not isinstance(value, torch.fx.Node):
        if isinstance(value, torch.Tensor):
            return "tensor"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return "number"
        return "dtype" if isinstance(value, torch.dtype) else ""
    node = value
    if node.op == "get_attr":
        return _kind(_attribute(root, node.target), root)
    if node.op == "call_method":
        self_kind = _kind(node.args[0], root) if node.args else ""
        if self_kind not in ("tensor", ""):  # (a tensor's method: the value's own is not known)
            return ""
        if node.target == "size":
            return "number" if len(node.args) > 1 or node.kwargs else "shape"
        if node.target in ("dim", "ndimension", "numel", "nelement"):
            return "number"
        return "tensor" if self_kind == "tensor" and node.target not in _NOT_TENSOR_METHODS else ""
    if node.op != "call_function":
        return ""
    args = [*node.args, *node.kwargs.values()]
    if node.target is getattr and len(args) == 2:
        # (``x.shape``, ``x.dtype`` of a value the graph does not type: only a tensor has them here)
        if _kind(args[0], root) not in ("tensor", ""):
            return ""
        return {"shape": "shape", "dtype": "dtype", "ndim": "number"}.get(args[1], "")
    if node.target is operator.getitem and len(args) == 2 and _kind(args[0], root) == "shape":
        return "number" if isinstance(args[1], int) else ""
    kinds = [_kind(a, root) for a in args]
    if getattr(node.target, "__module__", "") == "math":  # (fx wraps math's functions of a Proxy)
        return "number" if kinds and all(k == "number" for k in kinds) else ""
    if node.target in _ARITHMETIC:
        if all(k == "number" for k in kinds):
            return "number"
        if "tensor" in kinds and all(k in ("tensor", "number") for k in kinds):
            return "tensor"
        return ""
    if getattr(node.target, "__module__", "") in ("torch", "torch.nn.functional", "torch._C._nn") and "tensor" in kinds:
        return "tensor"
    return ""


def _in_graph(q, key, v, scale, divisor, mask, fills, fill_first, dropout, dropout_p, dropout_training, einsum,
              softmax_float32, probs_to, probs_type_as):
    """Under ``torch.fx`` symbolic tracing: the call as one ``adopter::sdpa`` node where every
    argument has its slot (module doc), the source's ops otherwise."""
    tracer = next(a.tracer for a in (q, key, v, scale, divisor, mask, dropout_p, dropout_training, probs_to,
                                      probs_type_as, *(m for m, _ in fills), *(x for _, x in fills)) if is_proxy(a))
    root = tracer.root
    source = (q, key, v, scale, divisor, mask, fills, fill_first, dropout, dropout_p, dropout_training, False, einsum,
              softmax_float32, probs_to, probs_type_as)
    why, slots = _slots(tracer, root, scale, divisor, mask, fills, dropout, dropout_p, dropout_training, probs_to,
                        probs_type_as, q, key, v, fill_first, einsum, softmax_float32)
    if why:
        record_fallback(KERNEL, f"fx tracing: {why}: the graph records the source's ops")
        return _original(*source)
    return tracer.create_proxy("call_function", OP, slots, {})


def _slots(tracer, root, scale, divisor, mask, fills, dropout, dropout_p, dropout_training, probs_to, probs_type_as,
           q, key, v, fill_first, einsum, softmax_float32):
    """("", the op's arguments), or why the call has no place in the op."""
    if not (isinstance(fill_first, bool) and isinstance(softmax_float32, bool)
            and (einsum is None or isinstance(einsum, tuple) and all(isinstance(e, str) for e in einsum))):
        return "arguments the graph does not tell", ()
    for t in (q, key, v):
        if _kind(t, root) not in ("tensor", ""):
            return "a query, key or value that is not a tensor", ()
    numbers = []
    for value in (scale, divisor):
        kind = "" if value is None else _kind(value, root)
        if value is not None and kind not in ("number", "tensor"):
            return "a scale that is neither a number nor a tensor where the graph tells", ()
        numbers += [value if kind == "number" else None, value if kind == "tensor" else None]
    for m in (mask, *(m for m, _ in fills)):
        if m is not None and _kind(m, root) not in ("tensor", ""):
            return "a mask that is not a tensor", ()
    values, lowest = [], []
    for _, value in fills:
        if value != LOWEST and type(value) is not float:  # (TorchScript's float[]: an int is no float there)
            return "a fill value that is not a float", ()
        values.append(0.0 if value == LOWEST else value)
        lowest.append(value == LOWEST)
    if dropout is not None:
        if plain_reason(dropout, nn.Dropout) or global_hooks():
            return "the dropout module is not a plain nn.Dropout (or global hooks see it called)", ()
        try:
            path = tracer.path_of_module(dropout)
        except NameError:
            return "the dropout module is not a submodule of the traced model", ()
        # (read when the graph runs: the graph module's train()/eval() switch its copy of them)
        dropout_p = tracer.create_proxy("get_attr", f"{path}.p" if path else "p", (), {})
        dropout_training = tracer.create_proxy("get_attr", f"{path}.training" if path else "training", (), {})
        inplace = dropout.inplace
    else:
        inplace = False
        if dropout_p is not None and _kind(dropout_p, root) != "number":
            return "a dropout probability that is not a number", ()
        if not isinstance(dropout_training, bool):
            return "a dropout flag the graph computes", ()
    probs_dtype = probs_tensor = None
    if softmax_float32:  # (ignored otherwise, as the source's ops ignore it)
        if probs_type_as is not None and _kind(probs_type_as, root) not in ("tensor", ""):
            return "a cast to the type of something other than a tensor", ()
        kind = "" if probs_to is None else _kind(probs_to, root)
        if probs_to is not None and kind not in ("dtype", "tensor"):
            return "a cast to something other than a dtype or a tensor", ()
        probs_dtype, probs_tensor = (probs_to, None) if kind == "dtype" else (None, probs_to)
    else:
        probs_type_as = None
    return "", (q, key, v, *numbers, mask, [m for m, _ in fills], values, lowest, fill_first, dropout_p,
                dropout_training, inplace, list(einsum or ()), softmax_float32, probs_dtype, probs_tensor,
                probs_type_as)
