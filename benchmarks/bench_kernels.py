"""Microbenchmarks: each adopter.kernels kernel vs the unfused PyTorch reference it replaces.

Forward + backward at BERT-base shapes (batch 8, seq 128, hidden 768, intermediate 3072, 12 heads),
fp32 on CPU, fp16 on CUDA (when present); eval-mode forward too for the BatchNorm folds (that is
where they differ). Conv+BN uses a ResNet stage shape (8, 64, 28, 28), 3x3 conv.

pytest-benchmark (one entry per case and impl):

    pytest benchmarks/bench_kernels.py --benchmark-json benchmarks/results/kernels_cpu.json \
        --benchmark-max-time 0.5
    python benchmarks/bench_kernels.py summarize benchmarks/results/kernels_cpu.json

Paired mode, for a shared/noisy machine: fused and reference steps alternate round by round, and the
ratio is the median of the per-round ratios (load changes hit both sides of a round alike):

    python benchmarks/bench_kernels.py paired --rounds 15 > benchmarks/results/kernels_cpu_paired.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, HIDDEN, INTERMEDIATE, HEADS = 8, 128, 768, 3072, 12
# CPU threads (ADOPTER_BENCH_THREADS, default 1): on a shared 2-core machine one thread per process
# gives far steadier ratios than two threads fighting other jobs for the same cores.
if not torch.cuda.is_available():
    torch.set_num_threads(int(os.environ.get("ADOPTER_BENCH_THREADS", "1")))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
IMPLS = ("fused", "reference")


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _t(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=grad)


def _mod(m):
    return m.to(device=DEVICE, dtype=DTYPE)


def _fwd_bwd(fn, inputs, params=()):
    leaves = [t for t in list(inputs) + list(params) if t.requires_grad]

    def step():
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for t in leaves:
            t.grad = None
        _sync()

    return step


def _eval_fwd(m, x):
    m.eval()
    x = x.detach()

    def step():
        with torch.no_grad():
            m(x)
        _sync()

    return step


# ------------------------------------------------------------------ cases: name -> impl -> step
def dropout_add_layer_norm(impl):
    from adopter.kernels import FusedDropoutAddLayerNorm

    x, r = _t(BATCH, SEQ, HIDDEN), _t(BATCH, SEQ, HIDDEN)
    if impl == "fused":
        m = _mod(FusedDropoutAddLayerNorm(HIDDEN, p=0.1, eps=1e-12))
        return _fwd_bwd(m, (x, r), m.parameters())
    m, drop = _mod(nn.LayerNorm(HIDDEN, eps=1e-12)), nn.Dropout(0.1)
    return _fwd_bwd(lambda x, r: m(drop(x) + r), (x, r), m.parameters())


def linear_bias_gelu(impl):
    from adopter.kernels import FusedLinearBiasGeLU

    x = _t(BATCH, SEQ, HIDDEN)
    if impl == "fused":
        m = _mod(FusedLinearBiasGeLU(HIDDEN, INTERMEDIATE))
        return _fwd_bwd(m, (x,), m.parameters())
    m = _mod(nn.Linear(HIDDEN, INTERMEDIATE))
    return _fwd_bwd(lambda x: F.gelu(m(x)), (x,), m.parameters())


def qkv(impl):
    from adopter.kernels import FusedQKV

    x = _t(BATCH, SEQ, HIDDEN)
    if impl == "fused":
        m = _mod(FusedQKV(HIDDEN, HIDDEN))
        return _fwd_bwd(m, (x,), m.parameters())
    m = _mod(nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)]))
    return _fwd_bwd(lambda x: tuple(layer(x) for layer in m), (x,), m.parameters())


def softmax(impl):
    from adopter.kernels import softmax as fused_softmax

    scores = _t(BATCH, HEADS, SEQ, SEQ)
    fn = (lambda s: fused_softmax(s, -1)) if impl == "fused" else (lambda s: F.softmax(s, -1))
    return _fwd_bwd(fn, (scores,))


def _bert_eager_attention(q, k, v, mask, dropout_p):
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    probs = F.dropout(F.softmax(scores, dim=-1), dropout_p, training=dropout_p > 0)
    return torch.matmul(probs, v)


def _attention(impl, dropout_p):
    from adopter.kernels import attention

    q, k, v = (_t(BATCH, HEADS, SEQ, HIDDEN // HEADS) for _ in range(3))
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool, device=DEVICE)
    keep[:, SEQ * 3 // 4:] = False  # padded tail, as in a real batch
    mask = torch.zeros(BATCH, 1, 1, SEQ, device=DEVICE, dtype=DTYPE).masked_fill(
        ~keep[:, None, None, :], torch.finfo(DTYPE).min)
    if impl == "fused":
        return _fwd_bwd(lambda q, k, v: attention(q, k, v, mask=mask, dropout_p=dropout_p), (q, k, v))
    return _fwd_bwd(lambda q, k, v: _bert_eager_attention(q, k, v, mask, dropout_p), (q, k, v))


def attention_dropout0(impl):
    return _attention(impl, 0.0)


def attention_dropout01(impl):
    return _attention(impl, 0.1)


def _conv_bn(impl):
    from adopter.kernels import FusedConv2dBatchNorm2d

    if impl == "fused":
        return _mod(FusedConv2dBatchNorm2d(64, 64, 3, padding=1, bias=False)), _t(BATCH, 64, 28, 28)
    m = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64))
    return _mod(m), _t(BATCH, 64, 28, 28)


def _linear_bn(impl):
    from adopter.kernels import FusedLinearBatchNorm1d

    if impl == "fused":
        return _mod(FusedLinearBatchNorm1d(HIDDEN, HIDDEN)), _t(BATCH * SEQ, HIDDEN)
    return _mod(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN))), _t(BATCH * SEQ, HIDDEN)


def conv_bn_train(impl):
    m, x = _conv_bn(impl)
    return _fwd_bwd(m.train(), (x,), m.parameters())


def conv_bn_eval(impl):
    return _eval_fwd(*_conv_bn(impl))


def linear_bn_train(impl):
    m, x = _linear_bn(impl)
    return _fwd_bwd(m.train(), (x,), m.parameters())


def linear_bn_eval(impl):
    return _eval_fwd(*_linear_bn(impl))


CASES: dict[str, Callable[[str], Callable[[], None]]] = {
    f.__name__: f
    for f in (dropout_add_layer_norm, linear_bias_gelu, qkv, softmax, attention_dropout0, attention_dropout01,
              conv_bn_train, conv_bn_eval, linear_bn_train, linear_bn_eval)
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel(benchmark, case, impl):
    benchmark.group = case
    step = CASES[case](impl)
    for _ in range(2):  # warm-up (allocator, lazy imports, triton compilation)
        step()
    benchmark(step)


# ------------------------------------------------------------------ reports
def summarize(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    by_case: dict = {}
    for b in data["benchmarks"]:
        by_case.setdefault(b["params"]["case"], {})[b["params"]["impl"]] = b["stats"]
    lines = [
        "| kernel | fused min (ms) | reference min (ms) | ratio of mins | ratio of medians | rounds f/r |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        stats = by_case.get(case, {})
        if set(stats) != set(IMPLS):
            continue
        f, r = stats["fused"], stats["reference"]
        lines.append(
            f"| {case} | {f['min'] * 1e3:.3f} | {r['min'] * 1e3:.3f} | {f['min'] / r['min']:.2f} "
            f"| {f['median'] / r['median']:.2f} | {f['rounds']}/{r['rounds']} |"
        )
    return "\n".join(lines) + "\n"


def _time(step, n: int = 1) -> float:
    """Seconds per call, over ``n`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def _calls_for(step, target_s: float = 0.05) -> int:
    """Calls per timing so that one timing lasts about ``target_s`` (short ops are all noise otherwise)."""
    return max(1, min(200, round(target_s / max(_time(step), 1e-6))))


def paired(rounds: int, cases) -> str:
    lines = [
        (
            f"device: {DEVICE.type}, dtype: {DTYPE}, torch threads: {torch.get_num_threads()}, "
            f"rounds: {rounds} (each timing repeats the step for >= ~50 ms)"
        ),
        "",
        "| kernel | fused median (ms) | reference median (ms) | median per-round fused/reference | IQR of ratio |",
        "|---|---|---|---|---|",
    ]
    for case in cases:
        fused, ref = CASES[case]("fused"), CASES[case]("reference")
        for _ in range(2):
            fused(), ref()
        n = _calls_for(ref)
        tf, tr, ratios = [], [], []
        for i in range(rounds):
            if i % 2:  # alternate who goes first
                b, a = _time(ref, n), _time(fused, n)
            else:
                a, b = _time(fused, n), _time(ref, n)
            tf.append(a), tr.append(b), ratios.append(a / b)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [min(ratios), 0, max(ratios)]
        lines.append(
            f"| {case} | {statistics.median(tf) * 1e3:.3f} | {statistics.median(tr) * 1e3:.3f} "
            f"| {statistics.median(ratios):.2f} | {q[0]:.2f}-{q[2]:.2f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="markdown ratios from a --benchmark-json file")
    s.add_argument("json")
    p = sub.add_parser("paired", help="interleaved fused/reference timing, median per-round ratio")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--case", action="append", choices=list(CASES))
    args = parser.parse_args()
    if args.command == "summarize":
        print(summarize(args.json), end="")
    else:
        print(paired(args.rounds, args.case or list(CASES)), end="")
