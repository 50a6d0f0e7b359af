"""Guarded fused LM head + causal-LM loss: what the ``linear_cross_entropy`` rewrite calls.

The rewritten source::

    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

becomes one call that receives the user's head module, the hidden states, the loss function (read
only when the labels are not None, as the source read it: transformers' ``loss_function`` property
logs a warning per read for a model without a ``loss_type``) and the loss call's arguments other
than the logits, verbatim::

    logits, loss = linear_cross_entropy(self.lm_head, hidden_states,
                                        self.loss_function if labels is not None else None, labels=labels, ...)

It computes the loss chunk by chunk without ever materializing the ``(tokens x vocab)`` logits
(:mod:`adopter.kernels.ops.linear_cross_entropy`) when, at run time, all of this holds:

* the loss is needed for training: labels given, grad mode on, the head in training mode, and the
  hidden states or the head's parameters require grad;
* the head is a plain ``nn.Linear`` (its own ``forward``, no hooks, plain tensor parameters), not
  traced by fx, no global module hooks;
* the loss function is transformers' ``ForCausalLMLoss`` itself (checked by identity with
  ``transformers.loss.loss_utils.ForCausalLMLoss``; transformers is not imported here) with the
  parameters the kernel implements, called with only those: ``vocab_size`` equal to the head's
  ``out_features``, ``num_items_in_batch``, ``ignore_index``, ``shift_labels``;
* labels shape matches the hidden states (as ``logits.view(-1, vocab)`` needs);
* logits were not asked for: no ``ADOPTER_KEEP_LOGITS=1`` in the environment, not inside
  :func:`keep_logits` (a compiled model reads the variable when it is compiled, and recompiles
  when a ``keep_logits()`` block opens).

Then it returns ``(None, loss)``: **the logits are None** — the one observable difference, and the
reason for the opt-out. The first such call for a model (its head module) warns with
:class:`LogitsNotComputedWarning`, naming the rewritten site and the opt-out, so a training loop
that reads ``outputs.logits`` is not left with a bare ``AttributeError`` on None. Otherwise it computes exactly what the source computed:
``(head(h), None if labels is None else loss_function(logits, ...))``. The loss is
``ForCausalLMLoss``'s: labels shifted by one position (padded with ``ignore_index``) unless
``shift_labels`` is given, fp32 log-softmax, ``sum / num_items_in_batch`` when that is given,
the mean over counted tokens otherwise.

Under ``torch.compile`` the guard is traced like any Python (the checks of the loss function's
identity and signature are evaluated once per compilation, as constants), the chunked loss is one
custom op of the graph (:mod:`adopter.kernels.ops.linear_cross_entropy`) and the warning is issued
while the call is traced: no graph break.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import sys
import threading
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .backend import _constant_under_compile
from .guard_checks import context_reason, plain_reason, record_fallback
from .ops import finite
from .ops.linear_cross_entropy import _compute_dtype, chunk_rows, linear_cross_entropy_sum
from .policy import policy_reason
from .telemetry import calling_frame, record_backend, source_file

__all__ = ["KEEP_LOGITS_ENV", "LogitsNotComputedWarning", "keep_logits", "linear_cross_entropy",
           "lm_head_cross_entropy"]

KERNEL = "linear_cross_entropy"
KEEP_LOGITS_ENV = "ADOPTER_KEEP_LOGITS"
_LOSS_MODULE = "transformers.loss.loss_utils"
# ForCausalLMLoss's parameters in the transformers versions whose semantics the kernel implements:
# all positional-or-keyword but the last (**kwargs), with these defaults
_CAUSAL_LM_PARAMETERS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels",
                         "kwargs")
_CAUSAL_LM_DEFAULTS = {"num_items_in_batch": None, "ignore_index": -100, "shift_labels": None}


class LogitsNotComputedWarning(UserWarning):
    """A rewritten causal LM computed its training loss with the fused LM head + cross-entropy and
    returned ``logits=None`` (training with labels). Issued once per model; keep the logits with
    ``ADOPTER_KEEP_LOGITS=1`` or ``with adopter.kernels.keep_logits():``."""


class _KeepLogits(threading.local):
    depth = 0


_KEEP = _KeepLogits()
# keep_logits() blocks open in any thread: what compiled code reads instead of the thread-local
# depth (a module global's value is something torch.compile guards on, so entering a block
# recompiles with the logits kept; a block in another thread keeps them too, which is always correct)
_KEEP_ANY = 0
_KEEP_LOCK = threading.Lock()


@contextlib.contextmanager
def keep_logits():
    """Inside this block the rewritten sites compute the logits as the original code did (training
    code that reads ``outputs.logits``)."""
    global _KEEP_ANY
    _KEEP.depth += 1
    with _KEEP_LOCK:
        _KEEP_ANY += 1
    try:
        yield
    finally:
        _KEEP.depth -= 1
        with _KEEP_LOCK:
            _KEEP_ANY -= 1


def _env_keeps_logits() -> bool:
    return os.environ.get(KEEP_LOGITS_ENV, "").strip() not in ("", "0")


@_constant_under_compile
def _env_keeps_logits_at_compile() -> bool:
    """:func:`_env_keeps_logits` evaluated while torch.compile traces (dynamo cannot guard on the
    environment: a compiled model reads the variable when it is compiled)."""
    return _env_keeps_logits()


def _logits_wanted() -> bool:
    if torch.compiler.is_compiling():
        return _KEEP_ANY > 0 or _env_keeps_logits_at_compile()
    return _KEEP.depth > 0 or _env_keeps_logits()


@functools.cache
def _signature_is_known(fn: Any) -> bool:
    """Whether ``fn``'s signature is the one the kernel implements (names, kinds, defaults), so
    that :func:`_bind` binds a call as Python would."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if tuple(p.name for p in parameters) != _CAUSAL_LM_PARAMETERS:
        return False
    if parameters[-1].kind is not inspect.Parameter.VAR_KEYWORD or any(
            p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters[:-1]):
        return False
    for p in parameters[:-1]:
        default = _CAUSAL_LM_DEFAULTS.get(p.name, inspect.Parameter.empty)
        if not (p.default is default or (type(p.default) is type(default) and p.default == default)):
            return False
    return True


