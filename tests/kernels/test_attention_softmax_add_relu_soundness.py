"""``attention``, ``softmax``/``Softmax`` and ``add_relu`` compute what the code they replace computes.

* attention, against the written-out core of the rewritten classes (BertSelfAttention's
  ``softmax(q @ k^T / sqrt(d) + mask)``, dropout, ``@ v``; T5's fp32 softmax with a position bias),
  called as rewrites call it (``additive=True``) and as the public API: a NaN or fully ``-inf``-masked
  row stays NaN (SDPA gives 0), float64 stays float64 with weights or dropout, a bool mask adds 1.0,
  what the original rejects raises, dtypes/shapes/masks/causal/GQA, dropout under one seed (the same
  RNG draws), double backward, torch.jit.trace, torch.func and forward AD, CPU autocast;
* softmax, against ``F.softmax``: dtypes, ``dtype=``, CPU autocast, empty and size-1 dims, strides,
  non-finite values, out-of-range dims, double backward (the triton path too, under the interpreter in
  a fresh process);
* add_relu: a sum that overflowed is not recorded finite; vmap in eval mode.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from adopter.kernels import Softmax, add_relu, conv_bn, count_kernel_calls, freeze, softmax
from adopter.kernels.ops import finite
from adopter.kernels.ops.attention import attention
from torch import nn

NAN, INF = float("nan"), float("inf")
TOL = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-10},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}


def assert_same(got, want, dtype=None):
    """Same shape, dtype, NaN positions, and values within the dtype's rounding."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan()), "a NaN where the original has one, and only there"
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype or want.dtype])


# ---------------------------------------------------------------- attention: the originals


def bert_original(q, k, v, mask=None, p=0.0, training=False):
    """BertSelfAttention's core (transformers 4.x), as the rewrite replaces it; ``(out, weights)``."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    probs = F.softmax(scores, dim=-1)
    probs = F.dropout(probs, p, training)
    return torch.matmul(probs, v), probs


def bert_rewritten(q, k, v, mask=None, p=0.0, training=False, need_weights=False):
    """The call the rewrite emits for it."""
    return attention(q, k, v, mask=mask, dropout_p=(p if training else 0.0), scale=1.0 / math.sqrt(q.shape[-1]),
                     additive=True, need_weights=need_weights)


def t5_original(q, k, v, position_bias, p=0.0, training=False):
    scores = torch.matmul(q, k.transpose(3, 2))
    scores += position_bias
    weights = F.softmax(scores.float(), dim=-1).type_as(scores)
    weights = F.dropout(weights, p=p, training=training)
    return torch.matmul(weights, v)


def t5_rewritten(q, k, v, position_bias, p=0.0, training=False):
    """The call the rewrite emits for it (``scores.float()``: the softmax in float32)."""
    return attention(q, k, v, mask=position_bias, dropout_p=(p if training else 0.0), scale=1.0, additive=True,
                     softmax_dtype=torch.float32)


def _qkv(shape=(2, 3, 6, 8), dtype=torch.float32, kv_shape=None, grad=False, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(shape, dtype=dtype)
    k, v = (torch.randn(kv_shape or shape, dtype=dtype) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _padding(dtype=torch.float32, b=2, s=6, fill=None):
    """HF's extended additive padding mask (b, 1, 1, s): the last keys of batch 0 dropped."""
    m = torch.zeros(b, 1, 1, s, dtype=dtype)
    m[0, ..., -2:] = torch.finfo(dtype).min if fill is None else fill
    return m


# ---------------------------------------------------------------- 1. NaN and fully masked rows

NONFINITE = ["nan_q", "nan_k", "nan_v", "inf_q", "inf_v", "row_all_-inf", "some_-inf", "+inf_mask", "nan_mask",
             "row_all_-inf_inf_v", "sprinkled_inf"]


def _nonfinite(case, dtype):
    q, k, v = _qkv(dtype=dtype)
    mask = torch.zeros(2, 1, 6, 6, dtype=dtype)
    target = {"nan_q": (q, NAN), "nan_k": (k, NAN), "nan_v": (v, NAN), "inf_q": (q, INF), "inf_v": (v, INF)}
    if case in target:
        t, value = target[case]
        t[0, 1, 2, 3] = value
    elif case == "row_all_-inf":
        mask[0, 0, 1, :] = -INF
        mask[1, 0, 4, :] = -INF
    elif case == "some_-inf":
        mask[0, 0, 1, :3] = -INF
    elif case == "+inf_mask":
        mask[0, 0, 1, 2] = INF
    elif case == "nan_mask":
        mask[1, 0, 3, 0] = NAN
    elif case == "row_all_-inf_inf_v":  # (SDPA: 0 times the values, NaN where a value is infinite)
        mask[0, 0, 1, :] = -INF
        v[0, 2, 3, 5] = INF
    elif case == "sprinkled_inf":  # (a seventh of q, k and v infinite, either sign)
        gen = torch.Generator().manual_seed(3)
        for t in (q, k, v):
            flat = t.view(-1)
            pick = torch.randperm(flat.numel(), generator=gen)[: flat.numel() // 7]
            flat[pick] = INF * torch.randn(pick.numel(), generator=gen).sign().to(dtype)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("case", NONFINITE)
def test_nonfinite_rows_are_what_the_original_gives(case, dtype):
    q, k, v, mask = _nonfinite(case, dtype)
    want, want_w = bert_original(q, k, v, mask)
    assert want.isnan().any() or want.isinf().any() or case == "some_-inf"
    assert_same(bert_rewritten(q, k, v, mask), want)
    got, got_w = bert_rewritten(q, k, v, mask, need_weights=True)
    assert_same(got, want)
    assert_same(got_w, want_w)
    # the public API (an additive float mask): the same numbers
    assert_same(attention(q, k, v, mask=mask), want)


def test_fully_masked_rows_take_the_eager_ops_and_say_so():
    q, k, v, mask = _nonfinite("row_all_-inf", torch.float32)
    with count_kernel_calls() as counted:
        out = bert_rewritten(q, k, v, mask)
    [call] = [c for c in counted.calls if c.kernel == "attention"]
    assert call.backend == "original" and "row came out NaN or zero" in call.reason
    assert out[0, :, 1].isnan().all() and out[1, :, 4].isnan().all() and not out[0, :, 0].isnan().any()
    # a bool keep-mask of the public API (True keeps): a row with no key kept is NaN on both paths
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, 0, 1] = False
    fused, (eager, _) = attention(q, k, v, mask=keep), attention(q, k, v, mask=keep, need_weights=True)
    assert_same(fused, eager)
    assert fused[0, :, 1].isnan().all() and not fused[0, :, 0].isnan().any()


