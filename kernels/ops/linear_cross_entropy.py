"""Fused linear + cross-entropy: the summed token losses of ``cross_entropy(h @ W.T + b, y)`` without
the ``(tokens x vocab)`` logits.

Tokens are processed in chunks. For each chunk the forward computes the chunk's logits, their
fp32 log-softmax, the chunk's loss and *already the gradients* of the summed loss with respect to
the chunk's hidden states and (accumulated over chunks, in fp32) the head's weight and bias; the
chunk's logits are then dropped. Only those gradients are kept for the backward, which scales them
by the incoming gradient. Chunking under plain autograd would save nothing (every chunk's logits
would stay alive until the backward); recomputing them in the backward would cost a third matmul.
Here the work is the same as eager's (one forward matmul, two gradient matmuls), and the peak
memory is one chunk of logits plus the gradients eager produces anyway.

Ignored tokens (``label == ignore_index``) have zero loss and zero gradient, as in
``F.cross_entropy``: they are left out of the matmuls altogether.

The per-chunk softmax/gradient step runs as one triton kernel on CUDA (``triton_linear_cross_entropy``),
with torch otherwise; the matmuls are torch's in both cases.
"""
from __future__ import annotations

import torch

from ..backend import select_backend, triton_dtype_ok

# Logits bytes one chunk may hold (fp32). 2048 tokens x 32000 vocab = 262 MB unchunked; a 32 MB chunk
# (256 tokens of a 32k vocabulary) measured as fast as larger ones on CPU (see the rule's doc).
CHUNK_BYTES = 32 * 2**20
MIN_CHUNK_ROWS = 16