def _never_reads(fn: Any, name: str) -> bool:
    """Whether the code of ``fn`` never loads its parameter ``name`` (bytecode, not source: what runs)."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None or name not in code.co_varnames:
        return False
    return not any(i.opname.startswith("LOAD_") and i.argval == name for i in dis.get_instructions(code))


@_constant_under_compile
def _extra_keywords_ignored() -> bool:
    """Whether transformers' causal-LM loss drops keyword arguments it does not name (models pass
    theirs on: ``output_attentions=None`` under PEFT): ``ForCausalLMLoss`` hands ``**kwargs`` only to
    ``fixed_cross_entropy``, whose code never reads them. Checked on the installed version. (Marked
    constant outside the cache: torch.compile does not take the mark through an ``lru_cache`` wrapper.)"""
    return _extra_keywords_ignored_cached()


@functools.cache
def _extra_keywords_ignored_cached() -> bool:
    module = sys.modules.get(_LOSS_MODULE)
    outer = getattr(module, "ForCausalLMLoss", None)
    inner = getattr(module, "fixed_cross_entropy", None)
    if outer is None or inner is None or not _never_reads(inner, "kwargs"):
        return False
    import dis

    loads = [i.argval for i in dis.get_instructions(outer.__code__) if i.opname.startswith("LOAD_")]
    # kwargs is read once, to be passed on to fixed_cross_entropy (nothing else reads it)
    return loads.count("kwargs") == 1 and "fixed_cross_entropy" in loads


@_constant_under_compile  # a fact of the function object: evaluated once while torch.compile traces
def _causal_lm_loss_reason(loss_function: Any) -> str:
    """"" when ``loss_function`` is transformers' ``ForCausalLMLoss`` as the kernel implements it."""
    module = sys.modules.get(_LOSS_MODULE)
    reference = getattr(module, "ForCausalLMLoss", None) if module is not None else None
    if reference is None or loss_function is not reference:
        name = getattr(loss_function, "__qualname__", type(loss_function).__name__)
        return f"loss function {name} is not transformers' ForCausalLMLoss"
    if not _signature_is_known(loss_function):
        return "this transformers version's ForCausalLMLoss has parameters the kernel does not implement"
    return ""


def _bind(loss_args: tuple, loss_kwargs: dict) -> tuple[dict | None, str]:
    """The loss call's arguments by parameter name (what ``inspect.Signature.bind`` gives for the
    signature :func:`_signature_is_known` checked, the logits passed first), or why they do not
    bind. Written out, not ``inspect``: torch.compile traces it like any Python."""
    names = _CAUSAL_LM_PARAMETERS[1:-1]
    if len(loss_args) > len(names):
        return None, f"loss call arguments do not bind: {len(loss_args) + 1} positional arguments"
    args = dict(zip(names, loss_args))
    extra = []
    for name, value in loss_kwargs.items():
        if name in args or name == _CAUSAL_LM_PARAMETERS[0]:
            return None, f"loss call arguments do not bind: multiple values for argument {name!r}"
        if name in names:
            args[name] = value
        else:
            extra.append(name)
    if extra and not _extra_keywords_ignored():
        return None, f"loss keyword arguments the kernel does not implement: {', '.join(sorted(extra))}"
    for name in ("labels", "vocab_size"):
        if name not in args:
            return None, f"loss call arguments do not bind: missing a required argument: {name!r}"
    return args, ""


def _labels_of(loss_args: tuple, loss_kwargs: dict) -> Any:
    """The labels the source's ``if labels is not None`` tested: the loss call's second argument."""
    if loss_args:
        return loss_args[0]
    if "labels" not in loss_kwargs:
        raise TypeError("linear_cross_entropy: the loss call passes no labels")
    return loss_kwargs["labels"]