def test_a_zero_output_row_that_is_not_masked_is_still_right():
    # zero values: the scan sends the call to the eager ops, which give the same zeros
    q, k, v = _qkv()
    v = torch.zeros_like(v)
    assert torch.equal(bert_rewritten(q, k, v, _padding()), bert_original(q, k, v, _padding())[0])


# ---------------------------------------------------------------- 2. float64 stays float64


def test_float64_weights_and_dropout_are_computed_in_float64():
    q, k, v = _qkv(dtype=torch.float64)
    mask = _padding(torch.float64)
    want, want_w = bert_original(q, k, v, mask)
    got, got_w = bert_rewritten(q, k, v, mask, need_weights=True)
    assert got_w.dtype == torch.float64
    torch.testing.assert_close(got_w, want_w, atol=1e-14, rtol=1e-12)  # (a float32 softmax: ~1e-8)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    torch.manual_seed(5)
    got = bert_rewritten(q, k, v, mask, p=0.3, training=True)
    torch.manual_seed(5)
    want, _ = bert_original(q, k, v, mask, p=0.3, training=True)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(attention(q, k, v, mask=mask, need_weights=True)[1], want_w, atol=1e-14, rtol=1e-12)


# ---------------------------------------------------------------- 3. modes: jit.trace, torch.func, forward AD


def test_jit_trace_records_the_original_computation():
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(bert_rewritten, (q, k, v, _padding()), check_trace=False)
        traced_api = torch.jit.trace(lambda q, k, v: attention(q, k, v, is_causal=True), (q, k, v), check_trace=False)
    q2, k2, v2 = _qkv(seed=1)
    other = _padding(fill=-1e4)
    other[1, ..., 0] = -3.0
    assert_same(traced(q2, k2, v2, other), bert_original(q2, k2, v2, other)[0])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    want = F.softmax((q2 @ k2.transpose(-1, -2) / math.sqrt(8)).masked_fill(~causal, -INF), -1) @ v2
    assert_same(traced_api(q2, k2, v2), want)


@pytest.mark.parametrize("api", [False, True], ids=["rewrite", "api"])
def test_torch_func_transforms_and_forward_ad(api):
    q, k, v = _qkv(dtype=torch.float64)
    mask = _padding(torch.float64)

    def new(q, k, v):
        return attention(q, k, v, mask=mask) if api else bert_rewritten(q, k, v, mask)

    def old(q, k, v):
        return bert_original(q, k, v, mask)[0]

    def loss(f):
        return lambda q, k, v: f(q, k, v).pow(2).sum()

    for a, b in zip(torch.func.grad(loss(new), argnums=(0, 1, 2))(q, k, v),
                    torch.func.grad(loss(old), argnums=(0, 1, 2))(q, k, v)):
        assert_same(a, b)
    stacked = [torch.stack([t, t.flip(0)]) for t in (q, k, v)]  # vmap over a leading ensemble dim
    assert_same(torch.func.vmap(new)(*stacked), torch.func.vmap(old)(*stacked))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    for a, b in zip(torch.func.jvp(new, (q, k, v), tangents), torch.func.jvp(old, (q, k, v), tangents)):
        assert_same(a, b)
    with fwAD.dual_level():
        out = new(fwAD.make_dual(q, tangents[0]), k, v)
        got = fwAD.unpack_dual(out)
        want = fwAD.unpack_dual(old(fwAD.make_dual(q, tangents[0]), k, v))
        assert_same(got.primal, want.primal)
        assert_same(got.tangent, want.tangent)


# ---------------------------------------------------------------- 4. masks and arguments as the original takes them


def test_bool_mask_adds_one_as_the_original_does():
    q, k, v = _qkv()
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[0, ..., -2:] = False
    want, want_w = bert_original(q, k, v, keep)  # scores + keep: +1.0 where True, nothing dropped
    assert_same(bert_rewritten(q, k, v, keep), want)
    got, got_w = bert_rewritten(q, k, v, keep, need_weights=True)
    assert_same(got, want)
    assert_same(got_w, want_w)
    assert (want_w[0, ..., -2:] > 0).all()


