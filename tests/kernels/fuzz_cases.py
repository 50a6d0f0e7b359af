"""Differential fuzzing of ``adopter.kernels`` against the code each kernel replaces (shared by the
fast tier, ``tests/kernels/test_kernel_fuzz.py``, and the long tier, ``benchmarks/fuzz_kernels.py``).

Three tables and one comparison:

* :data:`ROWS` — one row per kernel form the rewrites emit: ``build(draw)`` draws the axes (dtype,
  shapes, layout, values, module configuration, subclasses, hooks, parametrizations...) from a
  seeded :class:`Draw` and returns a :class:`Spec`: how to build the user's modules (twice: one
  *world* runs the original code, the other the kernel), the inputs, the original callable and the
  kernel callable. Adding a kernel is adding a row.
* :data:`EXECS` / :data:`GRADS` / :data:`CHANGES` — how a call runs (eager, ``torch.fx``,
  ``torch.jit.trace``, ``torch.compile``), under which autograd mode (no_grad, inference_mode,
  backward, double backward, ``torch.func.grad``/``vmap``/``jvp``, forward AD, CPU autocast) and
  which state changes happen between calls (fused/foreach AdamW step, a train-mode call that moves
  BatchNorm statistics, ``.data`` writes, ``load_state_dict``, dtype round trips, hooks added...).
  A :class:`Mode` is one of each exec and grad mode plus a sequence of changes.
* :func:`run_case` builds both worlds from the same seed, runs the same sequence of calls and
  changes on both, and compares after every call: outputs (values within dtype tolerances, NaN/inf
  positions, dtype, shape, ``requires_grad``, memory layout), gradients of inputs and parameters
  (first and second order), tangents, the worlds' state (BatchNorm running statistics, parameters),
  the inputs (in-place writes), the RNG (the next draw after the call) and hook calls. An exception
  on both sides is a match; one on the kernel side only is a crash; one on the original side only a
  mismatch (the kernel computed something where the user's code raises).

Every case is named ``<row>|<exec>/<grad mode>/<changes>|s<seed>`` and reproduces from that name
alone (:func:`case_from_id`; the draws depend on this file, so a name is stable while it is unchanged)::

    python benchmarks/fuzz_kernels.py --cases 'conv_bn|eager/grad/once|s102002'

prints the drawn axes and every difference. A failing case is classified by :func:`classify` into
the kernel bugs of :data:`BUGS`. Where values differ, a float64 copy of the original's world is run
too and the kernel is judged by whether it is about as accurate as the original (low-precision
gradients are always judged so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import adopter.kernels as K
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from adopter.kernels import guarded as G
from adopter.kernels.ops import finite
from torch import nn

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
NAN, INF = float("nan"), float("inf")


def _is_proxy(x: Any) -> bool:
    return isinstance(x, torch.fx.Proxy)


# ====================================================================== draws


def _stable_hash(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def _show(value: Any) -> Any:
    """A JSON-friendly, readable form of a drawn value."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_show(v) for v in value]
    return getattr(value, "__name__", None) or repr(value)


class Draw:
    """Seeded axis choices (``random.Random``); every choice is recorded under its name."""

    def __init__(self, seed: int, salt: str = "", pins: dict | None = None) -> None:
        import random

        self.seed = seed
        self.rng = random.Random(_stable_hash(seed, salt))
        self.pins = dict(pins or {})
        self.choices: dict[str, Any] = {}

    def pick(self, name: str, options: list, weights: list | None = None) -> Any:
        if name in self.pins:
            value = self.pins[name]
        else:
            value = self.rng.choices(options, weights)[0] if weights else self.rng.choice(options)
        self.choices[name] = _show(value)
        return value

    def flag(self, name: str, p: float = 0.5) -> bool:
        return self.pick(name, [True, False], [p, 1 - p])

    def gen(self, *salt: Any) -> torch.Generator:
        return torch.Generator().manual_seed(_stable_hash(self.seed, *salt) & 0x7FFFFFFF)


def gen_for(*salt: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_stable_hash(*salt) & 0x7FFFFFFF)


# ====================================================================== tensors

VALUES = ["normal", "nan", "inf", "negzero", "large", "overflow", "tiny"]
VALUE_WEIGHTS = [14, 1, 1, 1, 1, 1, 1]
LAYOUTS = ["contiguous", "channels_last", "strided", "transposed", "expanded"]


def values(gen: torch.Generator, shape, dtype: torch.dtype, kind: str = "normal", scale: float = 1.0,
           positive: bool = False) -> torch.Tensor:
    """A tensor of ``shape`` drawn from ``gen``: normal values, or with NaN / +-inf / -0.0 entries,
    magnitudes whose squares (``large``) or sums (``overflow``) overflow ``dtype``, or tiny ones."""
    shape = tuple(shape)
    t = torch.randn(shape, generator=gen, dtype=F64) * scale
    if positive:
        t = t.abs() + 0.1
    n = t.numel()
    real = dtype if dtype.is_floating_point else F64
    if n and kind in ("nan", "inf", "negzero"):
        flat = t.view(-1)
        idx = torch.randperm(n, generator=gen)[: max(1, n // 7)]
        if kind == "nan":
            flat[idx] = NAN
        elif kind == "inf":
            flat[idx] = INF * torch.sign(torch.randn(idx.numel(), generator=gen, dtype=F64)).clamp(min=-1)
        else:
            flat[idx] = -0.0
    elif kind == "large":
        t = t * math.sqrt(torch.finfo(real).max) / 2
    elif kind == "overflow":
        t = t * torch.finfo(real).max / 3
    elif kind == "tiny":
        t = t * torch.finfo(real).tiny * 4
    if dtype.is_floating_point:
        return t.to(dtype)
    return t.to(dtype)


def lay(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in ``layout`` (a leaf: ``detach``ed views keep their strides); ``expanded``
    repeats ``t[:1]`` along dim 0 (a stride-0 tensor)."""
    if layout == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided" and t.dim() >= 1:
        big = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2].detach()
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2).detach()
    if layout == "expanded" and t.dim() >= 1 and t.shape[0] > 1:
        return t[:1].expand(t.shape).detach()
    return t.contiguous()


def pick_dtype(d: Draw, options=(F32, F64, BF16, F16), weights=(8, 2, 2, 1), name: str = "dtype") -> torch.dtype:
    return d.pick(name, list(options), list(weights))


def pick_values(d: Draw, name: str = "values") -> str:
    return d.pick(name, VALUES, VALUE_WEIGHTS)


# ====================================================================== module variants

_CALLS = {"hooks": 0}


class SubLinear(nn.Linear):
    """A subclass that does not override forward (computes what nn.Linear does)."""


class SubLinearForward(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


class SubLinearCall(nn.Linear):
    """Overrides ``__call__`` (not forward): what the user's code runs is the override."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) + 1.0


class CastedLinear(nn.Linear):
    def forward(self, input):
        return F.linear(input, self.weight.to(input.dtype), self.bias)


class SubConv(nn.Conv2d):
    pass


class SubConvForward(nn.Conv2d):
    def forward(self, x):
        return super().forward(x) - 0.25


class SubConvConvForward(nn.Conv2d):
    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight * 0.5, bias)


class SubBN2d(nn.BatchNorm2d):
    pass


class SubBN2dForward(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) + 0.5


class SubBN1d(nn.BatchNorm1d):
    pass


class SubBN1dForward(nn.BatchNorm1d):
    def forward(self, x):
        return super().forward(x) + 0.5


class SubLayerNorm(nn.LayerNorm):
    pass


class SubLayerNormForward(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 3.0


class SubDropout(nn.Dropout):
    pass


class ScaledGELU(nn.GELU):
    def forward(self, x):
        return super().forward(x) * 2.0


def _count_hook(*args, **kwargs):
    _CALLS["hooks"] += 1


def _double_output_hook(module, args, output):
    _CALLS["hooks"] += 1
    return output * 2 if isinstance(output, torch.Tensor) else output


def _pre_hook(module, args):
    _CALLS["hooks"] += 1


def _instance_forward(module: nn.Module) -> None:
    base = type(module).forward

    def forward(self, *args, **kwargs):
        return base(self, *args, **kwargs) * 0.5

    module.forward = types.MethodType(forward, module)


HOOKS = ["none", "forward_hook", "output_hook", "pre_hook", "backward_hook"]
HOOK_WEIGHTS = [40, 1, 1, 1, 1]


def hook(module: nn.Module, how: str) -> nn.Module:
    if how == "forward_hook":
        module.register_forward_hook(_count_hook)
    elif how == "output_hook":
        module.register_forward_hook(_double_output_hook)
    elif how == "pre_hook":
        module.register_forward_pre_hook(_pre_hook)
    elif how == "backward_hook":
        module.register_full_backward_hook(_count_hook)
    return module


def linear_variant(d: Draw, name: str, n_in: int, n_out: int, bias: bool, cls_options=None) -> Callable[[], nn.Module]:
    """A factory of the user's Linear in the drawn variant (plain, subclasses, instance forward,
    parametrizations) with the drawn hook."""
    options = cls_options or ["plain", "sub", "sub_forward", "sub_call", "instance_forward", "weight_norm",
                              "spectral_norm"]
    weights = [40] + [1] * (len(options) - 1)
    kind = d.pick(f"{name}.variant", options, weights)
    how = d.pick(f"{name}.hook", HOOKS, HOOK_WEIGHTS)

    def make():
        cls = {"sub": SubLinear, "sub_forward": SubLinearForward, "sub_call": SubLinearCall,
               "casted": CastedLinear}.get(kind, nn.Linear)
        m = cls(n_in, n_out, bias=bias)
        if kind == "instance_forward":
            _instance_forward(m)
        elif kind == "weight_norm":
            m = torch.nn.utils.parametrizations.weight_norm(m)
        elif kind == "spectral_norm":
            m = torch.nn.utils.parametrizations.spectral_norm(m)
        return hook(m, how)

    return make


# ====================================================================== specs


@dataclasses.dataclass
class Spec:
    """One drawn configuration of a kernel row."""

    world: Callable[[str], nn.Module]        # "orig" | "kern" -> the user's modules (a fresh, deterministic build)
    inputs: Callable[[torch.Generator], list]  # positional inputs (tensors) of both callables
    original: Callable[..., Any]              # original(world, *inputs): the code the kernel replaces
    kernel: Callable[..., Any]                # kernel(world, *inputs): the rewritten call
    dtype: torch.dtype                        # for the tolerance
    extreme: bool = False                     # inputs with magnitudes that overflow or underflow: ill-conditioned
    train: bool = False                       # the worlds' mode for ordinary calls
    context: Callable[[], Any] | None = None  # around everything the kernel side runs (e.g. QKV on CPU)
    accept: Callable[[list, list], tuple[list, list, str]] | None = None  # documented differences
    tol: tuple[float, float] | None = None    # (rtol, atol relative to the output's magnitude)
    params_grad: bool = True
    vmap_ok: bool = True
    freeze: bool = False                      # adopter.kernels.freeze(kernel world); the original: eval, no grad
    hooks_comparable: bool = True             # False where the kernel's modules differ in structure (Fused*)
    grad_outputs: tuple[int, ...] | None = None  # the outputs gradients flow from (None: all)
    documented: str = ""                      # a difference here is a documented limitation (the reason)


def _seeded_world(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed & 0x7FFFFFFF)
        return build()


def _bn_stats(bn: nn.Module, gen: torch.Generator, how: str) -> None:
    if bn.running_mean is None:
        return
    n = bn.running_mean.numel()
    with torch.no_grad():
        if how == "default":
            return
        bn.running_mean.copy_(torch.randn(n, generator=gen, dtype=F64))
        var = torch.rand(n, generator=gen, dtype=F64) * 1.5 + 0.5
        if how == "tiny_var":
            var = var * 1e-9
        elif how == "zero_var":
            var = var * 0.0
        elif how == "huge_var":
            var = var * 1e30
        bn.running_var.copy_(var)
        if bn.weight is not None:
            bn.weight.copy_(torch.randn(n, generator=gen, dtype=F64))
            bn.bias.copy_(torch.randn(n, generator=gen, dtype=F64))
        bn.num_batches_tracked.fill_(3)


def _bn_config(d: Draw, prefix: str = "bn") -> dict:
    return {
        "affine": d.flag(f"{prefix}.affine", 0.85),
        "track_running_stats": d.flag(f"{prefix}.track", 0.9),
        "momentum": d.pick(f"{prefix}.momentum", [0.1, None, 0.7], [6, 2, 1]),
        "eps": d.pick(f"{prefix}.eps", [1e-5, 1e-3, 0.0], [6, 2, 1]),
    }


BN_STATS = ["random", "default", "tiny_var", "zero_var", "huge_var"]
BN_STATS_WEIGHTS = [12, 2, 1, 1, 1]


def _params_grad(world: nn.Module, on: bool) -> nn.Module:
    if not on:
        for p in world.parameters():
            p.requires_grad_(False)
    return world


# ---------------------------------------------------------------------- Conv2d + BatchNorm2d


def _conv_geometry(d: Draw) -> dict:
    cin = d.pick("conv.cin", [1, 2, 3, 4])
    cout = d.pick("conv.cout", [1, 3, 4, 8])
    groups = math.gcd(cin, cout) if d.flag("conv.grouped", 0.2) else 1
    k = d.pick("conv.kernel", [1, 3, (1, 3), 2])
    stride = d.pick("conv.stride", [1, 2], [3, 1])
    dilation = d.pick("conv.dilation", [1, 2], [4, 1])
    padding = d.pick("conv.padding", [0, 1, "same"], [3, 3, 1])
    if padding == "same" and stride != 1:
        padding = 1
    mode = d.pick("conv.padding_mode", ["zeros", "reflect", "circular"], [8, 1, 1])
    bias = d.flag("conv.bias", 0.6)
    return dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=stride, padding=padding,
                dilation=dilation, groups=groups, bias=bias, padding_mode=mode)


CONV_VARIANTS = ["plain", "sub", "sub_forward", "sub_conv_forward", "instance_forward", "weight_norm"]
BN2D_VARIANTS = ["plain", "sub", "sub_forward"]


def _conv_bn_parts(d: Draw, *, fused_module: bool = False):
    """Draws shared by the Conv2d+BatchNorm2d rows: returns (geometry, bn config, make_conv, make_bn,
    dtype, bn_dtype, stats, make_x)."""
    geo = _conv_geometry(d)
    bnc = _bn_config(d)
    dtype = pick_dtype(d)
    bn_dtype = dtype if fused_module or not d.flag("bn.other_dtype", 0.04) else (F64 if dtype != F64 else F32)
    bn_width = geo["out_channels"] if fused_module or not d.flag("bn.wrong_width", 0.03) else 1
    stats = d.pick("bn.stats", BN_STATS, BN_STATS_WEIGHTS)
    if fused_module:
        conv_kind, bn_kind, conv_hook, bn_hook = "plain", "plain", "none", "none"
    else:
        conv_kind = d.pick("conv.variant", CONV_VARIANTS, [40, 1, 1, 1, 1, 2])
        bn_kind = d.pick("bn.variant", BN2D_VARIANTS, [40, 1, 1])
        conv_hook = d.pick("conv.hook", HOOKS, HOOK_WEIGHTS)
        bn_hook = d.pick("bn.hook", HOOKS, HOOK_WEIGHTS)

    def make_conv():
        cls = {"sub": SubConv, "sub_forward": SubConvForward, "sub_conv_forward": SubConvConvForward}.get(conv_kind, nn.Conv2d)
        m = cls(**geo).to(dtype)
        if conv_kind == "instance_forward":
            _instance_forward(m)
        elif conv_kind == "weight_norm":
            m = torch.nn.utils.parametrizations.weight_norm(m)
        return hook(m, conv_hook)

    def make_bn(gen):
        cls = {"sub": SubBN2d, "sub_forward": SubBN2dForward}.get(bn_kind, nn.BatchNorm2d)
        bn = cls(bn_width, **bnc)
        _bn_stats(bn, gen, stats)
        return hook(bn.to(bn_dtype), bn_hook)

    batch = d.pick("x.batch", [0, 1, 2, 3], [1, 3, 4, 2])
    hw = (d.pick("x.h", [1, 4, 5, 7, 8], [1, 3, 3, 2, 2]), d.pick("x.w", [1, 4, 5, 7, 8], [1, 3, 3, 2, 2]))
    rank = d.pick("x.rank", [4, 3], [20, 1])  # 3: an unbatched (C, H, W) input
    layout = d.pick("x.layout", LAYOUTS, [6, 4, 1, 1, 1])
    kind = pick_values(d, "x.values")

    def make_x(gen):
        shape = ((batch,) if rank == 4 else ()) + (geo["in_channels"],) + hw
        return lay(values(gen, shape, dtype, kind), layout)

    return geo, dtype, make_conv, make_bn, make_x


def _act(d: Draw):
    """The activation the source applies after the BatchNorm (None: none): modules live in the world."""
    return d.pick("act", ["none", "ReLU", "ReLU_inplace", "F.relu", "torch.relu", "GELU", "ReLU_hooked"],
                  [6, 6, 2, 2, 2, 1, 1])


def _act_module(name: str) -> nn.Module | None:
    if name == "ReLU":
        return nn.ReLU()
    if name == "ReLU_inplace":
        return nn.ReLU(inplace=True)
    if name == "GELU":
        return nn.GELU()
    if name == "ReLU_hooked":
        return hook(nn.ReLU(), "forward_hook")
    return None


def _act_fn(name: str, world: nn.Module):
    if name == "none":
        return None
    if name == "F.relu":
        return F.relu
    if name == "torch.relu":
        return torch.relu
    return world.act


def build_conv_bn(d: Draw) -> Spec:
    geo, dtype, make_conv, make_bn, make_x = _conv_bn_parts(d)
    act = _act(d)
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.conv = make_conv()
            w.bn = make_bn(d.gen("bn"))
            m = _act_module(act)
            if m is not None:
                w.act = m
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    def original(w, x):
        y = w.bn(w.conv(x))
        fn = _act_fn(act, w)
        return y if fn is None else fn(y)

    def kernel(w, x):
        fn = _act_fn(act, w)
        return K.conv_bn(w.conv, w.bn, x) if fn is None else K.conv_bn(w.conv, w.bn, x, fn)

    return derived_axis(d, Spec(world, lambda g: [make_x(g)], original, kernel, dtype, train=train,
                                params_grad=params_grad))


def build_seq_conv_bn(d: Draw) -> Spec:
    geo, dtype, make_conv, make_bn, make_x = _conv_bn_parts(d)
    tail = d.pick("seq.tail", ["ReLU", "ReLU_inplace", "none", "Identity", "GELU"], [6, 2, 3, 1, 1])
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)
    named = d.flag("seq.ordered_dict", 0.3)
    second = d.flag("seq.second_pair", 0.3)  # (Conv2d, BatchNorm2d, act, Conv2d, BatchNorm2d): pairs in a row

    def world(kind):
        def build():
            parts = [make_conv(), make_bn(d.gen("bn"))]
            if tail != "none":
                parts.append({"ReLU": nn.ReLU(), "ReLU_inplace": nn.ReLU(inplace=True), "Identity": nn.Identity(),
                              "GELU": nn.GELU()}[tail])
            if second:
                c = geo["out_channels"]
                bn2 = nn.BatchNorm2d(c)
                _bn_stats(bn2, d.gen("bn2"), "random")
                parts += [nn.Conv2d(c, c, 1), bn2]
                parts[-2].to(parts[0].weight.dtype), parts[-1].to(parts[1].running_mean.dtype if
                                                                  parts[1].running_mean is not None else torch.float32)
            cls = nn.Sequential if kind == "orig" else K.GuardedSequential
            if named:
                from collections import OrderedDict
                seq = cls(OrderedDict(zip(["conv", "bn", "act", "conv2", "bn2"][:len(parts)] if tail != "none"
                                          else ["conv", "bn", "conv2", "bn2"], parts)))
            else:
                seq = cls(*parts)
            w = nn.Module()
            w.seq = seq
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    call = lambda w, x: w.seq(x)  # noqa: E731 (the same source; the worlds differ)
    return derived_axis(d, Spec(world, lambda g: [make_x(g)], call, call, dtype, train=train, params_grad=params_grad))


def build_fused_conv_bn_module(d: Draw) -> Spec:
    geo, dtype, make_conv, make_bn, make_x = _conv_bn_parts(d, fused_module=True)
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.conv = make_conv()
            w.bn = make_bn(d.gen("bn"))
            return w
        orig = _seeded_world(d.seed, build)
        if kind == "orig":
            return _params_grad(orig, params_grad)
        bn = orig.bn
        fused = K.FusedConv2dBatchNorm2d(
            **geo, bn_eps=bn.eps, bn_momentum=bn.momentum, bn_affine=bn.affine,
            bn_track_running_stats=bn.track_running_stats, bn_name="bn", dtype=orig.conv.weight.dtype)
        fused.bn.to(bn.weight.dtype if bn.weight is not None else orig.conv.weight.dtype)
        w = nn.Module()
        w.conv = fused
        w.load_state_dict(orig.state_dict())  # the original's checkpoint keys load into the fused module
        return _params_grad(w, params_grad)

    return derived_axis(d, Spec(world, lambda g: [make_x(g)], lambda w, x: w.bn(w.conv(x)), lambda w, x: w.conv(x),
                                dtype, train=train, params_grad=params_grad, hooks_comparable=False))


# ---------------------------------------------------------------------- Linear + BatchNorm1d

BN1D_VARIANTS = ["plain", "sub", "sub_forward"]


def _linear_bn_parts(d: Draw, *, fused_module: bool = False):
    n_in = d.pick("linear.in", [1, 3, 8])
    n_out = d.pick("linear.out", [1, 4, 7])
    bias = d.flag("linear.bias", 0.7)
    bnc = _bn_config(d)
    dtype = pick_dtype(d)
    stats = d.pick("bn.stats", BN_STATS, BN_STATS_WEIGHTS)
    bn_width = n_out if fused_module or not d.flag("bn.wrong_width", 0.03) else 1
    if fused_module:
        make_lin = lambda: nn.Linear(n_in, n_out, bias=bias)  # noqa: E731
        bn_kind, bn_hook = "plain", "none"
    else:
        make_lin = linear_variant(d, "linear", n_in, n_out, bias)
        bn_kind = d.pick("bn.variant", BN1D_VARIANTS, [40, 1, 1])
        bn_hook = d.pick("bn.hook", HOOKS, HOOK_WEIGHTS)

    def make_bn(gen):
        cls = {"sub": SubBN1d, "sub_forward": SubBN1dForward}.get(bn_kind, nn.BatchNorm1d)
        bn = cls(bn_width, **bnc)
        _bn_stats(bn, gen, stats)
        return hook(bn, bn_hook)

    batch = d.pick("x.batch", [0, 1, 2, 5], [1, 3, 4, 2])
    rank = d.pick("x.rank", [2, 3, 1], [20, 2, 1])
    layout = d.pick("x.layout", LAYOUTS, [8, 0, 1, 1, 1])
    kind = pick_values(d, "x.values")

    def make_x(gen):
        shape = {2: (batch, n_in), 3: (batch, n_out, n_in), 1: (n_in,)}[rank]
        return lay(values(gen, shape, dtype, kind), layout)

    return n_in, n_out, bias, dtype, make_lin, make_bn, make_x


def build_linear_bn(d: Draw) -> Spec:
    n_in, n_out, bias, dtype, make_lin, make_bn, make_x = _linear_bn_parts(d)
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.linear = make_lin()
            w.bn = make_bn(d.gen("bn"))
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    return derived_axis(d, Spec(world, lambda g: [make_x(g)], lambda w, x: w.bn(w.linear(x)),
                                lambda w, x: K.linear_bn(w.linear, w.bn, x), dtype, train=train,
                                params_grad=params_grad))


def build_seq_linear_bn(d: Draw) -> Spec:
    n_in, n_out, bias, dtype, make_lin, make_bn, make_x = _linear_bn_parts(d)
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)
    tail = d.pick("seq.tail", ["none", "ReLU"], [3, 1])

    def world(kind):
        def build():
            parts = [make_lin(), make_bn(d.gen("bn"))] + ([nn.ReLU()] if tail == "ReLU" else [])
            w = nn.Module()
            w.seq = (nn.Sequential if kind == "orig" else K.GuardedSequential)(*parts)
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    call = lambda w, x: w.seq(x)  # noqa: E731
    return derived_axis(d, Spec(world, lambda g: [make_x(g)], call, call, dtype, train=train, params_grad=params_grad))


