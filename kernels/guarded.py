"""Guarded kernels: what rewritten source calls, handing over the user's own modules.

A rewrite never changes ``__init__``: ``self.dropout``, ``self.LayerNorm``, ``self.dense`` stay
the user's modules (same parameter names and state dict; PEFT ``target_modules``, tensor-parallel
plans and checkpoints keep working). The rewritten ``forward`` passes them to one of these
functions, e.g. ``dropout_add_layer_norm(self.dropout, self.LayerNorm, h, residual)`` (or, for a
functional dropout, ``F.dropout`` itself with the arguments the source passed it), which checks *at
run time* what it got:

* module types (the exact torch classes, or subclasses that do not override ``forward``), no
  forward/backward hooks on them (a hook would be skipped by the fused path), no global hooks;
* the activation (only a GeLU the kernel computes: ``nn.GELU``, ``F.gelu`` and the
  transformers GeLU classes, with their approximation), dtypes, shapes, the training flag;

and runs the fused kernel when everything holds, or else calls the modules exactly as the
original source did (``norm(dropout(x) + residual)``). So a rewritten class computes what the
original computed for every configuration and every instance, including instances the analysis
never saw. Each call is counted in :mod:`adopter.kernels.telemetry` with its path, so a
fallback is visible in reports. While ``torch.fx`` traces (Proxy inputs) the original
computation is traced (the graph shows the user's modules, follows their train/eval flags, and
scripts). Derived weights (a folded BatchNorm, concatenated Q/K/V) are computed from the live
parameters on every call, or kept between calls under :func:`adopter.kernels.freeze`'s promise
(``kernels/frozen.py``). Under TorchScript none of this is compiled: rewrites keep
the original statements in an ``if torch.jit.is_scripting():`` branch.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adopter.catalogue import TRANSFORMERS_GELUS

from .backend import last_backend
from .frozen import frozen_tensors, is_frozen, release, release_if_training
from .guard_checks import (
    context_reason,
    defines_own_forward,
    has_hooks,
    hooks_reason,
    is_parametrized,
    plain_reason,
    record_fallback,
)
from .norm_act import norm_act_parts
from .ops import conv_prepacked as _conv_ops
from .ops import finite
from .ops.batch_norm_fold import fold_batch_norm, fold_range
from .ops.bias_gelu import linear_bias_gelu
from .ops.common import is_proxy
from .ops.dropout_add_layer_norm import dropout_add_layer_norm as _dropout_add_layer_norm
from .policy import policy_reason
from .telemetry import record

__all__ = ["conv_bn", "dropout_add_layer_norm", "gelu_mode", "linear_bn", "linear_gelu", "qkv"]

# ---------------------------------------------------------------- Linear + GeLU

# transformers.activations classes -> the GeLU they compute (one catalogue with the rules)
_TRANSFORMERS_GELUS = TRANSFORMERS_GELUS




def gelu_mode(activation: Any, args: tuple = (), kwargs: dict | None = None) -> tuple[str | None, str]:
    """``("none" | "tanh", "")`` when ``activation(h, *args, **kwargs)`` is a GeLU the fused kernel
    computes (its ``approximate``), else ``(None, why not)``."""
    kwargs = kwargs or {}
    if activation is F.gelu:
        if args or set(kwargs) - {"approximate"}:  # (approximate is keyword-only: F.gelu raises)
            return None, "F.gelu with unexpected arguments"
        mode = kwargs.get("approximate", "none")
        return (mode, "") if mode in ("none", "tanh") else (None, f"F.gelu(approximate={mode!r})")
    if args or kwargs:
        return None, f"{type(activation).__name__} called with extra arguments"
    cls = type(activation)
    if isinstance(activation, nn.GELU):
        why = plain_reason(activation, nn.GELU)
        if why:
            return None, why
        return (activation.approximate, "") if activation.approximate in ("none", "tanh") else (None, "nn.GELU mode")
    mode = _TRANSFORMERS_GELUS.get(cls.__name__)
    if mode is None or cls.__module__ != "transformers.activations":
        return None, f"activation is {cls.__name__}, not a GeLU the kernel computes"
    if not defines_own_forward(cls, "transformers.activations"):
        return None, f"{cls.__name__}.forward is replaced"
    if has_hooks(activation):
        return None, f"{cls.__name__} has hooks"
    return mode, ""


def linear_gelu(linear: nn.Module, activation: Any, x: torch.Tensor, *act_args: Any, **act_kwargs: Any) -> Any:
    """``activation(linear(x), *act_args, **act_kwargs)``; with an ``nn.Linear`` and a GeLU the
    kernel computes, the matmul then one fused bias+GeLU kernel (triton on CUDA)."""
    reason = context_reason(x) or policy_reason("linear_gelu", x) or plain_reason(linear, nn.Linear)
    if not reason:
        mode, reason = gelu_mode(activation, act_args, act_kwargs)
    if reason:
        record_fallback("linear_gelu", reason)
        return activation(linear(x), *act_args, **act_kwargs)
    out = linear_bias_gelu(x, linear.weight, linear.bias, mode)
    record("linear_gelu", last_backend())
    return out


# ---------------------------------------------------------------- Dropout + add + LayerNorm


def _f_dropout_args(p: Any = 0.5, training: Any = True, inplace: Any = False) -> tuple[Any, Any, Any]:
    """``F.dropout``'s arguments after ``input``, with its defaults."""
    return p, training, inplace


