"""The compile policy (``adopter.kernels.policy.COMPILE_POLICY``) does what it says: a kernel listed
there runs its original math while torch.compile traces (no fused Function or custom op in the
graph, one graph, the eager values), a kernel not listed keeps its fused form in the graph, and
eager calls are never affected. Every kernel whose fused form a graph shows is checked both ways
(the entry set, then removed), and the shipped dict is checked as shipped.

CPU, small shapes, dynamo with a capturing ``aot_eager`` backend (what the graphs hold after AOT
autograd: custom ops' fake and autograd registrations are exercised). ``benchmarks/bench_stacking.py``
measures what the policy buys under inductor.
"""
from __future__ import annotations

import types

import pytest
import torch
from adopter.kernels import backend, conv_bn, guarded, linear_bn, policy
from adopter.kernels.guarded_gated_mlp import gated_mlp
from adopter.kernels.guarded_linear_cross_entropy import KEEP_LOGITS_ENV, LogitsNotComputedWarning, linear_cross_entropy
from adopter.kernels.guarded_rms_norm import rms_norm
from adopter.kernels.guarded_rotary import rotary
from adopter.kernels.telemetry import ORIGINAL, count_kernel_calls
from test_execution_modes_llm import _capturing_aot_eager  # (aot_eager recording each captured call)
from torch import nn