def build_fused_linear_bn_module(d: Draw) -> Spec:
    n_in, n_out, bias, dtype, make_lin, make_bn, make_x = _linear_bn_parts(d, fused_module=True)
    train = d.flag("train", 0.1)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.linear = make_lin()
            w.bn = make_bn(d.gen("bn"))
            return w.to(dtype)
        orig = _seeded_world(d.seed, build)
        if kind == "orig":
            return _params_grad(orig, params_grad)
        bn = orig.bn
        fused = K.FusedLinearBatchNorm1d(
            n_in, n_out, bias=bias, bn_eps=bn.eps, bn_momentum=bn.momentum, bn_affine=bn.affine,
            bn_track_running_stats=bn.track_running_stats, bn_name="bn", dtype=dtype)
        w = nn.Module()
        w.linear = fused
        w.load_state_dict(orig.state_dict())
        return _params_grad(w, params_grad)

    return derived_axis(d, Spec(world, lambda g: [make_x(g)], lambda w, x: w.bn(w.linear(x)),
                                lambda w, x: w.linear(x), dtype, train=train, params_grad=params_grad,
                                hooks_comparable=False))


# ---------------------------------------------------------------------- Linear + GeLU


def _gelu_activation(d: Draw, name: str = "act"):
    """(factory of the activation module or None, functional act, act args, act kwargs)."""
    import transformers.activations as A

    kind = d.pick(name, ["GELU", "GELU_tanh", "F.gelu", "F.gelu_tanh_arg", "F.gelu_tanh_kw", "GELUActivation",
                         "NewGELUActivation", "GELUTanh", "FastGELUActivation", "QuickGELUActivation", "ReLU",
                         "ScaledGELU", "GELU_hooked"],
                  [8, 4, 3, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1])
    if kind == "F.gelu":
        return None, F.gelu, (), {}
    if kind == "F.gelu_tanh_arg":
        return None, F.gelu, ("tanh",), {}
    if kind == "F.gelu_tanh_kw":
        return None, F.gelu, (), {"approximate": "tanh"}
    factory = {
        "GELU": nn.GELU, "GELU_tanh": lambda: nn.GELU("tanh"), "GELUActivation": A.GELUActivation,
        "NewGELUActivation": A.NewGELUActivation, "GELUTanh": A.GELUTanh, "FastGELUActivation": A.FastGELUActivation,
        "QuickGELUActivation": A.QuickGELUActivation, "ReLU": nn.ReLU, "ScaledGELU": ScaledGELU,
        "GELU_hooked": lambda: hook(nn.GELU(), "forward_hook"),
    }[kind]
    return factory, None, (), {}


def _features_input(d: Draw, n_in: int, dtype, ranks=(2, 3, 1), rank_weights=(6, 6, 1)):
    rank = d.pick("x.rank", list(ranks), list(rank_weights))
    batch = d.pick("x.batch", [0, 1, 2, 3], [1, 3, 4, 2])
    seq = d.pick("x.seq", [1, 3, 5], [1, 2, 2])
    layout = d.pick("x.layout", LAYOUTS, [8, 0, 1, 2, 1])
    kind = pick_values(d, "x.values")

    def make_x(gen):
        shape = {1: (n_in,), 2: (batch, n_in), 3: (batch, seq, n_in), 4: (batch, 2, seq, n_in)}[rank]
        return lay(values(gen, shape, dtype, kind), layout)

    return make_x


def build_linear_gelu(d: Draw) -> Spec:
    dtype = pick_dtype(d)
    n_in, n_out = d.pick("linear.in", [1, 4, 9]), d.pick("linear.out", [1, 6, 8])
    make_lin = linear_variant(d, "linear", n_in, n_out, d.flag("linear.bias", 0.8))
    factory, fn, args, kwargs = _gelu_activation(d)
    make_x = _features_input(d, n_in, dtype)
    train = d.flag("train", 0.3)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.linear = make_lin()
            if factory is not None:
                w.act = factory()
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    act = lambda w: w.act if fn is None else fn  # noqa: E731
    return Spec(world, lambda g: [make_x(g)], lambda w, x: act(w)(w.linear(x), *args, **kwargs),
                lambda w, x: K.linear_gelu(w.linear, act(w), x, *args, **kwargs), dtype, train=train,
                params_grad=params_grad)


def build_seq_linear_gelu(d: Draw) -> Spec:
    dtype = pick_dtype(d)
    n_in, n_out = d.pick("linear.in", [1, 4, 9]), d.pick("linear.out", [1, 6, 8])
    make_lin = linear_variant(d, "linear", n_in, n_out, d.flag("linear.bias", 0.8))
    factory, _, _, _ = _gelu_activation(d, "act_module")
    factory = factory or nn.GELU
    make_x = _features_input(d, n_in, dtype)
    train = d.flag("train", 0.3)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.seq = (nn.Sequential if kind == "orig" else K.GuardedSequential)(make_lin(), factory())
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    call = lambda w, x: w.seq(x)  # noqa: E731
    return Spec(world, lambda g: [make_x(g)], call, call, dtype, train=train, params_grad=params_grad)


# ---------------------------------------------------------------------- Q/K/V


@contextlib.contextmanager
def qkv_on_cpu():
    saved = G.QKV_FUSE_ON_CPU
    G.QKV_FUSE_ON_CPU = True
    try:
        yield
    finally:
        G.QKV_FUSE_ON_CPU = saved


@contextlib.contextmanager
def fold_per_call_lifted():
    """The per-call fold's size policy lifted (``guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE``: a
    performance threshold): small shapes then take the fold, so its math is checked."""
    saved = getattr(G, "FOLD_PER_CALL_MAX_WEIGHT_SHARE", None)
    if saved is not None:
        G.FOLD_PER_CALL_MAX_WEIGHT_SHARE = float("inf")
    try:
        yield
    finally:
        if saved is not None:
            G.FOLD_PER_CALL_MAX_WEIGHT_SHARE = saved


def contexts(*factories):
    """One context-manager factory entering each of ``factories`` (None entries skipped)."""
    factories = [f for f in factories if f is not None]

    @contextlib.contextmanager
    def both():
        with contextlib.ExitStack() as stack:
            for f in factories:
                stack.enter_context(f())
            yield

    return both if factories else None


