"""Measure, on this machine, where each guarded kernel's fused path pays: the calibration that
:mod:`adopter.kernels.cost` reads at every call (``adopter calibrate``; the shipped CPU file comes
from ``benchmarks/calibrate_kernels.py``).

For each kernel, mode (``train``: forward and backward with grad; ``infer``: forward under no_grad)
and size, the kernel's own guarded entry point (what rewritten code calls) runs with its fused
path and with it switched off (:func:`adopter.kernels.policy.kernels_off`: the guard, then the
original math — what a call costs when the cost model says no), alternating round by round, so
that load on a shared machine hits both sides alike. Each point is the median of the per-round
ratios (original time / fused time, process CPU time on CPU) with a bootstrap 95 % interval.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adopter.verification.benchmark import _bootstrap_median_interval

Step = Callable[[], object]


@dataclass(frozen=True)
class Case:
    """One kernel at one size: ``build(mode)`` returns the call to time (None: mode not measured)."""

    kernel: str
    label: str
    size: int  # what kernels.cost sizes the call by (x.numel(), or tokens x vocab for the LM-head loss)
    build: Callable[[str], Step | None]
    variant: str = ""  # a form calibrated apart (policy_reason's variant): "channels_last"

    @property
    def key(self) -> str:
        """The calibration's name for the curve this case is a point of."""
        return f"{self.kernel}@{self.variant}" if self.variant else self.kernel


def _rows(rows: int, width: int, grad: bool) -> torch.Tensor:
    return torch.randn(rows, width, requires_grad=grad)


def _train_step(call: Callable[[], object], leaves: list[torch.Tensor]) -> Step:
    def step():
        for t in leaves:
            t.grad = None
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return step


def _step(mode: str, call: Callable[[], object], leaves: list[torch.Tensor]) -> Step:
    if mode == "train":
        return _train_step(call, leaves)

    def infer():
        with torch.no_grad():
            return call()
    return infer


def _modules_leaves(*mods: nn.Module) -> list[torch.Tensor]:
    return [p for m in mods for p in m.parameters()]


# rows x width of the row-wise kernels: a prototype's few tokens up to BERT-base at batch 8 x 128
ROW_SHAPES = ((64, 64), (256, 128), (128, 768), (1024, 768), (4096, 1024))


def _linear_gelu(rows: int, width: int) -> Case:
    def build(mode):
        from adopter.kernels import linear_gelu

        linear, act = nn.Linear(width, 4 * width), nn.GELU()
        x = _rows(rows, width, mode == "train")
        return _step(mode, lambda: linear_gelu(linear, act, x), [x, *_modules_leaves(linear)])
    return Case("linear_gelu", f"{rows}x{width}->{4 * width}", rows * width, build)


def _dropout_add_layer_norm(rows: int, width: int) -> Case:
    def build(mode):
        from adopter.kernels import dropout_add_layer_norm

        drop, norm = nn.Dropout(0.1), nn.LayerNorm(width)
        drop.train(mode == "train")
        x, res = _rows(rows, width, mode == "train"), _rows(rows, width, mode == "train")
        return _step(mode, lambda: dropout_add_layer_norm(drop, norm, x, res), [x, res, *_modules_leaves(norm)])
    return Case("dropout_add_layer_norm", f"{rows}x{width}", rows * width, build)


def _rms_norm(rows: int, width: int) -> Case:
    def build(mode):
        from adopter.kernels import rms_norm

        weight = torch.ones(width, requires_grad=mode == "train")
        x = _rows(rows, width, mode == "train")
        return _step(mode, lambda: rms_norm(x, weight, 1e-6), [x, weight])
    return Case("rms_norm", f"{rows}x{width}", rows * width, build)


