"""Eval-mode CPU inference of ResNet-50, original vs optimized (Conv+BatchNorm folded), side by side.

    python benchmarks/bench_conv_bn_inference.py            # writes benchmarks/results/conv_bn_inference.json
    python benchmarks/bench_conv_bn_inference.py --layers   # also times each ResNet-50 conv shape alone
    python benchmarks/bench_conv_bn_inference.py --nchw-1x1 # also: aten vs oneDNN for the 1x1 convs by batch
    python benchmarks/bench_conv_bn_inference.py --profile  # also: where a forward's time goes, per op

The models are built as ``adopter verify`` builds them (``adopter/verification/run.py``): the
shipped ``microsoft/resnet-50`` config with random weights, the class optimized on the shrunk
config, the optimized model built at full size with the original's weights (BatchNorm statistics
first calibrated by a few train-mode passes, as any checkpoint has them). Single-threaded, no grad,
224x224, batch 1, 4 and 8, NCHW and channels-last inputs. Four variants run in one process,
alternating (the order rotates every round): the original; the optimized model with aten's conv
on the folded weights (``adopter.kernels.ops.conv_prepacked.ENABLED = False``); the optimized
model with the ReLU after each conv run as its own op (``conv_prepacked.EPILOGUE = False``); the
optimized model as shipped (oneDNN where that pays, folded weights packed once where that pays,
the ReLU in the conv's epilogue); at batch 4 and up with NCHW input, a fifth: the shipped model with
every light 1x1 conv in oneDNN on the NCHW data whatever its spatial extent (``NCHW_ONEDNN_MAX_HW_1X1``
lifted). Per variant: median wall
and process CPU time of a forward, the median of the per-round ratios original/variant, and the
peak CPU allocator memory of a forward (``peak_step_memory``); plus the bytes the kernels keep
cached (folded and packed weights), and the largest difference of the outputs.

``--layers``: every conv shape of ResNet-50 alone (NCHW input, folded bias), aten's conv against
the packed NHWC conv with its two layout copies, beside the weight/activation ratio the kernel's
choice (``NCHW_WEIGHT_OVER_ACTIVATIONS``, ``_1X1``) reads.

``--nchw-1x1``: ResNet-50's 1x1 stride-1 conv shapes with NCHW input at batch 1, 2, 4, 8, 16: aten's
conv + bias (+ ReLU) against oneDNN on the NCHW data with bias (and ReLU) in the epilogue, summed
over the shapes (what ``NCHW_ONEDNN_MIN_BATCH_1X1`` rests on).

``--profile``: one forward of the original and of the optimized model per batch and layout under
``torch.profiler``: self CPU time per op kind (convolutions, batch norm, ReLU, residual add, max
pool, copies), and the share of the original's forward its BatchNorm and ReLU passes take, the
most a kernel that keeps the convolutions as they are can remove.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).parent / "results" / "conv_bn_inference.json"
VARIANTS = ("original", "optimized_aten_conv", "optimized_relu_apart", "optimized")


def build_models():
    from adopter.kernels import freeze
    from adopter.tracing import build_model

    from adopter.optimizing.optimize import optimize, shrink_config
    from adopter.verification.equivalence import load_same_weights

    built = build_model("microsoft/resnet-50", device="cpu")
    original = built.model
    torch.manual_seed(0)
    with torch.no_grad():  # realistic BatchNorm statistics (a fresh model's are mean 0, var 1)
        original.train()
        for _ in range(3):
            original(pixel_values=torch.randn(8, 3, 224, 224))
    original.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimized_cls = optimize(type(original), config=shrink_config(built.config), device="cpu")
    optimized = optimized_cls(copy.deepcopy(built.config)).eval()
    load_same_weights(original, optimized)
    # as a deployment runs it (and as `adopter verify --mode inference` measures it): frozen, so the
    # kernels keep the folded and packed weights between calls (kernels/frozen.py)
    freeze(original), freeze(optimized)
    return original, optimized, optimized_cls.adopter_report


def _call(model, x, prepack: bool, epilogue: bool = True, max_hw_1x1: int | None = None):
    from adopter.kernels.ops import conv_prepacked

    shipped_max_hw = conv_prepacked.NCHW_ONEDNN_MAX_HW_1X1
    conv_prepacked.ENABLED, conv_prepacked.EPILOGUE = prepack, epilogue
    if max_hw_1x1 is not None:
        conv_prepacked.NCHW_ONEDNN_MAX_HW_1X1 = max_hw_1x1
    try:
        return model(pixel_values=x).pooler_output
    finally:
        conv_prepacked.ENABLED = conv_prepacked.EPILOGUE = True
        conv_prepacked.NCHW_ONEDNN_MAX_HW_1X1 = shipped_max_hw


def _cache_bytes() -> int:
    from adopter.kernels import guarded

    total = 0
    for cache in (guarded._FOLD_CACHE, guarded._PACK_CACHE):
        for _, value in cache.items():
            for t in value[1] if isinstance(value[1], tuple) else (value[1],):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()  # (a packed weight: its logical size)
    return total


def measure_models(rounds: int, batches: list[int]) -> list[dict]:
    from adopter.verification.benchmark import peak_step_memory

    original, optimized, report = build_models()
    variants = {
        "original": lambda x: _call(original, x, True),
        "optimized_aten_conv": lambda x: _call(optimized, x, False),
        "optimized_relu_apart": lambda x: _call(optimized, x, True, epilogue=False),
        "optimized": lambda x: _call(optimized, x, True),
        # NCHW only: every light 1x1 conv from batch 4 in oneDNN on the NCHW data, whatever its H x W
        # (what NCHW_ONEDNN_MAX_HW_1X1 is measured against, in the model)
        "optimized_nchw_1x1_any_hw": lambda x: _call(optimized, x, True, max_hw_1x1=1 << 30),
    }
    rows = []
    for batch in batches:
        for layout in ("contiguous", "channels_last"):
            torch.manual_seed(batch)
            x = torch.randn(batch, 3, 224, 224)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            names = VARIANTS + (("optimized_nchw_1x1_any_hw",) if layout == "contiguous" and batch >= 4 else ())
            wall: dict[str, list[float]] = {v: [] for v in names}
            cpu: dict[str, list[float]] = {v: [] for v in names}
            with torch.no_grad():
                outputs = {name: variants[name](x) for name in names}  # warm-up (and caches)
                for name in names:
                    variants[name](x)
                n = rounds if batch == 1 else max(3, rounds // 3)
                for r in range(n):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for name in order:
                        t, c = time.perf_counter(), time.process_time()
                        variants[name](x)
                        wall[name].append(time.perf_counter() - t)
                        cpu[name].append(time.process_time() - c)
                peaks = {}
                for name in names:
                    peaks[name] = peak_step_memory(lambda run=variants[name], x=x: run(x), torch.device("cpu"))[0]
            ref = outputs["original"]
            row = {"batch": batch, "input_layout": layout, "rounds": n, "variants": {}}
            for name in names:
                out = outputs[name]
                row["variants"][name] = {
                    "wall_ms_median": round(statistics.median(wall[name]) * 1e3, 2),
                    "cpu_ms_median": round(statistics.median(cpu[name]) * 1e3, 2),
                    "speedup_wall": round(statistics.median(a / b for a, b in zip(wall["original"], wall[name])), 3),
                    "speedup_cpu": round(statistics.median(a / b for a, b in zip(cpu["original"], cpu[name])), 3),
                    "peak_memory_bytes": peaks[name],
                    "max_abs_diff_vs_original": float((out - ref).abs().max()),
                    "output_is_contiguous": out.is_contiguous(),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows, report, _cache_bytes()  # (while the models live: the caches are weak)


def _conv_shapes() -> list[tuple[nn.Conv2d, tuple[int, ...], int]]:
    from adopter.tracing import build_model

    model = build_model("microsoft/resnet-50", device="cpu").model.eval()
    seen: dict[tuple, list] = {}

    def hook(mod, inputs, _out):
        key = (mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, tuple(inputs[0].shape[1:]))
        seen.setdefault(key, [mod, tuple(inputs[0].shape[1:]), 0])[2] += 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 224, 224))
    for h in handles:
        h.remove()
    return [tuple(v) for v in seen.values()]


def measure_layers(batches: list[int], reps: int) -> list[dict]:
    from adopter.kernels.ops.conv_prepacked import conv_prepacked, pack_conv_weight

    rows = []
    for mod, shape, count in _conv_shapes():
        w = mod.weight.detach().clone()
        b = torch.randn(w.shape[0])
        args = (mod.padding, mod.stride, mod.dilation, mod.groups)
        for batch in batches:
            x = torch.randn(batch, *shape)
            packed = pack_conv_weight(w, *args, x.shape)
            fns = {
                "aten": lambda x=x, w=w, b=b, mod=mod: torch.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation,
                                                                    mod.groups),
                "packed_nhwc": lambda x=x, p=packed, b=b, a=args: conv_prepacked(x, p, b, *a, "contiguous"),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            with torch.no_grad():
                for f in fns.values():
                    f()
                for r in range(reps):
                    for k in (fns if r % 2 == 0 else reversed(list(fns))):
                        c = time.process_time()
                        fns[k]()
                        times[k].append(time.process_time() - c)
            out = torch.conv2d(x, w, None, mod.stride, mod.padding, mod.dilation, mod.groups)
            row = {
                "in": mod.in_channels, "out": mod.out_channels, "kernel": list(mod.kernel_size),
                "stride": list(mod.stride), "input": [batch, *shape], "calls_per_forward": count,
                "weight_over_activations": round(w.numel() / (x.numel() + out.numel()), 3),
                **{f"{k}_cpu_ms": round(statistics.median(v) * 1e3, 3) for k, v in times.items()},
            }
            row["aten_over_packed"] = round(row["aten_cpu_ms"] / row["packed_nhwc_cpu_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def measure_nchw_1x1(batches: list[int], reps: int) -> dict:
    shapes = sorted({(mod.in_channels, mod.out_channels, shape) for mod, shape, _ in _conv_shapes()
                     if mod.kernel_size == (1, 1) and mod.stride == (1, 1)})
    pointwise = torch.ops.mkldnn._convolution_pointwise
    rows = []
    for batch in batches:
        sums = {"aten_relu": 0.0, "onednn_relu": 0.0, "aten": 0.0, "onednn": 0.0}
        per_shape = []
        for cin, cout, shape in shapes:
            torch.manual_seed(cin + cout)
            x = torch.randn(batch, *shape)
            w, b = torch.randn(cout, cin, 1, 1) * 0.05, torch.randn(cout)
            fns = {
                "aten_relu": lambda x=x, w=w, b=b: torch.relu(torch.conv2d(x, w, b)),
                "onednn_relu": lambda x=x, w=w, b=b: pointwise(x, w, b, [0, 0], [1, 1], [1, 1], 1, "relu", [], ""),
                "aten": lambda x=x, w=w, b=b: torch.conv2d(x, w, b),
                "onednn": lambda x=x, w=w, b=b: pointwise(x, w, b, [0, 0], [1, 1], [1, 1], 1, "none", [], ""),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            with torch.no_grad():
                torch.testing.assert_close(fns["onednn_relu"](), fns["aten_relu"](), rtol=1e-4, atol=1e-4)
                for r in range(reps):
                    for k in (list(fns) if r % 2 == 0 else list(reversed(list(fns)))):
                        c = time.process_time()
                        fns[k]()
                        times[k].append(time.process_time() - c)
            medians = {k: statistics.median(times[k]) * 1e3 for k in fns}
            for k in sums:
                sums[k] += medians[k]
            per_shape.append({"cin": cin, "cout": cout, "hw": shape[1] * shape[2],
                              **{f"{k}_cpu_ms": round(v, 2) for k, v in medians.items()},
                              "aten_over_onednn_relu": round(medians["aten_relu"] / medians["onednn_relu"], 3),
                              "aten_over_onednn": round(medians["aten"] / medians["onednn"], 3)})
        row = {"batch": batch, **{f"{k}_cpu_ms_sum": round(v, 2) for k, v in sums.items()},
               "aten_over_onednn_relu": round(sums["aten_relu"] / sums["onednn_relu"], 3),
               "aten_over_onednn": round(sums["aten"] / sums["onednn"], 3)}
        # by spatial extent: what NCHW_ONEDNN_MAX_HW_1X1 rests on
        for name, keep in (("hw_at_most_196", lambda r: r["hw"] <= 196), ("hw_above_196", lambda r: r["hw"] > 196)):
            part = [r for r in per_shape if keep(r)]
            for k in ("relu", ""):
                a = sum(r[f"aten{'_' + k if k else ''}_cpu_ms"] for r in part)
                o = sum(r[f"onednn{'_' + k if k else ''}_cpu_ms"] for r in part)
                row[f"{name}_aten_over_onednn{'_' + k if k else ''}"] = round(a / o, 3) if o else None
        row["per_shape"] = per_shape
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"shapes": [[cin, cout, list(shape)] for cin, cout, shape in shapes], "rows": rows}


_OP_KINDS = {
    "convolution": ("aten::mkldnn_convolution", "aten::_slow_conv2d_forward", "mkldnn::_convolution_pointwise"),
    "batch_norm": ("aten::native_batch_norm", "aten::_native_batch_norm_legit_no_training"),
    "relu": ("aten::clamp_min", "aten::relu", "aten::relu_", "aten::clamp_min_", "aten::threshold"),
    "residual_add": ("aten::add_", "aten::add", "aten::_add_relu_", "aten::_add_relu"),
    "max_pool": ("aten::max_pool2d_with_indices",),
    "copies": ("aten::copy_",),
}


def measure_profile(batches: list[int]) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    original, optimized, _ = build_models()
    rows = []
    for batch in batches:
        for layout in ("contiguous", "channels_last"):
            x = torch.randn(batch, 3, 224, 224)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            row: dict = {"batch": batch, "input_layout": layout}
            for name, model in (("original", original), ("optimized", optimized)):
                with torch.no_grad():
                    for _ in range(2):
                        model(pixel_values=x)
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        model(pixel_values=x)
                events = prof.key_averages()
                total = sum(e.self_cpu_time_total for e in events) / 1e3
                kinds = {kind: round(sum(e.self_cpu_time_total for e in events if e.key in keys) / 1e3, 1)
                         for kind, keys in _OP_KINDS.items()}
                row[name] = {"self_cpu_ms_total": round(total, 1), "self_cpu_ms": kinds}
            orig = row["original"]
            share = (orig["self_cpu_ms"]["batch_norm"] + orig["self_cpu_ms"]["relu"]) / orig["self_cpu_ms_total"]
            row["original_batch_norm_and_relu_share"] = round(share, 3)
            row["speed_bound_removing_them"] = round(1 / (1 - share), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=45, help="rounds at batch 1 (a third of them, at least 3, at larger batches)")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--layers", action="store_true", help="also time every ResNet-50 conv shape alone")
    parser.add_argument("--nchw-1x1", action="store_true", help="also time ResNet-50's 1x1 convs, aten vs oneDNN, by batch")
    parser.add_argument("--profile", action="store_true", help="also profile one forward of each model, per op kind")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    rows, report, cache_bytes = measure_models(args.rounds, batches)
    result = {
        "what": "ResNet-50 (microsoft/resnet-50 config, random weights, calibrated BN) eval forward, no grad, "
                "1 thread, 224x224; variants alternating in one process",
        "command": "python benchmarks/bench_conv_bn_inference.py" + (" --layers" if args.layers else "")
                   + (" --nchw-1x1" if args.nchw_1x1 else "") + (" --profile" if args.profile else ""),
        "rules_applied": sorted({a.rule for a in report.applied}),
        "kernel_cache_bytes": cache_bytes,  # folded + packed weights the optimized model's kernels keep
        "models": rows,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "threads": torch.get_num_threads()},
    }
    if args.layers:
        result["layers"] = measure_layers(batches, reps=11)
    if args.nchw_1x1:
        result["nchw_1x1_batches"] = measure_nchw_1x1([1, 2, 4, 8, 16], reps=9)
    if args.profile:
        result["profile"] = measure_profile(batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
