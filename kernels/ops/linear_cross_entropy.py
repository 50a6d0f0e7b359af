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
``F.cross_entropy``: they are left out of the matmuls altogether. (Eager computes their log-softmax
all the same, so one nan or inf logit there makes its gradients nan: when a bound cannot rule that
out, the call runs :func:`_reference_loss_and_grads`, eager's computation, logits and all.)

A double backward (``create_graph=True``) differentiates the gradients: it computes them again
from the saved inputs with :func:`_reference_loss_and_grads`, whose ops autograd follows.

The per-chunk softmax/gradient step runs as one triton kernel on CUDA (``triton_linear_cross_entropy``),
with torch otherwise; the matmuls are torch's in both cases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import select_backend, triton_dtype_ok

# Logits bytes one chunk may hold (fp32). 2048 tokens x 32000 vocab = 262 MB unchunked; a 32 MB chunk
# (256 tokens of a 32k vocabulary) measured as fast as larger ones on CPU (see the rule's doc).
CHUNK_BYTES = 32 * 2**20
MIN_CHUNK_ROWS = 16


def chunk_rows(n_rows: int, vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk: as many as fit ``chunk_bytes`` of fp32 logits (at least ``MIN_CHUNK_ROWS``)."""
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, chunk_bytes // (4 * max(vocab, 1)))))


def _softmax_grad_torch(logits: torch.Tensor, labels: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """For a chunk of logits (rows, vocab) and labels (rows,) (all valid): the row losses
    ``logsumexp(z) - z[label]`` and ``softmax(z) - onehot(label)`` (the gradient of their sum
    wrt ``z``), in ``dtype`` (fp32; fp64 for float64 logits the source does not upcast). ``logits``
    may be overwritten."""
    z = logits.to(dtype) if logits.dtype != dtype else logits
    target = z.gather(1, labels[:, None]).squeeze(1)
    row_max = z.amax(dim=1, keepdim=True)
    p = z.sub_(row_max).exp_()  # in place: no second (rows, vocab) buffer
    total = p.sum(dim=1, keepdim=True)
    loss = row_max.squeeze(1) + total.squeeze(1).log() - target
    p.div_(total)
    p.scatter_add_(1, labels[:, None], torch.full_like(target[:, None], -1.0))
    return loss, p


def softmax_grad(logits: torch.Tensor, labels: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Row losses (in ``dtype``, the softmax's: fp32, or fp64) and the gradient of their sum wrt
    ``logits`` (in ``logits.dtype``, as eager's backward of ``logits.float()`` casts it); triton on
    CUDA (fp32 softmax), torch otherwise."""
    backend = select_backend(
        "linear_cross_entropy", (logits, labels),
        has_triton=lambda: (dtype == torch.float32 and triton_dtype_ok(logits) and logits.is_contiguous()
                            and logits.dim() == 2),
    )
    if backend == "triton":
        from .triton_linear_cross_entropy import softmax_grad_

        return softmax_grad_(logits, labels)
    loss, grad = _softmax_grad_torch(logits, labels, dtype)
    return loss, grad.to(logits.dtype)


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.dtype | None:
    """The dtype ``F.linear(h, weight, bias)`` computes in, or None where it refuses the mix (it
    takes one dtype): under autocast, autocast's dtype for each tensor it casts — every floating
    one but float64, which autocast leaves alone —, else the tensors' own."""
    device = h.device.type
    cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    dtype = None
    for t in (h, weight, bias):
        if t is None:
            continue
        d = cast if cast is not None and t.dtype != torch.float64 else t.dtype
        if dtype is not None and d != dtype:
            return None
        dtype = d
    return dtype


def _softmax_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    """The dtype of the source's log-softmax of logits computed in ``dtype``: float32 after a
    ``.float()`` (``upcast``: ForCausalLMLoss, a written ``.float()``), even of float64 logits;
    otherwise the logits', computed in float32 for half ones (autocast's policy for the cross
    entropy; without autocast eager computes it in float32 too and rounds its output)."""
    return torch.float32 if upcast else torch.promote_types(dtype, torch.float32)


def _ignored_logits_finite(h_ignored: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                           dtype: torch.dtype) -> bool:
    """Whether every logit of the ignored rows ``h_ignored`` is finite, by a bound that needs no
    matmul: ``|h_i . w_j + b_j| <= sum_k |h_ik| * max|w| + max|b|`` within half the largest
    ``dtype`` value (room for the matmul's rounding); ``w``/``b`` are cast to ``dtype`` already.
    A nan or inf anywhere in them fails it, and so does a float16 product that may overflow."""
    acc = torch.promote_types(dtype, torch.float32)
    if h_ignored.numel() == 0 or w.numel() == 0:
        bound = torch.zeros((), dtype=acc, device=w.device)
    else:
        low, high = torch.aminmax(w)  # max|w| without a weight-sized temporary
        bound = (torch.linalg.vector_norm(h_ignored.to(dtype), ord=1, dim=1, dtype=acc).amax()
                 * torch.maximum(low.abs(), high.abs()).to(acc))
    if b is not None and b.numel():
        low, high = torch.aminmax(b)
        bound = bound + torch.maximum(low.abs(), high.abs()).to(acc)
    return bool(bound <= torch.finfo(dtype).max / 2)


def _reference_loss_and_grads(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    dtype: torch.dtype, softmax_dtype: torch.dtype, want_h: bool, want_w: bool, want_b: bool,
) -> tuple[torch.Tensor, int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
    """:func:`_loss_and_grads`'s result as eager computes it, every row's logits materialized:
    ``F.linear`` in ``dtype``, the log-softmax in ``softmax_dtype``, the summed negative
    log-likelihood of the counted rows, and its gradients through the very backward kernels of
    eager's graph (``_log_softmax_backward_data`` over every row: a nan or inf logit in an ignored
    row gives that row nan gradients, as eager's does). Plain ops (the compiled custom op runs
    this where autograd records nothing); under grad mode autograd follows them, so the
    gradients returned are differentiable (double backward)."""
    hd = h.to(dtype)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    out = torch.log_softmax(F.linear(hd, w, b).to(softmax_dtype), dim=1)
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)[:, None]
    loss = -torch.where(valid, out.gather(1, target).squeeze(1), 0).sum()
    grad_out = torch.zeros_like(out).scatter_(1, target, -valid.to(out.dtype)[:, None])
    g = torch.ops.aten._log_softmax_backward_data(grad_out, out, 1, out.dtype).to(dtype)
    return loss, int(valid.sum()), (
        g.mm(w).to(h.dtype) if want_h else None,
        g.t().mm(hd).to(weight.dtype) if want_w else None,
        g.sum(0).to(bias.dtype) if want_b else None,
    )


def _loss_and_grads(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, ignore_index: int,
    chunk: int, dtype: torch.dtype, softmax_dtype: torch.dtype, want_h: bool, want_w: bool, want_b: bool,
) -> tuple[torch.Tensor, int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
    """The chunked forward: ``(loss_sum (in ``softmax_dtype``), counted tokens, (grad_h, grad_w,
    grad_b))``, the gradients of ``loss_sum`` (None where not wanted), each in its input's dtype;
    the matmuls run in ``dtype`` (what ``F.linear`` would compute in), the softmax in
    ``softmax_dtype``. Ignored rows are left out of the matmuls (their gradient rows are zero),
    which makes the number of rows computed depend on the labels' values: eager code only, see
    :func:`_linear_cross_entropy_op` for compiled graphs."""
    with torch.autocast(h.device.type, enabled=False):
        valid = labels != ignore_index
        rows = valid.nonzero().squeeze(1)
        count = rows.numel()
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        if count < h.shape[0] and not _ignored_logits_finite(h[~valid], w, b, dtype):
            return _reference_loss_and_grads(h, weight, bias, labels, ignore_index, dtype, softmax_dtype,
                                             want_h, want_w, want_b)
        hv = h if count == h.shape[0] else h.index_select(0, rows)
        hv = hv.to(dtype)
        yv = labels if count == h.shape[0] else labels.index_select(0, rows)
        loss = torch.zeros((), dtype=softmax_dtype, device=h.device)
        grad_hv = torch.empty_like(hv) if want_h else None
        acc = torch.promote_types(dtype, torch.float32)  # the accumulators: fp32, fp64 for a float64 head
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=h.device) if want_b else None
        for start in range(0, count, chunk):
            h_c = hv[start:start + chunk]
            z = torch.addmm(b, h_c, w.t()) if b is not None else torch.mm(h_c, w.t())
            row_loss, g = softmax_grad(z, yv[start:start + chunk], softmax_dtype)
            del z
            loss += row_loss.sum()
            if want_h:
                torch.mm(g, w, out=grad_hv[start:start + chunk])
            if want_w:
                if dtype == acc:
                    grad_w.addmm_(g.t(), h_c)
                else:  # low-precision matmul (as eager's), accumulated over chunks in fp32
                    grad_w += torch.mm(g.t(), h_c)
            if want_b:
                grad_b += g.sum(0, dtype=acc)
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
    (``h``: (tokens, hidden), ``y``: (tokens,)), the matmuls in ``dtype``, the softmax in
    ``softmax_dtype``; returns ``(loss_sum, valid_count)``; the second output is not
    differentiable. The eager form (``torch.compile`` graphs call :func:`_linear_cross_entropy_op`,
    the same computation as one custom op)."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype):
        wants = (h.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        loss, count, grads = _loss_and_grads(h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype,
                                             *wants)
        ctx.empty = count == 0
        ctx.grads = grads
        # for a double backward only, unpacked there alone (inputs, which eager's graph keeps as well)
        ctx.save_for_backward(h, weight, bias, labels)
        ctx.ignore_index, ctx.dtype, ctx.softmax_dtype = ignore_index, dtype, softmax_dtype
        count_t = torch.tensor(count, device=h.device)
        ctx.mark_non_differentiable(count_t)
        return loss, count_t

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        # no token counted: eager's gradient is zero (its mean of nothing is nan, the gradient of
        # the count's 1/0 never reaches a row), nan only where a logit was: scaling by 0 keeps that
        scale = torch.zeros_like(grad_loss) if ctx.empty else grad_loss
        if torch.is_grad_enabled():
            # create_graph (double backward): the gradients computed in the forward have no graph;
            # computed again from the saved inputs by eager's ops, they are functions of h, W and b
            h, weight, bias, labels = ctx.saved_tensors
            with torch.autocast(h.device.type, enabled=False):
                _, _, grads = _reference_loss_and_grads(h, weight, bias, labels, ctx.ignore_index, ctx.dtype,
                                                        ctx.softmax_dtype, *ctx.needs_input_grad[:3])
        else:
            grads = ctx.grads
        scaled = [g * scale.to(g.dtype) if g is not None else None for g in grads]
        return scaled[0], scaled[1], scaled[2], None, None, None, None, None


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
    chunk: int, dtype: torch.dtype, softmax_dtype: torch.dtype, want_h: bool, want_w: bool, want_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_sum, count, grad_h, grad_w, grad_b)`` of :func:`_loss_and_grads` (empty gradients
    where not wanted)."""
    loss, count, grads = _loss_and_grads(h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype,
                                         want_h, want_w, want_b)
    grad_h, grad_w, grad_b = (g if g is not None else h.new_empty(0) for g in grads)
    return loss, torch.tensor(count, device=h.device), grad_h, grad_w, grad_b


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype, want_h, want_w,
                               want_b):
    return (
        h.new_empty((), dtype=softmax_dtype),
        h.new_empty((), dtype=torch.int64),
        h.new_empty(h.shape) if want_h else h.new_empty(0),
        weight.new_empty(weight.shape) if want_w else h.new_empty(0),
        bias.new_empty(bias.shape) if want_b else h.new_empty(0),
    )


def _op_setup_context(ctx, inputs, output):
    _, count, grad_h, grad_w, grad_b = output
    ctx.save_for_backward(count, grad_h, grad_w, grad_b)
    ctx.wants = inputs[8:11]


def _op_backward(ctx, grad_loss, _grad_count, _grad_h, _grad_w, _grad_b):
    count, *grads = ctx.saved_tensors
    # no token counted: every gradient is zero (the mean of nothing is nan, its gradient 0); a
    # select on the count, not a branch on its value
    scale = torch.where(count > 0, grad_loss, torch.zeros_like(grad_loss))
    dh, dw, db = (g * scale.to(g.dtype) if want else None for g, want in zip(grads, ctx.wants))
    return dh, dw, db, None, None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _compiled_sum(h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype):
    """:class:`LinearCrossEntropyFunction`'s outputs through the custom op (under torch.compile)."""
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and h.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    loss, count, *_ = _linear_cross_entropy_op(h, weight, bias, labels, ignore_index, chunk, dtype, softmax_dtype,
                                               *wants)
    return loss, count


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk: int | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of counted tokens)`` of ``cross_entropy(linear(h, weight, bias),
    labels, ignore_index=ignore_index, reduction="sum")``, logits computed and dropped chunk by chunk;
    ``h`` is (..., hidden) and ``labels`` has its leading shape. ``upcast``: the cross entropy reads
    ``logits.float()`` (ForCausalLMLoss); else the logits themselves. The loss is fp32 (fp64 for a
    float64 head's logits, not upcast)."""
    h2 = h.reshape(-1, h.shape[-1])
    y = labels.reshape(-1)
    if y.shape[0] != h2.shape[0]:
        raise ValueError(f"{y.shape[0]} labels for {h2.shape[0]} hidden states")
    dtype = _compute_dtype(h2, weight, bias)
    if dtype is None:
        raise RuntimeError(f"F.linear takes one dtype: hidden states {h.dtype}, weight {weight.dtype}"
                           + (f", bias {bias.dtype}" if bias is not None else ""))
    softmax_dtype = _softmax_dtype(dtype, upcast)
    if torch.compiler.is_compiling():
        # the chunk from the vocabulary alone (more rows than there are is the same loop): a
        # number of tokens that varies (dynamic shapes) is not specialized on
        chunk = chunk or chunk_rows(2**62, weight.shape[0])
        return _compiled_sum(h2, weight, bias, y, int(ignore_index), int(chunk), dtype, softmax_dtype)
    chunk = chunk or chunk_rows(h2.shape[0], weight.shape[0])
    return LinearCrossEntropyFunction.apply(h2, weight, bias, y, int(ignore_index), int(chunk), dtype, softmax_dtype)
