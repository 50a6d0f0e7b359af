"""The LLM kernels (RMSNorm, gated MLP, rotary embeddings, the fused LM-head loss) against the original
computation each guarded call replaces, where an audit found them apart:

* double backward (``create_graph=True``): the gradient of a gradient is the original's (the fused
  loss used to hand back a gradient without a graph, the SiLU gated MLP and rotary raised);
* an in-place update of a half-precision input after RMSNorm, before the backward: the original
  normalizes a float32 copy and does not mind, so neither may the kernel;
* nan and inf logits in rows the loss ignores and in rows it counts: the original's loss and
  gradients, nan where it has nan (it computes every row's log-softmax);
* the dtype the fused loss computes in: a float64 head under CPU autocast stays float64 (autocast
  casts no float64), and the other head/autocast combinations compute what the original does;
* execution modes the fused paths do not implement (``torch.func`` grad/vmap/jvp, forward AD,
  ``torch.jit.trace``): each kernel returns what the original returns;
* ``torch.compile(fullgraph=True)``: no graph break (slow);
* the rewritten gpt2 head reads ``self.loss_function`` only with labels, as the source did: no log
  line the original does not print, and no graph break in compiled decoding.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from adopter.kernels.guarded_gated_mlp import gated_mlp, gated_mlp_packed
from adopter.kernels.guarded_linear_cross_entropy import (
    LogitsNotComputedWarning,
    linear_cross_entropy,
    lm_head_cross_entropy,
)
from adopter.kernels.guarded_rms_norm import rms_norm
from adopter.kernels.guarded_rotary import rotary, rotary_complex, rotary_interleaved, rotary_pairs
from adopter.kernels.ops.rms_norm import RMSNormForm, rms_norm_reference
from adopter.kernels.telemetry import count_kernel_calls
from adopter.rewrite import rewrite_source
from adopter.rewrite.loader import load_rewritten_module
from torch import nn

from adopter.core.rules.linear_cross_entropy import RULE as LCE_RULE
from adopter.core.scan import scan_source

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

# training with labels drops the logits, by design (the warning has its own tests)
pytestmark = pytest.mark.filterwarnings(
    f"ignore::{LogitsNotComputedWarning.__module__}.LogitsNotComputedWarning")

VOCAB = 37


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


# ---------------------------------------------------------------- the subjects: each guarded call and its original


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def _angles(width: int, repeat_interleave: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(9, width, generator=_g(1)) * 6.0
    if repeat_interleave:
        theta = theta.repeat_interleave(2, dim=-1)
    return theta.cos(), theta.sin()


def _labels(ignore: int) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (2, 5), generator=_g(3))
    labels[0, :2] = ignore  # a masked prompt
    return labels


class Site(nn.Module):
    """One guarded call with the modules and parameters it reads; ``forward`` runs the guarded call,
    or, with ``use_original``, the code the rewrite replaced (what the kernel's fallback runs)."""

    def __init__(self, case: "Case"):
        super().__init__()
        torch.manual_seed(0)
        case.build(self)
        self.case = case
        self.use_original = False

    def forward(self, *xs):
        return (self.case.original if self.use_original else self.case.fused)(self, *xs)


@dataclass(frozen=True)
class Case:
    kernel: str  # the telemetry name
    build: Callable[[Site], None]
    fused: Callable[..., Any]
    original: Callable[..., Any]
    inputs: Callable[[], tuple]  # fresh inputs, the floating ones requiring grad


def _build_rms(site):
    site.weight = nn.Parameter(1.0 + 0.1 * _randn(16, seed=5))


def _build_mlp(site):
    site.gate, site.up, site.down = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)
    site.act = nn.SiLU()


def _build_mlp_gelu(site):
    _build_mlp(site)
    site.act = nn.GELU(approximate="tanh")


def _build_packed(site):
    site.gate_up, site.down = nn.Linear(16, 48), nn.Linear(24, 16)


def _build_head(site, ignore=-100):
    site.head = nn.Linear(16, VOCAB)
    site.labels = _labels(ignore)