def _argument_case(case):
    """(q, k, v, mask, p, training) the original computes something for, or rejects."""
    q, k, v = _qkv()
    mask, p, training = _padding(), 0.0, False
    if case == "mask longer than the keys":
        mask = torch.zeros(2, 1, 6, 9)
    elif case == "mask of rank 5":
        mask = torch.zeros(1, 2, 1, 1, 6)
    elif case == "mask (q, k)":
        mask = torch.randn(6, 6)
    elif case == "int64 mask":
        mask = torch.randint(0, 3, (2, 1, 1, 6))
    elif case == "float64 mask":
        mask = _padding(torch.float64)
    elif case == "0-dim float64 mask":
        mask = torch.tensor(-2.0, dtype=torch.float64)
    elif case == "python float mask":
        mask = -1.5
    elif case == "kv heads 2 of 4":
        q, k, v = _qkv((2, 4, 6, 8), kv_shape=(2, 2, 6, 8))
    elif case == "kv heads 1 of 3":
        q, k, v = _qkv((2, 3, 6, 8), kv_shape=(2, 1, 6, 8))
    elif case == "q heads 1 of 3":
        q, k, v = _qkv((2, 1, 6, 8), kv_shape=(2, 3, 6, 8))
    elif case == "kv batch 1 of 2":
        q, k, v = _qkv((2, 3, 6, 8), kv_shape=(1, 3, 6, 8))
    elif case == "rank 3 cross attention":
        q, k, v = _qkv((6, 5, 8), kv_shape=(6, 7, 8))
        mask = torch.zeros(6, 1, 7)
    elif case == "head dims differ":
        q, k, v = _qkv((2, 3, 6, 8), kv_shape=(2, 3, 6, 5))
    elif case == "value head dim 5":
        q, k, _ = _qkv()
        v = torch.randn(2, 3, 6, 5)
    elif case == "dropout 1.5":
        p, training = 1.5, True
    elif case == "dropout -0.1":
        p, training = -0.1, True
    elif case == "dropout 1.0":
        p, training = 1.0, True
    elif case == "dropout 1.5 in eval":
        p = 1.5  # (F.dropout checks p in eval mode too; the rewrite passes 0.0: see the report)
    else:
        raise AssertionError(case)
    return q, k, v, mask, p, training


ARGUMENT_CASES = ["mask longer than the keys", "mask of rank 5", "mask (q, k)", "int64 mask", "float64 mask",
                  "0-dim float64 mask", "python float mask", "kv heads 2 of 4", "kv heads 1 of 3",
                  "q heads 1 of 3", "kv batch 1 of 2", "rank 3 cross attention", "head dims differ",
                  "value head dim 5", "dropout 1.5", "dropout -0.1", "dropout 1.0"]


@pytest.mark.parametrize("need_weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("case", ARGUMENT_CASES)
def test_arguments_as_the_original_takes_them(case, need_weights):
    q, k, v, mask, p, training = _argument_case(case)
    torch.manual_seed(0)
    try:
        want = bert_original(q, k, v, mask, p, training)
    except (RuntimeError, ValueError) as error:
        with pytest.raises(type(error)):
            bert_rewritten(q, k, v, mask, p, training, need_weights=need_weights)
        return
    torch.manual_seed(0)
    got = bert_rewritten(q, k, v, mask, p, training, need_weights=need_weights)
    if need_weights:
        assert_same(got[0], want[0])
        assert_same(got[1], want[1])
    else:
        assert_same(got, want[0])


# ---------------------------------------------------------------- 5. dtypes, shapes, masks, causal, GQA


SHAPES = {
    "bert": ((2, 3, 6, 8), None),
    "all size 1": ((1, 1, 1, 1), None),
    "one query": ((2, 3, 1, 8), (2, 3, 5, 8)),
    "one key": ((2, 3, 5, 8), (2, 3, 1, 8)),
    "odd": ((3, 5, 7, 13), (3, 5, 11, 13)),
    "no keys": ((2, 3, 4, 8), (2, 3, 0, 8)),
    "no queries": ((2, 3, 0, 8), (2, 3, 4, 8)),
}
MASKS = ["none", "padding (b,1,1,k)", "square (b,1,q,k)", "per head (1,h,q,k)", "2-D (q,k)"]


def _mask(kind, q, k, dtype):
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    torch.manual_seed(7)
    shape = {"padding (b,1,1,k)": (b, 1, 1, lk), "square (b,1,q,k)": (b, 1, lq, lk),
             "per head (1,h,q,k)": (1, h, lq, lk), "2-D (q,k)": (lq, lk)}.get(kind)
    if shape is None:
        return None
    m = torch.randn(shape, dtype=dtype)
    return m.masked_fill(torch.rand(shape) < 0.3, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_dtypes_shapes_and_masks(shape, mask_kind, dtype):
    q_shape, kv_shape = SHAPES[shape]
    q, k, v = _qkv(q_shape, dtype, kv_shape, grad=dtype != torch.float16)
    mask = _mask(mask_kind, q, k, dtype)
    want, want_w = bert_original(q, k, v, mask)
    for need_weights in (False, True):
        got = bert_rewritten(q, k, v, mask, need_weights=need_weights)
        got, got_w = got if need_weights else (got, None)
        assert_same(got, want)
        if need_weights:
            assert_same(got_w, want_w)
        if q.requires_grad and want.numel():
            g = torch.randn_like(want)
            for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g, retain_graph=True)):
                assert_same(a, b, torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("with_mask", [False, True], ids=["causal", "causal+mask"])
def test_causal_fills_the_scores_on_every_path(with_mask):
    # an infinite score behind the diagonal: SDPA's causal kernels never see it, so the eager path
    # fills (masked_fill) rather than adds -inf (which would make inf - inf = NaN)
    q, k, v = _qkv((1, 2, 4, 8))
    k[0, 0, 3] = 0.0
    k[0, 0, 3, 0] = INF  # (key 3's scores: +-inf, masked for queries 0-2)
    q[0, 0, 0, 0] = 1.0
    mask = torch.zeros(1, 1, 4, 4) if with_mask else None
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8) + (0 if mask is None else mask)).masked_fill(~keep, -INF)
    want = F.softmax(scores, -1) @ v
    assert not want[0, 0, :3].isnan().any()
    assert_same(attention(q, k, v, mask=mask, is_causal=True), want)
    assert_same(attention(q, k, v, mask=mask, is_causal=True, need_weights=True)[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("q_len,k_len", [(5, 5), (3, 7), (1, 4)])
def test_causal_and_grouped_query_heads_of_the_api(q_len, k_len, dtype):
    q, _, _ = _qkv((2, 4, q_len, 8), dtype)
    _, k, v = _qkv((2, 2, k_len, 8), dtype, seed=1)
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2) / math.sqrt(8)).masked_fill(~keep, -INF)
    want = F.softmax(scores, -1) @ vv
    assert_same(attention(q, k, v, is_causal=True), want)
    assert_same(attention(q, k, v, is_causal=True, need_weights=True)[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_t5_position_bias_with_its_gradient(dtype):
    q, k, v = _qkv(dtype=dtype, grad=True)
    bias = torch.randn(1, 3, 6, 6, dtype=dtype, requires_grad=True)
    want = t5_original(q, k, v, bias)
    got = t5_rewritten(q, k, v, bias)
    # T5's source rounds its softmax to float32 (``scores.float()``), also for float64 scores; the
    # rewrite passes that on (``softmax_dtype``): float64 computes as the source does
    assert_same(got, want)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, bias), g), torch.autograd.grad(want, (q, k, v, bias), g)):
        assert_same(a, b, dtype)