def derived_axis(d: Draw, spec: Spec, extra=None) -> Spec:
    """How a kernel that derives weights (a BatchNorm fold, concatenated QKV) may keep or compute
    them: under ``adopter.kernels.freeze``, folded on every call with the size policy lifted, or
    the shipped policy (small shapes then run the original layers)."""
    how = d.pick("derived", ["freeze", "per_call", "shipped"], [4, 4, 1])
    if how == "freeze" and hasattr(K, "freeze"):
        spec.freeze, spec.train, spec.params_grad = True, False, False
    spec.context = contexts(extra, fold_per_call_lifted if how == "per_call" else None)
    return spec


def build_qkv(d: Draw) -> Spec:
    dtype = pick_dtype(d)
    n_in = d.pick("in", [1, 4, 8])
    n_q = d.pick("q_out", [2, 8])
    n_kv = n_q if d.flag("same_width", 0.7) else d.pick("kv_out", [1, 4])
    biases = d.pick("bias", ["all", "none", "mixed"], [6, 3, 1])
    other_dtype = d.flag("v_other_dtype", 0.04)
    makers = [linear_variant(d, name, n_in, n, biases == "all" or (biases == "mixed" and name == "q"),
                             ["plain", "sub", "sub_forward", "sub_call", "weight_norm", "spectral_norm"])
              for name, n in (("q", n_q), ("k", n_kv), ("v", n_kv))]
    make_x = _features_input(d, n_in, dtype, ranks=(1, 2, 3, 4), rank_weights=(1, 4, 6, 1))
    train = d.flag("train", 0.3)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind):
        def build():
            w = nn.Module()
            w.q, w.k, w.v = (m() for m in makers)
            w.to(dtype)
            if other_dtype:
                w.v.to(F64 if dtype != F64 else F32)
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    return derived_axis(d, Spec(world, lambda g: [make_x(g)], lambda w, x: (w.q(x), w.k(x), w.v(x)),
                                lambda w, x: K.qkv(w.q, w.k, w.v, x), dtype, train=train, params_grad=params_grad),
                        extra=qkv_on_cpu)


# ---------------------------------------------------------------------- Dropout + add + LayerNorm


def build_dropout_add_layer_norm(d: Draw) -> Spec:
    dtype = pick_dtype(d)
    hidden = d.pick("hidden", [1, 4, 7, 16])
    norm_shape = (hidden,) if not d.flag("norm.two_dims", 0.1) else (3, hidden)
    affine = d.flag("norm.affine", 0.85)
    bias = d.flag("norm.bias", 0.85)
    eps = d.pick("norm.eps", [1e-5, 1e-12, 0.1], [4, 1, 1])
    norm_kind = d.pick("norm.variant", ["plain", "sub", "sub_forward", "RMSNorm"], [20, 1, 1, 1])
    norm_hook = d.pick("norm.hook", HOOKS, HOOK_WEIGHTS)
    drop = d.pick("dropout", ["module", "module_sub", "module_inplace", "F.dropout_kw", "F.dropout_pos",
                              "F.dropout_default", "F.dropout_training_tensor", "module_hooked"],
                  [8, 1, 1, 3, 2, 1, 1, 1])
    p = d.pick("p", [0.0, 0.1, 0.5, 1.0], [3, 4, 1, 1])
    prenorm = d.flag("prenorm", 0.4)
    residual_how = d.pick("residual", ["same", "broadcast", "float32", "bfloat16"], [12, 1, 2, 1])
    train = d.flag("train", 0.4)
    params_grad = d.flag("params_grad", 0.8)
    rank = d.pick("x.rank", [2, 3], [1, 3])
    batch = d.pick("x.batch", [0, 1, 2, 3], [1, 3, 4, 2])
    layout = d.pick("x.layout", LAYOUTS, [8, 0, 1, 2, 1])
    kind = pick_values(d, "x.values")

    def world(kind_):
        def build():
            w = nn.Module()
            if norm_kind == "RMSNorm":
                norm = nn.RMSNorm(norm_shape, eps=eps, elementwise_affine=affine)
            else:
                cls = {"sub": SubLayerNorm, "sub_forward": SubLayerNormForward}.get(norm_kind, nn.LayerNorm)
                norm = cls(norm_shape, eps=eps, elementwise_affine=affine, bias=bias)
                if affine:
                    with torch.no_grad():
                        norm.weight.normal_()
                        if norm.bias is not None:
                            norm.bias.normal_()
            w.norm = hook(norm, norm_hook)
            if drop.startswith("module"):
                cls = SubDropout if drop == "module_sub" else nn.Dropout
                w.drop = cls(p, inplace=drop == "module_inplace")
                if drop == "module_hooked":
                    hook(w.drop, "forward_hook")
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    def inputs(gen):
        shape = ((batch, 5) if rank == 3 else (batch,)) + tuple(norm_shape)
        x = lay(values(gen, shape, dtype, kind), layout)
        r_dtype = {"float32": F32, "bfloat16": BF16}.get(residual_how, dtype)
        r_shape = shape if residual_how != "broadcast" else (1,) * (len(shape) - len(norm_shape)) + tuple(norm_shape)
        return [x, values(gen, r_shape, r_dtype)]

    def drop_call(w):
        """(dropout callable, args, kwargs) as the source called it."""
        if drop.startswith("module"):
            return w.drop, (), {}
        if drop == "F.dropout_kw":
            return F.dropout, (), {"p": p, "training": w.training}
        if drop == "F.dropout_pos":
            return F.dropout, (p, w.training), {}
        if drop == "F.dropout_training_tensor":
            return F.dropout, (), {"p": p, "training": torch.tensor(w.training)}
        return F.dropout, (), {}

    def original(w, x, r):
        fn, args, kwargs = drop_call(w)
        h = fn(x, *args, **kwargs) + r
        return (h, w.norm(h)) if prenorm else w.norm(h)

    def kernel(w, x, r):
        fn, args, kwargs = drop_call(w)
        return K.dropout_add_layer_norm(fn, w.norm, x, r, *args, prenorm=prenorm, **kwargs)

    return Spec(world, inputs, original, kernel, dtype, train=train, params_grad=params_grad)


# ---------------------------------------------------------------------- softmax


def build_softmax(d: Draw) -> Spec:
    dtype = pick_dtype(d)
    out_dtype = d.pick("out_dtype", [None, F32, F64], [6, 1, 1])
    rank = d.pick("x.rank", [0, 1, 2, 3, 4], [1, 2, 4, 4, 2])
    dim = d.pick("dim", [-1, 0, 1, -2], [6, 1, 1, 1])
    module = d.flag("module", 0.3)
    layout = d.pick("x.layout", LAYOUTS, [8, 1, 1, 2, 1])
    kind = pick_values(d, "x.values")
    shape = [3, 1, 5, 4][:rank]

    def world(kind_):
        w = nn.Module()
        w.sm = (nn.Softmax(dim) if kind_ == "orig" else K.Softmax(dim)) if module else nn.Identity()
        return w

    def original(w, x):
        return w.sm(x) if module else F.softmax(x, dim, dtype=out_dtype)

    def kernel(w, x):
        return w.sm(x) if module else K.softmax(x, dim, dtype=out_dtype)

    return Spec(world, lambda g: [lay(values(g, shape, dtype, kind, scale=3.0), layout)], original, kernel, dtype)


# ---------------------------------------------------------------------- attention