def _scaled_l2_norm(rows: int, width: int, dtype: torch.dtype = torch.float32) -> Case:
    """x-transformers' ``F.normalize(x, dim=-1) * scale * gamma``; ``half``: a bfloat16 input and
    gamma normalized in bfloat16 (no upcast), where the kernel's float32 backward costs more."""
    def build(mode):
        from adopter.kernels import scaled_l2_norm

        gamma = torch.ones(width, dtype=dtype, requires_grad=mode == "train")
        x = torch.randn(rows, width, dtype=dtype, requires_grad=mode == "train")
        return _step(mode, lambda: scaled_l2_norm(x, width ** 0.5, gamma), [x, gamma])
    return Case("scaled_l2_norm", f"{rows}x{width}", rows * width, build,
                variant="" if dtype == torch.float32 else "half")


def _gated_mlp(rows: int, width: int) -> Case:
    def build(mode):
        from adopter.kernels import gated_mlp

        inner = 8 * width // 3
        gate, up, down = nn.Linear(width, inner, bias=False), nn.Linear(width, inner, bias=False), \
            nn.Linear(inner, width, bias=False)
        act = nn.SiLU()
        x = _rows(rows, width, mode == "train")
        return _step(mode, lambda: gated_mlp(gate, up, down, act, x), [x, *_modules_leaves(gate, up, down)])
    return Case("gated_mlp", f"{rows}x{width}", rows * width, build)


def _rotary(rows: int, width: int) -> Case:
    heads, dim = max(1, width // 64), min(width, 64)
    batch = max(1, rows // 128)
    seq = rows // batch

    def build(mode):
        from adopter.kernels import rotary

        x = torch.randn(batch, heads, seq, dim, requires_grad=mode == "train")
        angles = torch.randn(seq, dim)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        return _step(mode, lambda: rotary(x, cos, sin), [x])
    return Case("rotary", f"{batch}x{heads}x{seq}x{dim}", batch * heads * seq * dim, build)


# (batch, channels, side) of the CNN kernels (inference: where the folds and add+ReLU run): a
# prototype's first layers up to a ResNet-50 stage at batch 8
MAP_SHAPES = ((1, 16, 16), (1, 32, 28), (1, 64, 28), (1, 128, 14), (1, 64, 56), (4, 64, 56), (8, 256, 14),
              (8, 64, 56))


def _conv_bn(batch: int, channels: int, side: int, layout: str = "") -> Case:
    def build(mode):
        if mode != "infer":
            return None
        from adopter.kernels import conv_bn, freeze

        # (conv, BatchNorm, ReLU: the block CNNs repeat; the fold then runs ReLU as the conv's epilogue)
        conv, bn, act = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        with torch.no_grad():
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        freeze(nn.Sequential(conv, bn).eval())  # (as verify and optimize() do for inference)
        x = torch.randn(batch, channels, side, side)
        if layout:
            x = x.contiguous(memory_format=torch.channels_last)
        return _step(mode, lambda: conv_bn(conv, bn, x, act), [])
    # (sized by the conv's multiply-adds, as kernels.guarded.conv_macs: 3x3, stride 1)
    return Case("conv_bn", f"{batch}x{channels}x{side}x{side}" + (f" {layout}" if layout else ""),
                batch * channels * side * side * channels * 9, build, layout)


def _add_relu(batch: int, channels: int, side: int) -> Case:
    def build(mode):
        if mode != "infer":
            return None
        from adopter.kernels import add_relu
        from adopter.kernels.ops import finite

        act = nn.ReLU()
        x, res = torch.randn(batch, channels, side, side), torch.randn(batch, channels, side, side)
        for t in (x, res):  # (in a network, what the fold before it marked)
            finite.mark(t, 8.0)
        return _step(mode, lambda: add_relu(act, x, res), [])
    return Case("add_relu", f"{batch}x{channels}x{side}x{side}", batch * channels * side * side, build)


def _linear_bn(rows: int, width: int) -> Case:
    def build(mode):
        if mode != "infer":
            return None
        from adopter.kernels import freeze, linear_bn

        linear, bn = nn.Linear(width, width), nn.BatchNorm1d(width)
        freeze(nn.Sequential(linear, bn).eval())
        x = torch.randn(rows, width)
        return _step(mode, lambda: linear_bn(linear, bn, x), [])
    return Case("linear_bn", f"{rows}x{width}", rows * width, build)


# (tokens, hidden, vocab) of the LM-head loss: a character-level vocabulary up to a Llama's
LOSS_SHAPES = ((256, 64, 65), (1024, 128, 65), (512, 128, 1024), (1024, 256, 8192), (1024, 256, 32000))


def _lm_head_loss(tokens: int, hidden: int, vocab: int) -> Case:
    def build(mode):
        if mode != "train":
            return None
        from adopter.kernels import lm_head_cross_entropy

        head = nn.Linear(hidden, vocab, bias=False)
        h = torch.randn(tokens, hidden, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,))
        return _step(mode, lambda: lm_head_cross_entropy(head, h, F.cross_entropy, target)[1], [h, head.weight])
    from adopter.kernels.guarded_linear_cross_entropy import KERNEL

    return Case(KERNEL, f"{tokens}x{hidden}->{vocab}", tokens * vocab, build)


# (batch, heads, seq, head_dim) of written-out attention: a prototype's few tokens, a ViT-S/16 image
# (197 tokens), a GPT-2-small training block, a long context
ATTENTION_SHAPES = ((1, 2, 16, 16), (2, 4, 64, 32), (4, 6, 197, 64), (4, 12, 256, 64), (1, 8, 1024, 64))


def _sdpa(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype = torch.float32) -> Case:
    def build(mode):
        from adopter.kernels import sdpa

        grad = mode == "train"
        q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dtype, requires_grad=grad) for _ in range(3))
        fill = torch.ones(seq, seq, dtype=torch.bool).tril().logical_not()  # (nanoGPT's causal buffer == 0)
        drop = nn.Dropout(0.1).eval()  # (no dropout drawn: the fused path)
        return _step(mode, lambda: sdpa(q, k.transpose(-2, -1), v, scale=head_dim ** -0.5, fill=fill,
                                                  fill_value=float("-inf"), dropout=drop), [q, k, v])
    half = dtype in (torch.float16, torch.bfloat16)  # (the kernel's variant "half": calibrated apart)
    return Case("sdpa", f"{batch}x{heads}x{seq}x{head_dim}" + (f" {dtype}".replace("torch.", "") if half else ""),
                batch * heads * seq * seq, build, "half" if half else "")


