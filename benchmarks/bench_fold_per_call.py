"""What a BatchNorm fold costs when computed on every call (weights not frozen) against the frozen
fold and the original two layers, per conv shape and batch: where ``FOLD_PER_CALL_MAX_WEIGHT_SHARE``
(``kernels/guarded.py``) comes from.

    python benchmarks/bench_fold_per_call.py       # writes benchmarks/results/fold_per_call.json

Single thread, no grad, eval mode, float32 NCHW input. Three variants per shape, alternating each
round: ``bn(conv(x))``; ``conv_bn`` with the fold forced on every call (the threshold lifted); and
``conv_bn`` under :func:`adopter.kernels.freeze` (the fold and its packed weight kept). Per variant
the median process CPU time and wall time of a call; per shape the median of the per-round ratios
original/variant (> 1: the variant is faster), beside the weight's share of the output.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import adopter.kernels.guarded as guarded
import torch
from adopter.kernels import conv_bn, freeze, unfreeze
from torch import nn

# (in channels, out channels, kernel, spatial): ResNet-50's conv shapes at their extremes
SHAPES = [(512, 2048, 1, 7), (256, 256, 3, 14), (1024, 256, 1, 14), (64, 64, 3, 56), (64, 256, 1, 56),
          (3, 64, 7, 112)]
BATCHES = (1, 8)


def _time(fn, inner: int) -> tuple[float, float]:
    c, w = time.process_time(), time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.process_time() - c) / inner, (time.perf_counter() - w) / inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fold_per_call.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for cin, cout, k, hw in SHAPES:
        for batch in BATCHES:
            conv, bn = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False).eval(), nn.BatchNorm2d(cout).eval()
            with torch.no_grad():
                bn.running_var.uniform_(0.5, 2.0)
                bn.running_mean.normal_()
            x = torch.randn(batch, cin, hw, hw)
            inner = max(1, int(2e8 // max(1, conv.weight.numel() * batch * hw * hw)))

            def original(conv=conv, bn=bn, x=x):
                return bn(conv(x))

            def per_call(conv=conv, bn=bn, x=x):
                share = guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE
                guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE = float("inf")
                try:
                    return conv_bn(conv, bn, x)
                finally:
                    guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE = share

            def frozen(conv=conv, bn=bn, x=x):
                freeze(conv), freeze(bn)
                try:
                    return conv_bn(conv, bn, x)
                finally:
                    unfreeze(conv), unfreeze(bn)

            variants = {"original": original, "fold_per_call": per_call, "frozen": frozen}
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            with torch.no_grad():
                for fn in variants.values():
                    fn()
                for r in range(args.rounds):
                    names = list(variants)
                    names = names[r % len(names):] + names[:r % len(names)]
                    for name in names:
                        times[name].append(_time(variants[name], inner))
            row = {"in_channels": cin, "out_channels": cout, "kernel": k, "spatial": hw, "batch": batch,
                   "weight_share_of_output": conv.weight.numel() / (batch * cout * hw * hw)}
            for name in variants:
                row[f"{name}_cpu_ms"] = 1e3 * statistics.median(t[0] for t in times[name])
                row[f"{name}_wall_ms"] = 1e3 * statistics.median(t[1] for t in times[name])
                if name != "original":
                    row[f"{name}_speedup_cpu"] = statistics.median(
                        o[0] / v[0] for o, v in zip(times["original"], times[name]))
                    row[f"{name}_speedup_wall"] = statistics.median(
                        o[1] / v[1] for o, v in zip(times["original"], times[name]))
            rows.append(row)
            print(f"{cin}->{cout} k{k} {hw}x{hw} b{batch}: share {row['weight_share_of_output']:.3f} "
                  f"per-call {row['fold_per_call_speedup_cpu']:.3f} frozen {row['frozen_speedup_cpu']:.3f}")
    result = {"torch": torch.__version__, "threads": 1, "rounds": args.rounds,
              "threshold": guarded.FOLD_PER_CALL_MAX_WEIGHT_SHARE,
              "figure": "median over rounds of original/variant process CPU time (and wall)", "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