def attention_original(q, k, v, mask=None, bias=None, dropout_p=0.0, scale=None, is_causal=False, need_weights=False):
    """``softmax(q @ k^T * scale + mask + bias) @ v`` written out (HF eager attention): GQA keys and
    values repeated per query head, a bool mask keeps where True, causal top-left aligned, the
    softmax in float32."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    k_len = k.shape[-2]
    for m in (mask, bias):
        if m is not None:
            m = m[..., :k_len]
            scores = scores + (torch.zeros((), dtype=scores.dtype).masked_fill(~m, -INF) if m.dtype == torch.bool else m)
    if is_causal:
        keep = torch.ones(q.shape[-2], k_len, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -INF)
    weights = F.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p, training=True)
    out = torch.matmul(weights, v)
    return (out, weights) if need_weights else out


def build_attention(d: Draw) -> Spec:
    dtype = pick_dtype(d, weights=(8, 2, 2, 1))
    b, h, s, dh = d.pick("batch", [1, 2]), d.pick("heads", [1, 2, 4]), d.pick("q_len", [1, 3, 5]), d.pick("head_dim", [2, 8])
    kv_heads = h if d.flag("mha", 0.7) else 1
    k_len = s if d.flag("square", 0.7) else d.pick("k_len", [1, 4, 7])
    mask_kind = d.pick("mask", ["none", "bool", "additive", "bool_all_masked_row", "additive_min", "longer",
                                "min_all_masked_row"], [5, 3, 3, 1, 2, 1, 1])
    bias_on = d.flag("bias", 0.2)
    is_causal = d.flag("is_causal", 0.3)
    dropout_p = d.pick("dropout_p", [0.0, 0.2], [5, 1])
    scale = d.pick("scale", [None, 1.0, 0.3], [5, 1, 1])
    need_weights = d.flag("need_weights", 0.2)
    kind = pick_values(d, "x.values")
    layout = d.pick("x.layout", ["contiguous", "transposed", "strided"], [6, 2, 1])

    def inputs(gen):
        def qkv_(heads, length):
            t = values(gen, (b, length, heads, dh), dtype, kind)
            if layout == "transposed":  # a (b, s, h, d) projection viewed as (b, h, s, d)
                return t.transpose(1, 2).detach()
            return lay(t.transpose(1, 2).contiguous(), layout)
        out = [qkv_(h, s), qkv_(kv_heads, k_len), qkv_(kv_heads, k_len)]
        width = k_len + (2 if mask_kind == "longer" else 0)
        # (key 0 is always kept: a row whose every key is masked by a finite additive mask is rounding
        # noise in both codes; the fully masked row is its own axis value)
        if mask_kind in ("bool", "bool_all_masked_row"):
            m = torch.rand((b, 1, s, width), generator=gen) > 0.3
            m[..., 0] = True
            if mask_kind == "bool_all_masked_row":
                m[..., 0, :] = False
            out.append(m)
        elif mask_kind in ("additive", "longer"):
            keep = torch.rand((b, 1, 1, width), generator=gen) > 0.3
            keep[..., 0] = True
            out.append(torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -1e4))
        elif mask_kind in ("additive_min", "min_all_masked_row"):  # (HF's masks: finfo(dtype).min)
            keep = torch.rand((b, 1, s, width), generator=gen) > 0.5
            keep[..., 0] = True
            if mask_kind == "min_all_masked_row":
                keep[..., 0, :] = False
            out.append(torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min))
        if bias_on:
            out.append(values(gen, (1, h, s, k_len), dtype))
        return out

    def split(args):
        q, k, v, *rest = args
        mask = rest.pop(0) if mask_kind != "none" else None
        bias = rest.pop(0) if bias_on else None
        return q, k, v, mask, bias

    kw = dict(dropout_p=dropout_p, scale=scale, is_causal=is_causal, need_weights=need_weights)
    # (the original's softmax runs in float32 whatever the input dtype, which the rewrite tells the
    # kernel as softmax_dtype: float64 inputs are compared at float32's tolerance)
    return Spec(lambda kind_: nn.Module(), inputs,
                lambda w, *args: attention_original(*split(args), **kw),
                lambda w, *args: K.attention(*split(args), **kw, softmax_dtype=torch.float32), dtype, vmap_ok=False,
                tol=TOL[F32] if dtype == F64 else None)


# ---------------------------------------------------------------------- add + ReLU


def _relu_activation(d: Draw):
    return d.pick("act", ["ReLU", "ReLU_inplace", "F.relu", "torch.relu", "ReLU6", "ReLU_hooked"], [6, 3, 3, 2, 1, 1])


def _relu_world(act: str):
    w = nn.Module()
    if act in ("ReLU", "ReLU_inplace", "ReLU6", "ReLU_hooked"):
        w.act = {"ReLU": nn.ReLU(), "ReLU_inplace": nn.ReLU(inplace=True), "ReLU6": nn.ReLU6(),
                 "ReLU_hooked": hook(nn.ReLU(), "forward_hook")}[act]
    return w


def _relu_fn(act: str, w):
    return {"F.relu": F.relu, "torch.relu": torch.relu}.get(act) or w.act


def build_add_relu(d: Draw) -> Spec:
    dtype = pick_dtype(d, weights=(8, 3, 1, 1))
    act = _relu_activation(d)
    in_place = d.flag("in_place", 0.5)
    known = d.pick("finite", ["checked", "unknown", "checked_then_data_write"], [8, 2, 1])
    fresh = d.flag("x_fresh_local", 0.6)  # the rewrite's `out` is a local only it holds
    shape = d.pick("shape", [(0, 3), (2, 3, 4, 4), (5,), (1, 1), (2, 4, 3)], [1, 5, 2, 1, 2])
    layout_x = d.pick("x.layout", LAYOUTS, [8, 3, 1, 1, 1])
    layout_r = d.pick("r.layout", LAYOUTS, [8, 3, 1, 1, 1])
    broadcast = d.flag("r.broadcast", 0.1)
    r_dtype = dtype if not d.flag("r.other_dtype", 0.05) else F64
    kind = pick_values(d, "x.values")

    def inputs(gen):
        x = lay(values(gen, shape, dtype, kind), layout_x)
        r = values(gen, (1,) * (len(shape) - 1) + shape[-1:] if broadcast else shape, r_dtype)
        return [x, lay(r, layout_r)]

    def prepare(x, r):
        if fresh:
            x = x * 1.0  # a tensor only this frame holds, like `out = self.bn(...)`
        if known != "unknown" and not _is_proxy(x) and not torch.compiler.is_compiling():
            finite.check(x)
            finite.check(r)
            if known == "checked_then_data_write" and x.numel():
                x.data.view(-1)[0] = NAN  # a write the version counter does not see
        return x, r

    def original(w, x, r):
        out, r = prepare(x, r)
        if in_place:
            out += r
            return _relu_fn(act, w)(out)
        return _relu_fn(act, w)(out + r)

    def kernel(w, x, r):
        out, r = prepare(x, r)
        return K.add_relu(_relu_fn(act, w), out, r, in_place=in_place)

    return Spec(lambda kind_: _relu_world(act), inputs, original, kernel, dtype, documented=(
        "a NaN written through .data after the operands were recorded finite (adopter/kernels/ops/finite.py: "
        "a .data write bypasses the version counter)" if known == "checked_then_data_write" else ""))


def build_conv_bn_add_relu(d: Draw) -> Spec:
    """A residual block's end (ResNet): ``relu(bn(conv(x)) + identity)`` against ``conv_bn`` then
    ``add_relu`` (finite-value provenance flows from one kernel to the next)."""
    dtype = pick_dtype(d, weights=(8, 2, 1, 1))
    c = d.pick("channels", [2, 4])
    k = d.pick("kernel", [1, 3])
    in_place = d.flag("in_place", 0.7)
    stats = d.pick("bn.stats", BN_STATS, BN_STATS_WEIGHTS)
    batch = d.pick("x.batch", [1, 2, 4], [3, 3, 1])
    hw = d.pick("x.hw", [3, 5, 7])
    layout = d.pick("x.layout", LAYOUTS, [5, 5, 1, 1, 1])
    kind = pick_values(d, "x.values")
    id_kind = d.pick("identity.values", VALUES, VALUE_WEIGHTS)
    act = d.pick("act", ["ReLU", "ReLU_inplace", "F.relu"], [3, 3, 1])
    params_grad = d.flag("params_grad", 0.5)

    def world(kind_):
        def build():
            w = nn.Module()
            w.conv = nn.Conv2d(c, c, k, padding=k // 2, bias=False)
            w.bn = nn.BatchNorm2d(c)
            _bn_stats(w.bn, d.gen("bn"), stats)
            if act != "F.relu":
                w.act = nn.ReLU(inplace=act == "ReLU_inplace")
            return _params_grad(w.to(dtype).eval(), params_grad)
        return _seeded_world(d.seed, build)

    def inputs(gen):
        return [lay(values(gen, (batch, c, hw, hw), dtype, kind), layout),
                lay(values(gen, (batch, c, hw, hw), dtype, id_kind), layout)]

    relu = lambda w: F.relu if act == "F.relu" else w.act  # noqa: E731

    def original(w, x, identity):
        out = w.bn(w.conv(x))
        if in_place:
            out += identity
            return relu(w)(out)
        return relu(w)(out + identity)

    def kernel(w, x, identity):
        if not _is_proxy(identity) and not torch.compiler.is_compiling():
            finite.check(identity)  # (a block's input: checked where it entered the kernels)
        out = K.conv_bn(w.conv, w.bn, x)
        return K.add_relu(relu(w), out, identity, in_place=in_place)

    return derived_axis(d, Spec(world, inputs, original, kernel, dtype, params_grad=params_grad))


# ---------------------------------------------------------------------- RMSNorm

RMS_FORMS = {
    "llama": {},
    "olmo2": {"weight_before_cast": True},
    "helium": {"weight_before_cast": True, "weight_fp32": True},
    "gemma": {"offset": 1.0, "weight_before_cast": True, "weight_fp32": True},
    "litgpt_offset": {"offset": 1.0},
    "t5": {"cast_to_half_weight": True},
    "no_upcast": {"upcast": False},
    "no_upcast_before_cast": {"upcast": False, "weight_before_cast": True},
}


def rms_norm_written(form: str, x, weight, eps, dim=-1):
    """Each RMSNorm form as model code writes it (Llama, OLMo-2, Helium, Gemma, litgpt, T5, no upcast)."""
    if form == "t5":
        variance = x.to(torch.float32).pow(2).mean(-1 if dim == -1 else dim, keepdim=True)
        h = x * torch.rsqrt(variance + eps)
        if weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(weight.dtype)
        return weight * h
    input_dtype = x.dtype
    if form.startswith("no_upcast"):
        h = x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps)
        return (h * weight).to(input_dtype) if form == "no_upcast_before_cast" else weight * h.to(input_dtype)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(dim, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if form == "llama":
        return weight * h.to(input_dtype)
    if form == "olmo2":
        return (weight * h).to(input_dtype)
    if form == "helium":
        return (weight.float() * h).to(input_dtype)
    if form == "gemma":
        return (h * (1.0 + weight.float())).to(input_dtype)
    if form == "litgpt_offset":
        return h.to(input_dtype) * (1 + weight)
    raise AssertionError(form)


def build_rms_norm(d: Draw) -> Spec:
    form = d.pick("form", sorted(RMS_FORMS))
    dtype = pick_dtype(d, weights=(6, 2, 4, 2))
    w_dtype = d.pick("weight.dtype", ["same", F32, BF16], [6, 2, 1])
    w_dtype = dtype if w_dtype == "same" else w_dtype
    hidden = d.pick("hidden", [1, 4, 7, 64])
    eps = d.pick("eps", [1e-6, 1e-5, 0, 0.5, "tensor"], [4, 2, 1, 1, 1])
    dim = d.pick("dim", ["-1", "last", "[-1]", "0"], [8, 1, 1, 1])
    rank = d.pick("x.rank", [1, 2, 3, 4], [1, 3, 4, 1])
    batch = d.pick("x.batch", [0, 1, 2, 3], [1, 3, 4, 2])
    layout = d.pick("x.layout", LAYOUTS, [8, 0, 1, 2, 1])
    kind = pick_values(d, "x.values")
    w_kind = d.pick("weight.values", ["normal", "zeros", "negzero", "nan"], [12, 1, 1, 1])
    params_grad = d.flag("params_grad", 0.8)

    def world(kind_):
        def build():
            w = nn.Module()
            w.weight = nn.Parameter(values(gen_for(d.seed, "w"), (hidden,), w_dtype, w_kind) + (
                0 if w_kind != "normal" else 1))
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    def inputs(gen):
        shape = {1: (hidden,), 2: (batch, hidden), 3: (batch, 3, hidden), 4: (batch, 2, 3, hidden)}[rank]
        return [lay(values(gen, shape, dtype, kind, scale=3.0), layout)]

    def eps_of(x):
        return torch.tensor(1e-6) if eps == "tensor" else eps

    def dim_of(x):
        return {"-1": -1, "last": x.dim() - 1, "[-1]": [-1], "0": 0}[dim]

    def original(w, x):
        return rms_norm_written(form, x, w.weight, eps_of(x), dim_of(x))

    def kernel(w, x):
        from adopter.kernels.guarded_rms_norm import rms_norm
        kw = dict(RMS_FORMS[form])
        if dim != "-1":
            kw["dim"] = dim_of(x)
        return rms_norm(x, w.weight, eps_of(x), **kw)

    if form == "t5" and dim != "-1":
        # (T5LayerNorm always reduces over -1: no dim form)
        dim = "-1"
    return Spec(world, inputs, original, kernel, dtype if dtype != F64 else F64, params_grad=params_grad)


# ---------------------------------------------------------------------- scaled L2 norm


def build_scaled_l2_norm(d: Draw) -> Spec:
    """x-transformers' RMSNorm, ``F.normalize(x[.float()], dim=-1[, eps]) * f1 * f2 ...`` [cast back],
    the factors a Python scale, a gamma Parameter (in either order), an offset gamma, a 0-d buffer."""
    upcast, cast_back = d.pick("form", [(False, False), (True, False), (True, True), (False, True)], [4, 2, 3, 1])
    dtype = pick_dtype(d, weights=(6, 2, 4, 2))
    g_dtype = d.pick("gamma.dtype", ["same", F32, BF16], [6, 2, 1])
    g_dtype = dtype if g_dtype == "same" else g_dtype
    hidden = d.pick("hidden", [1, 4, 7, 64])
    eps = d.pick("eps", ["default", 1e-6, 0.5, 0, "tensor"], [4, 2, 1, 1, 1])
    factors = d.pick("factors", ["scale_gamma", "gamma_scale", "scale", "none", "offset_gamma", "buffer_gamma"],
                     [4, 2, 1, 1, 1, 1])
    rank = d.pick("x.rank", [1, 2, 3, 4], [1, 3, 4, 1])
    batch = d.pick("x.batch", [0, 1, 2, 3], [1, 3, 4, 2])
    layout = d.pick("x.layout", LAYOUTS, [8, 0, 1, 2, 1])
    kind = pick_values(d, "x.values")
    g_kind = d.pick("gamma.values", ["normal", "zeros", "negzero", "nan"], [12, 1, 1, 1])
    params_grad = d.flag("params_grad", 0.8)

    def world(kind_):
        def build():
            w = nn.Module()
            w.scale = hidden ** 0.5
            w.gamma = nn.Parameter(values(gen_for(d.seed, "g"), (hidden,), g_dtype, g_kind) + (
                0 if g_kind != "normal" else 1))
            w.register_buffer("temperature", torch.tensor(1.5, dtype=g_dtype))
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    def fs(w):
        return {"scale_gamma": (w.scale, w.gamma), "gamma_scale": (w.gamma, w.scale), "scale": (w.scale,),
                "none": (), "offset_gamma": (w.scale, w.gamma + 1.0), "buffer_gamma": (w.temperature, w.gamma)}[factors]

    def inputs(gen):
        shape = {1: (hidden,), 2: (batch, hidden), 3: (batch, 3, hidden), 4: (batch, 2, 3, hidden)}[rank]
        return [lay(values(gen, shape, dtype, kind, scale=3.0), layout)]

    def eps_kw(x):
        return {} if eps == "default" else {"eps": torch.tensor(1e-6) if eps == "tensor" else eps}

    def original(w, x):
        h = x.float() if upcast else x
        y = F.normalize(h, dim=-1, **eps_kw(x))
        for f in fs(w):
            y = y * f
        return y.type_as(x) if cast_back else y

    def kernel(w, x):
        return K.scaled_l2_norm(x, *fs(w), upcast=upcast, cast_back=cast_back, **eps_kw(x))

    return Spec(world, inputs, original, kernel, dtype, params_grad=params_grad)


# ---------------------------------------------------------------------- gated MLP


def _gated_activation(d: Draw):
    """(module factory or None, function, args, kwargs)."""
    import transformers.activations as A

    kind = d.pick("act", ["SiLU", "F.silu", "F.silu_inplace", "GELU", "GELU_tanh", "F.gelu_tanh_kw", "SiLUActivation",
                          "GELUActivation", "NewGELUActivation", "ReLU", "SiLU_hooked"],
                  [8, 3, 1, 2, 2, 1, 1, 1, 1, 1, 1])
    if kind == "F.silu":
        return None, F.silu, (), {}
    if kind == "F.silu_inplace":
        return None, F.silu, (), {"inplace": True}
    if kind == "F.gelu_tanh_kw":
        return None, F.gelu, (), {"approximate": "tanh"}
    return {"SiLU": nn.SiLU, "GELU": nn.GELU, "GELU_tanh": lambda: nn.GELU("tanh"),
            "SiLUActivation": getattr(A, "SiLUActivation", nn.SiLU), "GELUActivation": A.GELUActivation,
            "NewGELUActivation": A.NewGELUActivation, "ReLU": nn.ReLU,
            "SiLU_hooked": lambda: hook(nn.SiLU(), "forward_hook")}[kind], None, (), {}


GATED_LINEAR = ["plain", "sub", "sub_forward", "sub_call", "casted", "weight_norm", "spectral_norm"]


def build_gated_mlp(d: Draw) -> Spec:
    dtype = pick_dtype(d, weights=(8, 2, 3, 1))
    hidden, inter = d.pick("hidden", [1, 4, 8]), d.pick("intermediate", [2, 6, 16])
    up_inter = inter if d.flag("same_width", 0.95) else inter + 1
    bias = d.flag("bias", 0.3)
    casted_dtype = d.flag("casted_fp32_weights", 0.1)
    makers = [linear_variant(d, name, n_in, n_out, bias, GATED_LINEAR)
              for name, n_in, n_out in (("gate", hidden, inter), ("up", hidden, up_inter), ("down", inter, hidden))]
    factory, fn, args, kwargs = _gated_activation(d)
    make_x = _features_input(d, hidden, dtype, ranks=(1, 2, 3), rank_weights=(1, 3, 6))
    train = d.flag("train", 0.3)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind_):
        def build():
            w = nn.Module()
            w.gate, w.up, w.down = (m() for m in makers)
            if factory is not None:
                w.act = factory()
            w.to(dtype)
            if casted_dtype:
                for m in (w.gate, w.up, w.down):
                    if isinstance(m, CastedLinear):
                        m.to(F32)
            return _params_grad(w, params_grad)
        return _seeded_world(d.seed, build)

    act = lambda w: w.act if fn is None else fn  # noqa: E731

    def original(w, x):
        return w.down(act(w)(w.gate(x), *args, **kwargs) * w.up(x))

    def kernel(w, x):
        from adopter.kernels.guarded_gated_mlp import gated_mlp
        return gated_mlp(w.gate, w.up, w.down, act(w), x, *args, **kwargs)

    return Spec(world, lambda g: [make_x(g)], original, kernel, dtype, train=train, params_grad=params_grad)


def build_gated_mlp_packed(d: Draw) -> Spec:
    dtype = pick_dtype(d, weights=(8, 2, 3, 1))
    hidden, half = d.pick("hidden", [1, 4, 8]), d.pick("half", [1, 3, 8])
    packed_out = 2 * half if d.flag("even", 0.9) else 2 * half + 1
    bias = d.flag("bias", 0.3)
    how = d.pick("split", ["chunks", "split_int", "split_list", "split_uneven", "chunks3"], [12, 4, 4, 1, 1])
    dim = d.pick("dim", ["-1", "last", "0"], [16, 4, 1])
    gate = d.pick("gate", [0, 1], [3, 1])
    make_gu = linear_variant(d, "gate_up", hidden, packed_out, bias, GATED_LINEAR)
    make_down = linear_variant(d, "down", half, hidden, bias, GATED_LINEAR)
    factory, fn, args, kwargs = _gated_activation(d)
    make_x = _features_input(d, hidden, dtype, ranks=(1, 2, 3), rank_weights=(1, 3, 6))
    train = d.flag("train", 0.3)
    params_grad = d.flag("params_grad", 0.8)

    def world(kind_):
        def build():
            w = nn.Module()
            w.gate_up, w.down = make_gu(), make_down()
            if factory is not None:
                w.act = factory()
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    act = lambda w: w.act if fn is None else fn  # noqa: E731

    def split_kw(x):
        dd = {"-1": -1, "last": x.dim() - 1, "0": 0}[dim]
        if how == "chunks":
            return {"chunks": 2, "dim": dd}
        if how == "chunks3":
            return {"chunks": 3, "dim": dd}
        if how == "split_int":
            return {"split": packed_out // 2, "dim": dd}
        if how == "split_list":
            return {"split": [packed_out // 2, packed_out - packed_out // 2], "dim": dd}
        return {"split": [1, packed_out - 1], "dim": dd}

    def original(w, x):
        kw = split_kw(x)
        y = w.gate_up(x)
        parts = y.chunk(kw["chunks"], kw["dim"]) if "chunks" in kw else y.split(kw["split"], kw["dim"])
        first, second = parts  # (the source unpacks two: more parts raise, as here)
        g, u = (first, second) if gate == 0 else (second, first)
        return w.down(act(w)(g, *args, **kwargs) * u)

    def kernel(w, x):
        from adopter.kernels.guarded_gated_mlp import gated_mlp_packed
        return gated_mlp_packed(w.gate_up, w.down, act(w), x, *args, gate=gate, **split_kw(x), **kwargs)

    return Spec(world, lambda g: [make_x(g)], original, kernel, dtype, train=train, params_grad=params_grad)


# ---------------------------------------------------------------------- LM head + cross entropy


def _lce_accept(orig: list, kern: list) -> tuple[list, list, str]:
    """Documented: the fused loss returns logits=None (training with labels)."""
    if len(orig) == 2 and len(kern) == 2 and kern[0] is None and isinstance(orig[0], torch.Tensor):
        return orig[1:], kern[1:], "logits None (documented)"
    return orig, kern, ""


def build_linear_cross_entropy(d: Draw) -> Spec:
    from transformers.loss.loss_utils import ForCausalLMLoss

    dtype = pick_dtype(d, weights=(8, 2, 3, 1))
    hidden, vocab = d.pick("hidden", [1, 4, 8]), d.pick("vocab", [2, 11, 37])
    b, s = d.pick("batch", [1, 2, 3]), d.pick("seq", [1, 2, 5])
    bias = d.flag("head.bias", 0.3)
    make_head = linear_variant(d, "head", hidden, vocab, bias,
                               ["plain", "sub", "sub_forward", "sub_call", "weight_norm", "spectral_norm"])
    ignored = d.pick("labels.ignored", ["some", "none", "all"], [5, 3, 1])
    ignore_index = d.pick("ignore_index", [-100, 0, 5], [6, 1, 1])
    n_items = d.pick("num_items_in_batch", [None, "int", "tensor", "zero"], [5, 2, 2, 1])
    shift = d.flag("shift_labels", 0.15)
    positional = d.flag("positional", 0.2)
    vocab_arg = d.pick("vocab_size", ["right", "wrong"], [12, 1])
    train = d.flag("train", 0.85)
    params_grad = d.flag("params_grad", 0.8)
    kind = pick_values(d, "h.values")
    layout = d.pick("h.layout", LAYOUTS, [8, 0, 1, 2, 1])
    extra_kw = d.flag("extra_kwarg", 0.1)

    def world(kind_):
        def build():
            w = nn.Module()
            w.head = make_head()
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    def inputs(gen):
        h = lay(values(gen, (b, s, hidden), dtype, kind), layout)
        labels = torch.randint(0, vocab, (b, s), generator=gen)
        if ignored == "some":
            labels[:, : max(1, s // 2)] = ignore_index
        elif ignored == "all":
            labels[:] = ignore_index
        return [h, labels]

    def loss_args(labels):
        kw = {}
        if ignore_index != -100:
            kw["ignore_index"] = ignore_index
        if n_items == "int":
            kw["num_items_in_batch"] = 7
        elif n_items == "tensor":
            kw["num_items_in_batch"] = torch.tensor(7)
        elif n_items == "zero":
            kw["num_items_in_batch"] = 0
        if shift:
            kw["shift_labels"] = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        if extra_kw:
            kw["output_attentions"] = None
        v = vocab if vocab_arg == "right" else vocab + 1
        if positional:
            return (labels, v), kw
        return (), {"labels": labels, "vocab_size": v, **kw}

    def original(w, h, labels):
        logits = w.head(h)
        args, kw = loss_args(labels)
        if args:
            return logits, ForCausalLMLoss(logits, *args, **kw)
        return logits, ForCausalLMLoss(logits=logits, **kw)

    def kernel(w, h, labels):
        from adopter.kernels.guarded_linear_cross_entropy import linear_cross_entropy
        args, kw = loss_args(labels)
        return linear_cross_entropy(w.head, h, ForCausalLMLoss, *args, **kw)

    # (ForCausalLMLoss computes in float32 (logits.float()) whatever the input dtype: float64 inputs
    # are compared at float32's tolerance)
    return Spec(world, inputs, original, kernel, dtype, train=train, accept=_lce_accept, params_grad=params_grad,
                vmap_ok=False, grad_outputs=(1,), tol=TOL[F32] if dtype == F64 else None)


def build_lm_head_cross_entropy(d: Draw) -> Spec:
    dtype = pick_dtype(d, weights=(8, 2, 3, 1))
    hidden, vocab = d.pick("hidden", [1, 4, 8]), d.pick("vocab", [2, 11, 37])
    b, s = d.pick("batch", [1, 2, 3]), d.pick("seq", [2, 5])
    bias = d.flag("head.bias", 0.3)
    make_head = linear_variant(d, "head", hidden, vocab, bias,
                               ["plain", "sub", "sub_forward", "sub_call", "weight_norm", "spectral_norm"])
    loss_kind = d.pick("loss", ["F.cross_entropy", "CrossEntropyLoss"], [3, 2])
    reduction = d.pick("reduction", ["mean", "sum", "none"], [6, 2, 1])
    ignore_index = d.pick("ignore_index", [-100, 0], [5, 1])
    smoothing = d.pick("label_smoothing", [0.0, 0.1], [8, 1])
    class_weight = d.flag("class_weight", 0.05)
    rows = d.pick("rows", ["none", "shift", "ellipsis_shift"], [3, 2, 2])
    contiguous = d.flag("contiguous", 0.5)
    flatten = d.pick("flatten", ["view", "reshape", "flatten01"], [4, 2, 1])
    vocab_kw = d.pick("vocab_arg", ["none", "right", "wrong"], [4, 2, 1])
    upcast = d.flag("upcast", 0.3)
    all_ignored = d.flag("all_ignored", 0.05)
    train = d.flag("train", 0.85)
    params_grad = d.flag("params_grad", 0.8)
    kind = pick_values(d, "h.values")
    layout = d.pick("h.layout", LAYOUTS, [8, 0, 1, 2, 1])

    rows_value = {"none": None, "shift": (slice(None), slice(None, -1), slice(None)),
                  "ellipsis_shift": (Ellipsis, slice(None, -1), slice(None))}[rows]
    vocab_value = {"none": None, "right": vocab, "wrong": vocab + 1}[vocab_kw]
    flatten_value = (0, 1) if flatten == "flatten01" else flatten

    def world(kind_):
        def build():
            w = nn.Module()
            w.head = make_head()
            if loss_kind == "CrossEntropyLoss":
                weight = torch.rand(vocab, generator=gen_for(d.seed, "cw")) if class_weight else None
                w.loss = nn.CrossEntropyLoss(weight=weight, ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=smoothing)
            return _params_grad(w.to(dtype), params_grad)
        return _seeded_world(d.seed, build)

    def inputs(gen):
        h = lay(values(gen, (b, s, hidden), dtype, kind), layout)
        labels = torch.randint(0, vocab, (b, s), generator=gen)
        labels[0, 0] = ignore_index
        if all_ignored:
            labels[:] = ignore_index
        return [h, labels]

    def target_of(labels):
        return (labels[:, 1:] if rows != "none" else labels).reshape(-1)

    def loss_call(w, z, target):
        if loss_kind == "CrossEntropyLoss":
            return w.loss, (target,), {}
        kw = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": smoothing}
        if class_weight:
            kw["weight"] = torch.rand(vocab, generator=gen_for(d.seed, "cw")).to(z.dtype if z is not None else dtype)
        return F.cross_entropy, (target,), kw

    def original(w, h, labels):
        logits = w.head(h)
        z = logits if rows_value is None else logits[rows_value]
        if contiguous:
            z = z.contiguous()
        if flatten == "view":
            z = z.view(-1, z.size(-1) if vocab_value is None else vocab_value)
        elif flatten == "reshape":
            z = z.reshape(-1, z.size(-1) if vocab_value is None else vocab_value)
        else:
            z = z.flatten(0, 1)
        if upcast:
            z = z.float()
        fn, args, kw = loss_call(w, z, target_of(labels))
        if "weight" in kw:
            kw["weight"] = kw["weight"].to(z.dtype)
        return logits, fn(z, *args, **kw)

    def kernel(w, h, labels):
        from adopter.kernels.guarded_linear_cross_entropy import lm_head_cross_entropy
        fn, args, kw = loss_call(w, None, target_of(labels))
        if "weight" in kw:
            kw["weight"] = kw["weight"].to(torch.float32 if upcast else w.head.weight.dtype)
        return lm_head_cross_entropy(w.head, h, fn, *args, rows=rows_value, contiguous=contiguous,
                                     flatten=flatten_value, vocab=vocab_value, upcast=upcast, **kw)

    # (with .float() the source's cross entropy runs in float32 for float64 logits too)
    return Spec(world, inputs, original, kernel, dtype, train=train, accept=_lce_accept, params_grad=params_grad,
                vmap_ok=False, grad_outputs=(1,), tol=TOL[F32] if dtype == F64 and upcast else None)


# ---------------------------------------------------------------------- rotary


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_wrong(x):  # a look-alike that is not the rotation (a library's patch)
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((x2, -x1), dim=-1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def rotate_every_two_any_rank(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryHolder(nn.Module):
    """A module whose method is the rotation (``self.rotate_half``)."""

    def rotate_half(self, x):
        return rotate_half(x)


def _rope_angles(gen, s: int, width: int, dtype, repeat: str):
    inv = 1.0 / (10000 ** (torch.arange(0, width, dtype=F64) / max(width, 1)))
    t = torch.arange(s, dtype=F64)[:, None] * inv[None, :] + torch.rand((), generator=gen, dtype=F64)
    if repeat == "cat":
        t = torch.cat((t, t), dim=-1)
    elif repeat == "interleave":
        t = t.repeat_interleave(2, dim=-1)
    return t.cos().to(dtype), t.sin().to(dtype)


def _rope_common(d: Draw):
    dtype = pick_dtype(d, weights=(8, 2, 4, 2))
    b, h, s = d.pick("batch", [0, 1, 2], [1, 4, 3]), d.pick("heads", [1, 3]), d.pick("seq", [1, 4, 5])
    dh = d.pick("head_dim", [2, 6, 8, 5], [3, 3, 3, 1])
    cos_shape = d.pick("cos.shape", ["(1,1,s,d)", "(b,1,s,d)", "(s,d)", "(b,h,s,d)", "wider"], [5, 3, 3, 1, 1])
    cos_dtype = d.pick("cos.dtype", ["same", "float32", "float64"], [10, 1, 1])
    cos_grad = d.flag("cos.requires_grad", 0.08)
    x_layout = d.pick("x.layout", ["contiguous", "transposed_bshd", "strided", "expanded"], [6, 4, 1, 1])
    kind = pick_values(d, "x.values")
    return dtype, b, h, s, dh, cos_shape, cos_dtype, cos_grad, x_layout, kind


def _rope_x(gen, dtype, b, h, s, dh, layout, kind):
    if layout == "transposed_bshd":  # q.view(b, s, h, d).transpose(1, 2)
        return values(gen, (b, s, h, dh), dtype, kind).transpose(1, 2).detach()
    return lay(values(gen, (b, h, s, dh), dtype, kind), {"contiguous": "contiguous", "strided": "strided",
                                                          "expanded": "expanded"}[layout])


def _rope_cos(gen, cos_shape, cos_dtype, dtype, b, h, s, width, repeat):
    cdt = {"same": dtype, "float32": F32, "float64": F64}[cos_dtype]
    cos, sin = _rope_angles(gen, s, width, cdt, repeat)
    shape = {"(1,1,s,d)": (1, 1), "(b,1,s,d)": (b, 1), "(s,d)": (), "(b,h,s,d)": (b, h), "wider": (b, h + 1)}[cos_shape]
    if cos_shape in ("(b,1,s,d)", "(b,h,s,d)", "wider"):
        cos, sin = (t.expand(*shape, *t.shape).contiguous() for t in (cos, sin))
    elif shape:
        cos, sin = (t.reshape(*shape, *t.shape) for t in (cos, sin))
    if cos_shape == "wider":
        cos, sin = cos[:, : h + 1], sin[:, : h + 1]
    return cos, sin


def build_rotary(d: Draw) -> Spec:
    dtype, b, h, s, dh, cos_shape, cos_dtype, cos_grad, x_layout, kind = _rope_common(d)
    how = d.pick("rotate_half", ["function", "None", "tensor", "method", "wrong", "lambda"], [6, 3, 2, 1, 1, 1])
    if cos_shape == "wider":
        cos_shape = "(b,h,s,d)" if h > 1 else cos_shape

    def inputs(gen):
        x = _rope_x(gen, dtype, b, h, s, dh, x_layout, kind)
        cos, sin = _rope_cos(gen, cos_shape, cos_dtype, dtype, b, h, s, dh // 2, "cat")
        return [x, cos.requires_grad_(cos_grad) if cos.is_floating_point() else cos, sin]

    def fn_of(w):
        return {"function": rotate_half, "method": w.holder.rotate_half if hasattr(w, "holder") else rotate_half,
                "wrong": rotate_half_wrong, "lambda": lambda t: rotate_half(t)}.get(how)

    def world(kind_):
        w = nn.Module()
        w.holder = RotaryHolder()
        return w

    def original(w, x, cos, sin):
        if how == "tensor":
            return (x * cos) + (rotate_half(x) * sin)
        fn = fn_of(w) or rotate_half
        return (x * cos) + (fn(x) * sin)

    def kernel(w, x, cos, sin):
        from adopter.kernels.guarded_rotary import rotary
        if how == "tensor":
            return rotary(x, cos, sin, rotate_half(x))
        return rotary(x, cos, sin, fn_of(w))

    return Spec(world, inputs, original, kernel, dtype)


def build_rotary_interleaved(d: Draw) -> Spec:
    dtype, b, h, s, dh, cos_shape, cos_dtype, cos_grad, x_layout, kind = _rope_common(d)
    fn = d.pick("rotate_every_two", ["gptj", "any_rank"], [2, 1])
    rotation = rotate_every_two if fn == "gptj" else rotate_every_two_any_rank

    def inputs(gen):
        x = _rope_x(gen, dtype, b, h, s, dh, x_layout, kind)
        cos, sin = _rope_cos(gen, cos_shape, cos_dtype, dtype, b, h, s, dh // 2, "interleave")
        return [x, cos.requires_grad_(cos_grad), sin]

    from adopter.kernels.guarded_rotary import rotary_interleaved
    return Spec(lambda k: nn.Module(), inputs, lambda w, x, c, s_: (x * c) + (rotation(x) * s_),
                lambda w, x, c, s_: rotary_interleaved(x, c, s_, rotation), dtype)


def build_rotary_pairs(d: Draw) -> Spec:
    dtype, b, h, s, dh, cos_shape, cos_dtype, cos_grad, x_layout, kind = _rope_common(d)
    join = d.pick("join", ["stack", "cat"])
    swap = d.flag("angles_first", 0.15)  # the source wrote the angles as the pair (symmetric)

    def inputs(gen):
        x = _rope_x(gen, dtype, b, h, s, max(dh // 2, 1) * 2, x_layout, kind)
        x1, x2 = x[..., ::2], x[..., 1::2]
        cos, sin = _rope_cos(gen, cos_shape, cos_dtype, dtype, b, h, s, x1.shape[-1], "none")
        if cos_grad:
            cos.requires_grad_(True)
        return [x1.detach(), x2.detach(), cos, sin]

    def original(w, x1, x2, cos, sin):
        if swap:
            x1, x2, cos, sin = cos, sin, x1, x2
        if join == "cat":
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def kernel(w, x1, x2, cos, sin):
        from adopter.kernels.guarded_rotary import rotary_pairs
        if swap:
            x1, x2, cos, sin = cos, sin, x1, x2
        return rotary_pairs(x1, x2, cos, sin, join=join)

    return Spec(lambda k: nn.Module(), inputs, original, kernel, dtype)


def build_rotary_complex(d: Draw) -> Spec:
    dtype = pick_dtype(d, options=(F32, F64), weights=(3, 1))
    b, s, h = d.pick("batch", [0, 1, 2], [1, 4, 3]), d.pick("seq", [1, 4]), d.pick("heads", [1, 3])
    dh = d.pick("head_dim", [2, 8])
    freqs_how = d.pick("freqs", ["plain", "conj", "parameter", "requires_grad", "other_dtype", "broadcast_wider"],
                       [8, 2, 1, 1, 1, 1])
    order = d.pick("order", ["x*f", "f*x"], [4, 1])
    kind = pick_values(d, "x.values")
    x_layout = d.pick("x.layout", ["contiguous", "transposed"], [3, 1])
    cdt = torch.complex64 if dtype == F32 else torch.complex128

    def world(kind_):
        w = nn.Module()
        ang = torch.rand(s, dh // 2, generator=gen_for(d.seed, "freqs"), dtype=F64) * 6
        f = torch.polar(torch.ones_like(ang), ang)
        f = f.to(torch.complex128 if freqs_how == "other_dtype" and cdt == torch.complex64 else cdt)
        f = f.reshape(1, s, 1, dh // 2)
        if freqs_how == "broadcast_wider":
            f = f.expand(2, s, 1, dh // 2).contiguous()
        if freqs_how == "parameter":
            w.freqs = nn.Parameter(f)
        else:
            w.register_buffer("freqs", f)
        return w

    def inputs(gen):
        x = values(gen, (b, s, h, dh), dtype, kind)
        if x_layout == "transposed":
            x = x.transpose(1, 2).contiguous().transpose(1, 2).detach()
        return [x]

    def freqs_of(w):
        f = w.freqs
        if freqs_how == "conj":
            f = f.conj()
        if freqs_how == "requires_grad":
            f = f.detach().requires_grad_(True)
        return f

    def as_complex(x):
        return torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))

    def original(w, x):
        xc, f = as_complex(x), freqs_of(w)
        out = torch.view_as_real(xc * f if order == "x*f" else f * xc)
        return out.flatten(3).type_as(x)

    def kernel(w, x):
        from adopter.kernels.guarded_rotary import rotary_complex
        xc, f = as_complex(x), freqs_of(w)
        out = rotary_complex(xc, f) if order == "x*f" else rotary_complex(f, xc)
        return out.flatten(3).type_as(x)

    return Spec(world, inputs, original, kernel, dtype)


# ====================================================================== the row table


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    build: Callable[[Draw], Spec]
    kernel: str            # telemetry name (fused calls are counted under it)


ROWS: dict[str, Row] = {r.name: r for r in [
    Row("conv_bn", build_conv_bn, "conv_bn"),
    Row("seq_conv_bn", build_seq_conv_bn, "conv_bn"),
    Row("fused_conv_bn_module", build_fused_conv_bn_module, ""),
    Row("linear_bn", build_linear_bn, "linear_bn"),
    Row("seq_linear_bn", build_seq_linear_bn, "linear_bn"),
    Row("fused_linear_bn_module", build_fused_linear_bn_module, ""),
    Row("linear_gelu", build_linear_gelu, "linear_gelu"),
    Row("seq_linear_gelu", build_seq_linear_gelu, "linear_gelu"),
    Row("qkv", build_qkv, "qkv"),
    Row("dropout_add_layer_norm", build_dropout_add_layer_norm, "dropout_add_layer_norm"),
    Row("softmax", build_softmax, "softmax"),
    Row("attention", build_attention, "attention"),
    Row("add_relu", build_add_relu, "add_relu"),
    Row("conv_bn_add_relu", build_conv_bn_add_relu, "add_relu"),
    Row("rms_norm", build_rms_norm, "rms_norm"),
    Row("scaled_l2_norm", build_scaled_l2_norm, "scaled_l2_norm"),
    Row("gated_mlp", build_gated_mlp, "gated_mlp"),
    Row("gated_mlp_packed", build_gated_mlp_packed, "gated_mlp"),
    Row("linear_cross_entropy", build_linear_cross_entropy, "linear_cross_entropy"),
    Row("lm_head_cross_entropy", build_lm_head_cross_entropy, "linear_cross_entropy"),
    Row("rotary", build_rotary, "rotary"),
    Row("rotary_interleaved", build_rotary_interleaved, "rotary"),
    Row("rotary_pairs", build_rotary_pairs, "rotary"),
    Row("rotary_complex", build_rotary_complex, "rotary"),
]}


# ====================================================================== modes

EXECS = ["eager", "fx", "jit_trace", "compile_eager", "compile_aot_eager", "compile_inductor"]
GRADS = ["no_grad", "inference", "grad", "double", "func_grad", "vmap", "jvp", "fwad", "autocast", "autocast_grad"]
CHANGES = ["adamw_fused", "adamw_foreach", "train_call", "data_mul", "data_copy", "inplace", "load_state_dict",
           "load_assign", "dtype_roundtrip", "add_hooks", "global_hook", "requires_grad_off", "requires_grad_on",
           "train_flip", "unfreeze"]
# Under adopter.kernels.freeze the user promises that weights do not change: these changes break the
# promise silently (documented: "call unfreeze before changing weights"), so a difference after one of
# them, on a frozen world, is reported as documented rather than as a mismatch ...
BREAKS_FREEZE = {"adamw_fused", "adamw_foreach", "data_mul", "data_copy", "inplace", "load_state_dict"}
# ... while these end the promise in a way the kernels must see (training mode, requires_grad, new
# parameter objects, .to(), unfreeze): a difference after them is a mismatch.
ENDS_FREEZE = {"train_call", "train_flip", "load_assign", "dtype_roundtrip", "requires_grad_on", "unfreeze"}


@dataclasses.dataclass(frozen=True)
class Mode:
    exec: str = "eager"
    grad: str = "no_grad"
    changes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.exec}/{self.grad}/{'+'.join(self.changes) or 'once'}"

    @classmethod
    def parse(cls, name: str) -> Mode:
        exec_, grad, changes = name.split("/")
        return cls(exec_, grad, () if changes == "once" else tuple(changes.split("+")))


# ====================================================================== running one side


class Failure(Exception):
    """An exception raised while running one side, with the stage it was raised in."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage, self.error = stage, error