def _original(head: nn.Module, hidden_states: Any, loss_function: Any, labels: Any, loss_args: tuple,
              loss_kwargs: dict) -> tuple[Any, Any]:
    logits = head(hidden_states)
    if labels is None:
        return logits, None
    if loss_args:  # the source passed logits and labels positionally
        return logits, loss_function(logits, *loss_args, **loss_kwargs)
    return logits, loss_function(logits=logits, **loss_kwargs)


# ---------------------------------------------------------------- the range guard

# per weight tensor: (weak reference, version counter, (max row L2 norm, max |w|)) — a read of the
# head's weight once per optimizer step (its version changes), small next to the loss's matmuls
_WEIGHT_NORMS: dict[int, tuple[weakref.ReferenceType, int, tuple[float, float]]] = {}


def _row_norm_and_max(t: torch.Tensor) -> tuple[float, float]:
    """``(max over rows of the L2 norm, max |t|)`` of a (..., k) tensor: NaN or inf when an element
    is not finite."""
    if t.numel() == 0:
        return 0.0, 0.0
    t = t.detach()
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    norms = torch.linalg.vector_norm(t, 2, dim=-1, dtype=acc)
    if bool(norms.isnan().any()):  # (amax drops no NaN, but be explicit: a NaN fails every test)
        return math.nan, math.nan
    peak = float(t.abs().amax())
    return float(norms.amax()) * (1 + 2**-20), peak


def _weight_norms(w: torch.Tensor) -> tuple[float, float]:
    entry = _WEIGHT_NORMS.get(id(w))
    try:
        version = w._version
    except RuntimeError:  # an inference tensor: no version counter, read every time
        return _row_norm_and_max(w)
    if entry is not None and entry[0]() is w and entry[1] == version:
        return entry[2]
    found = _row_norm_and_max(w)
    if len(_WEIGHT_NORMS) >= 64:
        _WEIGHT_NORMS.clear()
    _WEIGHT_NORMS[id(w)] = (weakref.ref(w), version, found)
    return found