def _dropout_setting(dropout: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, str]:
    """``(p, training, "")`` of what ``dropout(x, *args, **kwargs)`` computes when the fused kernel
    can compute it (a plain ``nn.Dropout`` module, or ``F.dropout`` with a probability in [0, 1]
    and a bool ``training``, not in place), else ``(None, None, why not)``."""
    if isinstance(dropout, nn.Module):
        why = plain_reason(dropout, nn.Dropout) or ("Dropout called with extra arguments" if args or kwargs else "")
        if not why and dropout.inplace:
            why = "in-place Dropout"
        return (None, None, why) if why else (dropout.p, dropout.training, "")
    if dropout is not F.dropout:
        return None, None, f"dropout is {getattr(dropout, '__name__', type(dropout).__name__)}, not F.dropout"
    try:
        p, training, inplace = _f_dropout_args(*args, **kwargs)
    except TypeError:
        return None, None, "F.dropout with unexpected arguments"
    if inplace:
        return None, None, "in-place F.dropout"
    if type(training) is not bool:
        return None, None, "F.dropout training flag is not a bool"
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        return None, None, "F.dropout probability is not a number in [0, 1]"
    return float(p), training, ""


def dropout_add_layer_norm(
    dropout: Any, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor, *drop_args: Any, prenorm: bool = False,
    **drop_kwargs: Any,
) -> Any:
    """``norm(dropout(x, *drop_args, **drop_kwargs) + residual)``; with ``prenorm=True`` the pair
    ``(h, norm(h))`` of the sum ``h = dropout(x, ...) + residual`` and its normalization (a pre-norm
    block keeps the sum as its next residual).

    ``dropout`` is what the source called: an ``nn.Dropout`` module (``self.dropout``), or the
    functional ``F.dropout`` with the arguments the source passed it after the input
    (``dropout_add_layer_norm(F.dropout, self.norm, y, x, p=self.p, training=self.training)``:
    ``F.dropout``'s defaults ``p=0.5, training=True`` apply as in the source). With a plain
    ``nn.Dropout``/``F.dropout`` (probability in [0, 1], bool ``training``, not in place) and a
    plain ``nn.LayerNorm``: one fused kernel each way on CUDA (dropout mask regenerated in the
    backward), the unfused ops otherwise; anything else runs the original computation. ``x`` may
    be in half precision with a float32 ``residual`` (autocast)."""
    reason = context_reason(x, residual) or policy_reason("dropout_add_layer_norm", x) or plain_reason(norm, nn.LayerNorm)
    p = training = None
    if not reason:
        p, training, reason = _dropout_setting(dropout, drop_args, drop_kwargs)
    if not reason and (not isinstance(residual, torch.Tensor) or x.shape != residual.shape):
        reason = "residual is not a tensor of x's shape"
    if reason:
        record_fallback("dropout_add_layer_norm", reason)
        h = dropout(x, *drop_args, **drop_kwargs) + residual
        return (h, norm(h)) if prenorm else norm(h)
    out = _dropout_add_layer_norm(
        x, residual, norm.normalized_shape, norm.weight, norm.bias, norm.eps, p, training, prenorm=prenorm
    )
    record("dropout_add_layer_norm", last_backend())
    return out