def _wrapper(fn: Callable, world: nn.Module, n: int) -> nn.Module:
    """A module whose ``forward`` of ``n`` positional tensors calls ``fn(self.w, ...)``: what fx,
    jit.trace and torch.compile see (the user's module calling the kernel)."""
    names = ", ".join(f"a{i}" for i in range(n))
    ns: dict = {}
    exec(f"def forward(self, {names}):\n    return self._fn(self.w, {names})\n", ns)  # noqa: S102
    cls = type("FuzzModel", (nn.Module,), {"forward": ns["forward"]})
    m = cls()
    m.w = world
    object.__setattr__(m, "_fn", fn)
    m.train(world.training)
    return m


def _flatten(out: Any) -> list:
    if isinstance(out, (tuple, list)):
        return [y for x in out for y in _flatten(x)]
    return [out]


def _state(world: nn.Module) -> dict:
    try:
        return dict(world.state_dict(keep_vars=True))
    except Exception:  # noqa: BLE001
        return {}


class Side:
    """One world (``orig`` or ``kern``) with its executable under an exec mode."""

    def __init__(self, spec: Spec, kind: str, mode: Mode, n_inputs: int) -> None:
        self.spec, self.kind, self.mode = spec, kind, mode
        self.fn = spec.original if kind == "orig" else spec.kernel
        self.n = n_inputs
        self.ctx = spec.context if kind == "kern" and spec.context else contextlib.nullcontext
        try:
            with self.ctx():
                self.world = spec.world(kind)
            self.world.train(spec.train)
            if spec.freeze:
                if kind == "kern":
                    K.freeze(self.world)
                else:  # what freeze() does to the model, without the promise
                    self.world.eval()
                    self.saved_requires_grad = [(p, p.requires_grad) for p in self.world.parameters()]
                    for p in self.world.parameters():
                        p.requires_grad_(False)
        except Exception as e:  # noqa: BLE001
            raise Failure("build", e) from e
        self.exe = None
        self.hook_handles: list = []

    # the executable: built at the first call
    def executable(self, inputs: list):
        if self.exe is not None:
            return self.exe
        exec_ = self.mode.exec
        if exec_ == "eager":
            self.exe = lambda *xs: self.fn(self.world, *xs)
            return self.exe
        model = _wrapper(self.fn, self.world, self.n)
        try:
            if exec_ == "fx":
                self.module = torch.fx.symbolic_trace(model)
            elif exec_ == "jit_trace":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.module = torch.jit.trace(model, tuple(inputs), check_trace=False, strict=False)
            else:
                torch._dynamo.reset()
                backend = exec_.split("_", 1)[1]
                self.module = torch.compile(model, fullgraph=True, backend=backend)
        except Exception as e:  # noqa: BLE001
            if self.kind == "orig":
                # the user's code does not trace/compile this way: the reference is its eager run
                # (a kernel that traces where the original does not is no difference)
                self.untraceable = f"{exec_}: {type(e).__name__}"
                self.exe = model  # (called eagerly: module hooks see the same calls)
                return self.exe
            raise Failure(exec_, e) from e
        self.exe = self.module
        return self.exe

    def set_training(self, on: bool) -> None:
        self.world.train(on)
        module = getattr(self, "module", None)
        if module is not None and hasattr(module, "train"):
            module.train(on)

    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, t) for k, t in sorted(_state(self.world).items())
                if isinstance(t, nn.Parameter) and t.requires_grad]