def _range_reason(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> str:
    """"" when bounds show that no value the fused loss computes — logits, the softmax's gradient
    rows times the weight (grad_h), the hidden states summed over the rows (grad_w, per chunk and in
    all), the bias gradient — can come near the largest value of its dtype (1/16 of it), so that the
    fused and the original computation differ in rounding only, never in where an inf or a NaN
    lands (a NaN or inf in ``h``, ``weight`` or ``bias`` fails too); otherwise why not. By
    Cauchy-Schwarz ``|h_i . w_j + b_j| <= max_i |h_i| * max_j |w_j| + max |b|``; each gradient row
    ``softmax - onehot`` has an L1 norm at most 2, each of its entries at most 1. Reads ``h`` once
    and the weight once per version. Not under torch.compile (no host read there: the compiled
    call is taken as it is)."""
    if torch.compiler.is_compiling():
        return ""
    dtype = _compute_dtype(h, weight, bias)
    if dtype is None:
        return ""  # (refused by _fused_reason already)
    chunk = chunk_rows(rows, weight.shape[0])
    limit = torch.finfo(dtype).max * finite.RANGE_SHARE

    def fits(h_row, h_max, w_row, w_max, b_max):
        checks = (
            (h_row * w_row + b_max, limit),                                    # the logits
            (2 * w_max, min(limit, torch.finfo(h.dtype).max * finite.RANGE_SHARE)),  # grad_h
            (min(rows, chunk) * h_max, limit),                                 # grad_w, one chunk's matmul
            (rows * h_max, torch.finfo(weight.dtype).max * finite.RANGE_SHARE),      # grad_w, summed
            (float(rows), torch.finfo(bias.dtype).max * finite.RANGE_SHARE if bias is not None else math.inf),
            # squares of the hidden states (fuzz case linear_cross_entropy|eager/grad/adamw_fused|s2318:
            # at |h| ~ sqrt(max) the original has NaN gradients the fused loss has not; not analysed)
            (h_max * h_max, limit),
        )
        return all(value <= bound for value, bound in checks)  # (False for NaN)

    # first a bound on each whole tensor's elements (one BLAS pass each, recorded per tensor version
    # by ops/finite: ample for float32/float64 heads), then, when that is too coarse, rows'
    h_all = finite.magnitude(h) if h.dtype in (torch.float32, torch.float64) else math.nan
    w_all = finite.magnitude(weight) if weight.dtype in (torch.float32, torch.float64) else math.nan
    b_all = (finite.magnitude(bias) if bias.dtype in (torch.float32, torch.float64) else math.nan) \
        if bias is not None else 0.0
    # (finite.magnitude bounds each element: a row's L2 norm is within sqrt(its length) of that)
    root_k = math.sqrt(h.shape[-1])
    if fits(h_all * root_k, h_all, w_all * root_k, w_all, b_all):
        return ""
    h_row, h_max = _row_norm_and_max(h)
    w_row, w_max = _weight_norms(weight)
    b_max = _row_norm_and_max(bias)[1] if bias is not None else 0.0
    if fits(h_row, h_max, w_row, w_max, b_max):
        return ""
    return ("values where the logits or their gradients could overflow, or NaN/inf, which would land elsewhere "
            "than in the original's")


def _logits_size(head: Any, hidden_states: Any) -> int | None:
    """tokens x vocabulary of the logits the head would compute (what the cost model sizes the
    fused loss by), None when that is not read off plain tensors."""
    # (read by the cost model only, after the mode checks: never under jit.trace or compile; from
    # the module's own parameters: reading ``head.weight`` of a parametrized head would run its
    # parametrization — spectral_norm's power iteration updates its state in training)
    weight = (getattr(head, "__dict__", {}).get("_parameters") or {}).get("weight")
    if (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() >= 1 and hidden_states.shape[-1]
            and isinstance(weight, torch.Tensor) and weight.dim() == 2):
        return hidden_states.numel() // hidden_states.shape[-1] * weight.shape[0]
    return None


def _fused_reason(head: Any, hidden_states: Any) -> str:
    if _logits_wanted():
        return f"logits kept ({KEEP_LOGITS_ENV} or keep_logits())"
    if not torch.is_grad_enabled():
        return "grad disabled (evaluation: the logits are returned)"
    reason = (context_reason(hidden_states)
              or policy_reason(KERNEL, hidden_states, size=lambda: _logits_size(head, hidden_states))
              or plain_reason(head, nn.Linear))
    if reason:
        return reason
    if not head.training:
        return "head in eval mode (the logits are returned)"
    params = [p for p in (head.weight, head.bias) if p is not None]
    if any(type(p) not in (torch.Tensor, nn.Parameter) for p in params):
        return "head parameters are not plain tensors"
    if not isinstance(hidden_states, torch.Tensor) or type(hidden_states) is not torch.Tensor:
        return "hidden states are not a plain tensor"
    if not (hidden_states.requires_grad or any(p.requires_grad for p in params)):
        return "nothing requires grad"
    if not hidden_states.is_floating_point() or hidden_states.shape[-1:] != (head.in_features,):
        return "hidden states do not fit the head"
    if _compute_dtype(hidden_states, head.weight, head.bias) is None:
        # (autocast casts no float64: a float64 head takes float64 hidden states under it too)
        return "F.linear would refuse these dtypes: hidden states, head weight and bias differ (after autocast)"
    if any(p.device != hidden_states.device for p in params):
        return "head parameters and hidden states on different devices"
    return ""


def _loss_inputs(head: nn.Linear, hidden_states: torch.Tensor, args: dict) -> tuple[torch.Tensor | None, str]:
    """ForCausalLMLoss's token labels (``shift_labels``, or ``labels`` shifted by one), or why not."""
    vocab_size = args["vocab_size"]
    if type(vocab_size) is not int or vocab_size != head.out_features:
        return None, f"vocab_size {vocab_size!r} is not the head's out_features {head.out_features}"
    ignore_index = args.get("ignore_index", -100)
    if type(ignore_index) is not int:
        return None, "ignore_index is not an int"
    shift_labels = args.get("shift_labels")
    if shift_labels is None:
        labels = args["labels"]
        if not isinstance(labels, torch.Tensor):
            return None, "labels are not a tensor"
        # as ForCausalLMLoss: tokens < n predict n; the last position has no target
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    elif not isinstance(shift_labels, torch.Tensor) or not shift_labels.is_contiguous():
        return None, "shift_labels is not a contiguous tensor (ForCausalLMLoss views it)"
    if shift_labels.dtype != torch.int64:
        return None, "labels are not an int64 tensor"
    tokens = hidden_states.numel() // hidden_states.shape[-1]
    if shift_labels.numel() != tokens:
        return None, f"{shift_labels.numel()} labels for {tokens} hidden states"
    reason = _items_reason(args.get("num_items_in_batch"))
    if reason:
        return None, reason
    return shift_labels.to(device=hidden_states.device, dtype=torch.int64), ""


def _items_reason(n_items: Any) -> str:
    """"" when the loss may be divided by ``num_items_in_batch`` after the fused sum: None, or a
    count that is provably positive and finite. Divided by 0 (a batch whose labels are all ignored),
    inf or NaN, the loss's gradient reaches the logits as inf/NaN, and the original's log-softmax
    backward spreads it otherwise than the fused sum's gradients scaled in its backward: that runs
    as written. A python number is compared (no device work); a tensor's value is read — free on
    the CPU, one device-to-host sync per call on an accelerator (transformers' Trainer passes a
    device tensor; the original path instead materializes the tokens x vocab logits). Under
    torch.compile a tensor's value cannot be read without a graph break: the original runs."""
    if n_items is None:
        return ""
    if isinstance(n_items, bool) or not isinstance(n_items, (int, float, torch.Tensor)):
        return "num_items_in_batch is not a number or tensor"
    if not isinstance(n_items, torch.Tensor):
        if 0 < n_items < math.inf:  # False for nan
            return ""
        return f"num_items_in_batch={n_items!r} is not positive and finite (the loss divides by it)"
    if torch.compiler.is_compiling():
        return "num_items_in_batch is a tensor under torch.compile (its value cannot be checked without a graph break)"
    if (n_items.is_complex() or n_items.dtype is torch.bool or n_items.numel() == 0
            or n_items.device.type == "meta"):
        return "num_items_in_batch is not a real, non-empty count tensor"
    try:
        positive = bool(((n_items > 0) & (n_items < math.inf)).all())
    except RuntimeError:  # e.g. a functorch-batched tensor: its value cannot be read here
        return "num_items_in_batch's value cannot be read here"
    return "" if positive else "num_items_in_batch is not positive and finite (the loss divides by it)"


def linear_cross_entropy(head: nn.Module, hidden_states: Any, loss_function: Any, *loss_args: Any,
                         **loss_kwargs: Any) -> tuple[Any, Any]:
    """``(logits, loss)`` of ``logits = head(hidden_states)`` and ``loss = None if labels is None else
    loss_function(logits, *loss_args, **loss_kwargs)`` (logits by keyword when ``loss_args`` is
    empty, as the source spelled it); ``labels`` is the loss call's second argument (``loss_function``
    is not called without them: the rewrite passes None then). Fused (see the
    module doc): ``(None, loss)`` without the logits ever existing."""
    labels = _labels_of(loss_args, loss_kwargs)
    if labels is None:
        record_fallback(KERNEL, "no labels (inference: the logits are returned)")
        return _original(head, hidden_states, loss_function, labels, loss_args, loss_kwargs)
    bound = None
    reason = _fused_reason(head, hidden_states) or _causal_lm_loss_reason(loss_function)
    if not reason:
        bound, reason = _bind(loss_args, loss_kwargs)
    if not reason:
        targets, reason = _loss_inputs(head, hidden_states, bound)
    if not reason:
        reason = _range_reason(hidden_states, head.weight, head.bias, hidden_states.numel() // hidden_states.shape[-1])
    if reason:
        record_fallback(KERNEL, reason)
        return _original(head, hidden_states, loss_function, labels, loss_args, loss_kwargs)
    loss_sum, count = linear_cross_entropy_sum(
        hidden_states, head.weight, head.bias, targets, ignore_index=bound.get("ignore_index", -100),
    )
    n_items = bound.get("num_items_in_batch")
    if n_items is None:
        loss = loss_sum / count  # reduction="mean" over counted tokens (nan when none, as eager)
    else:
        # fixed_cross_entropy: reduction="sum", then divided by the batch's item count
        if torch.is_tensor(n_items):
            n_items = n_items.to(loss_sum.device)
        loss = loss_sum / n_items
    record_backend(KERNEL)
    _warn_logits_not_computed(head)
    return None, loss


# ---------------------------------------------------------------- a written-out cross entropy (issue 24)
#
# ``logits = self.lm_head(x); loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ...)``
# and its spellings (see the rule's doc): the rewrite hands over the head, the hidden states, the cross
# entropy the source calls (``F.cross_entropy`` or an ``nn.CrossEntropyLoss`` instance) with its arguments
# other than the logits, verbatim, and how the source turned the logits into the loss's 2-D input
# (``rows``: the subscript of a shift such as ``logits[..., :-1, :]``; ``contiguous``; ``flatten``: "view",
# "reshape" or the ``(start, end)`` of ``.flatten``; ``vocab``: the last size of the view when the source
# wrote one, e.g. ``self.config.vocab_size``; ``upcast``: ``.float()``).

# F.cross_entropy's parameters after ``input``, in order (checked against the installed torch once)
_CE_PARAMETERS = ("target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                "label_smoothing": 0.0}


@_constant_under_compile
def _cross_entropy_signature_known() -> bool:
    """Whether ``torch.nn.functional.cross_entropy`` has the parameters (names, order, defaults)
    :func:`_bind_cross_entropy` binds by. (Marked constant outside the cache: torch.compile does not
    take the mark through an ``lru_cache`` wrapper and would trace ``inspect.signature``.)"""
    return _cross_entropy_signature_known_cached()


@functools.cache
def _cross_entropy_signature_known_cached() -> bool:
    try:
        parameters = list(inspect.signature(F.cross_entropy).parameters.values())
    except (TypeError, ValueError):
        return False
    if tuple(p.name for p in parameters) != ("input",) + _CE_PARAMETERS:
        return False
    return all(p.default == _CE_DEFAULTS[p.name] for p in parameters[2:])


def _bind_cross_entropy(loss_fn: Any, loss_args: tuple, loss_kwargs: dict) -> tuple[dict | None, str]:
    """``{target, weight, size_average, reduce, ignore_index, reduction, label_smoothing}`` of the
    cross entropy the source called — ``F.cross_entropy(input, *loss_args, **loss_kwargs)`` or
    ``loss_fn(input, *loss_args, **loss_kwargs)`` for a plain ``nn.CrossEntropyLoss`` — or why not."""
    if loss_fn is F.cross_entropy:
        if not _cross_entropy_signature_known():
            return None, "this torch's F.cross_entropy has parameters the kernel does not implement"
        if len(loss_args) > len(_CE_PARAMETERS):
            return None, "cross entropy arguments do not bind: too many positional arguments"
        args = dict(zip(_CE_PARAMETERS, loss_args))
        for name, value in loss_kwargs.items():
            if name in args or name not in _CE_PARAMETERS:
                return None, f"cross entropy arguments do not bind: {name!r}"
            args[name] = value
        if "target" not in args:
            return None, "cross entropy arguments do not bind: no target"
        return {**_CE_DEFAULTS, **args}, ""
    if type(loss_fn) is nn.CrossEntropyLoss:
        reason = plain_reason(loss_fn, nn.CrossEntropyLoss)
        if reason:
            return None, reason
        if len(loss_args) + len(loss_kwargs) != 1 or (loss_kwargs and "target" not in loss_kwargs):
            return None, "nn.CrossEntropyLoss called with other arguments than (input, target)"
        target = loss_args[0] if loss_args else loss_kwargs["target"]
        return {**_CE_DEFAULTS, "target": target, "weight": loss_fn.weight, "ignore_index": loss_fn.ignore_index,
                "reduction": loss_fn.reduction, "label_smoothing": loss_fn.label_smoothing}, ""
    if torch.compiler.is_compiling():
        # e.g. an nn.CrossEntropyLoss built inside the compiled code: dynamo hands it over as a
        # lambda whose arguments cannot be read (and asking for its name would break the graph)
        return None, "loss is not torch's cross entropy as torch.compile shows it (a loss built in the compiled code)"
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    return None, f"loss {name} is not torch's cross entropy (F.cross_entropy or a plain nn.CrossEntropyLoss)"


def _cross_entropy_reason(args: dict) -> str:
    """"" when the bound cross entropy is one the fused sum implements."""
    if args["weight"] is not None:
        return "class weights (weight=) are not implemented by the fused loss"
    if args["size_average"] is not None or args["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} (the fused loss reduces: mean or sum)"
    smoothing = args["label_smoothing"]
    if type(smoothing) not in (int, float) or smoothing != 0:
        return "label_smoothing is not implemented by the fused loss"
    if type(args["ignore_index"]) is not int:
        return "ignore_index is not an int"
    return ""


def _keeps_last_dim(rows: Any, ndim: int) -> bool:
    """Whether ``t[rows]`` (a tuple of slices and at most one Ellipsis) leaves the last of ``ndim``
    dimensions whole, so that ``linear(h)[rows] == linear(h[rows])``."""
    if type(rows) is not tuple or not all(r is Ellipsis or type(r) is slice for r in rows):
        return False
    dots = [i for i, r in enumerate(rows) if r is Ellipsis]
    if len(dots) > 1 or len(rows) - len(dots) > ndim:
        return False
    if dots:
        last = rows[-1] if dots[0] < len(rows) - 1 else None
    else:
        last = rows[-1] if len(rows) == ndim else None
    return last is None or (last.start is None and last.stop is None and last.step is None)


def _layout_reason(head: nn.Linear, hidden_states: torch.Tensor, rows: Any, contiguous: bool, flatten: Any,
                   vocab: Any) -> str:
    """"" when the source's ``logits[rows]...flatten`` is ``(tokens, vocab)`` of ``hidden_states[rows]``
    in row order (what the fused sum computes), and the source's own code would not raise."""
    ndim = hidden_states.dim()
    if _classes_first(flatten):
        if rows is not None or contiguous or vocab is not None:
            return "the classes are moved to dim 1 of laid-out logits"
        if ndim != 3:
            return f"{flatten[0]} of {ndim}-d logits: not the classes of (batch, tokens, vocab) logits at dim 1"
        return ""
    if rows is not None:
        if not _keeps_last_dim(rows, ndim):
            return "the logits' subscript is not rows (slices leaving the vocabulary dimension whole)"
        if flatten == "view" and not contiguous:
            return "view of sliced logits (the source's view may fail: it runs as written)"
    if flatten in ("view", "reshape"):
        if vocab is not None and (type(vocab) is not int or vocab != head.out_features):
            return f"the logits are viewed with {vocab!r} columns, not the head's out_features {head.out_features}"
        return ""
    if type(flatten) is tuple and len(flatten) == 2 and all(type(d) is int for d in flatten) and ndim >= 2:
        if flatten[0] % ndim == 0 and flatten[1] % ndim == ndim - 2:
            return ""
        return f"flatten{flatten} of {ndim}-d logits is not (tokens, vocab)"
    return f"unknown logits layout {flatten!r}"


def _classes_first(flatten: Any) -> bool:
    """The layout moves the classes of (batch, tokens, vocab) logits to dim 1 (``("transpose", 1, 2)``,
    ``("permute", 0, 2, 1)``, ``("rearrange", "b n c -> b c n")``): torch's cross entropy over dim 1
    with a (batch, tokens) target, which is the per-token cross entropy of the (tokens, vocab) rows."""
    return type(flatten) is tuple and len(flatten) >= 2 and flatten[0] in ("transpose", "permute", "rearrange")


def _move_classes(z: Any, flatten: tuple) -> Any:
    """The source's own op of a :func:`_classes_first` layout."""
    kind, *args = flatten
    if kind == "transpose":
        return z.transpose(*args)
    if kind == "permute":
        return z.permute(*args)
    from einops import rearrange  # the source calls it: installed

    return rearrange(z, *args)


def _original_cross_entropy(head: nn.Module, hidden_states: Any, loss_fn: Any, loss_args: tuple, loss_kwargs: dict,
                            rows: Any, contiguous: bool, flatten: Any, vocab: Any, upcast: bool) -> tuple[Any, Any]:
    """The source's statements: the head, then the cross entropy of the logits as it laid them out."""
    logits = head(hidden_states)
    z = logits if rows is None else logits[rows]
    if contiguous:
        z = z.contiguous()
    if _classes_first(flatten):
        z = _move_classes(z, flatten)
    elif flatten == "view":
        z = z.view(-1, z.size(-1) if vocab is None else vocab)
    elif flatten == "reshape":
        z = z.reshape(-1, z.size(-1) if vocab is None else vocab)
    else:
        z = z.flatten(flatten[0], flatten[1])
    if upcast:
        z = z.float()
    return logits, loss_fn(z, *loss_args, **loss_kwargs)


def lm_head_cross_entropy(head: nn.Module, hidden_states: Any, loss_fn: Any, *loss_args: Any, rows: Any = None,
                          contiguous: bool = False, flatten: Any = "view", vocab: Any = None, upcast: bool = False,
                          **loss_kwargs: Any) -> tuple[Any, Any]:
    """``(logits, loss)`` of the source's ``logits = head(hidden_states)`` and ``loss = loss_fn(<the
    logits laid out as (tokens, vocab)>, *loss_args, **loss_kwargs)`` where ``loss_fn`` is
    ``F.cross_entropy`` or an ``nn.CrossEntropyLoss``; the layout keywords say how the source laid
    the logits out: ``logits[rows]``, ``.contiguous()``, ``.view(-1, vocab)`` / ``.reshape(-1, vocab)``
    (``flatten="view"`` / ``"reshape"``; ``vocab`` None: the logits' own last size) or
    ``.flatten(*flatten)``, ``.float()`` (``upcast``); or the classes of (batch, tokens, vocab) logits
    moved to dim 1 for a (batch, tokens) target, ``flatten`` saying how the source writes it
    (``("transpose", 1, 2)``, ``("permute", 0, 2, 1)``, ``("rearrange", "b n c -> b c n")``).

    Fused (the module doc's conditions: training, grad on, a plain ``nn.Linear`` head, logits not
    kept; and a cross entropy the chunked sum computes: an int64 target per token, ``ignore_index``,
    ``reduction`` mean or sum, no ``weight`` nor ``label_smoothing``): ``(None, loss)``, the logits never
    materialized, the loss in the dtype the source's cross entropy returns. Anything else runs the
    source's statements."""
    layout = (rows, contiguous, flatten, vocab, upcast)
    reason = _fused_reason(head, hidden_states)
    if not reason:
        bound, reason = _bind_cross_entropy(loss_fn, loss_args, loss_kwargs)
    if not reason:
        reason = _cross_entropy_reason(bound) or _layout_reason(head, hidden_states, rows, contiguous, flatten, vocab)
    if not reason:
        h = hidden_states if rows is None else hidden_states[rows]
        target = bound["target"]
        tokens = h.numel() // h.shape[-1]
        if not isinstance(target, torch.Tensor) or type(target) is not torch.Tensor:
            reason = "the target is not a plain tensor"
        elif target.dtype != torch.int64:
            reason = "the target is not an int64 (class index) tensor"
        elif _classes_first(flatten) and tuple(target.shape) != tuple(h.shape[:-1]):
            reason = f"target of shape {tuple(target.shape)} for logits of shape {(*h.shape[:-1], head.out_features)}"
        elif not _classes_first(flatten) and (target.dim() != 1 or target.shape[0] != tokens):
            reason = f"target of shape {tuple(target.shape)} for {tokens} logits rows"
        elif target.device != h.device:
            reason = "target and hidden states on different devices"
        else:
            reason = _range_reason(h, head.weight, head.bias, tokens)
    if reason:
        record_fallback(KERNEL, reason)
        return _original_cross_entropy(head, hidden_states, loss_fn, loss_args, loss_kwargs, *layout)
    loss_sum, count = linear_cross_entropy_sum(h, head.weight, head.bias, target, ignore_index=bound["ignore_index"],
                                               upcast=upcast)
    loss = loss_sum / count if bound["reduction"] == "mean" else loss_sum
    # the dtype the source's cross entropy returns: fp32 for .float() logits or under autocast (its
    # fp32 policy; float64 logits stay float64), otherwise the logits' (fp32 arithmetic here for
    # half logits, fp64 for float64 ones)
    if not upcast and not torch.is_autocast_enabled(h.device.type):
        dtype = _compute_dtype(h, head.weight, head.bias)
        if dtype != loss.dtype:
            loss = loss.to(dtype)
    record_backend(KERNEL)
    _warn_logits_not_computed(head)
    return None, loss


lm_head_cross_entropy.report_note = (
    "its calls in training return logits=None (the fused cross entropy never materializes them); code that "
    f"reads the logits in training needs {KEEP_LOGITS_ENV}=1 or `with adopter.kernels.keep_logits():`"
)


# what optimize's report says at each site rewritten to this kernel (adopter.optimizing.optimize.kernel_note)
linear_cross_entropy.report_note = (
    "its calls in training with labels return logits=None (the fused loss never materializes them); code "
    f"that reads outputs.logits needs {KEEP_LOGITS_ENV}=1 or `with adopter.kernels.keep_logits():`"
)


# ---------------------------------------------------------------- the logits=None warning

# heads (one per model) whose call already warned; and, for heads that cannot be weakly referenced, sites
_WARNED: weakref.WeakSet = weakref.WeakSet()
_WARNED_SITES: set = set()


def logits_not_computed_message(site: str = "") -> str:
    """What :class:`LogitsNotComputedWarning` says (``site``: where the call is, e.g.
    ``modeling_llama.py:468 (LlamaForCausalLM.forward)``)."""
    where = f" at {site}" if site else ""
    return (
        f"adopter: the rewritten LM head + loss{where} computed the training loss without the logits, so "
        "this model returns logits=None when training with labels (the tokens x vocab logits are never "
        "materialized; eval and calls without labels return them). Code that reads outputs.logits "
        f"(accuracy, distillation) needs them kept: set {KEEP_LOGITS_ENV}=1 or run the model inside "
        "`with adopter.kernels.keep_logits():`. Shown once per model."
    )


def _traced_site() -> tuple[str, int, str] | None:
    """``(code file, line, function)`` of the user frame torch.compile is tracing (the rewritten
    site) when this runs while dynamo traces; None otherwise."""
    guards = sys.modules.get("torch._guards")
    context = guards.TracingContext.try_get() if guards is not None else None
    if context is None:
        return None
    try:
        frames = list(guards.TracingContext.extract_stack())
    except Exception:  # noqa: BLE001  (a private API: without it the warning names no site)
        return "", 0, ""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for frame in reversed(frames):
        if not os.path.abspath(frame.filename).startswith(package):
            return frame.filename, frame.lineno or 0, frame.name
    return "", 0, ""


def _eager_site() -> tuple[str, int, str]:
    frame = calling_frame()
    if frame is None:
        return "", 0, ""
    code = frame.f_code
    return code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)


def _site_text(code_file: str, line: int, function: str) -> str:
    """``file:line (function)`` in the user's terms: a model rewritten in memory (``optimize``)
    runs code whose lines are the rewritten source's, so only its file is named."""
    if not code_file:
        return ""
    file = source_file(code_file)
    where = os.path.basename(file) if file != code_file else f"{os.path.basename(file)}:{line}"
    return f"{where} ({function})" if function else where


@_constant_under_compile  # runs (once) while torch.compile traces the call, not in the graph
def _warn_logits_not_computed(head: Any) -> None:
    """Warn (:class:`LogitsNotComputedWarning`) the first time the call through ``head`` drops the
    logits; the warning is attributed to the calling line (of the rewritten source, which an
    in-memory rewrite has in ``linecache``)."""
    try:
        if head in _WARNED:
            return
        _WARNED.add(head)
        per_site = False
    except TypeError:  # not weakly referenceable: once per site instead
        per_site = True
    code_file, line, function = _traced_site() or _eager_site()
    if per_site:
        if (code_file, function) in _WARNED_SITES:
            return
        _WARNED_SITES.add((code_file, function))
    message = logits_not_computed_message(_site_text(code_file, line, function))
    if code_file:
        warnings.warn_explicit(message, LogitsNotComputedWarning, code_file, line)
    else:
        warnings.warn(message, LogitsNotComputedWarning, stacklevel=3)