# ---------------------------------------------------------------- Q/K/V projections

_QKV_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensor_key(tensors, freeze_tokens: tuple[int, ...]) -> tuple | None:
    """What a derived weight of ``tensors`` is kept under: the freeze promise it was built under
    (``frozen_tensors``' tokens) and each tensor's identity, version and place."""
    try:
        return (freeze_tokens, *(None if t is None else (id(t), t._version, t.data_ptr(), t.dtype, t.device)
                                 for t in tensors))
    except RuntimeError:  # inference tensors have no version counter
        return None


def _cached(cache: weakref.WeakKeyDictionary, owner: nn.Module, modules: tuple, tensors: tuple, build):
    """``build()`` of ``tensors`` (parameters and buffers of ``modules``): kept between calls only
    while the modules are under :func:`adopter.kernels.freeze`'s promise (no version counter can
    tell that a tensor changed: ``kernels/frozen.py``), computed from the live tensors otherwise,
    with autograd recording it when a gradient can flow."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    ):
        return build()
    tokens = frozen_tensors(modules, tensors)
    key = _tensor_key(tensors, tokens) if tokens else None
    if key is None:
        with torch.no_grad():
            return build()
    hit = cache.get(owner)
    if hit is not None and hit[0] == key:
        return hit[1]
    # (inference_mode(False) first: it switches grad mode on, no_grad then off again)
    with torch.inference_mode(False), torch.no_grad():
        value = build()
    cache[owner] = (key, value)
    return value


# On CPU one matmul over the concatenated weights is no faster than three (single-threaded at
# BERT-base width: 0.94-1.0x, benchmarks/results/qkv_cpu.json), and the concatenation costs a copy
# per training step: CPU calls run the three modules. (Tests switch this on to check the math.)
QKV_FUSE_ON_CPU = False


def qkv(query: nn.Module, key: nn.Module, value: nn.Module, x: torch.Tensor) -> tuple[Any, Any, Any]:
    """``(query(x), key(x), value(x))``; three ``nn.Linear`` on one input run as one matmul over
    their concatenated weights (parameters unchanged; the concatenation is cached while no
    gradient flows). On CPU the three modules run (see ``QKV_FUSE_ON_CPU``)."""
    layers = (query, key, value)
    reason = context_reason(x) or policy_reason("qkv", x)
    if not reason and x.device.type == "cpu" and not QKV_FUSE_ON_CPU:
        reason = "CPU: three matmuls are as fast as one over concatenated weights"
    reason = reason or next((why for why in (plain_reason(layer, nn.Linear) for layer in layers) if why), "")
    if not reason:
        weights = tuple(layer.weight for layer in layers)
        biases = tuple(layer.bias for layer in layers)
        if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
            reason = "projections differ in input size, dtype or device"
        elif len({b is None for b in biases}) != 1:
            reason = "some projections have a bias and some not"
    if reason:
        record_fallback("qkv", reason)
        return query(x), key(x), value(x)

    def concatenated():
        bias = None if biases[0] is None else torch.cat(biases)
        return torch.cat(weights), bias

    weight, bias = _cached(_QKV_CACHE, query, layers, weights + biases, concatenated)
    out = F.linear(x, weight, bias).split([w.shape[0] for w in weights], dim=-1)
    record("qkv", "torch")
    return out[0], out[1], out[2]


# ---------------------------------------------------------------- Conv/Linear + BatchNorm (eval)

_FOLD_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# BatchNorm -> (key, oneDNN-packed folded conv weight): see kernels/ops/conv_prepacked.py
_PACK_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BatchNorm = nn.modules.batchnorm._BatchNorm


def _fold_reason(bn: nn.Module, bn_type: type) -> str:
    why = plain_reason(bn, bn_type)
    if why:
        return why
    if bn.training:
        return _TRAINING
    if bn.running_mean is None or bn.running_var is None:
        return "BatchNorm tracks no running statistics"
    if torch.is_autocast_enabled(bn.running_mean.device.type):
        # autocast runs the conv in low precision and the BatchNorm in float32: a fold rounds the
        # BN scale into the low-precision weight (gradients 5-10x less accurate than the original's)
        return "autocast: the original runs the BatchNorm in float32 after a low-precision layer"
    return ""


# Without the freeze promise a fold is computed on every call: it reads the layer's weight in
# float64 a few times, the BatchNorm it saves reads and writes the output once. It pays only where
# the weight is a tiny share of the output (benchmarks/bench_fold_per_call.py,
# results/fold_per_call.json, one thread: shares 0.001 and 0.003 ran 1.08x and 1.47x of the
# original, 0.012-0.02 ran 0.93-0.98x, and ResNet-50's deep convs at batch 1 (shares 5-12) 0.24-0.75x).
# Off by default (0): a fold rounds differently from the two layers, and the same unfrozen model
# traced by fx (which records the original layers, so that gm.train() follows) or scripted then
# differs from its eager run by more than the libraries' own tests allow (timm's
# test_model_forward_fx, visformer: 3e-3 against 1e-5). Under freeze() the fold is kept and pays
# everywhere; 0.01 switches the per-call fold on where it pays.
FOLD_PER_CALL_MAX_WEIGHT_SHARE = 0.0


def _fold_pays_per_call(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether folding on this call costs less than the BatchNorm it saves: the weight at most
    :data:`FOLD_PER_CALL_MAX_WEIGHT_SHARE` of the output (its size taken as the input's with the
    layer's output features: a stride only makes the output smaller, and the rule stricter)."""
    if x.dim() < 2 or x.shape[1] == 0:
        return False
    out_size = x.numel() // x.shape[1] * weight.shape[0]
    return weight.numel() <= FOLD_PER_CALL_MAX_WEIGHT_SHARE * out_size