pytestmark = pytest.mark.filterwarnings(f"ignore::{LogitsNotComputedWarning.__module__}.LogitsNotComputedWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.delenv(KEEP_LOGITS_ENV, raising=False)
    monkeypatch.delenv(policy.OFF_ENV, raising=False)
    # (the fold at these small shapes: whether it pays unfrozen is guarded.py's size rule, not this file's)
    monkeypatch.setattr(guarded, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", float("inf"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _Head(nn.Module):
    """A rewritten causal LM's head and transformers' loss."""

    def __init__(self, hidden=16, vocab=37):
        super().__init__()
        from transformers.loss.loss_utils import ForCausalLMLoss

        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.loss_function = ForCausalLMLoss
        self.vocab_size = vocab

    def forward(self, h, labels):
        return linear_cross_entropy(self.lm_head, h, self.loss_function, labels=labels, vocab_size=self.vocab_size)


def _subject(kernel: str):
    """``(fn, make_inputs, params)``: a call of the guarded kernel that fuses in eager."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if kernel == "rms_norm":
        weight = nn.Parameter(torch.randn(32))
        return (lambda x: rms_norm(x, weight, 1e-6)), (lambda: (torch.randn(3, 5, 32, generator=g),)), [weight]
    if kernel == "rotary":
        def inputs():
            return (torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g),
                    torch.randn(2, 1, 5, 8, generator=g))
        site = types.SimpleNamespace(rotate_half=_rotate_half)
        return (lambda x, cos, sin: rotary(x, cos, sin, site.rotate_half)), inputs, []
    if kernel == "gated_mlp":
        layers = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False)
        act = nn.SiLU()
        return ((lambda x: gated_mlp(*layers, act, x)), (lambda: (torch.randn(2, 5, 16, generator=g),)),
                [p for m in layers for p in m.parameters()])
    if kernel == "linear_cross_entropy":
        pytest.importorskip("transformers")
        head = _Head()

        def inputs():
            labels = torch.randint(0, 37, (2, 9), generator=g)
            labels[0, :4] = -100  # a masked prompt
            return torch.randn(2, 9, 16, generator=g), labels

        return (lambda h, labels: head(h, labels)[1]), inputs, list(head.parameters())
    if kernel in ("conv_bn", "linear_bn"):  # eval mode, running statistics: folded in eager
        layer = nn.Conv2d(3, 4, 3, padding=1) if kernel == "conv_bn" else nn.Linear(8, 4)
        bn = (nn.BatchNorm2d if kernel == "conv_bn" else nn.BatchNorm1d)(4).eval()
        with torch.no_grad():
            bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2.0), bn.weight.normal_(), bn.bias.normal_()
        call = conv_bn if kernel == "conv_bn" else linear_bn
        shape = (2, 3, 5, 5) if kernel == "conv_bn" else (4, 8)
        return ((lambda x: call(layer, bn, x)), (lambda: (torch.randn(*shape, generator=g),)),
                [*layer.parameters(), *bn.parameters()])
    raise AssertionError(kernel)


# what each fused kernel leaves in a captured graph; the original computations have none of it
FUSED_IN_GRAPH = {
    "rms_norm": "RMSNormFunction",
    "rotary": "addcmul",  # the rotated term added in place (the written expression adds)
    "gated_mlp": "GatedActFunction",
    "linear_cross_entropy": "adopter.linear_cross_entropy",
    "conv_bn": "batch_norm_fold.py",  # the fold's ops on the parameters, traced from there
    "linear_bn": "batch_norm_fold.py",
}
# what the original computation leaves instead (dynamo's graph: torch functions)
ORIGINAL_IN_GRAPH = {
    "rms_norm": "method rsqrt",
    "rotary": "method cat",  # rotate_half's
    "gated_mlp": "function silu",
    "linear_cross_entropy": "function cross_entropy",
    "conv_bn": "function batch_norm",
    "linear_bn": "function batch_norm",
}


def _run(fn, inputs, params):
    """Output (the loss for the LM head) and the gradients of a weighted sum of it, with respect to
    the parameters and the first input (rotary angles take no gradient: the fused rotation's
    precondition)."""
    inputs = (inputs[0].requires_grad_(), *inputs[1:])
    out = fn(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    wrt = [*params, *(t for t in inputs if t.requires_grad)]
    return out, torch.autograd.grad((out * weights).sum(), wrt)


def _compiled_graph(kernel: str) -> tuple[str, tuple, tuple]:
    """What the compiled (``fullgraph=True``) call captured, and (compiled, eager) results on the
    same inputs."""
    fn, make_inputs, params = _subject(kernel)
    inputs = make_inputs()
    seen: list[str] = []
    compiled = torch.compile(fn, backend=_capturing_aot_eager(seen), fullgraph=True)
    got = _run(compiled, [t.clone() for t in inputs], params)
    with count_kernel_calls() as counted:
        want = _run(fn, [t.clone() for t in inputs], params)
    assert {c.kernel for c in counted.calls if c.backend != ORIGINAL} == {kernel}, "the eager call must fuse"
    return "\n".join(seen), got, want


def _assert_same(got, want):
    (out, grads), (ref, ref_grads) = got, want
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", sorted(FUSED_IN_GRAPH))
def test_listed_kernel_runs_its_original_math_when_compiled(monkeypatch, kernel):
    monkeypatch.setitem(policy.COMPILE_POLICY, kernel, "test: inductor fuses it")
    captured, got, want = _compiled_graph(kernel)
    assert FUSED_IN_GRAPH[kernel] not in captured, f"{kernel}: the fused form is in the compiled graph"
    assert ORIGINAL_IN_GRAPH[kernel] in captured, f"{kernel}: the original computation is not in the graph"
    _assert_same(got, want)


@pytest.mark.parametrize("kernel", sorted(FUSED_IN_GRAPH))
def test_unlisted_kernel_keeps_its_fused_form_when_compiled(monkeypatch, kernel):
    monkeypatch.setattr(policy, "COMPILE_POLICY", {k: v for k, v in policy.COMPILE_POLICY.items() if k != kernel})
    captured, got, want = _compiled_graph(kernel)
    assert FUSED_IN_GRAPH[kernel] in captured, f"{kernel}: the fused form is not in the compiled graph"
    _assert_same(got, want)


@pytest.mark.parametrize("kernel", sorted(FUSED_IN_GRAPH))
def test_shipped_policy_as_shipped(kernel):
    captured, got, want = _compiled_graph(kernel)
    listed = kernel in policy.COMPILE_POLICY
    assert (FUSED_IN_GRAPH[kernel] in captured) is not listed, (kernel, policy.COMPILE_POLICY)
    _assert_same(got, want)


def test_shipped_policy_names_known_kernels_with_reasons():
    known = {"linear_gelu", "dropout_add_layer_norm", "qkv", "conv_bn", "linear_bn", "add_relu", *FUSED_IN_GRAPH}
    for kernel, reason in policy.COMPILE_POLICY.items():
        assert kernel in known, kernel
        assert isinstance(reason, str) and reason.strip(), kernel
    # the fused LM-head loss is kept under compile: inductor cannot avoid the (tokens x vocab) logits
    assert "linear_cross_entropy" not in policy.COMPILE_POLICY


def test_policy_leaves_eager_calls_fused(monkeypatch):
    for kernel in FUSED_IN_GRAPH:
        monkeypatch.setitem(policy.COMPILE_POLICY, kernel, "test")
    for kernel in FUSED_IN_GRAPH:
        fn, make_inputs, params = _subject(kernel)
        with count_kernel_calls() as counted:
            _run(fn, make_inputs(), params)
        assert [c.backend for c in counted.calls if c.kernel == kernel] != [ORIGINAL], kernel
        assert all(c.backend != ORIGINAL for c in counted.calls if c.kernel == kernel), kernel


def test_switched_off_kernel_runs_original_in_eager_only_while_the_block_runs():
    fn, make_inputs, params = _subject("rms_norm")
    with policy.kernels_off("rms_norm"), count_kernel_calls() as off:
        _run(fn, make_inputs(), params)
    with count_kernel_calls() as on:
        _run(fn, make_inputs(), params)
    assert [c.backend for c in off.calls] == [ORIGINAL]
    assert [c.backend for c in on.calls] != [ORIGINAL]
