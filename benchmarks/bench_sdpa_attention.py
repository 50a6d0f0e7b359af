"""What the sdpa_attention rewrite brings on CPU: the written-out attention (``softmax(q @ kᵀ * s +
mask) @ v``, as research code writes it) against the guarded kernel ``adopter.kernels.sdpa`` on its
fused path (SDPA, the guard's checks included), side by side in alternating rounds.

For each shape (batch, heads, seq, head_dim: a prototype's few tokens up to a long context), dtype
(float32, bfloat16) and mode (``infer``: forward under no_grad; ``train``: forward and backward), the
median over rounds of the per-round ratio written / fused of process CPU time and of wall time (> 1:
the kernel is faster), with bootstrap 95 % intervals, and the memory the backward keeps (the bytes of
the tensors autograd saves, counted by ``saved_tensors_hooks``: the written-out ops keep the
``(B, H, L, L)`` scores and probabilities, SDPA its output and row statistics).

    OMP_NUM_THREADS=1 python benchmarks/bench_sdpa_attention.py [--rounds 9] [--threads 1]

writes ``benchmarks/results/sdpa_cpu.json``. Where the fused path is measured slower the per-call
cost model keeps the source's ops: its calibration (``benchmarks/calibrate_kernels.py --kernels
sdpa``) measures the same kernel at the same shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ((1, 2, 16, 16), (2, 4, 64, 32), (4, 6, 197, 64), (4, 12, 256, 64), (1, 8, 1024, 64))


def written(q, k, v, scale, fill):
    att = (q @ k.transpose(-2, -1)) * scale
    att = att.masked_fill(fill, float("-inf"))
    att = torch.softmax(att, dim=-1)
    return att @ v


def fused(q, k, v, scale, fill):
    from adopter.kernels import sdpa

    return sdpa(q, k.transpose(-2, -1), v, scale=scale, fill=fill, fill_value=float("-inf"))


def _inputs(shape, dtype, grad):
    b, h, n, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))
    fill = torch.ones(n, n, dtype=torch.bool).tril().logical_not()
    return q, k, v, d ** -0.5, fill


def _step(fn, args, mode):
    q, k, v = args[:3]
    if mode == "infer":
        def run():
            with torch.no_grad():
                fn(*args)
    else:
        def run():
            for t in (q, k, v):
                t.grad = None
            fn(*args).float().sum().backward()
    return run


def _timed(run, repeats):
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        run()
    return time.process_time() - c0, time.perf_counter() - w0


def _interval(ratios):
    from adopter.verification.benchmark import _bootstrap_median_interval

    low, high = _bootstrap_median_interval(ratios)
    return [round(statistics.median(ratios), 4), round(low, 4), round(high, 4)]


def saved_bytes(fn, args) -> int:
    """Bytes of the distinct storages autograd saves for the backward (the inputs excluded: both
    sides keep them); views and detached aliases of one storage count once."""
    inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.float().sum().backward()
    return sum(storages.values())


def measure(shape, dtype, mode, rounds, min_side_s):
    from adopter.kernels import count_kernel_calls

    args = _inputs(shape, dtype, mode == "train")
    sides = {"written": _step(written, args, mode), "fused": _step(fused, args, mode)}
    with count_kernel_calls() as calls:
        sides["fused"]()
    if not all(c.fused for c in calls.calls if c.kernel == "sdpa"):
        return {"skipped": sorted({c.reason for c in calls.calls})}
    sides["written"]()
    start = time.perf_counter()
    sides["written"]()
    repeats = max(1, math.ceil(min_side_s / max(time.perf_counter() - start, 1e-6)))
    cpu, wall = [], []
    for r in range(rounds):
        order = ("written", "fused") if r % 2 else ("fused", "written")
        got = {name: _timed(sides[name], repeats) for name in order}
        if got["fused"][0] > 0 and got["fused"][1] > 0:
            cpu.append(got["written"][0] / got["fused"][0])
            wall.append(got["written"][1] / got["fused"][1])
    out = {"cpu_ratio": _interval(cpu), "wall_ratio": _interval(wall), "rounds": len(cpu), "repeats": repeats,
           "written_ms": round(1e3 * got["written"][1] / repeats, 3), "fused_ms": round(1e3 * got["fused"][1] / repeats, 3)}
    if mode == "train":
        out["saved_bytes"] = {"written": saved_bytes(written, args), "fused": saved_bytes(fused, args)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-side-s", type=float, default=0.05)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sdpa_cpu.json"))
    args = parser.parse_args()
    from adopter.kernels import cost

    torch.set_num_threads(args.threads)
    results = []
    with cost.ignored():  # (the fused side must run at every shape: this measures where it pays)
        for shape in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                for mode in ("infer", "train"):
                    point = measure(shape, dtype, mode, args.rounds, args.min_side_s)
                    row = {"shape": "x".join(map(str, shape)), "dtype": str(dtype).replace("torch.", ""),
                           "mode": mode, **point}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    results.append(row)
    data = {
        "what": "written-out attention (q @ k^T * s, causal masked_fill(-inf), softmax, @ v) / adopter.kernels.sdpa "
                "(fused path, guard included); ratios > 1: the kernel is faster; median of per-round ratios, "
                "bootstrap 95% interval [median, low, high]",
        "torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
        "command": "python benchmarks/bench_sdpa_attention.py " + " ".join(sys.argv[1:]),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