def _fold_cached(bn: nn.Module, tensors: tuple, keep: tuple[int, ...]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple | None]:
    """The fold of ``tensors`` (layer weight, bias, BN statistics and affine) and ``bn.eps``, and
    the key it is kept under. Kept between calls only when ``keep`` (the freeze tokens of the layer
    and the BatchNorm under :func:`adopter.kernels.freeze`'s promise: ``kernels/frozen.py``; no version counter
    tells that a fused optimizer step, a ``.data`` write or a train-mode BatchNorm changed a
    tensor); otherwise computed from the live tensors (key None), recorded by autograd when a
    gradient can flow. A kept fold is built outside inference mode, so it stays usable after it,
    and without autograd."""
    key = _tensor_key(tensors, keep) if keep else None
    if key is None:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return fold_batch_norm(*tensors, bn.eps), None
        with torch.no_grad():
            return fold_batch_norm(*tensors, bn.eps), None
    key = (*key, bn.eps)
    hit = _FOLD_CACHE.get(bn)
    if hit is not None and hit[0] == key:
        return hit[1], key
    # (inference_mode(False) first: it switches grad mode on, no_grad then off again; the other
    # order recorded the fold's graph and kept a float64 copy of the weight alive with it)
    with torch.inference_mode(False), torch.no_grad():
        value = fold_batch_norm(*tensors, bn.eps)
    _FOLD_CACHE[bn] = (key, value)
    return value, key


