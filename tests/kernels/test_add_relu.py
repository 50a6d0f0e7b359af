"""Residual add + ReLU (``adopter.kernels.add_relu(activation, x, residual, in_place=False)``) and the
provenance of finite tensors it rests on (``adopter.kernels.ops.finite``).

* the fused path (aten ``_add_relu``/``_add_relu_``) gives ``activation(x + residual)`` bit for bit, in
  aten's layout, for every ReLU form, both layouts, float32/float64, in place or not, with operands
  known finite by a check or by ``conv_bn``;
* in place: ``x`` holds the sum afterwards unless it provably cannot be seen (a ReLU that writes a
  new tensor is not written into a list's, a view's or a second name's tensor);
* a NaN or an infinity reaches the output as ``torch.relu`` passes it on (``_add_relu`` would give 0):
  operands not known finite, or known finite and written since, take the original ops;
* every other fallback (activation, gradients, dtypes, shapes, layouts, modes, hooks, fx,
  torch.compile) computes what the source computed, and says why;
* ``conv_bn``'s ReLU epilogue (oneDNN turns a NaN into 0) runs only on finite data.
"""
from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from adopter.kernels import add_relu, conv_bn, count_kernel_calls, freeze, guarded
from adopter.kernels.ops import finite
from adopter.kernels.policy import kernels_off
from test_conv_bn_activation import (  # (the activation zoo, conv + BN pairs, routes)
    ACTIVATIONS,
    FUSED,
    RELU_OPS,
    _input,
    _pair,
    _reference,
    _route,
)
from torch import nn

NAN, INF = float("nan"), float("inf")
# an odd size: the last elements fall in aten's scalar tail loop, where _add_relu turns a NaN into 0
# (its vectorized body happens to keep it): a NaN is put there for the fused path to lose
SHAPE = (3, 5, 5, 5)


@pytest.fixture(autouse=True)
def _fresh_provenance():
    finite.forget()
    yield
    finite.forget()


def _calls(counted) -> list[tuple[str, str]]:
    """(backend, reason) of each add_relu call counted."""
    return [(c.backend, c.reason) for c in counted.calls if c.kernel == "add_relu" for _ in range(c.count)]


def _original(act, x, r, in_place):
    """What the source computes, on copies: ``(result, x afterwards)``."""
    act = copy.deepcopy(act) if isinstance(act, nn.Module) else act
    x = x.clone()
    if in_place:
        x += r
        return act(x), x
    return act(x + r), x