def cases(kernels: set[str] | None = None) -> list[Case]:
    """Every calibration case (of ``kernels`` only, when given)."""
    found = [
        *(make(r, w) for make in (_linear_gelu, _dropout_add_layer_norm, _rms_norm, _scaled_l2_norm, _gated_mlp, _rotary, _linear_bn)
          for r, w in ROW_SHAPES),
        *(_scaled_l2_norm(r, w, torch.bfloat16) for r, w in ROW_SHAPES),
        *(make(b, c, s) for make in (_conv_bn, _add_relu) for b, c, s in MAP_SHAPES),
        *(_conv_bn(b, c, s, "channels_last") for b, c, s in MAP_SHAPES),
        *(_lm_head_loss(t, h, v) for t, h, v in LOSS_SHAPES),
        *(_sdpa(*shape, dtype) for dtype in (torch.float32, torch.bfloat16) for shape in ATTENTION_SHAPES),
    ]
    return [c for c in found if kernels is None or c.kernel in kernels]


def _timed(step: Step, repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        step()
    return time.process_time() - start


def measure(case: Case, mode: str, *, rounds: int, min_side_s: float) -> dict | None:
    """One point: the case in ``mode`` fused and switched off, alternating over ``rounds``."""
    from adopter.kernels import count_kernel_calls
    from adopter.kernels.policy import kernels_off

    step = case.build(mode)
    if step is None:
        return None
    with count_kernel_calls() as calls:
        step()
    if not any(c.fused for c in calls.calls if c.kernel == case.kernel):
        reasons = sorted({c.reason for c in calls.calls if c.kernel == case.kernel})
        return {"size": case.size, "shape": case.label, "skipped": "; ".join(reasons) or "no call recorded"}
    with kernels_off(case.kernel):
        step()
    start = time.perf_counter()
    step()
    one = max(time.perf_counter() - start, 1e-6)
    repeats = max(1, math.ceil(min_side_s / one))
    ratios = []
    for r in range(rounds):
        if r % 2:  # alternate which side goes first
            with kernels_off(case.kernel):
                off = _timed(step, repeats)
            on = _timed(step, repeats)
        else:
            on = _timed(step, repeats)
            with kernels_off(case.kernel):
                off = _timed(step, repeats)
        if on > 0 and off > 0:
            ratios.append(off / on)
    median = statistics.median(ratios)
    low, high = _bootstrap_median_interval(ratios)
    return {"size": case.size, "shape": case.label, "ratio": round(median, 4), "low": round(low, 4),
            "high": round(high, 4), "rounds": len(ratios), "repeats": repeats}


def calibrate(*, threads: list[int], rounds: int = 9, min_side_s: float = 0.02,
              kernels: set[str] | None = None, progress: Callable[[str], None] = lambda s: None) -> dict:
    """The calibration JSON (``adopter.kernels.cost`` format) measured here on CPU at each thread count."""
    from adopter.kernels import cost, policy

    # (the fused side must run, whatever is shipped: the calibration in force and the backend policy)
    shipped_policy = dict(policy.BACKEND_POLICY)
    policy.BACKEND_POLICY.clear()
    previous_threads = torch.get_num_threads()
    out: dict = {
        "format": cost.FORMAT, "device": "cpu", "torch": torch.__version__,
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
        "method": "original time / fused time of each kernel's guarded entry point, alternating rounds; "
                  "median of per-round ratios (process CPU time), bootstrap 95% interval",
        "rounds": rounds, "threads": {},
    }
    try:
        with warnings.catch_warnings(), cost.ignored():
            # (the fused LM-head loss warns once per model that the logits are not kept)
            warnings.filterwarnings("ignore", message=".*computed the training loss without the logits")
            for n in threads:
                torch.set_num_threads(n)
                per_kernel: dict = out["threads"].setdefault(str(n), {})
                for case in cases(kernels):
                    for mode in ("train", "infer"):
                        torch.manual_seed(0)
                        point = measure(case, mode, rounds=rounds, min_side_s=min_side_s)
                        if point is None:
                            continue
                        progress(_line(n, case, mode, point))
                        if "skipped" in point:
                            out.setdefault("skipped", []).append({"threads": n, "kernel": case.key, "mode": mode,
                                                                  **point})
                        else:
                            per_kernel.setdefault(case.key, {}).setdefault(mode, []).append(point)
    finally:
        torch.set_num_threads(previous_threads)
        policy.BACKEND_POLICY.update(shipped_policy)
    return out


def _line(threads: int, case: Case, mode: str, point: dict) -> str:
    head = f"{threads} thr  {case.key:<22} {mode:<5} {case.label:<20}"
    if "skipped" in point:
        return f"{head} skipped: {point['skipped']}"
    from adopter.kernels.cost import Point

    # (this point alone; the decision is the fit along the sizes: summary_lines)
    slower = not Point(point["size"], point["ratio"], point["low"], point["high"]).pays
    return f"{head} {point['ratio']:.3f} [{point['low']:.3f}-{point['high']:.3f}]" + ("  measured slower" if slower else "")


def summary_lines(data: dict) -> Iterator[str]:
    """One line per kernel, mode and thread count: from which sizes the fused path runs."""
    from adopter.kernels.cost import parse, verdict

    cal = parse(data, "calibration")
    for threads, kernels in sorted(cal.points.items()):
        for kernel, modes in sorted(kernels.items()):
            for mode, curve in sorted(modes.items()):
                paying = [p.size for p in curve if verdict(curve, p.size) is None]
                if not paying:
                    where = "never"
                elif len(paying) == len(curve):
                    where = "at every size measured"
                else:
                    where = "at " + ", ".join(f"{s:,}" for s in paying) + " (size; of " + \
                        ", ".join(f"{p.size:,}" for p in curve) + "; estimated between)"
                yield f"{threads} thread(s)  {kernel:<22} {mode:<5} fused: {where}"


def write(data: dict, path) -> None:
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