def _build_rope(site, width=8, repeat_interleave=False):
    site.cos, site.sin = _angles(width, repeat_interleave)


def _build_complex(site):
    theta = torch.rand(9, 1, 4, generator=_g(2)) * 6.0  # (seq, 1, pairs): broadcast over the heads
    site.freqs = torch.polar(torch.ones_like(theta), theta)


def _llama_rms(x, weight, eps=1e-6):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _gemma_rms(x, weight, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def _packed_original(s, x):
    g, u = s.gate_up(x).chunk(2, dim=-1)
    return s.down(F.silu(g) * u)


def _pairs(x):
    return x[..., 0::2], x[..., 1::2]


def _complex(x):
    return torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))


def _act(*shape):
    return lambda: (_randn(*shape).requires_grad_(),)


CASES = {
    "rms_norm": Case("rms_norm", _build_rms, lambda s, x: rms_norm(x, s.weight, 1e-6),
                     lambda s, x: _llama_rms(x, s.weight), _act(2, 5, 16)),
    "rms_norm_gemma": Case("rms_norm", _build_rms,
                           lambda s, x: rms_norm(x, s.weight, 1e-6, offset=1.0, weight_before_cast=True,
                                                 weight_fp32=True),
                           lambda s, x: _gemma_rms(x, s.weight), _act(2, 5, 16)),
    "gated_mlp_silu": Case("gated_mlp", _build_mlp, lambda s, x: gated_mlp(s.gate, s.up, s.down, s.act, x),
                           lambda s, x: s.down(s.act(s.gate(x)) * s.up(x)), _act(2, 5, 16)),
    "gated_mlp_gelu_tanh": Case("gated_mlp", _build_mlp_gelu, lambda s, x: gated_mlp(s.gate, s.up, s.down, s.act, x),
                                lambda s, x: s.down(s.act(s.gate(x)) * s.up(x)), _act(2, 5, 16)),
    "gated_mlp_packed": Case("gated_mlp", _build_packed,
                             lambda s, x: gated_mlp_packed(s.gate_up, s.down, F.silu, x, chunks=2, dim=-1),
                             _packed_original, _act(2, 5, 16)),
    "linear_cross_entropy": Case(
        "linear_cross_entropy", _build_head,
        lambda s, h: linear_cross_entropy(s.head, h, ForCausalLMLoss, labels=s.labels, vocab_size=VOCAB)[1],
        lambda s, h: ForCausalLMLoss(s.head(h), s.labels, VOCAB), _act(2, 5, 16)),
    "lm_head_cross_entropy": Case(
        "linear_cross_entropy", lambda s: _build_head(s, ignore=-1),
        lambda s, h: lm_head_cross_entropy(s.head, h, F.cross_entropy, s.labels.view(-1), ignore_index=-1)[1],
        lambda s, h: F.cross_entropy(s.head(h).view(-1, VOCAB), s.labels.view(-1), ignore_index=-1),
        _act(2, 5, 16)),
    "rotary": Case("rotary", _build_rope, lambda s, x: rotary(x, s.cos, s.sin, _rotate_half),
                   lambda s, x: x * s.cos + _rotate_half(x) * s.sin, _act(2, 4, 9, 8)),
    "rotary_inline": Case("rotary", _build_rope, lambda s, x: rotary(x, s.cos, s.sin),
                          lambda s, x: x * s.cos + _rotate_half(x) * s.sin, _act(2, 4, 9, 8)),
    "rotary_interleaved": Case("rotary", lambda s: _build_rope(s, 4, repeat_interleave=True),
                               lambda s, x: rotary_interleaved(x, s.cos, s.sin, _rotate_every_two),
                               lambda s, x: x * s.cos + _rotate_every_two(x) * s.sin, _act(2, 4, 9, 8)),
    "rotary_pairs_stack": Case("rotary", lambda s: _build_rope(s, 4),
                               lambda s, x: rotary_pairs(*_pairs(x), s.cos, s.sin).flatten(-2),
                               lambda s, x: torch.stack((_pairs(x)[0] * s.cos - _pairs(x)[1] * s.sin,
                                                         _pairs(x)[0] * s.sin + _pairs(x)[1] * s.cos),
                                                        dim=-1).flatten(-2),
                               _act(2, 4, 9, 8)),
    "rotary_pairs_cat": Case("rotary", lambda s: _build_rope(s, 4),
                             lambda s, x: rotary_pairs(*_pairs(x), s.cos, s.sin, join="cat"),
                             lambda s, x: torch.cat((_pairs(x)[0] * s.cos - _pairs(x)[1] * s.sin,
                                                     _pairs(x)[1] * s.cos + _pairs(x)[0] * s.sin), dim=-1),
                             _act(2, 4, 9, 8)),
    "rotary_complex": Case("rotary", _build_complex,
                           lambda s, x: rotary_complex(_complex(x), s.freqs).flatten(-2),
                           lambda s, x: torch.view_as_real(_complex(x) * s.freqs).flatten(-2), _act(2, 9, 4, 8)),
}
NAMES = sorted(CASES)