def _tensor(layout="contiguous", dtype=torch.float32, shape=SHAPE, *, seed=0):
    torch.manual_seed(seed)
    t = torch.randn(*shape, dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else t


def _known_pair(layout="contiguous", dtype=torch.float32, provenance="check"):
    """Two operands of SHAPE (mixed signs) known finite: checked, or computed by conv_bn from a
    checked input as in a residual block (``y = bn2(conv2(relu(bn1(conv1(x)))))``, residual ``x``)."""
    if provenance == "check":
        x, r = _tensor(layout, dtype, seed=1), _tensor(layout, dtype, seed=2)
        assert finite.check(x) and finite.check(r)
        return x, r
    c = SHAPE[1]
    conv1, bn1 = _pair(nn.Conv2d(c, c, 3, padding=1), seed=3, frozen=False)
    conv2, bn2 = _pair(nn.Conv2d(c, c, 1), seed=4, frozen=False)
    for m in (conv1, bn1, conv2, bn2):
        freeze(m.to(dtype))  # (frozen after .to(): new buffers are not the tensors frozen)
    r = _tensor(layout, dtype, seed=5)
    with torch.no_grad():
        y = conv_bn(conv2, bn2, conv_bn(conv1, bn1, r, nn.ReLU()))
    assert finite.known(y) and finite.known(r), "conv_bn records what it computed from finite data"
    assert (y < 0).any() and (y > 0).any()
    return y, r


# ---------------------------------------------------------------- 1. the fused path


@pytest.mark.parametrize("provenance", ["check", "conv_bn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("act_name", sorted(FUSED))
def test_fused_path_equals_the_original(act_name, in_place, layout, dtype, provenance):
    act = ACTIVATIONS[act_name]()
    x, r = _known_pair(layout, dtype, provenance)
    x_before, r_before = x.clone(), r.clone()
    want, _ = _original(act, x, r, in_place)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(act, x, r, in_place=in_place)
    assert _calls(counted) == [("torch", "")]
    assert torch.equal(out, want)
    assert out.dtype == want.dtype and out.stride() == want.stride()
    assert (want == 0).any() and (want > 0).any()  # the ReLU clips something
    assert torch.equal(r, r_before)
    if in_place:
        assert out is x, "in place: the sum's tensor is reused"
    else:
        assert out is not x and torch.equal(x, x_before)
    assert finite.known(out), "the fused result is recorded finite (a next kernel need not check it)"


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_mixed_dense_layouts_give_aten_strides(layout):
    other = "channels_last" if layout == "contiguous" else "contiguous"
    x, r = _tensor(layout, seed=1), _tensor(other, seed=2)
    finite.check(x), finite.check(r)
    want = torch.relu(x + r)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(F.relu, x, r)
    assert _calls(counted) == [("torch", "")]
    assert torch.equal(out, want) and out.stride() == want.stride()


def test_requires_grad_operands_under_no_grad_are_fused():
    x, r = _known_pair()
    x.requires_grad_(), r.requires_grad_()
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r)
    assert _calls(counted) == [("torch", "")]
    assert torch.equal(out, torch.relu(x.detach() + r.detach())) and not out.requires_grad


# ---------------------------------------------------------------- 2. in place: who sees the sum


def test_in_place_fuses_after_a_compiled_run_changed_the_frames_reference_counts():
    # Found by test order: after this fuzz case (a fused conv+BN module compiled with aot_eager), every
    # Python frame held one more reference to its arguments, and an in-place add_relu whose x only the
    # caller held was taken for shared (a count measured once at import). The count is measured per call.
    import fuzz_cases as fc

    fc.run_case(*fc.case_from_id("fused_conv_bn_module|compile_aot_eager/no_grad/requires_grad_off+train_call|s0"))
    x, r = _known_pair()
    want = torch.relu(x + r)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=True)
    assert _calls(counted) == [("torch", "")]
    assert out is x and torch.equal(out, want)


def test_in_place_relu_writes_into_x_even_when_x_is_referenced():
    x, r = _known_pair()
    x0 = x.clone()
    holder = [x]  # (an in-place ReLU writes into x in the source too: no reference matters)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(inplace=True), x, r, in_place=True)
    assert _calls(counted) == [("torch", "")]
    assert out is x and holder[0] is x
    assert torch.equal(x, torch.relu(x0 + r))


def test_unreferenced_x_takes_the_relu_of_a_new_tensor_relu():
    x, r = _known_pair()
    x0 = x.clone()
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=True)
    assert _calls(counted) == [("torch", "")]
    assert out is x and torch.equal(out, torch.relu(x0 + r))


def _shared(how: str):
    """``(x, r, holder)``: operands known finite, ``x`` also reachable through ``holder``."""
    x, r = _known_pair()
    if how == "list":
        return x, r, [x]
    if how == "second name":
        return x, r, x
    if how == "view of x":
        return x, r, x.view(-1)
    if how == "detached alias":  # (another tensor on x's storage, not a view: the storage tells)
        return x, r, x.detach()
    if how == "x is a view":
        base = torch.randn(3, *SHAPE)
        x = base[1]
        x.copy_(r.flip(0))
        finite.check(x)
        return x, r, base
    if how == "residual is x":
        return x, x, None
    raise AssertionError(how)


@pytest.mark.parametrize("act_name", ["ReLU", "F.relu", "torch.relu"])
@pytest.mark.parametrize("how", ["list", "second name", "view of x", "detached alias", "x is a view", "residual is x"])
def test_in_place_x_seen_elsewhere_keeps_the_sum(how, act_name):
    act = ACTIVATIONS[act_name]()
    x, r, holder = _shared(how)
    assert finite.known(x) and finite.known(r)
    x0, r0 = x.clone(), r.clone()
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(act, x, r, in_place=True)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and "referenced or viewed" in reason, reason
    assert out is not x
    assert torch.equal(x, x0 + r0), "x holds the sum, as after `x += r`"
    assert torch.equal(out, torch.relu(x0 + r0))
    if how == "list":
        assert holder[0] is x
    if how == "view of x":
        assert torch.equal(holder, (x0 + r0).view(-1))
    if how == "detached alias":
        assert torch.equal(holder, x0 + r0)
    if how == "x is a view":
        assert torch.equal(holder[1], x0 + r0)


