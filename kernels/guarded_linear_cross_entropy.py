"""Guarded fused LM head + causal-LM loss: what the ``linear_cross_entropy`` rewrite calls.

The rewritten source::

    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

becomes one call that receives the user's head module, the hidden states, the loss function and
the loss call's arguments other than the logits, verbatim::

    logits, loss = linear_cross_entropy(self.lm_head, hidden_states, self.loss_function, labels=labels, ...)

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
  :func:`keep_logits`.

Then it returns ``(None, loss)``: **the logits are None** — the one observable difference, and the
reason for the opt-out. Otherwise it computes exactly what the source computed:
``(head(h), None if labels is None else loss_function(logits, ...))``. The loss is
``ForCausalLMLoss``'s: labels shifted by one position (padded with ``ignore_index``) unless
``shift_labels`` is given, fp32 log-softmax, ``sum / num_items_in_batch`` when that is given,
the mean over counted tokens otherwise.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .backend import last_backend
from .guarded import _context_reason, _fallback, _plain
from .ops.linear_cross_entropy import linear_cross_entropy_sum
from .telemetry import record

__all__ = ["KEEP_LOGITS_ENV", "keep_logits", "linear_cross_entropy"]

KERNEL = "linear_cross_entropy"
KEEP_LOGITS_ENV = "ADOPTER_KEEP_LOGITS"
_LOSS_MODULE = "transformers.loss.loss_utils"
# ForCausalLMLoss's parameters in the transformers versions whose semantics the kernel implements
_CAUSAL_LM_PARAMETERS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels",
                         "kwargs")


class _KeepLogits(threading.local):
    depth = 0


_KEEP = _KeepLogits()


@contextlib.contextmanager
def keep_logits():
    """Inside this block the rewritten sites compute the logits as the original code did (training
    code that reads ``outputs.logits``)."""
    _KEEP.depth += 1
    try:
        yield
    finally:
        _KEEP.depth -= 1


def _logits_wanted() -> bool:
    return _KEEP.depth > 0 or os.environ.get(KEEP_LOGITS_ENV, "").strip() not in ("", "0")


@functools.cache
def _signature_is_known(fn: Any) -> bool:
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return names == _CAUSAL_LM_PARAMETERS


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


def _bind(loss_function: Any, loss_args: tuple, loss_kwargs: dict) -> tuple[dict | None, str]:
    try:
        bound = inspect.signature(loss_function).bind(None, *loss_args, **loss_kwargs)
    except TypeError as exc:
        return None, f"loss call arguments do not bind: {exc}"
    args = dict(bound.arguments)
    extra = args.pop("kwargs", {})
    if extra:
        return None, f"loss keyword arguments the kernel does not implement: {', '.join(sorted(extra))}"
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


def _fused_reason(head: Any, hidden_states: Any) -> str:
    if _logits_wanted():
        return f"logits kept ({KEEP_LOGITS_ENV} or keep_logits())"
    if not torch.is_grad_enabled():
        return "grad disabled (evaluation: the logits are returned)"
    reason = _context_reason(hidden_states) or _plain(head, nn.Linear)
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
    if hidden_states.dtype != head.weight.dtype and not torch.is_autocast_enabled(hidden_states.device.type):
        return "hidden states and head weight differ in dtype (outside autocast)"
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
    n_items = args.get("num_items_in_batch")
    if n_items is not None and not (isinstance(n_items, (int, float, torch.Tensor)) and not isinstance(n_items, bool)):
        return None, "num_items_in_batch is not a number or tensor"
    return shift_labels.to(device=hidden_states.device, dtype=torch.int64), ""


def linear_cross_entropy(head: nn.Module, hidden_states: Any, loss_function: Any, *loss_args: Any,
                         **loss_kwargs: Any) -> tuple[Any, Any]:
    """``(logits, loss)`` of ``logits = head(hidden_states)`` and ``loss = None if labels is None else
    loss_function(logits, *loss_args, **loss_kwargs)`` (logits by keyword when ``loss_args`` is
    empty, as the source spelled it); ``labels`` is the loss call's second argument. Fused (see the
    module doc): ``(None, loss)`` without the logits ever existing."""
    labels = _labels_of(loss_args, loss_kwargs)
    if labels is None:
        _fallback(KERNEL, "no labels (inference: the logits are returned)")
        return _original(head, hidden_states, loss_function, labels, loss_args, loss_kwargs)
    bound = None
    reason = _fused_reason(head, hidden_states) or _causal_lm_loss_reason(loss_function)
    if not reason:
        bound, reason = _bind(loss_function, loss_args, loss_kwargs)
    if not reason:
        targets, reason = _loss_inputs(head, hidden_states, bound)
    if reason:
        _fallback(KERNEL, reason)
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
    record(KERNEL, last_backend())
    return None, loss