def _conv_prepacked(conv: nn.Module, bn: nn.Module, x: torch.Tensor, tensors: tuple, weight: torch.Tensor,
                    bias: torch.Tensor | None, fold_key: tuple, attr: str) -> torch.Tensor | None:
    """The folded conv of ``x`` followed by ``attr`` (``"none"``/``"relu"``) in oneDNN: on a weight
    packed once per fold state (``fold_key``), conv geometry and per-sample input shape, or on the
    folded weight itself for a light NCHW conv; None where aten's conv runs instead
    (``prepack_layout`` says when)."""
    padding, stride, dilation, groups = conv.padding, conv.stride, conv.dilation, conv.groups
    layout = _conv_ops.prepack_layout(x, weight, bias, padding, stride, dilation, groups, conv.padding_mode, *tensors, attr=attr)
    if not layout:
        return None
    if layout == "onednn_contiguous":
        return _conv_ops.conv_prepacked(x, weight, bias, padding, stride, dilation, groups, layout, attr)
    key = (fold_key, x.shape[1:], padding, stride, dilation, groups)
    hit = _PACK_CACHE.get(bn)
    if hit is None or hit[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            hit = _PACK_CACHE[bn] = (key, _conv_ops.pack_conv_weight(weight, padding, stride, dilation, groups, x.shape))
    return _conv_ops.conv_prepacked(x, hit[1], bias, padding, stride, dilation, groups, layout, attr)


# the ReLU as functions and tensor methods, in place or not (``F.relu_`` is ``torch.relu_``)
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_)
# those that write the ReLU into their input
IN_PLACE_RELUS = (torch.relu_, torch.Tensor.relu_)


def epilogue_activation(activation: Any) -> str:
    """``"relu"`` when ``activation(h)`` is ``torch.relu(h)`` (``nn.ReLU`` itself without hooks or a
    ``forward`` of the instance's own, ``F.relu``, ``torch.relu``, their in-place and tensor-method
    spellings: on a fresh output the in-place ones compute the same; the conv can apply it in its
    epilogue), else ``""`` (it is called)."""
    if activation in _RELU_FUNCTIONS:
        return "relu"
    if type(activation) is nn.ReLU and not plain_reason(activation, nn.ReLU):
        return "relu"  # (``inplace`` or not: it acts on the fresh conv output either way)
    return ""


_AS_ACTIVATION = object()  # (_folded_call: the folded output gets ``activation``)


def _activated(out: Any, activation: Any) -> Any:
    return out if activation is None else activation(out)