@dataclasses.dataclass
class Result:
    error: Failure | None = None
    out: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)
    grads2: list = dataclasses.field(default_factory=list)
    tangents: list = dataclasses.field(default_factory=list)
    inputs_after: list = dataclasses.field(default_factory=list)
    state: dict = dataclasses.field(default_factory=dict)
    rng: torch.Tensor | None = None
    hooks: int = 0
    fused: int = 0
    original: int = 0


def _make_inputs(spec: Spec, seed: tuple, grad: str, leaves: bool, cast: torch.dtype | None = None) -> list:
    gen = gen_for(*seed)
    if grad == "inference":
        with torch.inference_mode():
            return spec.inputs(gen)
    xs = spec.inputs(gen)
    if cast is not None:  # (the float64 reference: the same values, upcast)
        xs = [x.detach().to(cast).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
              and x.is_floating_point() else x for x in xs]
    if leaves and grad in ("grad", "double", "autocast_grad"):
        xs = [x.requires_grad_(True) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
              and x.grad_fn is None else x for x in xs]
    return xs


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _cotangents(outs: list, seed: tuple, which: tuple[int, ...] | None = None) -> list:
    g = gen_for(*seed, "cotangent")
    return [torch.randn(o.shape, generator=g, dtype=F64) if _differentiable(o) and (which is None or i in which)
            else None for i, o in enumerate(outs)]


def _scalar(outs: list, cts: list) -> torch.Tensor | None:
    total = None
    for o, c in zip(outs, cts):
        if c is None or not o.requires_grad:
            continue
        term = (o.real if o.is_complex() else o).to(F64).mul(c).sum()
        total = term if total is None else total + term
    return total


def call_side(side: Side, spec: Spec, mode: Mode, seed: tuple, grad: str, cast: torch.dtype | None = None) -> Result:
    """One call of ``side`` under ``grad`` with the inputs of ``seed``: outputs and derivatives,
    then the world's state, the inputs, the next random draw and the hook count."""
    from adopter.kernels import count_kernel_calls

    res = Result()
    leaves = seed[-1] != "params_only"
    xs: list = []
    hooks_before = _CALLS["hooks"]
    stage = "inputs"
    torch.manual_seed(_stable_hash(*seed) & 0x7FFFFFFF)
    try:
        xs = _make_inputs(spec, seed[:-1], grad, leaves, cast)
        stage = "forward"
        with side.ctx(), count_kernel_calls() as counted, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exe = side.executable(xs)
            if grad in ("no_grad", "inference") or grad == "autocast":
                cm = {"no_grad": torch.no_grad, "inference": torch.inference_mode,
                      "autocast": lambda: torch.autocast("cpu", dtype=BF16)}[grad]
                with cm(), (torch.no_grad() if grad == "autocast" else contextlib.nullcontext()):
                    res.out = _flatten(exe(*xs))
            elif grad in ("grad", "double", "autocast_grad"):
                with torch.autocast("cpu", dtype=BF16) if grad == "autocast_grad" else contextlib.nullcontext():
                    res.out = _flatten(exe(*xs))
                leaves_ = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad] + [
                    p for _, p in side.params()]
                cts = _cotangents(res.out, seed, spec.grad_outputs)
                loss = _scalar(res.out, cts)
                if loss is not None and leaves_:
                    stage = "backward"
                    gs = torch.autograd.grad(loss, leaves_, allow_unused=True, create_graph=grad == "double")
                    res.grads = list(gs)
                    if grad == "double":
                        stage = "double_backward"
                        second = [(g.to(F64) ** 2).sum() for g in gs if g is not None and g.requires_grad]
                        if second:
                            res.grads2 = list(torch.autograd.grad(sum(second), leaves_, allow_unused=True))
                        else:
                            res.grads2 = [None] * len(leaves_)
                        res.grads = [None if g is None else g.detach() for g in res.grads]
            elif grad == "func_grad":
                idx = [i for i, x in enumerate(xs) if _differentiable(x)]

                def f(*diff):
                    args = list(xs)
                    for i, t in zip(idx, diff):
                        args[i] = t
                    outs = _flatten(exe(*args))
                    total = _scalar(outs, [torch.ones(o.shape, dtype=F64) if _differentiable(o) and (
                        spec.grad_outputs is None or j in spec.grad_outputs) else None for j, o in enumerate(outs)])
                    return total if total is not None else torch.zeros((), dtype=F64)

                if idx:
                    res.grads = list(torch.func.grad(f, argnums=tuple(range(len(idx))))(*[xs[i] for i in idx]))
                with torch.no_grad():
                    res.out = _flatten(exe(*xs))
            elif grad == "vmap":
                if not spec.vmap_ok or not xs or not _differentiable(xs[0]):
                    raise _Skip("vmap: no batched first input for this row")
                other = _make_inputs(spec, (*seed[:-1], "vmap"), "no_grad", False)[0]
                stacked = torch.stack([xs[0], other])
                with torch.no_grad():
                    res.out = _flatten(torch.func.vmap(lambda a: exe(a, *xs[1:]))(stacked))
            elif grad in ("jvp", "fwad"):
                idx = [i for i, x in enumerate(xs) if _differentiable(x) and x.dtype != torch.bool]
                if not idx:
                    raise _Skip("no differentiable input")
                g = gen_for(*seed, "tangent")
                tangents = [torch.randn(xs[i].shape, generator=g, dtype=F64).to(xs[i].dtype) for i in idx]
                if grad == "jvp":
                    def f(*diff):
                        args = list(xs)
                        for i, t in zip(idx, diff):
                            args[i] = t
                        return tuple(o for o in _flatten(exe(*args)))
                    with torch.no_grad():
                        out, tan = torch.func.jvp(f, tuple(xs[i] for i in idx), tuple(tangents))
                    res.out, res.tangents = list(out), list(tan)
                else:
                    with fwAD.dual_level(), torch.no_grad():
                        args = list(xs)
                        for i, t in zip(idx, tangents):
                            args[i] = fwAD.make_dual(xs[i], t)
                        outs = _flatten(exe(*args))
                        for o in outs:
                            if isinstance(o, torch.Tensor):
                                p, t = fwAD.unpack_dual(o)
                                res.out.append(p.clone())
                                res.tangents.append(None if t is None else t.clone())
                            else:
                                res.out.append(o)
                                res.tangents.append(None)
            else:
                raise AssertionError(grad)
    except _Skip:
        raise
    except Failure as e:
        res.error = e
        if side.kind == "kern" and e.stage == side.mode.exec and getattr(side, "orig_untraceable", ""):
            res.error = Failure("both", e.error)  # the original does not trace/compile either
    except Exception as e:  # noqa: BLE001
        res.error = Failure(stage, e)
    res.fused = sum(c.count for c in counted.calls if c.fused) if "counted" in locals() else 0
    res.original = sum(c.count for c in counted.calls if not c.fused) if "counted" in locals() else 0
    res.hooks = _CALLS["hooks"] - hooks_before
    res.rng = torch.rand(4)
    res.inputs_after = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]
    res.state = {k: v.detach().clone() for k, v in _state(side.world).items() if isinstance(v, torch.Tensor)}
    return res


class _Skip(Exception):
    pass


# ====================================================================== comparison

TOL = {F64: (1e-7, 1e-9), F32: (1e-4, 2e-5), BF16: (3e-2, 2e-2), F16: (1e-2, 4e-3)}


def _tolerance(spec: Spec, grad: str, t: torch.Tensor, extra: float = 1.0) -> tuple[float, float, float]:
    if spec.tol:
        return (*spec.tol, 0.0)
    dtype = spec.dtype
    if grad.startswith("autocast") or t.dtype in (BF16, F16):
        dtype = BF16 if BF16 in (t.dtype, dtype) or grad.startswith("autocast") else F16
    rtol, atol = TOL.get(dtype, TOL[F32])
    rtol, atol = min(rtol * extra, 0.5), min(atol * extra, 0.5)
    extra = 1.0
    if spec.extreme:  # rounding differences are amplified: values within 5%, NaN/inf positions exactly
        return max(rtol * extra, 5e-2), max(atol * extra, 5e-2), 1e-12
    return rtol * extra, atol * extra, 0.0