def test_cpu_autocast_gives_the_original_dtypes():
    q, k, v = _qkv()
    mask = torch.zeros(2, 1, 6, 6)
    mask[0, ..., -2:] = mask[1, 0, 3] = torch.finfo(torch.float32).min  # (row 3 of batch 1: all masked)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_w = bert_original(q, k, v, mask)
        got = bert_rewritten(q, k, v, mask)
        got_w_out, got_w = bert_rewritten(q, k, v, mask, need_weights=True)
        api_out, api_w = attention(q, k, v, mask=mask, need_weights=True)  # (the mask promotes the scores)
        # q, k, v as a Linear under autocast makes them, with the float32 mask HF builds
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        want_b, _ = bert_original(qb, kb, vb, mask)
        got_b = bert_rewritten(qb, kb, vb, mask)
    assert_same(got, want, torch.bfloat16)
    assert_same(got_w_out, want, torch.bfloat16)
    assert_same(got_w, want_w, torch.bfloat16)
    assert_same(got_b, want_b, torch.bfloat16)
    assert not want.isnan().any()
    assert_same(api_out, want, torch.bfloat16)
    assert_same(api_w, want_w, torch.bfloat16)


# ---------------------------------------------------------------- 6. dropout under one seed


@pytest.mark.parametrize("need_weights", [False, True], ids=["out", "weights"])
def test_dropout_draws_what_the_original_draws(need_weights):
    q, k, v = _qkv()
    mask = _padding()
    torch.manual_seed(11)
    want, want_w = bert_original(q, k, v, mask, p=0.25, training=True)
    after_original = torch.get_rng_state()
    torch.manual_seed(11)
    got = bert_rewritten(q, k, v, mask, p=0.25, training=True, need_weights=need_weights)
    assert torch.equal(torch.get_rng_state(), after_original), "the same RNG draws"
    if need_weights:
        got, got_w = got
        assert torch.equal(got_w == 0, want_w == 0) and (want_w == 0).any()
        assert_same(got_w, want_w)
    assert_same(got, want)
    state = torch.get_rng_state()
    bert_rewritten(q, k, v, mask, p=0.25, training=False)  # eval: the source's dropout draws nothing
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- 7. double backward (and what makes it work)


@pytest.mark.parametrize("case", ["rewrite", "api bool mask", "api gqa causal", "t5 bias"])
def test_double_backward_as_the_original(case):
    q, k, v = _qkv(dtype=torch.float64, grad=True)
    inputs = [q, k, v]
    if case == "rewrite":
        mask = _padding(torch.float64)

        def new():
            return bert_rewritten(q, k, v, mask)

        def old():
            return bert_original(q, k, v, mask)[0]
    elif case == "api bool mask":
        keep = _padding(torch.float64) == 0

        def new():
            return attention(q, k, v, mask=keep)

        def old():
            return bert_original(q, k, v, torch.zeros(()).double().masked_fill(~keep, -INF))[0]
    elif case == "api gqa causal":
        k, v = (t[:, :1].detach().requires_grad_() for t in (k, v))
        inputs = [q, k, v]
        keep = torch.ones(6, 6, dtype=torch.bool).tril()

        def new():
            return attention(q, k, v, is_causal=True)

        def old():
            return bert_original(q, k.expand_as(q), v.expand_as(q), torch.zeros(6, 6).double().masked_fill(~keep, -INF))[0]
    else:
        bias = torch.randn(1, 3, 6, 6, dtype=torch.float64, requires_grad=True)
        inputs.append(bias)

        def new():
            return t5_rewritten(q, k, v, bias)

        def old():
            return t5_original(q, k, v, bias)

    def second(f):
        out = f()
        g = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        firsts = torch.autograd.grad(out, inputs, g, create_graph=True)
        return firsts, torch.autograd.grad(sum((t * t).sum() for t in firsts), inputs)

    for a, b in zip(sum(second(new), ()), sum(second(old), ())):
        assert_same(a, b)


def test_gradcheck_and_gradgradcheck():
    q, k, v = _qkv((1, 2, 3, 4), torch.float64, grad=True)
    mask = _padding(torch.float64, b=1, s=3, fill=-1e3).requires_grad_()
    assert torch.autograd.gradcheck(bert_rewritten, (q, k, v, mask))
    assert torch.autograd.gradgradcheck(bert_rewritten, (q, k, v, mask))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_and_a_retained_graph(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(dtype=torch.float64, grad=True)
    mask = _padding(torch.float64)
    g = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    want = torch.autograd.grad(bert_original(q, k, v, mask)[0], (q, k, v), g)
    out = checkpoint(bert_rewritten, q, k, v, mask, use_reentrant=use_reentrant)
    (out * g).sum().backward()
    for t, w in zip((q, k, v), want):
        assert_same(t.grad, w)
        t.grad = None
    out = bert_rewritten(q, k, v, mask)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), g)
    for a, b, w in zip(first, again, want):
        assert_same(a, w)
        assert_same(b, w)