def _site(name: str) -> tuple[Site, tuple]:
    case = CASES[name]
    return Site(case).train(), case.inputs()


def _fused_calls(kernel: str, calls) -> list:
    return [c for c in calls.calls if c.kernel == kernel and c.fused]


def _scalar(out: torch.Tensor) -> torch.Tensor:
    """A scalar whose gradient depends on ``out`` (so the gradient of that gradient exercises the
    backward of the backward), with weights that tell the elements apart."""
    weights = torch.rand(out.shape, generator=_g(11)) + 0.5
    return (out.float() ** 2 * weights).sum()


def _close(got, want, what: str, **tol) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:
            assert a is None and b is None, f"{what} #{i}: {a} vs {b}"
            continue
        assert a.dtype == b.dtype, f"{what} #{i}: {a.dtype} vs {b.dtype}"
        torch.testing.assert_close(a, b, equal_nan=True, msg=lambda m, i=i: f"{what} #{i}: {m}",
                                   **(tol or {"atol": 1e-5, "rtol": 1e-4}))


# ---------------------------------------------------------------- double backward


def _second_order(site: Site, xs: tuple) -> list:
    """The gradients of a function of the first-order gradients (create_graph=True) with respect to
    the inputs and the parameters."""
    wrt = [*xs, *site.parameters()]
    first = torch.autograd.grad(_scalar(site(*xs)), wrt, create_graph=True, allow_unused=True)
    assert any(g is not None and g.requires_grad for g in first), "the first-order gradients have no graph"
    loss = sum(_scalar(g) for g in first if g is not None and g.requires_grad)
    return list(torch.autograd.grad(loss, wrt, allow_unused=True))


@pytest.mark.parametrize("name", NAMES)
def test_double_backward_is_the_originals(name):
    site, xs = _site(name)
    with count_kernel_calls() as calls:
        got = _second_order(site, xs)
    assert _fused_calls(site.case.kernel, calls), "the fused path did not run"
    site.use_original = True
    want = _second_order(site, xs)
    _close([g if g is None else g.detach() for g in got], want, "second-order gradients")


@pytest.mark.parametrize("name", ["rms_norm", "rms_norm_gemma"])
def test_double_backward_of_half_rms_norm_goes_through_its_input_copy(name):
    # a half input reaches the kernel as a copy (test below): the second-order terms of the input
    # must still flow back through it to x
    site, (x,) = _site(name)
    site.to(torch.bfloat16)
    x = x.detach().to(torch.bfloat16).requires_grad_()
    with count_kernel_calls() as calls:
        got = _second_order(site, (x,))
    assert _fused_calls("rms_norm", calls)
    site.use_original = True
    want = _second_order(site, (x,))
    for a, b in zip(got, want):  # bfloat16 through two backward passes: 2% of each gradient's scale
        scale = b.detach().float().abs().max().item()
        _close([a.detach()], [b], "second-order gradients", atol=2e-2 * scale, rtol=0)


# ---------------------------------------------------------------- RMSNorm: an in-place update of its input