# ---------------------------------------------------------------- 3. NaN and infinity


def _assert_same_with_nan(out, want):
    assert want.isnan().any()
    assert torch.equal(out.isnan(), want.isnan()), f"{int(out.isnan().sum())} NaN, want {int(want.isnan().sum())}"
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert out.stride() == want.stride()


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("bad", ["x-nan", "residual-nan", "x-inf+residual-minus-inf"])
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_nonfinite_operands_keep_the_nan(bad, in_place, checked):
    x, r = _tensor(seed=1), _tensor(seed=2)
    if bad == "x-nan":
        x[0, 1, 2, 3] = x[-1, -1, -1, -1] = NAN
    elif bad == "residual-nan":
        r[1, 0, 0, 0] = r[-1, -1, -1, -1] = NAN
    else:
        x[-1, -1, -1, -1], r[-1, -1, -1, -1] = INF, -INF
        x[0, 0, 0, 0] = INF
    if checked:
        assert not (finite.check(x) and finite.check(r))
        assert not (finite.known(x) and finite.known(r))
    want, _ = _original(nn.ReLU(), x, r, in_place)
    assert not torch.equal(torch._add_relu(x, r).isnan(), want.isnan()), "the fused kernel would lose a NaN"
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    assert _calls(counted) == [("original", "operands not known finite (a NaN would become 0)")]
    _assert_same_with_nan(out, want)
    if bad.startswith("x-inf"):
        assert out[0, 0, 0, 0] == INF
    assert not finite.known(out)