def test_compiled_attention_runs_the_original_ops():
    q, k, v, mask = _nonfinite("row_all_-inf", torch.float32)
    compiled = torch.compile(bert_rewritten, backend="eager", fullgraph=True)
    try:
        assert_same(compiled(q, k, v, mask), bert_original(q, k, v, mask)[0])
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- softmax


def _softmax_input(case, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 7, dtype=torch.float32)
    if case == "nonfinite":
        x[0, 0, 2], x[0, 1] = NAN, -INF
        x[1, 0, 3], x[1, 1, :3] = INF, -INF
        x[2, 2, 1:3] = INF
    elif case == "non-contiguous":
        x = torch.randn(7, 4, 3).transpose(0, 2)
    elif case == "size-1 dim":
        x = torch.randn(3, 1, 7)
    elif case == "empty dim":
        x = torch.randn(3, 0, 7)
    return x.to(dtype)


SOFTMAX_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("dim", [-1, 0, 1, 2, -3])
@pytest.mark.parametrize("case", ["plain", "nonfinite", "non-contiguous", "size-1 dim", "empty dim"])
@pytest.mark.parametrize("dtype", SOFTMAX_DTYPES, ids=str)
def test_softmax_is_f_softmax(dtype, case, dim, out_dtype):
    x = _softmax_input(case, dtype)
    want = F.softmax(x, dim, dtype=out_dtype)
    got = softmax(x, dim, dtype=out_dtype)
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    if out_dtype is None:
        module = Softmax(dim)(x)
        torch.testing.assert_close(module, F.softmax(x, dim), equal_nan=True, rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = F.softmax(x, dim, dtype=out_dtype), softmax(x, dim, dtype=out_dtype)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [3, -4, 10])
def test_softmax_dim_out_of_range_raises_as_f_softmax(dim):
    x = torch.randn(3, 4, 7)
    with pytest.raises(IndexError):
        F.softmax(x, dim)
    with pytest.raises(IndexError):
        softmax(x, dim)
    with pytest.raises(IndexError):
        Softmax(dim)(x)


