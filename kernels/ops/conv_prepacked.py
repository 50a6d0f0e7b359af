"""Eval-mode CPU convolution on a oneDNN weight packed once (inductor's CPU weight-pack pass, eagerly).

aten's float32 CPU convolution (``F.conv2d``) hands oneDNN a plain ``(out, in, kh, kw)`` weight and
oneDNN reorders it into its blocked layout on *every* call; for the deep, narrow-spatial layers of a
CNN (ResNet-50's last stage at 7x7: a 9.4 MB 3x3 weight against a 0.1 MB activation) that reorder
costs more than the convolution. A BatchNorm folded into a conv in eval gives a weight that is a
constant until a parameter or buffer changes, so it can be packed once
(``torch.ops.mkldnn._reorder_convolution_weight``) and the conv run on the packed weight
(``torch.ops.mkldnn._convolution_pointwise``), as inductor does after freezing.

``_convolution_pointwise`` computes in channels-last (NHWC). The result keeps the layout aten's conv
gives, which user code relies on (``.view`` of a conv output needs it):

* channels-last input -> channels-last output, no copy: always the packed path;
* contiguous (NCHW) input -> the input is copied to NHWC and the output back to NCHW: two copies of
  the activations, which pay only where the weight is large next to them
  (:data:`NCHW_WEIGHT_OVER_ACTIVATIONS`, ``_1X1``; measured per ResNet-50 layer, 1 thread:
  ``benchmarks/bench_conv_bn_inference.py --layers``);
* contiguous input, a light weight, where oneDNN on the NCHW data itself beats aten
  (``"onednn_contiguous"``: a 1x1 stride-1 conv from batch :data:`NCHW_ONEDNN_MIN_BATCH_1X1` over at
  most :data:`NCHW_ONEDNN_MAX_HW_1X1` positions, any
  other conv when an activation is fused into it) -> ``_convolution_pointwise`` on the plain weight
  (oneDNN reorders that small weight per call, as aten's oneDNN conv does), NCHW out, no copies;
* any other layout (a strided view, or a shape for which both layouts coincide) -> aten.

Every route takes a pointwise activation oneDNN applies in the conv's epilogue (``attr``:
``"relu"``), saving the pass over the output a separate ``relu`` makes.

Only float32 CPU tensors of the plain ``torch.Tensor`` type, with oneDNN available and enabled, no
gradient to record, no autocast, no torch function/dispatch mode and not while torch.compile or
torch.export trace (they see aten's conv, which inductor packs itself); zero padding only.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# The packed NHWC path for an NCHW input when weight elements >= this x (input + output elements).
# Two costs are compared: aten runs a 1x1 stride-1 conv as a GEMM on the NCHW data itself (at one
# thread and batch < 16), with no copy, and every other conv in oneDNN with a per-call weight
# reorder plus its own activation reorders. Measured per ResNet-50 conv shape at 1 thread, batch 1
# and 8 (benchmarks/results/conv_bn_inference.json, "layers"): packed wins from a ratio of about 2
# for the latter and about 7 for the former, ties around 1 and 6.
NCHW_WEIGHT_OVER_ACTIVATIONS = 1.0
NCHW_WEIGHT_OVER_ACTIVATIONS_1X1 = 6.0
# A light 1x1 stride-1 conv of an NCHW input runs in oneDNN on the NCHW data (plain weight, no
# copies, bias and activation in its epilogue) from this batch size. aten runs it as a GEMM at one
# thread below batch 16 ("THNN is faster single-threaded"), then the fold's bias and the ReLU as
# separate passes. Measured over ResNet-50's 1x1 stride-1 shapes, 1 thread, aten's conv + bias +
# ReLU over oneDNN's with both in the epilogue, summed: batch 1 0.85, 2 0.97, 4 1.09, 8 1.13, 16
# 1.11 (from 16 aten runs oneDNN itself); without a ReLU 0.85, 0.94, 1.00, 1.07, 0.99
# (benchmarks/results/conv_bn_inference.json, "nchw_1x1_batches").
NCHW_ONEDNN_MIN_BATCH_1X1 = 4
# ... and only up to this spatial extent (H * W). Timed alone, oneDNN on NCHW data beats aten by
# more at 14x14 and 7x7 than at 28x28 and 56x56 (batch 8: 1.18 against 1.09 with a ReLU, 1.20
# against 0.99 without); in the model the larger extents lose outright: ResNet-50's NCHW forward at
# batch 8 ran 1.05x the original's speed with the limit lifted against 1.12x with it, and 85
# against 80 MiB peak (batch 4: 1.09 against 1.11; a second run, batch 8: 1.06 against 1.17)
# (benchmarks/results/conv_bn_inference.json: "nchw_1x1_batches" hw_at_most_196 / hw_above_196;
# "models" optimized_nchw_1x1_any_hw beside optimized).
NCHW_ONEDNN_MAX_HW_1X1 = 196
# False: every conv runs aten's (benchmarks measure the lever with it off, on the same model)
ENABLED = True
# False: an activation handed to the kernel runs after the conv, not in its epilogue (likewise)
EPILOGUE = True


def _mkldnn_usable() -> bool:
    return torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()


def prepack_layout(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding, stride: Sequence[int],
    dilation: Sequence[int], groups: int, padding_mode: str, *grad_tensors: torch.Tensor | None,
    attr: str = "none",
) -> str:
    """``"channels_last"`` or ``"contiguous"`` (the layout of ``x``, and of the result) when the
    convolution of ``x`` with ``weight`` should run packed, ``"onednn_contiguous"`` when it should
    run in oneDNN on the plain weight (NCHW), else ``""`` (run aten's conv). ``grad_tensors``: the
    tensors the weight was computed from (a gradient through any of them needs aten's
    differentiable conv). ``attr``: the activation to be fused (``"none"`` or ``"relu"``)."""
    if not ENABLED or torch.compiler.is_compiling():  # (first: dynamo sees the rest as graph breaks)
        return ""
    # cheapest first: most calls (NCHW, a light weight) are settled by the shape alone
    if type(x) is not torch.Tensor or x.dtype != torch.float32 or x.dim() != 4 or weight.dtype != torch.float32:
        return ""
    if x.is_contiguous(memory_format=torch.channels_last):
        if x.is_contiguous():  # both layouts at once (C == 1 or H * W == 1): aten decides
            return ""
        layout = "channels_last"
    elif x.is_contiguous() and weight.is_contiguous() and not isinstance(padding, str):
        # (a channels-last weight with an NCHW input: aten answers channels-last; left to aten)
        gemm = _gemm(weight, stride, dilation)
        if _weight_heavy(x, weight, padding, stride, dilation, gemm):
            layout = "contiguous"
        elif (x.shape[0] >= NCHW_ONEDNN_MIN_BATCH_1X1 and x.shape[2] * x.shape[3] <= NCHW_ONEDNN_MAX_HW_1X1
              if gemm else attr != "none"):
            layout = "onednn_contiguous"
        else:  # aten's own choice (its GEMM, or oneDNN) is as fast
            return ""
    else:  # a strided view
        return ""
    if x.device.type != "cpu" or x.layout != torch.strided or x.numel() == 0 or weight.dim() != 4:
        return ""
    if (bias is not None and bias.dtype != torch.float32) or padding_mode != "zeros" or isinstance(padding, str):
        return ""
    if not _mkldnn_usable() or torch.is_autocast_enabled("cpu"):
        return ""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return ""
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, *grad_tensors)
    ):
        return ""
    return layout


def _weight_heavy(x: torch.Tensor, weight: torch.Tensor, padding, stride, dilation, gemm: bool) -> bool:
    n, _, h, w = x.shape
    out_h = (h + 2 * padding[0] - dilation[0] * (weight.shape[2] - 1) - 1) // stride[0] + 1
    out_w = (w + 2 * padding[1] - dilation[1] * (weight.shape[3] - 1) - 1) // stride[1] + 1
    if out_h <= 0 or out_w <= 0:
        return False
    activations = x.numel() + n * weight.shape[0] * out_h * out_w
    ratio = NCHW_WEIGHT_OVER_ACTIVATIONS_1X1 if gemm else NCHW_WEIGHT_OVER_ACTIVATIONS
    return weight.numel() >= ratio * activations


def _gemm(weight: torch.Tensor, stride, dilation) -> bool:
    """A conv aten runs as a GEMM on NCHW data at one thread (1x1, stride 1, no dilation)."""
    return weight.shape[2] == weight.shape[3] == 1 and tuple(stride) == (1, 1) and tuple(dilation) == (1, 1)


def pack_conv_weight(weight: torch.Tensor, padding, stride, dilation, groups: int, input_size) -> torch.Tensor:
    """``weight`` reordered once into the oneDNN layout a channels-last conv of an input of
    ``input_size`` reads (an opaque ``torch._mkldnn`` tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_convolution_weight(
            weight.detach(), list(padding), list(stride), list(dilation), groups, list(input_size))


def conv_prepacked(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, padding, stride, dilation, groups: int,
    layout: str, attr: str = "none",
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` on ``packed`` (from
    :func:`pack_conv_weight`; for ``"onednn_contiguous"`` the plain weight itself), followed by
    ``attr`` (``"relu"``: ``torch.relu`` of it), returned in ``layout`` (see :func:`prepack_layout`)."""
    out = torch.ops.mkldnn._convolution_pointwise(
        x, packed, bias, list(padding), list(stride), list(dilation), groups, attr, [], "")
    if layout != "channels_last":
        return out.contiguous()  # ("onednn_contiguous" already is: no copy)
    return out.contiguous(memory_format=torch.channels_last)  # (already is: no copy)


__all__ = ["ENABLED", "EPILOGUE", "NCHW_ONEDNN_MAX_HW_1X1", "NCHW_ONEDNN_MIN_BATCH_1X1", "NCHW_WEIGHT_OVER_ACTIVATIONS", "NCHW_WEIGHT_OVER_ACTIVATIONS_1X1", "conv_prepacked", "pack_conv_weight", "prepack_layout"]
