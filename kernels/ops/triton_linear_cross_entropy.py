"""Triton kernel for the per-chunk step of the fused linear + cross-entropy: from a chunk of logits
and their labels, each row's loss and, written over the logits, the gradient of the summed loss.

One program per row, two passes over the vocabulary in blocks: an online max/sum (fp32) for the
log-sum-exp, then ``softmax(z) - onehot(label)`` stored in the logits' dtype. The matmuls around it
stay torch's (``ops/linear_cross_entropy.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# vocabulary elements one program handles per step (a power of two; a 32k vocabulary takes 8 steps)
BLOCK_SIZE = 4096


@triton.jit
def _softmax_grad_rows(Z, LABELS, LOSS, stride_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_row
    label = tl.load(LABELS + row)
    cols = tl.arange(0, BLOCK)
    # pass 1: running max and running sum of exp(z - max), in fp32
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    # a label outside the vocabulary reads nothing and gives a nan loss (eager raises)
    target = tl.load(z_row + label, mask=(label >= 0) & (label < n_cols), other=float("nan")).to(tl.float32)
    lse = m + tl.log(s)
    tl.store(LOSS + row, lse - target)
    # pass 2: softmax - onehot(label), over the logits
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        inside = offs < n_cols
        z = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - tl.where(offs == label, 1.0, 0.0)
        tl.store(z_row + offs, g.to(Z.dtype.element_ty), mask=inside)


def softmax_grad_(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row losses (fp32) of ``logits`` (rows, vocab; contiguous, overwritten) against ``labels``
    (rows,; every label in range), and ``logits`` itself now holding ``softmax - onehot``."""
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(BLOCK_SIZE, triton.next_power_of_2(n_cols))
        _softmax_grad_rows[(rows,)](logits, labels.contiguous(), loss, logits.stride(0), n_cols, BLOCK=block)
    return loss, logits
