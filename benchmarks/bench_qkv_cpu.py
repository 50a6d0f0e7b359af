"""Is one matmul over concatenated q/k/v weights faster than three on CPU?

    python benchmarks/bench_qkv_cpu.py   # writes benchmarks/results/qkv_cpu.json

``adopter.kernels.qkv`` takes the user's three ``nn.Linear`` modules, so fusing means
concatenating their weights on every call (cached only while no gradient flows). This measures,
single-threaded at BERT-base width, the time of ``q(x), k(x), v(x)`` against the concatenated
form, forward+backward and forward-only, as alternating pairs (median of per-pair ratios). The
kernel's CPU policy (three matmuls on CPU) rests on this file.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

OUT = Path(__file__).parent / "results" / "qkv_cpu.json"


def concatenated(q, k, v, x):
    w = torch.cat([q.weight, k.weight, v.weight])
    b = torch.cat([q.bias, k.bias, v.bias])
    return F.linear(x, w, b).split([q.out_features, k.out_features, v.out_features], dim=-1)


def pair_ratios(a, b, n: int) -> list[float]:
    for f in (a, b, a, b):
        f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        a()
        ta = time.perf_counter() - t
        t = time.perf_counter()
        b()
        out.append(ta / (time.perf_counter() - t))
    return out


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for batch, seq in ((4, 32), (8, 128)):
        q, k, v = (nn.Linear(768, 768) for _ in range(3))
        x = torch.randn(batch, seq, 768, requires_grad=True)

        def three_train(q=q, k=k, v=v, x=x):
            sum(t.sum() for t in (q(x), k(x), v(x))).backward()

        def fused_train(q=q, k=k, v=v, x=x):
            sum(t.sum() for t in concatenated(q, k, v, x)).backward()

        ratios = pair_ratios(three_train, fused_train, 25)
        with torch.no_grad():
            w = torch.cat([q.weight, k.weight, v.weight])
            b = torch.cat([q.bias, k.bias, v.bias])
            ratios_eval = pair_ratios(
                lambda q=q, k=k, v=v, x=x: (q(x), k(x), v(x)),
                lambda x=x, w=w, b=b: F.linear(x, w, b).split(768, -1),
                25,
            )
        rows.append({
            "tokens": batch * seq, "batch": batch, "seq": seq,
            "train_three_over_fused_time": statistics.median(ratios),
            "eval_cached_three_over_fused_time": statistics.median(ratios_eval),
        })  # fmt: skip
        print(rows[-1], flush=True)
    OUT.write_text(json.dumps({"threads": 1, "torch": torch.__version__, "rows": rows,
                               "note": "> 1: the concatenated matmul is faster"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