def diff_tensors(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, floor: float = 0.0,
                 normwise: bool = False) -> str:
    """'' when ``got`` matches ``want``: NaN and +-inf at the same places, finite values within
    ``atol * max|want| + rtol * |want|``; else what differs (with the magnitude)."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.is_complex() or want.is_complex():
        got, want = torch.view_as_real(got.resolve_conj()), torch.view_as_real(want.resolve_conj())
    if not got.is_floating_point() and not want.is_floating_point():
        return "" if torch.equal(got, want) else "integer values differ"
    g, w = got.detach().to(F64), want.detach().to(F64)
    if g.numel() == 0:
        return ""
    nan_g, nan_w = g.isnan(), w.isnan()
    if not torch.equal(nan_g, nan_w):
        return f"NaN positions differ: kernel {int(nan_g.sum())} NaN, original {int(nan_w.sum())}"
    inf_g, inf_w = g.isinf(), w.isinf()
    if not torch.equal(inf_g, inf_w) or not torch.equal(g[inf_w], w[inf_w]):
        return f"inf positions differ: kernel {int(inf_g.sum())} inf, original {int(inf_w.sum())}"
    fin = torch.isfinite(w)
    if not fin.any():
        return ""
    gf, wf = g[fin], w[fin]
    scale = max(float(wf.abs().max()), floor)
    err = (gf - wf).abs()
    if normwise:  # (low-precision gradients: a ReLU mask flipped by one rounding moves single elements)
        norm = float(wf.norm())
        if float(err.norm()) > rtol * norm + atol * max(floor, 1e-30):
            return f"values differ (norm-wise): |diff| {float(err.norm()):.3g} of |original| {norm:.3g}"
        return ""
    bound = atol * scale + rtol * wf.abs()
    if bool((err > bound).any()):
        worst = float(err.max())
        rel = worst / scale if scale else float("inf")
        return f"values differ: max |diff| {worst:.3g} ({rel:.3g} of max |original| {scale:.3g})"
    return ""


def _judge_by_reference(why: str, got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor, slack: float,
                        extreme: bool) -> str:
    """A difference from the original judged against the float64 reference: NaN/inf where the
    reference has them (the original's own overflow), values as accurate as the original's."""
    if why.startswith(("NaN positions", "inf positions")):
        g, r = got.detach(), ref.detach()
        if torch.equal(g.isnan(), r.isnan()) and torch.equal(g.isinf(), r.isinf()):
            return ""  # (the original overflowed where the exact computation does not)
        return why
    if why.startswith("values differ") and not extreme:
        return _against_reference(got, want, ref, slack)
    return why


def _against_reference(got: torch.Tensor, want: torch.Tensor, ref: torch.Tensor, slack: float) -> str:
    """'' when ``got`` is about as close to the float64 reference ``ref`` as the original's ``want``
    is (within 3x its error, or ``slack`` of the reference's norm), NaN/inf where it has them."""
    why = diff_tensors(got, want, 0.5, 0.5)  # (NaN/inf positions; values only grossly)
    if why.startswith(("NaN positions", "inf positions")):
        why = _judge_by_reference(why, got, want, ref, slack, True)
    if why:
        return why
    g, w, r = (t.detach().to(F64) for t in (got, want, ref))
    fin = torch.isfinite(r) & torch.isfinite(w) & torch.isfinite(g)
    g, w, r = g[fin], w[fin], r[fin]
    err_k, err_o, norm = float((g - r).norm()), float((w - r).norm()), float(r.norm())
    if err_k > 3 * err_o + slack * norm:
        return (f"less accurate than the original: |kernel - float64 reference| {err_k:.3g}, "
                f"|original - reference| {err_o:.3g} (|reference| {norm:.3g})")
    return ""


def _reference_side(orig: Side) -> Side | None:
    """A float64 copy of the original's world as it is now (the reference low-precision results are
    judged against)."""
    import copy

    try:
        world = copy.deepcopy(orig.world).double()
    except Exception:  # noqa: BLE001
        return None
    ref = object.__new__(Side)
    ref.__dict__.update(orig.__dict__)
    ref.world, ref.exe, ref.hook_handles = world, None, []
    return ref


def _layout_class(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    return "strided"


def compare(spec: Spec, mode: Mode, grad: str, a: Result, b: Result, label: str,
            ref: Result | None = None) -> tuple[list[str], str]:
    """(differences of the kernel's result ``b`` from the original's ``a``, note)."""
    out: list[str] = []
    note = ""
    if b.error is not None and b.error.stage == "both":
        return [], "both raise"
    if a.error is not None or b.error is not None:
        if a.error is not None and b.error is not None:
            return [], "both raise"
        if a.error is None:
            return [f"{label}: CRASH kernel raised where the original did not: {b.error}"], ""
        return [f"{label}: the original raised ({a.error}) but the kernel returned"], ""
    wa, wb = a.out, b.out
    ref_out = ref.out if ref is not None else None
    if spec.accept is not None:
        wa, wb, note = spec.accept(wa, wb)
        if ref_out is not None:
            ref_out = spec.accept(ref_out, b.out)[0]
    if len(wa) != len(wb):
        return [f"{label}: {len(wb)} outputs, the original {len(wa)}"], note
    for i, (x, y) in enumerate(zip(wa, wb)):
        tag = f"{label}: output {i}"
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            out.append(f"{tag}: kernel {type(y).__name__}, original {type(x).__name__}")
            continue
        if not isinstance(x, torch.Tensor):
            if x != y:
                out.append(f"{tag}: {y!r} != {x!r}")
            continue
        if x.dtype != y.dtype:
            out.append(f"{tag}: dtype {y.dtype}, original {x.dtype}")
        if grad in ("grad", "double", "autocast_grad") and x.requires_grad != y.requires_grad:
            out.append(f"{tag}: requires_grad {y.requires_grad}, original {x.requires_grad}")
        if x.shape == y.shape and x.dim() and x.numel() > 1:
            lx, ly = _layout_class(x), _layout_class(y)
            if lx != "strided" and lx != ly:  # (reported, not a failure: values are what is compared)
                note = (note + "; " if note else "") + f"layout: output {i} {ly}, original {lx}"
        why = diff_tensors(y, x, *_tolerance(spec, grad, x))
        r = ref_out[i] if ref_out is not None and i < len(ref_out) else None
        if why and isinstance(r, torch.Tensor) and r.shape == x.shape:
            why = _judge_by_reference(why, y, x, r, TOL.get(spec.dtype, TOL[F32])[1], spec.extreme)
        if why:
            out.append(f"{tag}: {why}")
    for name, xs, ys in (("grad", a.grads, b.grads), ("second-order grad", a.grads2, b.grads2),
                         ("tangent", a.tangents, b.tangents)):
        finite_max = [float(x.detach().abs().nan_to_num(0, 0, 0).max()) for x in xs
                      if isinstance(x, torch.Tensor) and x.numel() and not x.is_complex()]
        out_max = [float(o.detach().abs().nan_to_num(0, 0, 0).max()) for o in a.out
                   if isinstance(o, torch.Tensor) and o.numel() and o.is_floating_point()]
        # (a small gradient's error is its terms', not its own: e.g. a norm over one element)
        floor = 1e-2 * max(finite_max + out_max, default=0.0)
        if spec.accept is not None and name == "tangent" and len(xs) != len(ys):
            xs, ys, _ = spec.accept(xs, ys)
        if len(xs) != len(ys):
            out.append(f"{label}: {len(ys)} {name}s, the original {len(xs)}")
            continue
        for i, (x, y) in enumerate(zip(xs, ys)):
            if x is None and y is None:
                continue
            x = torch.zeros_like(y) if x is None else x
            y = torch.zeros_like(x) if y is None else y
            extra = {"grad": 4.0, "second-order grad": 25.0, "tangent": 2.0}[name]
            rtol, atol, fl = _tolerance(spec, grad, x, extra=extra)
            low = x.dtype in (BF16, F16) or spec.dtype in (BF16, F16) or grad.startswith("autocast")
            r = ref.grads[i] if ref is not None and name == "grad" and i < len(ref.grads) else None
            usable = isinstance(r, torch.Tensor) and r.shape == x.shape
            if low and usable and not spec.extreme:
                # (slack: in a small tensor one ReLU mask flipped by an ordinary rounding of a near-zero
                # output moves a gradient by ~10% of its norm, whichever code rounds)
                why = _against_reference(y, x, r, 0.25 if BF16 in (x.dtype, spec.dtype) else 0.1)
            else:
                why = diff_tensors(y, x, rtol, atol, max(fl, floor), normwise=low)
                if why and usable:
                    why = _judge_by_reference(why, y, x, r, TOL.get(spec.dtype, TOL[F32])[1], spec.extreme)
            if why:
                out.append(f"{label}: {name} {i}: {why}")
    for i, (x, y) in enumerate(zip(a.inputs_after, b.inputs_after)):
        if isinstance(x, torch.Tensor):
            why = diff_tensors(y, x, *_tolerance(spec, grad, x))
            if why:
                out.append(f"{label}: input {i} after the call: {why}")
    keys = set(a.state) | set(b.state)
    for k in sorted(keys):
        if k not in a.state or k not in b.state:
            out.append(f"{label}: state key {k} only on the {'kernel' if k in b.state else 'original'} side")
            continue
        why = diff_tensors(b.state[k], a.state[k], *_tolerance(spec, grad, a.state[k]))
        if why:
            out.append(f"{label}: state {k}: {why}")
    if a.rng is not None and b.rng is not None and not torch.equal(a.rng, b.rng):
        out.append(f"{label}: RNG consumption differs (the next draw after the call)")
    if a.hooks != b.hooks and spec.hooks_comparable:
        out.append(f"{label}: hooks called {b.hooks} times, the original {a.hooks}")
    return out, note


# ====================================================================== state changes


def _float_state(world: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, t in sorted(_state(world).items())
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _perturbation(key: str, t: torch.Tensor, seed: int, positive: bool) -> torch.Tensor:
    g = gen_for(seed, key)
    if t.is_complex():
        return torch.randn(t.shape, generator=g, dtype=F64).to(t.dtype) * 0.1 + t.detach()
    p = torch.randn(t.shape, generator=g, dtype=F64)
    if positive:
        p = p.abs() + 0.2
    return p.to(t.dtype)


def apply_change(side: Side, change: str, seed: int) -> None:
    world = side.world
    if change in ("adamw_fused", "adamw_foreach"):
        named = [(k, t) for k, t in sorted(_state(world).items()) if isinstance(t, nn.Parameter)
                 and t.is_floating_point()]
        if not named:
            raise _Skip("no parameters to step")
        for k, p in named:
            p.grad = _perturbation(k, p, seed, False)
        opt = torch.optim.AdamW([p for _, p in named], lr=0.05, **({"fused": True} if change == "adamw_fused"
                                                                   else {"foreach": True}))
        opt.step()
        for _, p in named:
            p.grad = None
    elif change in ("data_mul", "data_copy", "inplace"):
        for k, t in _float_state(world):
            p = _perturbation(k, t, seed, "running_var" in k)
            if change == "data_mul":  # an EMA update through .data
                t.data.mul_(0.5).add_(p, alpha=0.5)
            elif change == "data_copy":
                t.data.copy_(p)
            else:
                with torch.no_grad():
                    t.mul_(0.5).add_(p, alpha=0.5)
    elif change in ("load_state_dict", "load_assign"):
        sd = world.state_dict()
        new = {k: (_perturbation(k, v, seed, "running_var" in k) if v.is_floating_point() else v.clone())
               for k, v in sd.items()}
        world.load_state_dict(new, assign=change == "load_assign")
    elif change == "dtype_roundtrip":
        dtypes = {k: t.dtype for k, t in _float_state(world)}
        if not dtypes:
            raise _Skip("no floating state")
        back = next(iter(dtypes.values()))
        world.double()
        with torch.no_grad():
            for k, t in _float_state(world):
                t.mul_(0.75)
        world.to(back)
    elif change == "add_hooks":
        for m in world.modules():
            if m is not world and not list(m.children()):
                side.hook_handles.append(m.register_forward_hook(_count_hook))
    elif change == "requires_grad_off":
        for p in world.parameters():
            p.requires_grad_(False)
    elif change == "requires_grad_on":
        for p in world.parameters():
            if p.is_floating_point() or p.is_complex():
                p.requires_grad_(True)
    elif change == "unfreeze":
        if side.kind == "kern" and side.spec.freeze:
            K.unfreeze(world)
        elif side.spec.freeze:
            for p, on in getattr(side, "saved_requires_grad", []):
                p.requires_grad_(on)
    elif change in ("train_call", "train_flip", "global_hook"):
        pass  # handled by the runner
    else:
        raise AssertionError(change)


# ====================================================================== one case


@dataclasses.dataclass
class Outcome:
    case: str
    row: str
    mode: str
    seed: int
    status: str                    # match | mismatch | crash | skip | documented
    problems: list[str]
    choices: dict
    note: str = ""
    fused: int = 0
    original: int = 0
    both_raise: bool = False

    def report(self) -> str:
        lines = [f"{self.case}: {self.status}" + (f" ({self.note})" if self.note else ""),
                 f"  choices: {self.choices}", f"  kernel calls: {self.fused} fused, {self.original} original"]
        lines += [f"  - {p}" for p in self.problems[:12]]
        return "\n".join(lines)


def case_id(row: str, mode: Mode, seed: int) -> str:
    return f"{row}|{mode.name}|s{seed}"


def case_from_id(cid: str) -> tuple[str, Mode, int]:
    row, mode, seed = cid.split("|")
    return row, Mode.parse(mode), int(seed[1:])


@contextlib.contextmanager
def _global_hook(active: bool):
    handle = nn.modules.module.register_module_forward_hook(_count_hook) if active else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def run_case(row_name: str, mode: Mode, seed: int, pins: dict | None = None) -> Outcome:
    """Run one case: build both worlds, then call - (change - call)... comparing after each call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _run_case(row_name, mode, seed, pins)


def _run_case(row_name: str, mode: Mode, seed: int, pins: dict | None = None) -> Outcome:
    row = ROWS[row_name]
    d = Draw(seed, row_name, pins)
    cid = case_id(row_name, mode, seed)
    try:
        spec = row.build(d)
    except _Skip as e:
        return Outcome(cid, row_name, mode.name, seed, "skip", [str(e)], d.choices)
    spec.extreme = any(v in ("large", "overflow", "tiny") for k, v in d.choices.items() if k.endswith("values")) or \
        d.choices.get("bn.stats") in ("tiny_var", "zero_var", "huge_var")
    if mode.exec.startswith("compile") and {"global_hook", "add_hooks"} & set(mode.changes):
        return Outcome(cid, row_name, mode.name, seed, "skip",
                       ["hooks registered after torch.compile: what dynamo guards on, not the kernel"], d.choices)
    grad_leaves = "both"
    if mode.grad in ("grad", "double", "autocast_grad"):
        grad_leaves = d.pick("grad.leaves", ["both", "params_only"], [3, 1])
        if grad_leaves == "params_only" and not spec.params_grad:
            grad_leaves = "both"
    finite.forget()
    problems: list[str] = []
    documented: list[str] = []
    notes: set[str] = set()
    fused = original = 0
    both_raise = False
    sides: list[Side] = []
    status = "match"
    try:
        try:
            orig = Side(spec, "orig", mode, 0)
        except Failure as e:
            return Outcome(cid, row_name, mode.name, seed, "skip", [f"the original's modules do not build: {e}"],
                           d.choices)
        try:
            n_inputs = len(spec.inputs(gen_for(seed, "probe")))
        except Exception as e:  # noqa: BLE001
            return Outcome(cid, row_name, mode.name, seed, "skip", [f"the inputs do not build: {e!r}"], d.choices)
        orig.n = n_inputs
        try:
            kern = Side(spec, "kern", mode, n_inputs)
        except Failure as e:
            return Outcome(cid, row_name, mode.name, seed, "crash", [f"the kernel's modules do not build: {e}"],
                           d.choices)
        sides = [orig, kern]

        steps: list[tuple[str, str]] = [("call", mode.grad)]
        for change in mode.changes:
            steps.append(("promise", change))
            if change == "train_call":
                steps += [("train", ""), ("call", mode.grad if mode.grad != "inference" else "no_grad"), ("eval", "")]
            elif change == "train_flip":
                steps += [("train", ""), ("call", "no_grad"), ("eval", "")]
            elif change == "global_hook":
                steps += [("global_hook", "")]
            else:
                steps += [("change", change)]
            steps.append(("call", mode.grad))
        global_hook = False
        promise, broken = spec.freeze, False
        for i, (step, arg) in enumerate(steps):
            if step == "promise":
                if promise and arg in BREAKS_FREEZE:
                    broken = True
                if arg in ENDS_FREEZE and not broken:
                    promise = False
            elif step == "call":
                label = f"call {i}"
                leaves_seed = (seed, i, "inputs", grad_leaves if arg in ("grad", "double", "autocast_grad") else "-")
                # a float64 copy of the original's world before the call: what a value difference is
                # judged against (is the kernel less accurate than the original, or only rounded otherwise?)
                reference = None
                if mode.exec == "eager" and arg in ("no_grad", "grad", "double") and spec.dtype != F64:
                    reference = _reference_side(orig)
                with _global_hook(global_hook):
                    ra = call_side(orig, spec, mode, leaves_seed, arg)
                    kern.orig_untraceable = getattr(orig, "untraceable", "")
                    finite.forget()
                    rb = call_side(kern, spec, mode, leaves_seed, arg)
                    finite.forget()
                fused += rb.fused
                original += rb.original
                ref = None
                low = spec.dtype in (BF16, F16) and arg in ("grad", "double")
                if reference is not None and ra.error is None and rb.error is None and (
                        low or any(k in p for p in compare(spec, mode, arg, ra, rb, label)[0]
                                   for k in ("values differ", "NaN positions", "inf positions"))):
                    hooks = _CALLS["hooks"]
                    ref = call_side(reference, spec, mode, leaves_seed, arg, cast=F64)
                    _CALLS["hooks"] = hooks
                    finite.forget()
                    ref = ref if ref.error is None else None
                diffs, note = compare(spec, mode, arg, ra, rb, label, ref)
                if note:
                    notes.add(note)
                if note == "both raise":
                    both_raise = True
                    if ra.error is not None and isinstance(ra.error.error, NotImplementedError):
                        notes.add(f"original: {ra.error}"[:200])
                    break  # (a sequence after an error on both sides compares nothing more)
                if broken and diffs:
                    documented.extend(diffs)
                else:
                    problems += diffs
            elif step in ("train", "eval"):
                for s in sides:
                    s.set_training(step == "train")
                if step == "eval":
                    for s in sides:
                        s.set_training(spec.train)
            elif step == "global_hook":
                global_hook = True
            else:
                errors = []
                for s in sides:
                    try:
                        apply_change(s, arg, seed)
                        errors.append(None)
                    except _Skip:
                        raise
                    except Exception as e:  # noqa: BLE001
                        errors.append(e)
                if errors[0] is not None and errors[1] is not None:
                    notes.add(f"change {arg} raises on both sides: {type(errors[0]).__name__}")
                    break
                if errors[1] is not None:
                    problems.append(f"change {arg}: CRASH on the kernel's world only: {errors[1]!r}")
                    break
                if errors[0] is not None:
                    problems.append(f"change {arg}: raised on the original's world only: {errors[0]!r}")
                    break
    except _Skip as e:
        return Outcome(cid, row_name, mode.name, seed, "skip", [str(e)], d.choices)
    finally:
        for s in sides:
            for h in s.hook_handles:
                h.remove()
        finite.forget()
    if sides and getattr(sides[0], "untraceable", ""):
        notes.add(f"the original does not trace ({sides[0].untraceable}): compared with its eager run")
    if problems and spec.documented:
        documented, problems = documented + problems, []
        notes.add(f"documented: {spec.documented}")
    if problems:
        status = "crash" if any("CRASH" in p for p in problems) else "mismatch"
    elif documented:
        status = "documented"
        if not spec.documented:
            notes.add("differs after a weight change under freeze() without unfreeze() (documented contract)")
        problems = documented
    return Outcome(cid, row_name, mode.name, seed, status, problems, d.choices, "; ".join(sorted(notes)),
                   fused, original, both_raise)


# ====================================================================== case lists

# The modes of the fast tier: every exec and autograd mode once, every state change after an eval call.
FAST_MODES: list[Mode] = [
    Mode("eager", "no_grad"), Mode("eager", "inference"), Mode("eager", "grad"), Mode("eager", "double"),
    Mode("eager", "func_grad"), Mode("eager", "vmap"), Mode("eager", "jvp"), Mode("eager", "fwad"),
    Mode("eager", "autocast"), Mode("eager", "autocast_grad"),
    *[Mode("eager", "no_grad", (c,)) for c in CHANGES],
    Mode("eager", "no_grad", ("requires_grad_off", "data_mul")),
    Mode("eager", "no_grad", ("requires_grad_off", "adamw_fused")),
    Mode("eager", "no_grad", ("requires_grad_off", "train_call")),
    Mode("eager", "no_grad", ("requires_grad_off", "dtype_roundtrip")),
    # a training loop: backward, a state change, backward again
    *[Mode("eager", "grad", (c,)) for c in ("adamw_fused", "adamw_foreach", "train_call", "data_mul", "load_state_dict")],
    Mode("fx", "no_grad"), Mode("fx", "grad"), Mode("fx", "no_grad", ("train_flip",)),
    Mode("fx", "no_grad", ("requires_grad_off", "data_mul")),
    Mode("jit_trace", "no_grad"), Mode("jit_trace", "no_grad", ("requires_grad_off", "load_state_dict")),
]
# compile is slow on two cores: a few rows in the fast tier
FAST_COMPILE: list[tuple[str, Mode]] = [
    ("fused_conv_bn_module", Mode("compile_aot_eager", "no_grad", ("requires_grad_off", "train_call"))),
    ("dropout_add_layer_norm", Mode("compile_aot_eager", "grad")),
    ("attention", Mode("compile_aot_eager", "grad")),
    ("rotary_complex", Mode("compile_aot_eager", "no_grad")),
    ("linear_bn", Mode("compile_inductor", "grad")),
    ("conv_bn", Mode("compile_aot_eager", "no_grad", ("requires_grad_off", "inplace"))),
    ("rms_norm", Mode("compile_aot_eager", "grad")),
    ("scaled_l2_norm", Mode("compile_aot_eager", "grad")),
    ("rotary", Mode("compile_aot_eager", "grad")),
    ("gated_mlp", Mode("compile_aot_eager", "grad")),
    ("linear_cross_entropy", Mode("compile_aot_eager", "grad")),
    ("qkv", Mode("compile_eager", "no_grad", ("requires_grad_off", "data_mul"))),
    ("conv_bn_add_relu", Mode("compile_inductor", "no_grad")),
]


# Cases of the long tier that showed a kernel bug (one per kind, fuzz_cases.BUGS), kept in the fast tier
FAST_PINNED = [
    "conv_bn|eager/grad/once|s102002",                           # bn_dtype (fixed: the original path)
    "dropout_add_layer_norm|eager/grad/data_mul|s100185",        # dropout_empty_inplace (fixed)
    "gated_mlp|eager/grad/once|s104257",                         # parametrization_reads (fixed; spectral_norm u/v)
    "lm_head_cross_entropy|eager/grad/adamw_fused|s100335",      # parametrization_reads (fixed; the LM head)
    "linear_cross_entropy|eager/grad/adamw_fused|s101318",       # lce_zero_items (fixed: the original path)
    "gated_mlp_packed|eager/grad/adamw_fused|s103301",           # original_raises (fixed; in-place SiLU on a split view)
    "rotary_pairs|eager/autocast_grad/once|s102366",             # autocast_cat (fixed)
    "attention|eager/autocast/once|s100195",                     # attention_autocast_dtype
    "attention|eager/jvp/once|s101193",                          # float64_in_float32 (fixed: softmax_dtype)
    "attention|eager/no_grad/requires_grad_off|s102208",         # nonfinite_inputs
]


def fast_cases(seeds_per_mode: int = 1) -> list[tuple[str, Mode, int]]:
    cases = []
    for r, row in enumerate(ROWS):
        for m, mode in enumerate(FAST_MODES):
            for k in range(seeds_per_mode):
                cases.append((row, mode, 1000 * k + 17 * r + m))
    cases += [(row, mode, 0) for row, mode in FAST_COMPILE]
    cases += [case_from_id(cid) for cid in FAST_PINNED]
    return cases


def random_mode(rng, compile_ok: bool = True) -> Mode:
    execs = EXECS if compile_ok else EXECS[:3]
    exec_ = rng.choices(execs, [10, 2, 2, 1, 1, 1][: len(execs)])[0]
    grad = rng.choice(GRADS) if exec_ == "eager" else rng.choice(["no_grad", "grad"])
    n = rng.choices([0, 1, 2, 3], [3, 4, 2, 1])[0]
    changes = tuple(rng.choice(CHANGES) for _ in range(n))
    return Mode(exec_, grad, changes)


# ====================================================================== what a failure shows

BUGS = {
    "call_override": "the guard checks that a Linear does not override forward, not __call__: an nn.Linear subclass "
                     "overriding __call__ is fused and its override skipped",
    "bn_width": "a BatchNorm whose num_features is not the layer's output width (1) is folded by broadcasting, "
                "where BatchNorm raises 'running_mean should contain N elements'",
    "bn_dtype": "a BatchNorm in another dtype than the layer is folded (cast to the layer's dtype), where the "
                "original raises 'mixed dtype'",
    "gelu_positional": "linear_gelu takes F.gelu(h, 'tanh') (approximate passed positionally) where F.gelu raises "
                       "TypeError (approximate is keyword-only)",
    "softmax_dim": "softmax wraps an out-of-range dim (dim % ndim) where F.softmax raises IndexError",
    "attention_autocast_dtype": "attention(need_weights=True) under CPU autocast returns the weights in bfloat16, "
                                "the eager original in float32",
    "autocast_cat": "under CPU autocast with float16 tensors torch.cat raises (at::autocast::prioritize): the "
                    "kernel and the original differ in whether they call it",
    "compile_super_cell": "under torch.compile the guard's inspection of a Linear subclass's forward (its closure "
                          "cell from zero-argument super()) makes dynamo fail (load_cell)",
    "overflow_regime": "inputs or BatchNorm statistics that overflow: NaN/inf land elsewhere than in the original "
                       "(the kernel multiplies in another order)",
    "nonfinite_inputs": "NaN/inf inputs: NaN/inf land elsewhere than in the original",
    "low_precision_grads": "bfloat16/float16 parameters with gradients: the kernel's gradients are several times "
                           "less accurate than the original's against a float64 reference (a BatchNorm folded into "
                           "a low-precision weight)",
    "dropout_empty_inplace": "dropout_add_layer_norm in training on an empty input that requires grad: F.dropout "
                             "returns the input itself and the kernel's in-place add_ raises (leaf in an in-place op)",
    "parametrization_reads": "a parametrized layer (weight_norm, spectral_norm): the kernel's guard reads .weight "
                             "more often than the original (the parametrization runs again: its hooks fire, and "
                             "spectral_norm in training does extra power iterations: other u/v buffers, other weights)",
    "lce_zero_items": "num_items_in_batch=0: the loss divides by zero; the kernel's gradients hold NaN elsewhere "
                      "than the original's",
    "fully_masked_rows": "attention rows whose every key is masked: NaN (the written-out softmax) vs the kernel's "
                         "masked-row-safe SDPA",
    "float64_in_float32": "float64 attention: the original (HF eager: softmax(scores.float())) computes the softmax "
                          "in float32, where a float64 finfo.min mask becomes -inf (NaN rows); the kernel computes "
                          "in float64",
    "compile_frozen_guard": "under torch.compile the guard's cheap first test reads is_frozen (a module looked up in "
                            "kernels/frozen.py's WeakKeyDictionary): dynamo guards on that dictionary's keys, and a "
                            "frozen module garbage-collected meanwhile fails the guard's creation (IndexError: list "
                            "index out of range); order-dependent",
    "original_raises": "the original raises and the kernel returns a result (it accepts what the user's code "
                       "rejects)",
}


def classify(o: Outcome) -> str:
    """The known bug (a key of :data:`BUGS`) a failing outcome shows, or "unclassified"."""
    ch, text = o.choices, "\n".join(o.problems)
    if any(v == "sub_call" for k, v in ch.items() if k.endswith("variant")):
        return "call_override"
    if ch.get("bn.wrong_width"):
        return "bn_width"
    if ch.get("bn.other_dtype") or "mixed dtype" in text:
        return "bn_dtype"
    if ch.get("act") == "F.gelu_tanh_arg" and "gelu() takes 1 positional argument" in text:
        return "gelu_positional"
    if o.row == "softmax" and "Dimension out of range" in text:
        return "softmax_dim"
    if o.row == "attention" and "dtype torch.bfloat16, original torch.float32" in text:
        return "attention_autocast_dtype"
    if "at::autocast::prioritize" in text:
        return "autocast_cat"
    if "Expected CellVariable" in text:
        return "compile_super_cell"
    if o.mode.startswith("compile") and "IndexError: list index out of range" in text:
        return "compile_frozen_guard"
    if "a leaf Variable that requires grad is being used in an in-place" in text and o.row == "dropout_add_layer_norm":
        return "dropout_empty_inplace"
    parametrized = any(v in ("weight_norm", "spectral_norm") for k, v in ch.items() if k.endswith("variant"))
    if "parametrizations.weight.0._u" in text or "parametrizations.weight.0._v" in text or (
            parametrized and "hooks called" in text):
        return "parametrization_reads"
    if ch.get("num_items_in_batch") == "zero":
        return "lce_zero_items"
    if o.row == "attention" and ch.get("mask") in ("bool_all_masked_row", "min_all_masked_row"):
        return "fully_masked_rows"
    if "less accurate than the original" in text:
        return "low_precision_grads"
    kinds = {v for k, v in ch.items() if k.endswith("values")}
    if kinds & {"large", "overflow", "tiny"} or ch.get("bn.stats") in ("tiny_var", "zero_var", "huge_var") or (
            ch.get("dtype") == "float16" and "positions differ" in text):
        return "overflow_regime"
    if kinds & {"nan", "inf"} and ("NaN positions" in text or "inf positions" in text):
        return "nonfinite_inputs"
    if ch.get("dtype") == "float64" and o.row == "attention":
        return "float64_in_float32"
    if "the original raised" in text and "CRASH" not in text:
        return "original_raises"
    return "unclassified"