RMS_FORMS = {
    "llama": RMSNormForm(),
    "olmo2": RMSNormForm(weight_before_cast=True),
    "gemma": RMSNormForm(offset=1.0, weight_before_cast=True, weight_fp32=True),
    "t5": RMSNormForm(cast_to_half_weight=True),
}


def _norm_then_add_(fused: bool, form: RMSNormForm, dtype, x_grad: bool):
    """Normalize, update the input in place (a residual stream's ``add_``), then backward: the
    gradients, or the error the backward raised."""
    x0 = _randn(2, 5, 16, dtype=dtype).requires_grad_(x_grad)
    w = (1.0 + 0.1 * _randn(16, seed=5)).to(dtype).requires_grad_()
    x = x0 * 1 if x_grad else x0.clone()
    if fused:
        keys = {k: getattr(form, k) for k in ("offset", "weight_before_cast", "weight_fp32", "cast_to_half_weight")}
        out = rms_norm(x, w, 1e-6, **keys)
    else:
        out = rms_norm_reference(x, w, 1e-6, form)
    x.add_(1.0)
    try:
        _scalar(out).backward()
    except RuntimeError as error:
        return type(error).__name__
    return [x0.grad, w.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("form", sorted(RMS_FORMS))
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_grad", "weight_grad_only"])
def test_rms_norm_input_updated_in_place_before_backward_as_the_original(form, dtype, x_grad):
    with count_kernel_calls() as calls:
        got = _norm_then_add_(True, RMS_FORMS[form], dtype, x_grad)
    assert _fused_calls("rms_norm", calls)
    want = _norm_then_add_(False, RMS_FORMS[form], dtype, x_grad)
    if isinstance(want, str) or isinstance(got, str):
        assert got == want  # the original raises too (a float32 input is what it saves itself)
    else:
        _close(got, want, "gradients", atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- the fused loss: nan and inf logits


def _loss_and_grads(name: str, spoil: Callable[[Site, torch.Tensor], None], fused: bool, dtype=torch.float32,
                    guarded: bool = False):
    """The loss and gradients of the site; ``fused``: through the kernel, its range guard lifted
    (the fused computation itself must place NaN/inf as the original does: under torch.compile no
    guard reads the data) unless ``guarded`` (then the guard decides; either path must match)."""
    from adopter.kernels import guarded_linear_cross_entropy as lce

    site, (h,) = _site(name)
    site.to(dtype)
    h = h.detach().to(dtype)
    spoil(site, h)
    h.requires_grad_()
    site.use_original = not fused
    range_reason = lce._range_reason
    if fused and not guarded:
        lce._range_reason = lambda *args: ""
    try:
        with count_kernel_calls() as calls:
            loss = site(h)
    finally:
        lce._range_reason = range_reason
    if fused and not guarded:
        assert _fused_calls("linear_cross_entropy", calls), "the fused path did not run"
    loss.backward()
    return [loss.detach(), h.grad, site.head.weight.grad, site.head.bias.grad]


@pytest.mark.parametrize("name", ["lm_head_cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 3e38])
def test_fused_loss_range_guard_takes_the_original_for_non_finite_or_huge_hidden_states(name, value):
    """Eager calls read a bound of the hidden states and the head (ops/finite, one pass): NaN, inf or
    values whose logits or gradients could overflow run the original computation, which matches."""
    def spoil(site, h):
        with torch.no_grad():
            h[0, 1, 2] = value

    site, (h,) = _site(name)
    h = h.detach().clone()
    spoil(site, h)
    h.requires_grad_()
    with count_kernel_calls() as calls:
        site(h)
    assert not _fused_calls("linear_cross_entropy", calls)
    got = _loss_and_grads(name, spoil, fused=True, guarded=True)
    want = _loss_and_grads(name, spoil, fused=False)
    for g, w in zip(got, want):
        if w is not None:
            assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())


# the hidden-state rows the loss ignores / counts: lm_head_cross_entropy's targets are the labels
# (row 0 ignored, row 2 counted); ForCausalLMLoss's are the labels shifted by one (the last position
# of each sequence ignored, position 0 predicting the label at 1: ignored in sequence 0, counted in 1)
ROWS = {
    "lm_head_cross_entropy": {"ignored": (0, 0), "counted": (0, 2)},
    "linear_cross_entropy": {"ignored": (0, 4), "counted": (1, 0)},
}


def _spoil_row(name: str, where: str, value: float):
    def spoil(site, h):
        h[ROWS[name][where]][3] = value
    return spoil


@pytest.mark.parametrize("name", ["lm_head_cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("where", ["ignored", "counted"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_fused_loss_non_finite_hidden_state_as_the_original(name, where, value):
    got = _loss_and_grads(name, _spoil_row(name, where, value), fused=True)
    want = _loss_and_grads(name, _spoil_row(name, where, value), fused=False)
    assert any(not torch.isfinite(t).all() for t in want)  # the subject: the original has non-finite values
    _close(got, want, f"{where} {value}")


def _spoil_params(kind: str):
    def spoil(site, h):
        with torch.no_grad():
            if kind == "masked_vocabulary":  # -inf logits in every row (a vocabulary masked by the bias)
                site.head.bias[5] = float("-inf")
            elif kind == "nan_weight":
                site.head.weight[7, 2] = float("nan")
            elif kind == "all_ignored_nan":  # no row counted, one ignored row nan
                site.labels.fill_(int(site.labels.min()))  # the case's ignore_index (the masked prompt's)
                h[0, 1, 0] = float("nan")
    return spoil


@pytest.mark.parametrize("name", ["lm_head_cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("kind", ["masked_vocabulary", "nan_weight", "all_ignored_nan"])
def test_fused_loss_non_finite_parameters_as_the_original(name, kind):
    got = _loss_and_grads(name, _spoil_params(kind), fused=True)
    want = _loss_and_grads(name, _spoil_params(kind), fused=False)
    _close(got, want, kind)


def test_fused_loss_overflowing_half_logits_in_an_ignored_row_as_the_original():
    """Finite float16 inputs whose ignored row's logits overflow to inf: the original's gradients
    are nan there (it computes that row's log-softmax), and so must the fused loss's be."""
    def spoil(site, h):
        h[ROWS["lm_head_cross_entropy"]["ignored"]] = 6e4
        with torch.no_grad():
            site.head.weight[0] = 0.25  # that row's logit 0: 16 * 6e4 * 0.25, past float16's 65504

    got = _loss_and_grads("lm_head_cross_entropy", spoil, fused=True, dtype=torch.float16)
    want = _loss_and_grads("lm_head_cross_entropy", spoil, fused=False, dtype=torch.float16)
    assert not torch.isfinite(want[2]).all()
    _close(got, want, "float16 overflow", atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- the fused loss: dtypes under autocast


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _loss_in(name: str, head_dtype, autocast_dtype, fused: bool, h_dtype=None):
    site, (h,) = _site(name)
    site.to(head_dtype)
    h = h.detach().to(h_dtype or head_dtype).requires_grad_()
    site.use_original = not fused
    with _autocast(autocast_dtype), count_kernel_calls() as calls:
        loss = site(h)
    if fused:
        assert _fused_calls("linear_cross_entropy", calls), "the fused path did not run"
    loss.backward()
    return [loss.detach(), h.grad, site.head.weight.grad, site.head.bias.grad]


# (head dtype, autocast dtype, tolerance): float64 computes in float64 (ForCausalLMLoss's .float()
# softmax in float32), autocast computes the matmuls in its dtype
DTYPES = [
    pytest.param(head, autocast, {"atol": tol, "rtol": tol},
                 id=f"{str(head).removeprefix('torch.')}-autocast_{str(autocast).removeprefix('torch.')}")
    for head, autocast, tol in [
        (torch.float64, torch.bfloat16, 1e-6),
        (torch.float64, torch.float16, 1e-6),
        (torch.float64, None, 1e-6),
        (torch.float32, torch.bfloat16, 2e-2),
        (torch.float32, torch.float16, 2e-3),
        (torch.bfloat16, None, 2e-2),
        (torch.float16, None, 2e-3),
    ]
]


@pytest.mark.parametrize("name", ["lm_head_cross_entropy", "linear_cross_entropy"])
@pytest.mark.parametrize("head_dtype, autocast_dtype, tol", DTYPES)
def test_fused_loss_computes_in_the_originals_dtype(name, head_dtype, autocast_dtype, tol):
    got = _loss_in(name, head_dtype, autocast_dtype, fused=True)
    want = _loss_in(name, head_dtype, autocast_dtype, fused=False)
    _close(got, want, f"{head_dtype} under autocast {autocast_dtype}", **tol)


def test_fused_cross_entropy_of_float64_logits_is_float64():
    """F.cross_entropy of float64 logits computes in float64 (no ``.float()`` in the source): so
    does the fused loss, to float64's precision."""
    got = _loss_in("lm_head_cross_entropy", torch.float64, None, fused=True)
    want = _loss_in("lm_head_cross_entropy", torch.float64, None, fused=False)
    _close(got, want, "float64", atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", ["lm_head_cross_entropy", "linear_cross_entropy"])
def test_fused_loss_mixed_float64_under_autocast_fails_as_the_original(name):
    # autocast casts the float32 hidden states, not the float64 head: F.linear refuses the mix
    with pytest.raises(RuntimeError) as original:
        _loss_in(name, torch.float64, torch.bfloat16, fused=False, h_dtype=torch.float32)
    with pytest.raises(type(original.value)):
        site, (h,) = _site(name)
        site.to(torch.float64)
        with _autocast(torch.bfloat16):
            site(h)


# ---------------------------------------------------------------- execution modes the fused paths do not implement


def _weights_like(out: torch.Tensor) -> torch.Tensor:
    return torch.rand(out.shape, generator=_g(13)) + 0.5


def _modes_run(site: Site, xs: tuple, mode: str):
    x, rest = xs[0].detach(), xs[1:]
    tangent = _randn(*x.shape, seed=17)
    if mode == "func_grad":
        return [torch.func.grad(lambda x: _scalar(site(x, *rest)))(x)]
    if mode == "vmap":
        batch = torch.stack([x, x * 0.5, x + 1.0])
        return [torch.func.vmap(lambda x: site(x, *rest))(batch)]
    if mode == "jvp":
        return list(torch.func.jvp(lambda x: site(x, *rest), (x,), (tangent,)))
    if mode == "forward_ad":
        with fwAD.dual_level():
            out = site(fwAD.make_dual(x, tangent), *rest)
            primal, out_tangent = fwAD.unpack_dual(out)
            return [primal.detach(), out_tangent]
    if mode == "jit_trace":
        traced = torch.jit.trace(site, (x.requires_grad_(),), check_trace=False)
        return [traced(x).detach(), traced(x * 0.5).detach()]
    raise AssertionError(mode)


MODES = ["func_grad", "vmap", "jvp", "forward_ad", "jit_trace"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_execution_mode_returns_the_originals(name, mode):
    site, xs = _site(name)
    site.use_original = True
    try:
        want = _modes_run(site, xs, mode)
    except Exception as error:  # noqa: BLE001  (what the original cannot do is no failure of the kernel)
        pytest.skip(f"the original fails under {mode}: {type(error).__name__}: {error}")
    site.use_original = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _modes_run(site, xs, mode)
    _close([g.detach() for g in got], [w.detach() for w in want], mode)
    # nothing of the guards shows (under jit.trace their shape tests would warn, TracerWarning)
    kernels = str(Path(rms_norm.__code__.co_filename).parent)  # the guarded kernels' package
    assert not [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if w.filename.startswith(kernels)]


# ---------------------------------------------------------------- torch.compile: no graph break


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rms_norm", "gated_mlp_silu", "gated_mlp_packed", "linear_cross_entropy",
                                  "lm_head_cross_entropy", "rotary", "rotary_interleaved", "rotary_pairs_stack",
                                  "rotary_complex"])
def test_compiled_fullgraph_without_graph_break(name):
    from torch._dynamo.utils import counters

    site, xs = _site(name)
    want = site(*xs)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(site, backend="aot_eager", fullgraph=True)
        got = compiled(*xs)
        (grad,) = torch.autograd.grad(_scalar(got), xs[0])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    (want_grad,) = torch.autograd.grad(_scalar(want), xs[0])
    _close([got.detach(), grad], [want.detach(), want_grad], "compiled")


# ---------------------------------------------------------------- the rewritten gpt2 head: self.loss_function with labels only


def _gpt2_classes():
    from transformers.models.gpt2 import modeling_gpt2

    text = Path(modeling_gpt2.__file__).read_text()
    matches = [m for m in scan_source(text, modeling_gpt2.__file__, [LCE_RULE]) if m.status == "static"]
    assert "GPT2LMHeadModel" in [m.class_name for m in matches]
    result = rewrite_source(text, matches, filename=modeling_gpt2.__file__, rules=[LCE_RULE])
    assert result.applied and "linear_cross_entropy(" in result.new_text
    rewritten = load_rewritten_module(modeling_gpt2, result.new_text)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return modeling_gpt2.GPT2LMHeadModel, rewritten.GPT2LMHeadModel, config


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logged(call: Callable[[], Any]) -> list[str]:
    """The transformers log lines ``call`` prints (``warning_once``'s cache cleared first)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    handler = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        call()
    finally:
        root.removeHandler(handler)
    return handler.lines


def test_rewritten_gpt2_without_labels_logs_what_the_original_logs():
    original_cls, rewritten_cls, config = _gpt2_classes()
    torch.manual_seed(0)
    original = original_cls(config).eval()
    rewritten = rewritten_cls(config).eval()
    rewritten.load_state_dict(original.state_dict())
    ids = torch.randint(0, 64, (1, 7), generator=_g(0))
    outs = []
    with torch.no_grad():
        want = _logged(lambda: outs.append(original(input_ids=ids)))
        got = _logged(lambda: outs.append(rewritten(input_ids=ids)))
    assert got == want
    torch.testing.assert_close(outs[1].logits, outs[0].logits)


@pytest.mark.slow
def test_rewritten_gpt2_decoding_step_compiles_to_one_graph():
    _, rewritten_cls, config = _gpt2_classes()
    torch.manual_seed(0)
    model = rewritten_cls(config).eval()
    ids = torch.randint(0, 64, (1, 7), generator=_g(0))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model(input_ids=ids).logits
            got = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- where the original divides by zero, raises


def _items_loss_and_grads(n_items: Any, fused: bool, ignore_all: bool = False):
    site, (h,) = _site("linear_cross_entropy")
    if ignore_all:
        site.labels.fill_(-100)
    site.use_original = not fused
    if fused:
        loss = linear_cross_entropy(site.head, h, ForCausalLMLoss, labels=site.labels, vocab_size=VOCAB,
                                    num_items_in_batch=n_items)[1]
    else:
        loss = ForCausalLMLoss(site.head(h), site.labels, VOCAB, num_items_in_batch=n_items)
    loss.backward()
    return [loss.detach(), h.grad, site.head.weight.grad, site.head.bias.grad]


@pytest.mark.parametrize("n_items", [0, 0.0, -3, float("nan"), float("inf"), torch.tensor(0), torch.tensor(0.0),
                                     torch.tensor([0.0]), torch.tensor(float("nan")), torch.tensor(-2)],
                         ids=lambda v: f"{type(v).__name__}({v.tolist() if torch.is_tensor(v) else v})")
@pytest.mark.parametrize("ignore_all", [False, True], ids=["counted", "all_ignored"])
def test_fused_loss_over_zero_or_non_finite_items_is_the_originals(n_items, ignore_all):
    """``num_items_in_batch`` 0 (a batch whose labels are all ignored), negative or not finite: the
    loss's gradient reaches the logits as inf/nan, which the original's log-softmax backward spreads
    otherwise than the fused sum's scaled gradients: the original runs, nan where it has nan."""
    with count_kernel_calls() as calls:
        got = _items_loss_and_grads(n_items, fused=True, ignore_all=ignore_all)
    assert not _fused_calls("linear_cross_entropy", calls)
    _close(got, _items_loss_and_grads(n_items, fused=False, ignore_all=ignore_all), f"num_items_in_batch={n_items}")


@pytest.mark.parametrize("n_items", [7, 7.5, torch.tensor(7), torch.tensor([7.0])], ids=str)
def test_fused_loss_over_a_positive_item_count_stays_fused(n_items):
    with count_kernel_calls() as calls:
        got = _items_loss_and_grads(n_items, fused=True)
    assert _fused_calls("linear_cross_entropy", calls)
    _close(got, _items_loss_and_grads(n_items, fused=False), f"num_items_in_batch={n_items}")


def _packed_in_place(s, x, fused: bool, act, *act_args, **act_kwargs):
    if fused:
        return gated_mlp_packed(s.gate_up, s.down, act, x, *act_args, chunks=2, dim=-1, **act_kwargs)
    g, u = s.gate_up(x).chunk(2, dim=-1)
    return s.down(act(g, *act_args, **act_kwargs) * u)


IN_PLACE_SILUS = {
    "F.silu(inplace=True)": (F.silu, (), {"inplace": True}),
    "F.silu(g, True)": (F.silu, (True,), {}),
    "nn.SiLU(inplace=True)": (nn.SiLU(inplace=True), (), {}),
}


@pytest.mark.parametrize("act", sorted(IN_PLACE_SILUS))
def test_packed_in_place_silu_raises_as_the_original(act):
    """``F.silu(g, inplace=True)`` of a half of ``chunk``: the original raises while autograd records
    ("Output 0 of Split is a view and is being modified inplace"); the kernel never writes ``g`` and
    used to return."""
    fn, args, kwargs = IN_PLACE_SILUS[act]
    site, (x,) = _site("gated_mlp_packed")
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        _packed_in_place(site, x, False, fn, *args, **kwargs)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        _packed_in_place(site, x, True, fn, *args, **kwargs)
    # without grad mode, nothing raises: the kernel runs and computes what the original computes
    with torch.no_grad(), count_kernel_calls() as calls:
        got = _packed_in_place(site, x, True, fn, *args, **kwargs)
    assert _fused_calls("gated_mlp", calls)
    with torch.no_grad():
        want = _packed_in_place(site, x, False, fn, *args, **kwargs)
    _close([got], [want], act)


def _rotary_call(name: str, dtype: torch.dtype):
    site, (x,) = _site(name)
    site.to(dtype)
    for key in ("cos", "sin"):
        setattr(site, key, getattr(site, key).to(dtype))
    return site, x.detach().to(dtype).requires_grad_()


@pytest.mark.parametrize("name", ["rotary", "rotary_inline", "rotary_interleaved", "rotary_pairs_stack",
                                  "rotary_pairs_cat"])
@pytest.mark.parametrize("dtype, autocast_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
                         ids=["fp16_in_bf16", "bf16_in_fp16"])
def test_rotary_under_autocast_of_another_half_dtype_raises_as_the_original(name, dtype, autocast_dtype):
    """CPU autocast to one half dtype, tensors of the other: the original's ``torch.cat``/``torch.stack``
    raises ("Unexpected floating ScalarType in at::autocast::prioritize"); the kernel joins nothing
    and used to return."""
    site, x = _rotary_call(name, dtype)
    for use_original in (True, False):
        site.use_original = use_original
        with torch.autocast("cpu", dtype=autocast_dtype), pytest.raises(RuntimeError, match="prioritize"):
            site(x)


@pytest.mark.parametrize("name", ["rotary", "rotary_pairs_cat"])
def test_rotary_under_autocast_of_its_own_dtype_stays_fused(name):
    site, x = _rotary_call(name, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), count_kernel_calls() as calls:
        got = site(x)
    assert _fused_calls("rotary", calls)
    site.use_original = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = site(x)
    _close([got], [want], name, atol=1e-2, rtol=1e-2)