def _folded_call(kernel: str, layer: nn.Module, bn: nn.Module, x: torch.Tensor, reason: str, run,
                 prepacked=None, activation: Any = None, after_fold: Any = _AS_ACTIVATION) -> Any:
    """``activation(bn(layer(x)))`` (``bn(layer(x))`` when ``activation`` is None), or with no
    ``reason`` against it ``run(x, weight, bias)`` with the batch norm folded into the layer's
    weights (fp64; kept between calls under ``freeze``, else folded where that pays), then the activation;
    ``prepacked(layer, bn, x, tensors, weight, bias, fold_key, attr)``, when given, the fold cached
    and its result not None, computes the same on a packed weight, with a ReLU activation applied
    inside when ``attr`` is ``"relu"``. ``after_fold``: what the folded layer's output gets instead of
    ``activation`` (a norm+act module's own submodules, then ``activation``), where the fold runs."""
    if not reason and is_proxy(x):
        # fx records the user's modules: the graph then follows gm.train()/gm.eval() as the original's
        # does (a fold recorded for the mode traced in stayed folded after gm.train())
        reason = "tracing: the graph records the original modules"
    if reason:
        record_fallback(kernel, reason)
        release_if_training(layer, bn)
        return _activated(bn(layer(x)), activation)
    tensors = (layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)
    if any(t is not None and (t.shape != (layer.weight.shape[0],) or t.dtype != layer.weight.dtype) for t in tensors[2:]):
        # (the original raises: BatchNorm's statistics of another width, or in another dtype)
        record_fallback(kernel, "BatchNorm of another width or dtype than the layer's output")
        return _activated(bn(layer(x)), activation)
    compiling = torch.compiler.is_compiling()
    keep = () if compiling else frozen_tensors((layer, bn), tensors)
    if not keep and not _fold_pays_per_call(layer.weight, x):  # (frozen when the cheap test ran, no longer)
        record_fallback(kernel, _NOT_PAID)
        return _activated(bn(layer(x)), activation)
    (weight, bias), fold_key = _fold_cached(bn, tensors, keep)
    # (while dynamo traces, the range guard's read of the input's magnitude cannot be traced: the
    # shipped COMPILE_POLICY runs the original layers there; one who lifts it accepts a fold whose
    # overflows may land elsewhere)
    out_bound = math.inf if compiling else fold_output_bound(x, _fold_range(bn, fold_key, tensors, bn.eps))
    if out_bound is None:
        record_fallback(kernel, _OUT_OF_RANGE)
        return _activated(bn(layer(x)), activation)
    record(kernel, "torch")
    if after_fold is not _AS_ACTIVATION:
        activation = after_fold
    relu = epilogue_activation(activation) if activation is not None else ""
    if fold_key is None:  # (an uncached fold: gradients, compiling, inference tensors; nothing to pack once)
        return _activated(run(x, weight, bias), activation)
    # the input and the fold are finite, and no value on the way can overflow (fold_output_bound): the
    # output is finite, and oneDNN's ReLU (0 for a NaN, where torch.relu keeps it) may run in the
    # conv's epilogue
    attr = relu if _conv_ops.EPILOGUE else ""
    out = prepacked(layer, bn, x, tensors, weight, bias, fold_key, attr or "none") if prepacked is not None else None
    if out is None:
        out = run(x, weight, bias)
    elif attr:
        activation = None  # (applied in the conv's epilogue)
    finite.mark(out, out_bound)
    result = _activated(out, activation)
    if relu and result is not out:
        finite.mark(result, out_bound)  # (the ReLU of finite values)
    return result


# BatchNorm -> (fold key, fold_range of it): read once per fold state kept under freeze
_FOLD_RANGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fold_range(owner: nn.Module, fold_key: tuple | None, tensors: tuple, eps: float) -> tuple[float, float]:
    """``ops.batch_norm_fold.fold_range`` of ``tensors``: kept with a fold kept under freeze
    (``fold_key``), else computed on this call (a read of the weight, as the fold is)."""
    if fold_key is None:
        return fold_range(*tensors, eps)
    hit = _FOLD_RANGE.get(owner)
    if hit is None or hit[0] != fold_key:
        hit = _FOLD_RANGE[owner] = (fold_key, fold_range(*tensors, eps))
    return hit[1]


def fold_output_bound(x: torch.Tensor, pq: tuple[float, float]) -> float | None:
    """A bound on every value of ``BN(layer(x))`` and of the folded layer (``fold_range``'s ``(P,
    Q)``) when ``x`` is finite and that bound stays far below the dtype's largest: the two then
    differ in rounding only, never in where an inf or a NaN lands; else None. Reads ``x`` once
    unless a kernel recorded its bound."""
    p, q = pq
    if not (x.is_floating_point() and math.isfinite(p) and math.isfinite(q)):
        return None
    limit = torch.finfo(x.dtype).max * finite.RANGE_SHARE
    recorded = finite.bound(x)
    bound = finite.magnitude(x) * p + q  # (NaN when x is not finite: the tests below fail)
    if not bound < limit and recorded is not None and math.isfinite(recorded):
        # the bound recorded with x was derived from the bounds before it (they compound through a
        # deep stack: ResNet-50's last blocks from config went out of range): x's own, read now
        bound = finite.read_magnitude(x) * p + q
    return bound if bound < limit else None