def chunk_rows(n_rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as fit ``chunk_bytes`` of fp32 logits (at least ``MIN_CHUNK_ROWS``)."""
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, chunk_bytes // (4 * max(vocab, 1)))))


def _softmax_grad_torch(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a chunk of logits (rows, vocab) and labels (rows,) (all valid): the row losses
    ``logsumexp(z) - z[label]`` (fp32) and ``softmax(z) - onehot(label)`` (the gradient of their sum
    wrt ``z``), in fp32. ``logits`` may be overwritten."""
    z = logits.float() if logits.dtype != torch.float32 else logits
    target = z.gather(1, labels[:, None]).squeeze(1)
    row_max = z.amax(dim=1, keepdim=True)
    p = z.sub_(row_max).exp_()  # in place: no second (rows, vocab) buffer
    total = p.sum(dim=1, keepdim=True)
    loss = row_max.squeeze(1) + total.squeeze(1).log() - target
    p.div_(total)
    p.scatter_add_(1, labels[:, None], torch.full_like(target[:, None], -1.0))
    return loss, p


def softmax_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row losses (fp32) and the gradient of their sum wrt ``logits`` (in ``logits.dtype``, as
    eager's backward of ``logits.float()`` casts it); triton on CUDA, torch otherwise."""
    backend = select_backend(
        "linear_cross_entropy", (logits, labels),
        has_triton=lambda: triton_dtype_ok(logits) and logits.is_contiguous() and logits.dim() == 2,
    )
    if backend == "triton":
        from .triton_linear_cross_entropy import softmax_grad_

        return softmax_grad_(logits, labels)
    loss, grad = _softmax_grad_torch(logits, labels)
    return loss, grad.to(logits.dtype)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(h, weight)`` computes in: autocast's when it is on, else the inputs'."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def _loss_and_grads(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    chunk: int, dtype: torch.dtype, want_h: bool, want_w: bool, want_b: bool,
) -> tuple[torch.Tensor, int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
    """The chunked forward: ``(loss_sum (fp32), counted tokens, (grad_h, grad_w, grad_b))``, the
    gradients of ``loss_sum`` (None where not wanted), each in its input's dtype; the matmuls run
    in ``dtype`` (what ``F.linear`` would compute in). Ignored rows are left out of the matmuls
    (their gradient rows are zero), which makes the number of rows computed depend on the labels'
    values: eager code only, see :func:`_linear_cross_entropy_op` for compiled graphs."""
    with torch.autocast(h.device.type, enabled=False):
        valid = labels != ignore_index
        rows = valid.nonzero().squeeze(1)
        count = rows.numel()
        hv = h if count == h.shape[0] else h.index_select(0, rows)
        hv = hv.to(dtype)
        yv = labels if count == h.shape[0] else labels.index_select(0, rows)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_hv = torch.empty_like(hv) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=h.device) if want_b else None
        for start in range(0, count, chunk):
            h_c = hv[start:start + chunk]
            z = torch.addmm(b, h_c, w.t()) if b is not None else torch.mm(h_c, w.t())
            row_loss, g = softmax_grad(z, yv[start:start + chunk])
            del z
            loss += row_loss.sum()
            if want_h:
                torch.mm(g, w, out=grad_hv[start:start + chunk])
            if want_w:
                if dtype == torch.float32:
                    grad_w.addmm_(g.t(), h_c)
                else:  # low-precision matmul (as eager's), accumulated over chunks in fp32
                    grad_w += torch.mm(g.t(), h_c)
            if want_b:
                grad_b += g.sum(0, dtype=torch.float32)
        if want_h:
            if count == h.shape[0]:
                grad_h = grad_hv.to(h.dtype)
            else:
                grad_h = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
                grad_h.index_copy_(0, rows, grad_hv.to(h.dtype))
        else:
            grad_h = None
    return loss, count, (
        grad_h,
        grad_w.to(weight.dtype) if grad_w is not None else None,
        grad_b.to(bias.dtype) if grad_b is not None else None,
    )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``sum_i cross_entropy(h_i @ W.T + b, y_i)`` over tokens with ``y_i != ignore_index``
    (``h``: (tokens, hidden), ``y``: (tokens,)); returns ``(loss_sum, valid_count)``; the second
    output is not differentiable. The eager form (``torch.compile`` graphs call
    :func:`_linear_cross_entropy_op`, the same computation as one custom op)."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, ignore_index, chunk):
        wants = (h.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        loss, count, grads = _loss_and_grads(h, weight, bias, labels, ignore_index, chunk,
                                             _compute_dtype(h, weight), *wants)
        ctx.empty = count == 0
        ctx.grads = grads
        count_t = torch.tensor(count, device=h.device)
        ctx.mark_non_differentiable(count_t)
        return loss, count_t

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        grads = ctx.grads
        if ctx.empty:
            # no token counted: every gradient is zero (eager's mean of nothing is nan, its gradient 0)
            scaled = [torch.zeros_like(g) if g is not None else None for g in grads]
        else:
            scaled = [g * grad_loss.to(g.dtype) if g is not None else None for g in grads]
        return scaled[0], scaled[1], scaled[2], None, None, None


# ---------------------------------------------------------------- the same as one op, for torch.compile
#
# Under torch.compile the autograd Function above cannot be traced into one graph: which rows it
# computes depends on the labels' values (``nonzero``, a data-dependent shape, and a Python loop
# over their count). As a custom op with a fake (shape) function and an autograd formula it is one
# opaque node of the graph instead: its outputs' shapes follow from the inputs' alone (the loss,
# the count and the gradients, shaped like h, weight and bias), the chunk loop runs inside it
# exactly as in eager (same kernels, triton on CUDA included), and the compiled model keeps the
# memory saving (no logits tensor in the graph). Gradients not wanted come back as empty tensors
# (an op's outputs cannot be None).


@torch.library.custom_op("adopter::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    chunk: int, dtype: torch.dtype, want_h: bool, want_w: bool, want_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_sum, count, grad_h, grad_w, grad_b)`` of :func:`_loss_and_grads` (empty gradients
    where not wanted)."""
    loss, count, grads = _loss_and_grads(h, weight, bias, labels, ignore_index, chunk, dtype, want_h, want_w, want_b)
    grad_h, grad_w, grad_b = (g if g is not None else h.new_empty(0) for g in grads)
    return loss, torch.tensor(count, device=h.device), grad_h, grad_w, grad_b


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(h, weight, bias, labels, ignore_index, chunk, dtype, want_h, want_w, want_b):
    return (
        h.new_empty((), dtype=torch.float32),
        h.new_empty((), dtype=torch.int64),
        h.new_empty(h.shape) if want_h else h.new_empty(0),
        weight.new_empty(weight.shape) if want_w else h.new_empty(0),
        bias.new_empty(bias.shape) if want_b else h.new_empty(0),
    )


def _op_setup_context(ctx, inputs, output):
    _, count, grad_h, grad_w, grad_b = output
    ctx.save_for_backward(count, grad_h, grad_w, grad_b)
    ctx.wants = inputs[7:10]


def _op_backward(ctx, grad_loss, _grad_count, _grad_h, _grad_w, _grad_b):
    count, *grads = ctx.saved_tensors
    # no token counted: every gradient is zero (the mean of nothing is nan, its gradient 0); a
    # select on the count, not a branch on its value
    scale = torch.where(count > 0, grad_loss, torch.zeros_like(grad_loss))
    dh, dw, db = (g * scale.to(g.dtype) if want else None for g, want in zip(grads, ctx.wants))
    return dh, dw, db, None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _compiled_sum(h, weight, bias, labels, ignore_index, chunk):
    """:class:`LinearCrossEntropyFunction`'s outputs through the custom op (under torch.compile)."""
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and h.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    loss, count, *_ = _linear_cross_entropy_op(h, weight, bias, labels, ignore_index, chunk,
                                               _compute_dtype(h, weight), *wants)
    return loss, count


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of counted tokens)`` of ``cross_entropy(linear(h, weight, bias),
    labels, ignore_index=ignore_index, reduction="sum")``, logits computed and dropped chunk by chunk;
    ``h`` is (..., hidden) and ``labels`` has its leading shape. The loss is fp32."""
    h2 = h.reshape(-1, h.shape[-1])
    y = labels.reshape(-1)
    if y.shape[0] != h2.shape[0]:
        raise ValueError(f"{y.shape[0]} labels for {h2.shape[0]} hidden states")
    if torch.compiler.is_compiling():
        # the chunk from the vocabulary alone (more rows than there are is the same loop): a
        # number of tokens that varies (dynamic shapes) is not specialized on
        chunk = chunk or chunk_rows(2**62, weight.shape[0])
        return _compiled_sum(h2, weight, bias, y, int(ignore_index), int(chunk))
    chunk = chunk or chunk_rows(h2.shape[0], weight.shape[0])
    return LinearCrossEntropyFunction.apply(h2, weight, bias, y, int(ignore_index), int(chunk))