def test_softmax_implicit_dim_and_scalars_as_f_softmax():
    x = torch.randn(3, 4, 7)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        got = softmax(x, None)
    with pytest.warns(UserWarning, match="Implicit dimension"):
        torch.testing.assert_close(got, F.softmax(x, None), rtol=0, atol=0)
    s = torch.tensor(2.5)
    assert torch.equal(softmax(s, 0), F.softmax(s, 0)) and torch.equal(softmax(s, -1), F.softmax(s, -1))
    with pytest.raises(IndexError):
        softmax(s, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_softmax_double_backward_and_modes(dtype):
    x = torch.randn(3, 4, 7, dtype=dtype, requires_grad=True)
    g = torch.randn(3, 4, 7, dtype=dtype)

    def second(f):
        (first,) = torch.autograd.grad(f(x), x, g, create_graph=True)
        return first, torch.autograd.grad((first * first).sum(), x)[0]

    for a, b in zip(second(lambda t: softmax(t, 1)), second(lambda t: F.softmax(t, 1))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(second(Softmax(-1)), second(lambda t: F.softmax(t, -1))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(torch.func.vmap(lambda t: softmax(t, 0))(x), F.softmax(x, 1))
    assert torch.equal(torch.func.grad(lambda t: softmax(t, -1)[0, 0, 0])(x), torch.func.grad(lambda t: F.softmax(t, -1)[0, 0, 0])(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(Softmax(-1), (x.detach(),))
    y = torch.randn(3, 4, 7, dtype=dtype)
    assert torch.equal(traced(y), F.softmax(y, -1))


_TRITON_SOFTMAX_SCRIPT = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from adopter import kernels
    from adopter.kernels import telemetry
    NAN, INF = float("nan"), float("inf")
    torch.manual_seed(0)
    # double backward through the triton Function (forced backend, interpreter)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 17).to(dtype).requires_grad_()
        g = torch.randn(3, 5, 17).to(dtype)
        def second(f):
            (first,) = torch.autograd.grad(f(x), x, g, create_graph=True)
            return first, torch.autograd.grad((first.float() ** 2).sum(), x)[0]
        with telemetry.count_kernel_calls() as counted:
            got = second(lambda t: kernels.softmax(t, -1))
        assert [c.backend for c in counted.calls] == ["triton"], counted.calls
        want = second(lambda t: F.softmax(t.float(), -1).to(dtype))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    # non-finite rows: NaN where F.softmax has NaN
    x = torch.randn(4, 9)
    x[0, 2], x[1] = NAN, -INF
    x[2, 3] = INF
    got, want = kernels.softmax(x, -1), F.softmax(x, -1)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True)
    # empty rows or an empty dim, a moved dim, a non-contiguous input
    for t, dim in ((torch.randn(3, 0), -1), (torch.randn(0, 5), -1), (torch.randn(2, 0, 3), 1),
                   (torch.randn(7, 4, 3).transpose(0, 2), 1)):
        torch.testing.assert_close(kernels.softmax(t, dim), F.softmax(t, dim))
    # torch.func: the original op runs (the Function has no vmap rule)
    x = torch.randn(2, 3, 5)
    assert torch.equal(torch.func.vmap(lambda t: kernels.softmax(t, -1))(x), F.softmax(x, -1))
    print("ok")
""")


def test_triton_softmax_under_the_interpreter_in_a_fresh_process():
    pytest.importorskip("triton")
    from adopter.kernels import backend

    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", **{backend.ENV_VAR: "triton"})
    done = subprocess.run([sys.executable, "-c", _TRITON_SOFTMAX_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


# ---------------------------------------------------------------- add_relu


@pytest.fixture
def _fresh_provenance():
    finite.forget()
    yield
    finite.forget()


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_a_sum_that_overflows_takes_the_original_ops(_fresh_provenance, in_place):
    # aten's _add_relu clamps an overflowed sum to the largest float, relu(x + r) is inf there;
    # operands recorded without a bound (as a ReLU of recorded tensors is) cannot rule it out
    x, r = torch.zeros(3, 5, 5, 5), torch.zeros(3, 5, 5, 5)
    x[0, 1, 1, 1] = r[0, 1, 1, 1] = 2e38
    x[1] = 1.0
    assert torch._add_relu(x, r)[0, 1, 1, 1] == torch.finfo(torch.float32).max
    want = torch.relu(x + r)
    finite.mark(x), finite.mark(r)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    [call] = [c for c in counted.calls if c.kernel == "add_relu"]
    assert call.backend == "original" and "overflow" in call.reason
    assert torch.equal(out, want) and out[0, 1, 1, 1] == INF
    assert not finite.known(out)


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_checked_operands_bound_the_sum_and_the_result_is_recorded_with_a_bound(_fresh_provenance, in_place):
    torch.manual_seed(0)
    x, r = torch.randn(3, 5, 5, 5) * 1e3, torch.randn(3, 5, 5, 5)
    want = torch.relu(x + r)
    assert finite.check(x) and finite.check(r)
    assert finite.bound(x) >= x.abs().max() and finite.bound(r) >= r.abs().max()
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    assert [c.backend for c in counted.calls] == ["torch"]
    assert torch.equal(out, want) and finite.known(out) and finite.bound(out) >= out.max()
    # a record without a bound (a ReLU of recorded tensors) costs one read, and is then bounded
    y = torch.relu(torch.randn(3, 5, 5, 5))
    finite.mark(y)
    with torch.no_grad():
        want = torch.relu(y + out)
        got = add_relu(F.relu, y, out, in_place=in_place)
    assert torch.equal(got, want) and finite.bound(got) >= got.max()


@pytest.mark.parametrize("case", ["randn", "channels_last", "one large", "tiny", "subnormal", "strided", "bfloat16",
                                  "float64", "int64", "empty"])
def test_recorded_bounds_are_upper_bounds(_fresh_provenance, case):
    torch.manual_seed(0)
    t = torch.randn(2, 3, 4, 5)
    if case == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    elif case == "one large":
        t = torch.full((1000,), 1e-30)
        t[17] = 1.5e19  # (its square is just below the float32 maximum)
    elif case == "tiny":
        t = t * 1e-20
    elif case == "subnormal":
        t = torch.full((7,), 1e-44)
    elif case == "strided":
        t = t[..., ::2]
    elif case == "bfloat16":
        t = t.bfloat16() * 1e30
    elif case == "float64":
        t = t.double() * 1e150
    elif case == "int64":
        t = torch.randint(-50, 50, (3, 4))
    elif case == "empty":
        t = torch.randn(3, 0)
    assert finite.check(t)
    assert t.numel() == 0 or finite.bound(t) >= t.abs().max().item()
    bad = t.double().clone() if case == "int64" else t.clone()
    if bad.numel():
        first = (0,) * bad.dim()
        bad[first] = NAN
        assert not finite.check(bad) and not finite.known(bad)
        bad[first] = INF
        assert not finite.check(bad)


def test_an_overflowed_conv_output_is_not_recorded_finite(_fresh_provenance):
    def pair(value):
        conv, bn = nn.Conv2d(1, 1, 1, bias=False), nn.BatchNorm2d(1).eval()
        with torch.no_grad():
            conv.weight.fill_(value)
        return freeze(conv), freeze(bn)

    x = torch.full((1, 1, 1, 3), 1e15)  # (3 elements: aten's scalar loop, which turns a NaN into 0)
    assert finite.check(x)
    first, up, down = pair(1e15), pair(1e15), pair(-1e15)
    with torch.no_grad():
        h = conv_bn(*first, x)  # 1e30
        ya, yb = conv_bn(*up, h), conv_bn(*down, h)  # +-1e45: inf and -inf
        assert ya.isinf().all() and yb.isinf().all()
        want = torch.relu(ya + yb)
        got = add_relu(nn.ReLU(), ya, yb)
    assert want.isnan().all()
    assert torch.equal(got.isnan(), want.isnan()), "inf + -inf is NaN, which the fused kernel makes 0"


class _Block(nn.Module):
    """A residual block's end as the rewrite leaves it: ``conv_bn`` then ``add_relu``."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        out = conv_bn(self.conv, self.bn, x)
        out = add_relu(self.relu, out, x, in_place=True)
        return out

    def original(self, x):
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


@pytest.mark.parametrize("frozen", [False, True])
def test_vmap_over_add_relu_in_eval_mode(_fresh_provenance, frozen):
    torch.manual_seed(0)
    block = _Block().eval()
    if frozen:
        freeze(block)
    x = torch.randn(3, 2, 4, 5, 5)
    finite.check(x)
    with torch.no_grad():
        got = torch.func.vmap(block)(x)
        want = torch.func.vmap(block.original)(x)
        plain = block.original(x.flatten(0, 1)).unflatten(0, (3, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- regressions (fuzzer cases)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fill", ["min", -1e4])
def test_half_row_masked_by_a_finite_mask_takes_the_eager_ops(dtype, fill):
    # attention|eager/grad/train_call|s105031: every key of a row masked by finfo.min (plus a bias):
    # the eager ops' softmax is over the rounding of scores + mask in the half dtype, SDPA's in float32
    q, k, v = _qkv(dtype=dtype, seed=4)
    mask = torch.zeros(2, 1, 6, 6, dtype=dtype)
    mask[0, 0, 2, :] = torch.finfo(dtype).min if fill == "min" else fill
    bias = torch.randn(1, 3, 6, 6).to(dtype)
    for additive in (True, False):
        with count_kernel_calls() as counted:
            got = attention(q, k, v, mask=mask, bias=bias, scale=1.0, additive=additive)
        assert [c.backend for c in counted.calls if c.kernel == "attention"] == ["original"]
        want = attention(q, k, v, mask=mask, bias=bias, scale=1.0, additive=additive, need_weights=True)[0]
        assert torch.equal(got, want)


def test_a_padding_mask_in_half_precision_keeps_the_fused_path():
    q, k, v = _qkv(dtype=torch.bfloat16)
    with count_kernel_calls() as counted:
        attention(q, k, v, mask=_padding(torch.bfloat16))
    assert [c.backend for c in counted.calls if c.kernel == "attention"] != ["original"]


def test_jit_trace_backward_in_bfloat16():
    # attention|jit_trace/grad/add_hooks|s300309: TorchScript's autodiff gave softmax(dtype=float32)'s
    # gradient in float32, which the bfloat16 q @ k^T backward rejected
    q, k, v = _qkv(dtype=torch.bfloat16, grad=True)
    mask = _padding(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(lambda q, k, v: attention(q, k, v, mask=mask), (q, k, v), check_trace=False)
        for _ in range(3):  # (the profiling executor differentiates from the second run on)
            out = traced(q, k, v)
            grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = torch.autograd.grad(attention(q, k, v, mask=mask, need_weights=True)[0].float().sum(), (q, k, v))
    for g, w in zip(grads, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, **TOL[torch.bfloat16])


def test_float64_is_softmaxed_in_float64_even_where_float32_overflows():
    # attention|eager/jvp/once|s101193, |eager/no_grad/load_state_dict|s101203, |compile_inductor/...|s300310:
    # float64 scores beyond float32's range (large values); the fuzzer's original casts them to float32
    # (softmax(scores.float()): inf, NaN rows), BERT's written-out ops and this kernel keep float64
    q, k, v = _qkv(dtype=torch.float64)
    q, k = q * 1e150, k * 1e150  # (scores ~1e300: finite in float64, inf in float32)
    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True
    keep[0, 0, 3] = False  # a fully masked row: NaN on both
    mask = torch.zeros((), dtype=torch.float64).masked_fill(~keep, -INF)
    want, want_w = bert_original(q, k, v, mask)
    assert (q @ k.transpose(-1, -2)).float().isinf().any()
    assert want[0, :, 3].isnan().all() and not want[1].isnan().any()
    assert_same(bert_rewritten(q, k, v, mask), want)
    assert_same(attention(q, k, v, mask=keep), want)
    assert_same(attention(q, k, v, mask=keep, need_weights=True)[1], want_w)


# ---------------------------------------------------------------- a softmax the source upcasts to float32

UPCAST_SOURCES = {
    # T5: softmax(scores.float()).type_as(scores)
    "t5": '''
import torch
from torch import nn


def forward(module, query, key, value, mask, dropout=0.0):
    scores = torch.matmul(query, key.transpose(3, 2))
    scores += mask
    attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output, None
''',
    # llama: softmax(w, dtype=torch.float32).to(query.dtype), the weights returned
    "llama": '''
import torch
from torch import nn


def forward(module, query, key, value, mask, dropout=0.0):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * 0.5
    if mask is not None:
        attn_weights = attn_weights + mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output, attn_weights
''',
    # a cast statement (.to(th.float32)) of the masked scores; torch imported as th only (the rewrite's
    # TorchScript guard imports torch)
    "to_float32": '''
import torch as th
import torch.nn.functional as F


def forward(module, query, key, value, mask, dropout=0.0):
    scores = query @ key.transpose(-1, -2)
    scores = scores + mask
    scores = scores.to(th.float32)
    probs = F.softmax(scores, dim=-1)
    probs = probs.to(query.dtype)
    out = probs @ value
    return out, None
''',
}


def _rewritten_upcast(name):
    import types

    from adopter.rewrite import rewrite_source
    from test_rewrite import matmul_match

    source = UPCAST_SOURCES[name]
    result = rewrite_source(source, [matmul_match(source, "T5Attention", "forward")], filename=f"{name}.py")
    assert [o.applied for o in result.outcomes] == [True], result.outcomes
    assert "softmax_dtype=torch.float32" in result.new_text
    modules = []
    for text in (source, result.new_text):
        module = types.ModuleType(f"upcast_{name}")
        exec(compile(text, f"{name}.py", "exec"), module.__dict__)
        modules.append(module.forward)
    return modules


def _overflowing(dtype):
    """float64 q/k whose batch-0 scores (~1e39) are beyond float32's range, a finfo.min mask (float32's
    -inf) with a fully masked row in batch 1: in float32 inf/-inf, NaN rows; finite in float64."""
    q, k, v = _qkv(dtype=dtype, seed=2)
    big = 1e20 if dtype == torch.float64 else 1.0
    q, k = q.clone(), k.clone()
    q[0] *= big
    k[0] *= big
    mask = torch.zeros(2, 1, 6, 6, dtype=dtype)
    mask[1, 0, :, 4:] = torch.finfo(dtype).min
    if dtype == torch.float64:
        mask[1, 0, 2, :] = torch.finfo(dtype).min
    return q, k, v, mask


@pytest.mark.parametrize("name", sorted(UPCAST_SOURCES))
def test_float64_source_with_a_float32_softmax_keeps_it(name):
    # attention|eager/jvp/once|s101193 and its kin: the source computes the softmax of float64 scores in
    # float32 (NaN rows where they overflow or a finfo.min mask becomes -inf); the rewrite does too
    original, rewritten = _rewritten_upcast(name)
    module = nn.Module().eval()
    q, k, v, mask = _overflowing(torch.float64)
    assert (q @ k.transpose(-1, -2)).float().isinf().any()
    want = original(module, q, k, v, mask)
    with count_kernel_calls() as counted:
        got = rewritten(module, q, k, v, mask)
    assert [c.backend for c in counted.calls if c.kernel == "attention"] == ["original"]
    assert want[0].isnan().any() and not want[0].isnan().all()
    assert not want[0][1, :, 3].isnan().any()  # (batch 1, a partly masked row: finite)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert_same(a, b)
        assert torch.equal(a.nan_to_num(), b.nan_to_num())  # (the same ops: the same numbers)
    # where the kernel computes the softmax in float64 itself, those rows are finite
    assert not attention(q, k, v, mask=mask, scale=1.0, additive=True).isnan().all(-1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(UPCAST_SOURCES))
def test_float32_and_half_sources_with_a_float32_softmax_stay_fused(name, dtype):
    original, rewritten = _rewritten_upcast(name)
    module = nn.Module().eval()
    q, k, v, mask = _overflowing(dtype)
    want = original(module, q, k, v, mask)
    with count_kernel_calls() as counted:
        got = rewritten(module, q, k, v, mask)
    backends = [c.backend for c in counted.calls if c.kernel == "attention"]
    assert backends and "original" not in backends, backends
    assert_same(got[0], want[0])


def test_softmax_dtype_float32_on_float32_inputs_is_the_fused_path():
    q, k, v = _qkv()
    with count_kernel_calls() as counted:
        got = attention(q, k, v, mask=_padding(), additive=True, softmax_dtype=torch.float32)
    assert [c.backend for c in counted.calls if c.kernel == "attention"] not in ([], ["original"])
    assert_same(got, attention(q, k, v, mask=_padding(), additive=True))


@pytest.mark.parametrize("additive", [True, False])
def test_softmax_dtype_float32_on_float64_inputs_as_written(additive):
    # (the API too: weights, dropout under one seed, gradients; the weights cast back to float64)
    q, k, v = _qkv(dtype=torch.float64, grad=True)
    bias = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) * 0.3 + bias
    want_w = F.softmax(scores.float(), dim=-1).to(torch.float64)
    out, weights = attention(q, k, v, bias=bias, scale=0.3, additive=additive, need_weights=True,
                             softmax_dtype=torch.float32)
    assert weights.dtype == torch.float64 and torch.equal(weights, want_w)
    assert torch.equal(out, want_w @ v)
    torch.manual_seed(5)
    dropped = attention(q, k, v, bias=bias, scale=0.3, dropout_p=0.2, additive=additive, softmax_dtype=torch.float32)
    torch.manual_seed(5)
    assert torch.equal(dropped, F.dropout(want_w, 0.2, training=True) @ v)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want_w @ v, (q, k, v), g)):
        assert torch.equal(a, b)


def test_codemod_passes_softmax_dtype_only_for_a_float32_softmax():
    from adopter.rewrite import rewrite_source
    from test_rewrite import matmul_match

    def rewrite(body):
        source = "import torch\n\n\ndef forward(q, k, v, mask):\n" + textwrap.indent(textwrap.dedent(body), "    ")
        result = rewrite_source(source, [matmul_match(source, "T5Attention", "forward")], filename="m.py")
        return result.outcomes[0], result.new_text

    plain = """
        s = torch.matmul(q, k.transpose(-1, -2))
        s = s + mask
        p = torch.softmax(s, dim=-1){cast}
        o = torch.matmul(p, v)
        return o
    """
    for cast in ("", ".to(q.dtype)", ".type_as(s)"):
        outcome, text = rewrite(plain.format(cast=cast))
        assert outcome.applied and "softmax_dtype" not in text, outcome.reason
    for upcast in ("torch.softmax(s, dim=-1, dtype=torch.float32)", "torch.softmax(s, -1, torch.float)",
                    "s.softmax(-1, dtype=torch.float32)", "torch.softmax(s.float(), dim=-1)",
                    "torch.softmax(s.half().float(), dim=-1)", "torch.softmax(s.to(torch.float32), dim=-1)"):
        outcome, text = rewrite(plain.replace("torch.softmax(s, dim=-1)", upcast).format(cast=".to(q.dtype)"))
        assert outcome.applied and "softmax_dtype=torch.float32" in text, (upcast, outcome.reason)
    # the last cast before the softmax decides: a round trip back is no float32 softmax
    outcome, text = rewrite(plain.replace("torch.softmax(s, dim=-1)", "torch.softmax(s.float().type_as(q), dim=-1)")
                            .format(cast=""))
    assert outcome.applied and "softmax_dtype" not in text, outcome.reason
    # scores cast to float32 and then a mask added: its dtype decides the softmax's (float64 promotes back)
    outcome, _ = rewrite("""
        s = torch.matmul(q, k.transpose(-1, -2))
        s = s.float()
        s = s + mask
        p = torch.softmax(s, dim=-1).to(q.dtype)
        o = torch.matmul(p, v)
        return o
    """)
    assert not outcome.applied and "cast to float32" in outcome.reason
    # a local `torch` is not the module the call would name
    outcome, _ = rewrite("""
        torch = q.new_empty(0)
        s = q @ k.transpose(-1, -2)
        s = s + mask
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        o = p @ v
        return o
    """)
    assert not outcome.applied and "`torch` is a local name" in outcome.reason
    # an augmented update of the probabilities is no mask or scale of the scores
    for update in ("p += mask", "p *= 2.0"):
        outcome, _ = rewrite(f"""
            s = torch.matmul(q, k.transpose(-1, -2))
            p = torch.softmax(s, dim=-1)
            {update}
            o = torch.matmul(p, v)
            return o
        """)
        assert not outcome.applied and "after softmax" in outcome.reason, (update, outcome.reason)
    assert not outcome.applied