_OUT_OF_RANGE = ("values where the folded layer could overflow, or NaN/inf, which would land elsewhere than in "
                 "the original's (ops/batch_norm_fold.fold_range)")
_TRAINING = "BatchNorm in training mode (batch statistics)"
_NOT_PAID = ("weights not frozen (adopter.kernels.freeze): a fold on every call costs more than the BatchNorm it "
             "saves at this size")


def _fold_may_pay(layer: nn.Module, bn: nn.Module, x: Any) -> bool:
    """The cheap first test of a fold (a few attribute reads: at the small shapes where the fold
    does not pay, the guard must cost next to nothing): False when the BatchNorm trains, or when the
    weights are not frozen and a fold on this call would cost more than it saves (also for a
    non-tensor input: fx's proxies then record the original modules)."""
    if bn.training or is_parametrized(layer) or is_parametrized(bn):
        return False  # (a parametrized weight: the guard would compute it twice, see plain_reason)
    if not torch.compiler.is_compiling() and is_frozen(layer) and is_frozen(bn):
        # (not while dynamo traces: the lookup in frozen.py's weak dictionary made dynamo guard on
        # its keys; a compiled call folds per call where that pays, see _folded_call)
        return True
    return isinstance(x, torch.Tensor) and _fold_pays_per_call(layer.weight, x)


def _unpaid(kernel: str, layer: nn.Module, bn: nn.Module, x: Any, activation: Any = None) -> Any:
    """The original layers, when :func:`_fold_may_pay` says no."""
    if bn.training:
        record_fallback(kernel, _TRAINING)
        release_if_training(layer, bn)
    elif is_parametrized(layer) or is_parametrized(bn):
        record_fallback(kernel, "a parametrized weight (the guard would compute it again)")
        release(layer, bn)  # (no weight of theirs is a frozen tensor any more)
    else:
        record_fallback(kernel, _NOT_PAID)
    return _activated(bn(layer(x)), activation)


def _layout(x: Any) -> str:
    """``"channels_last"`` for a 4-d input in that memory format (the fold pays differently there:
    calibrated apart), else "". (Read by the cost model only, after the mode checks: never under
    vmap, where a layout cannot be queried.)"""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return ""
    return "channels_last" if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last) else ""


def conv_macs(conv: Any, x: Any) -> int | None:
    """About the multiply-adds of ``conv(x)`` (what the cost model sizes a conv+BN call by: the
    BatchNorm the fold saves is one pass over the output, the guard a constant, the conv the rest);
    None when not read off a plain Conv2d and a tensor."""
    # (the module's own parameter: a parametrized conv's ``weight`` would run its parametrization)
    weight = (getattr(conv, "__dict__", {}).get("_parameters") or {}).get("weight")
    stride = getattr(conv, "stride", None)
    if (not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 4
            or not isinstance(stride, tuple) or len(stride) != 2):
        return None
    out_channels, _, kh, kw = weight.shape
    return x.numel() * out_channels * kh * kw // max(1, conv.groups * stride[0] * stride[1])