def _write_nan(t: torch.Tensor, how: str) -> None:
    if how == "add_":
        t.add_(NAN)
    elif how == "setitem":
        t[-1, -1] = NAN
    elif how == "through a view":
        t.view(-1)[-1] = NAN
    elif how == "through detach":
        t.detach()[-1, -1, -1, -1] = NAN
    elif how == "in inference_mode":
        with torch.inference_mode():
            t[-1, -1, -1, -1] = NAN
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("operand", ["x", "residual"])
@pytest.mark.parametrize("how", ["add_", "setitem", "through a view", "through detach", "in inference_mode"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_known_finite_written_since_is_no_longer_known(how, operand, in_place):
    x, r = _known_pair()
    _write_nan(x if operand == "x" else r, how)
    assert not finite.known(x if operand == "x" else r)
    assert finite.known(r if operand == "x" else x), "the other operand is still known"
    want, _ = _original(nn.ReLU(), x, r, in_place)
    assert not torch.equal(torch._add_relu(x, r).isnan(), want.isnan()), "the fused kernel would lose a NaN"
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    assert _calls(counted) == [("original", "operands not known finite (a NaN would become 0)")]
    _assert_same_with_nan(out, want)


def test_fused_aten_kernel_would_turn_the_nan_into_zero():
    # why the guard exists (and what the NaN tests above would catch): aten's _add_relu gives 0 (in
    # its scalar loop: a 3-element tensor is all tail)
    x, r = torch.tensor([NAN, -1.0, 2.0]), torch.zeros(3)
    assert torch.relu(x + r).isnan()[0]
    assert torch._add_relu(x, r)[0] == 0
    finite.mark(x), finite.mark(r)  # (a false record: the kernel trusts provenance, reads nothing)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(F.relu, x, r)
    assert _calls(counted) == [("torch", "")] and out[0] == 0


# ---------------------------------------------------------------- 4. fallbacks


def _instance_forward_relu():
    relu = nn.ReLU()
    relu.forward = lambda t: torch.relu(t) * 3.0  # (accelerate-style wrapper on the instance)
    return relu


FALLBACK_ACTIVATIONS = {
    **{name: make for name, make in ACTIVATIONS.items() if name not in FUSED},
    "GELU": nn.GELU,
    "ReLU6": nn.ReLU6,
    "LeakyReLU": nn.LeakyReLU,
    "ReLU-instance-forward": _instance_forward_relu,
}


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("act_name", sorted(FALLBACK_ACTIVATIONS))
def test_other_activations_are_called(act_name, in_place):
    act = FALLBACK_ACTIVATIONS[act_name]()
    x, r = _known_pair()
    reference = FALLBACK_ACTIVATIONS[act_name]()
    want, x_after = _original(reference, x, r, in_place)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(act, x, r, in_place=in_place)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and reason.endswith("not a ReLU"), reason
    assert torch.equal(out, want) and out.stride() == want.stride()
    assert torch.equal(x, x_after), "x holds what it holds after the source's statements"
    if act_name == "ReLU-hooked":
        assert act.calls == 1


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("act_name", sorted(FUSED))
def test_gradients_recorded_take_the_original_ops_and_flow(act_name, in_place):
    act = ACTIVATIONS[act_name]()
    torch.manual_seed(0)
    a = torch.randn(SHAPE, requires_grad=True)
    r = torch.randn(SHAPE, requires_grad=True)
    grad_out = torch.randn(SHAPE)

    def inputs():
        x = a * 1.5  # (not a leaf: the in-place add is allowed)
        finite.check(x), finite.check(r)
        return x

    ref_x = inputs()
    if in_place:
        ref_x += r
        want = act(ref_x)
    else:
        want = act(ref_x + r)
    want_grads = torch.autograd.grad(want, (a, r), grad_out)
    x = inputs()
    assert finite.known(x) and finite.known(r)
    with count_kernel_calls() as counted:
        out = add_relu(act, x, r, in_place=in_place)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and "gradient recorded" in reason, reason
    assert out.requires_grad and torch.equal(out, want)
    grads = torch.autograd.grad(out, (a, r), grad_out)
    for got, expected in zip(grads, want_grads):
        assert torch.equal(got, expected)
    assert (grads[0] == 0).any() and (grads[0] != 0).any()  # the ReLU's mask is in the gradient


def _operands(case: str):
    """(x, residual, expected reason fragment) for an operand the fused kernel does not take; each
    tensor operand is known finite, so only the named property sends the call to the original."""
    x, r = _tensor(seed=1), _tensor(seed=2)
    if case == "bfloat16":
        x, r = x.bfloat16(), r.bfloat16()
        why = "dtypes"
    elif case == "float16":
        x, r = x.half(), r.half()
        why = "dtypes"
    elif case == "float32+float64":
        r = r.double()
        why = "dtypes"
    elif case == "float64+float32":
        x = x.double()
        why = "dtypes"
    elif case == "broadcast (1,C,1,1)":
        r = r[:1, :, :1, :1].clone()
        why = "differ in shape"
    elif case == "broadcast (C,1,1)":
        r = r[0, :, :1, :1].clone()
        why = "differ in shape"
    elif case == "x transposed":
        x = x.transpose(2, 3)
        why = "not dense"
    elif case == "x sliced":
        x = torch.randn(*SHAPE[:3], 2 * SHAPE[3])[..., ::2]
        why = "not dense"
    elif case == "residual a float":
        r = 0.25
        why = "not plain tensors"
    elif case == "residual a Parameter":
        r = nn.Parameter(r, requires_grad=False)
        why = "not plain tensors"
    else:
        raise AssertionError(case)
    for t in (x, r):
        if isinstance(t, torch.Tensor):
            assert finite.check(t)
    return x, r, why


OPERAND_CASES = ["bfloat16", "float16", "float32+float64", "float64+float32", "broadcast (1,C,1,1)",
                 "broadcast (C,1,1)", "x transposed", "x sliced", "residual a float", "residual a Parameter"]


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("case", OPERAND_CASES)
def test_operands_the_kernel_does_not_take(case, in_place):
    x, r, why = _operands(case)
    want, x_after = _original(nn.ReLU(), x, r, in_place)
    with torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and why in reason, reason
    assert torch.equal(out, want)
    assert out.shape == want.shape and out.dtype == want.dtype and out.stride() == want.stride()
    assert torch.equal(x, x_after)


class _LoggingMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_torch_function_mode_sees_the_original_ops():
    x, r = _known_pair()
    want = torch.relu(x + r)
    with torch.no_grad(), count_kernel_calls() as counted, _LoggingMode() as mode:
        out = add_relu(torch.relu, x, r)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and "mode" in reason, reason
    assert torch.equal(out, want)
    assert "_add_relu" not in mode.names and "relu" in mode.names and any("add" in n for n in mode.names)


def test_torch_dispatch_mode_sees_the_original_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, r = _known_pair()
    want = torch.relu(x + r)
    with torch.no_grad(), count_kernel_calls() as counted, Log():
        out = add_relu(nn.ReLU(), x, r)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and "mode" in reason, reason
    assert torch.equal(out, want)
    assert not any("_add_relu" in s for s in seen) and any("relu" in s for s in seen), seen


def test_global_module_hooks_see_the_relu():
    x, r = _known_pair()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        with torch.no_grad(), count_kernel_calls() as counted:
            out = add_relu(nn.ReLU(), x, r)
    finally:
        handle.remove()
    assert _calls(counted) == [("original", "tracing or global hooks")]
    assert seen == ["ReLU"] and torch.equal(out, torch.relu(x + r))


def test_switched_off():
    x, r = _known_pair()
    with kernels_off("add_relu"), torch.no_grad(), count_kernel_calls() as counted:
        out = add_relu(F.relu, x, r)
    [(backend, reason)] = _calls(counted)
    assert backend == "original" and "switched off" in reason
    assert torch.equal(out, torch.relu(x + r))


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_inference_mode_tensors_are_never_known(in_place):
    with torch.inference_mode():
        x, r = _tensor(seed=1), _tensor(seed=2)
        assert finite.check(x) and finite.check(r)
        want, _ = _original(nn.ReLU(), x, r, in_place)
        with count_kernel_calls() as counted:
            out = add_relu(nn.ReLU(), x, r, in_place=in_place)
    assert _calls(counted) == [("original", "operands not known finite (a NaN would become 0)")]
    assert torch.equal(out, want)


class _Block(nn.Module):
    def __init__(self, act, in_place):
        super().__init__()
        self.act = act
        self.in_place = in_place

    def forward(self, x, r):
        return add_relu(self.act, x, r, in_place=self.in_place)


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("act_name", sorted(FUSED))
def test_fx_traces_the_original_add_and_relu(act_name, in_place):
    act = ACTIVATIONS[act_name]()
    block = _Block(act, in_place)
    with count_kernel_calls() as counted:
        traced = torch.fx.symbolic_trace(block)
    assert _calls(counted) == [("original", "tracing or global hooks")]
    nodes = [(n.op, n.target) for n in traced.graph.nodes]
    assert any(t in (operator.add, operator.iadd, torch.add) for op, t in nodes if op == "call_function"), nodes
    if isinstance(act, nn.Module):
        assert ("call_module", "act") in nodes, nodes
    else:
        assert ("call_function", act) in nodes, nodes
    assert "_add_relu" not in traced.code
    x, r = _known_pair()
    with torch.no_grad():
        got = traced(x.clone(), r.clone())
    assert torch.equal(got, torch.relu(x + r))
    xn = x.clone()
    xn[0, 0, 0, 0] = xn[-1, -1, -1, -1] = NAN
    with torch.no_grad():
        assert torch.equal(traced(xn.clone(), r).isnan(), torch.relu(xn + r).isnan())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_torch_compile_one_graph_original_math(backend, in_place):
    torch._dynamo.reset()
    block = _Block(nn.ReLU(inplace=True), in_place)
    compiled = torch.compile(block, backend=backend, fullgraph=True)  # (a graph break raises)
    x, r = _known_pair()
    want = torch.relu(x + r)
    eager_x = x.clone()
    finite.check(eager_x)
    with torch.no_grad(), count_kernel_calls() as counted:
        assert torch.equal(block(eager_x, r), want)  # (eagerly these operands take the fused path)
        got = compiled(x.clone(), r)
    assert _calls(counted) == [("torch", "")], "calls inside compiled code are not counted"
    assert torch.equal(got, want)
    xn = x.clone()
    xn[0, 0, 0, 0] = xn[-1, -1, -1, -1] = NAN
    with torch.no_grad():
        got = compiled(xn.clone(), r)
    assert torch.equal(got.isnan(), torch.relu(xn + r).isnan()), "no fused _add_relu in the graph: the NaN stays"
    torch._dynamo.reset()


# ---------------------------------------------------------------- 5. finite.py


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_check_answers_and_records_only_finite(value):
    t = torch.randn(3, 4)
    assert not finite.known(t)
    assert finite.check(t) and finite.known(t)
    bad = torch.randn(3, 4)
    bad[2, 1] = value
    assert not finite.check(bad) and not finite.known(bad)
    assert not finite.check(bad), "a nonfinite tensor is read again, never recorded"
    assert finite.check(torch.empty(0, 4))


def test_check_of_a_known_tensor_does_not_read_it():
    t = torch.randn(16)
    assert finite.check(t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert finite.check(t)
    assert not any(e.name in ("aten::sum", "aten::isfinite") for e in prof.events())


def test_known_is_per_tensor_and_per_version():
    t = torch.randn(2, 6)
    finite.mark(t)
    assert finite.known(t)
    assert not finite.known(t.clone()) and not finite.known(t.view(12)) and not finite.known(t[0])
    t.mul_(2.0)  # (still finite, but written: not known any more)
    assert not finite.known(t)
    assert finite.check(t) and finite.known(t)


@pytest.mark.parametrize("how", ["add_", "setitem", "through a view", "through detach", "in inference_mode"])
def test_known_is_invalidated_by_writes(how):
    t = _tensor()
    assert finite.check(t)
    _write_nan(t, how)
    assert not finite.known(t)
    assert not finite.check(t)


def test_a_dead_tensors_record_does_not_pass_to_a_new_one_at_its_address():
    t = torch.randn(3)
    finite.mark(t)
    address = id(t)
    del t
    keep = []
    for _ in range(200):
        u = torch.randn(3)
        if id(u) == address:
            assert not finite.known(u)
            return
        keep.append(u)
    pytest.skip("no tensor reused the address")


def test_inference_tensors_are_checked_but_never_recorded():
    with torch.inference_mode():
        good, bad = torch.randn(5), torch.randn(5)
        bad[3] = NAN
        assert finite.check(good) and not finite.known(good)
        finite.mark(good)
        assert not finite.known(good)
        assert not finite.check(bad)
        good[0] = NAN  # (no version counter: a record could not tell this)
        assert not finite.check(good)
    assert not finite.check(bad) and not finite.known(bad)


def test_forget_clears_every_record():
    ts = [torch.randn(4) for _ in range(3)]
    assert all(finite.check(t) for t in ts) and all(finite.known(t) for t in ts)
    finite.forget()
    assert not any(finite.known(t) for t in ts)


def test_records_are_bounded_and_the_newest_survives():
    ts = [torch.randn(1) for _ in range(finite._LIMIT + 50)]
    for t in ts:
        finite.mark(t)
    assert len(finite._KNOWN) <= finite._LIMIT
    assert finite.known(ts[-1])


# ---------------------------------------------------------------- 6. conv_bn: the ReLU epilogue on finite data only

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")


def _nonfinite_input(batch, layout, value):
    x = _input(batch, layout)
    # two channels at one pixel: infinities of both signs meet in a sum (NaN) for some filters
    x[0, 0, 2, 3] = x[0, 5, 2, 3] = value
    x[-1, 3, 0, 1] = x[-1, 7, 0, 1] = value
    return x


def _relu_ops(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name in RELU_OPS for e in prof.events())


@needs_onednn
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("act_name", sorted(FUSED))
def test_conv_bn_relu_epilogue_keeps_nan(act_name, layout, batch, value):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    act = ACTIVATIONS[act_name]()
    x_ok = _input(batch, layout)
    assert _route(conv, x_ok, attr="relu"), "this conv takes a oneDNN route: the epilogue would be used"
    with torch.no_grad():
        conv_bn(conv, bn, x_ok, act)  # (the first call in a process also probes oneDNN: not profiled)
        assert _relu_ops(lambda: conv_bn(conv, bn, x_ok, act)) == 0, "finite data: the ReLU is in the epilogue"
    x = _nonfinite_input(batch, layout, value)
    want = _reference(conv, bn, x, act)
    assert want.isnan().any()
    with torch.no_grad():
        got = conv_bn(conv, bn, x, act)
        assert _relu_ops(lambda: conv_bn(conv, bn, x, act)) > 0, "nonfinite data: the ReLU is called"
    assert int(got.isnan().sum()) == int(want.isnan().sum())
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert got.stride() == want.stride()
    assert not finite.known(got) and not finite.known(x)


@needs_onednn
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_bn_epilogue_without_the_finite_guard_would_lose_the_nan(layout, monkeypatch):
    # what the test above guards against: oneDNN's ReLU post-op gives 0 for a NaN
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _nonfinite_input(4, layout, NAN)
    want = _reference(conv, bn, x, nn.ReLU())
    monkeypatch.setattr(guarded, "fold_output_bound", lambda x, pq: 1.0)  # (the guard says: in range)
    with torch.no_grad():
        got = conv_bn(conv, bn, x, nn.ReLU())
    assert int(got.isnan().sum()) < int(want.isnan().sum())


@needs_onednn
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("where", ["conv weight", "negative running_var"])
def test_conv_bn_nonfinite_fold_keeps_nan(where, layout):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _input(4, layout)
    with torch.no_grad():
        conv_bn(conv, bn, x, nn.ReLU())  # (a fold cached as finite first: a change must be seen)
        if where == "conv weight":
            conv.weight[3, 0, 1, 1] = NAN
        else:
            bn.running_var[5] = -1.0
    want = _reference(conv, bn, x, nn.ReLU())
    assert want.isnan().any()
    with torch.no_grad():
        got = conv_bn(conv, bn, x, nn.ReLU())
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert not finite.known(got)


@needs_onednn
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_bn_records_what_it_computed_from_finite_data(layout):
    conv, bn = _pair(nn.Conv2d(16, 24, 3, padding=1))
    x = _input(2, layout)
    with torch.no_grad():
        out = conv_bn(conv, bn, x)  # (the range guard reads x once: recorded with its bound)
        assert finite.known(x) and finite.known(out) and finite.bound(out) < float("inf")
        assert finite.known(conv_bn(conv, bn, x, nn.ReLU())), "from a known input"
        x_nan = _nonfinite_input(2, layout, NAN)
        assert not finite.known(conv_bn(conv, bn, x_nan, nn.ReLU()))
    bn.train()
    with torch.no_grad():
        assert not finite.known(conv_bn(conv, bn, x, nn.ReLU())), "training: BN unfolded, nothing recorded"
    bn.eval()
    x_grad = x.clone().requires_grad_()
    assert not finite.known(conv_bn(conv, bn, x_grad, nn.ReLU())), "gradients: an uncached fold, nothing recorded"


@needs_onednn
def test_conv_bn_then_add_relu_fuses_and_a_nan_input_does_not():
    c = 16
    conv1, bn1 = _pair(nn.Conv2d(c, c, 3, padding=1), seed=1)
    conv2, bn2 = _pair(nn.Conv2d(c, c, 1), seed=2)

    def block(x):
        out = conv_bn(conv1, bn1, x, nn.ReLU())
        out = conv_bn(conv2, bn2, out)
        out = add_relu(nn.ReLU(), out, x, in_place=True)
        return out

    def reference(x):
        return torch.relu(bn2(conv2(torch.relu(bn1(conv1(x))))) + x)

    for x in (_input(2, "channels_last", channels=c), _nonfinite_input(2, "channels_last", NAN)):
        with torch.no_grad():
            want = reference(x.clone())
        x_before = x.clone()
        with torch.no_grad(), count_kernel_calls() as counted:
            got = block(x)
        torch.testing.assert_close(x, x_before, rtol=0, atol=0, equal_nan=True)  # (the block's input is not written)
        fused = not x.isnan().any()
        assert _calls(counted) == ([("torch", "")] if fused else
                                   [("original", "operands not known finite (a NaN would become 0)")])
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert got.stride() == want.stride()