def conv_bn(conv: nn.Module, bn: nn.Module, x: torch.Tensor, activation: Any = None) -> Any:
    """``bn(conv(x))``, or ``activation(bn(conv(x)))`` when the source applies one to it; an
    eval-mode BatchNorm with running statistics is folded into the conv's weights: one conv (on CPU
    in float32 without gradients, in oneDNN where that pays, on a weight packed once where that
    pays, a ReLU applied in the conv's epilogue: ``kernels/ops/conv_prepacked.py``).

    ``bn`` may be a norm+act module (a BatchNorm2d subclass whose forward applies its own
    submodules to its batch norm and nothing else, :func:`kernels.norm_act.norm_act_parts`, read
    from the class as it is at this call): the batch norm is folded, and its submodules are called
    on the folded conv's output as its forward calls them (a plain ReLU among them, alone, in the
    conv's epilogue)."""
    if not _fold_may_pay(conv, bn, x):
        return _unpaid("conv_bn", conv, bn, x, activation)
    after = norm_act_parts(bn) if type(bn) is not nn.BatchNorm2d else None
    reason = (hooks_reason() or policy_reason("conv_bn", x, size=lambda: conv_macs(conv, x), variant=lambda: _layout(x))
              or plain_reason(conv, nn.Conv2d, "_conv_forward")
              or (_fold_reason(bn, nn.BatchNorm2d) if after is None else _norm_act_reason(bn)))
    if not reason and not is_proxy(x) and (not isinstance(x, torch.Tensor) or x.dim() != 4):
        reason = "input is not a (batch, channels, height, width) tensor (BatchNorm2d raises on it)"
    folded = _NormActAfter.of(bn, after, activation) if not reason and after is not None else _AS_ACTIVATION
    return _folded_call("conv_bn", conv, bn, x, reason, conv._conv_forward, _conv_prepacked, activation, folded)


def _norm_act_reason(bn: nn.Module) -> str:
    """:func:`_fold_reason` for a norm+act module: its forward is its class's own (read by
    ``norm_act_parts``); the rest as for a BatchNorm2d."""
    if is_parametrized(bn):
        return f"this {type(bn).__name__} has a parametrized tensor"
    if "forward" in vars(bn):
        return f"this {type(bn).__name__} has its own forward"
    if has_hooks(bn):
        return f"{type(bn).__name__} has hooks"
    if bn.running_mean is None or bn.running_var is None:
        return "BatchNorm tracks no running statistics"
    if torch.is_autocast_enabled(bn.running_mean.device.type):
        return "autocast: the original runs the BatchNorm in float32 after a low-precision layer"
    return ""


class _NormActAfter:
    """What a norm+act module's forward applies after its batch norm (its submodules, in order),
    then the caller's own activation: called on the folded conv's output."""

    __slots__ = ("steps",)

    def __init__(self, steps: tuple) -> None:
        self.steps = steps

    @staticmethod
    def of(bn: nn.Module, names: tuple[str, ...], activation: Any) -> Any:
        steps = [getattr(bn, name) for name in names]
        # an nn.Identity (exactly, without hooks) returns its input: nothing to call
        steps = [s for s in steps if not (type(s) is nn.Identity and not has_hooks(s))]
        if activation is not None:
            steps.append(activation)
        if not steps:
            return None
        if len(steps) == 1:
            return steps[0]  # (a plain ReLU alone runs in the conv's epilogue: epilogue_activation)
        return _NormActAfter(tuple(steps))

    def __call__(self, out: Any) -> Any:
        for step in self.steps:
            out = step(out)
        return out


def linear_bn(linear: nn.Module, bn: nn.Module, x: torch.Tensor) -> Any:
    """``bn(linear(x))`` for ``(batch, features)`` input; an eval-mode BatchNorm1d with running
    statistics is folded into the Linear: one matmul."""
    if not _fold_may_pay(linear, bn, x):
        return _unpaid("linear_bn", linear, bn, x)
    reason = hooks_reason() or policy_reason("linear_bn", x) or plain_reason(linear, nn.Linear) or _fold_reason(bn, nn.BatchNorm1d)
    if not reason and (is_proxy(x) or x.dim() != 2):  # (fx: the rank is unknown while tracing)
        reason = f"input of rank {x.dim()} (folding needs (batch, features))"
    return _folded_call("linear_bn", linear, bn, x, reason, F.linear)
