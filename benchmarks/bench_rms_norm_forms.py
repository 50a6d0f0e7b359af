"""RMSNorm as written outside HuggingFace (issue 24): each new form's rewritten class (the guarded
``rms_norm`` kernel) against its original class, and torch's own ``nn.RMSNorm`` against the kernel
computing the same form, side by side: wall time and CPU time (``time.process_time``, every thread
of the process) per call, forward + backward (training) and a no-grad forward (inference).

Paired as in ``bench_kernels.py paired``: the two sides alternate round by round (who goes first
alternates too) and the ratio is the median of the per-round ratios, so load on a shared machine
hits both sides of a round alike.

    python benchmarks/bench_rms_norm_forms.py --rounds 15 > benchmarks/results/rms_norm_forms_cpu.md
    python benchmarks/bench_rms_norm_forms.py --builtin-only --json benchmarks/results/rms_norm_forms.json

``--builtin-only``: only torch's ``nn.RMSNorm`` and ``F.rms_norm`` against the kernel (the numbers
the RMSNorm rule's decision not to rewrite them rests on: its DOC quotes them). ``--json``: the
rows as a JSON record as well (machine, torch, threads, rounds).

CPU threads: ``ADOPTER_BENCH_THREADS`` (default 1, as bench_kernels.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "rules" / "RMSNorm"
if not torch.cuda.is_available():
    torch.set_num_threads(int(os.environ.get("ADOPTER_BENCH_THREADS", "1")))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (rows, hidden): a BERT-base-sized batch and a 7B-sized hidden dimension
SHAPES = ((8, 128, 768), (2, 128, 4096))


def _load(path: Path) -> types.ModuleType:
    module = types.ModuleType(f"bench_{path.parent.name}_{path.stem}")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _train_step(module, x):
    params = list(module.parameters())

    def step():
        out = module(x)
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in params:
            p.grad = None
        _sync()

    return step


def _infer_step(module, x):
    x = x.detach()

    def step():
        with torch.no_grad():
            module(x)
        _sync()

    return step


def _time(step, n: int) -> tuple[float, float]:
    """(wall, cpu) seconds per call over ``n`` back-to-back calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def _calls_for(step, target_s: float = 0.05) -> int:
    return max(1, min(200, round(target_s / max(_time(step, 1)[0], 1e-6))))


def paired(a, b, rounds: int) -> dict:
    for _ in range(2):
        a(), b()
    n = _calls_for(b)
    wa, wb, ca, cb, ratios, cpu_ratios = [], [], [], [], [], []
    for i in range(rounds):
        if i % 2:
            tb, ta = _time(b, n), _time(a, n)
        else:
            ta, tb = _time(a, n), _time(b, n)
        wa.append(ta[0]), wb.append(tb[0]), ca.append(ta[1]), cb.append(tb[1])
        ratios.append(ta[0] / tb[0]), cpu_ratios.append(ta[1] / max(tb[1], 1e-9))
    q = statistics.quantiles(ratios, n=4)
    return {"a_wall": statistics.median(wa), "b_wall": statistics.median(wb), "a_cpu": statistics.median(ca),
            "b_cpu": statistics.median(cb), "ratio": statistics.median(ratios), "iqr": (q[0], q[2]),
            "cpu_ratio": statistics.median(cpu_ratios)}


# class in positive_outside_hf.py, constructor keywords
FORMS = {
    "litgpt (x*x, dim attr)": ("LitGPTRMSNorm", {}),
    "litgpt unit offset": ("LitGPTRMSNorm", {"add_unit_offset": True}),
    "litgpt scale expr": ("LitGPTScaleRMSNorm", {}),
    "meta-llama _norm": ("MetaLlamaRMSNorm", {}),
    "no upcast (fp32 only)": ("NoUpcastRMSNorm", {}),
}


class _Functional(nn.Module):
    """``F.rms_norm(x, (hidden,), self.weight, eps)`` as a module: torch's functional built-in."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


def _pairs(dtype, builtin_only: bool = False):
    """name -> (fused module, reference module)."""
    before, after = _load(FIXTURES / "positive_outside_hf.py"), _load(FIXTURES / "rewritten" / "positive_outside_hf.py")
    out = {}
    for shape in SHAPES:
        hidden = shape[-1]
        for label, (cls, kwargs) in ({} if builtin_only else FORMS).items():
            if "no upcast" in label and dtype != torch.float32:
                continue  # the guarded call runs the original there
            original = getattr(before, cls)(hidden, **kwargs).to(DEVICE, dtype)
            rewritten = getattr(after, cls)(hidden, **kwargs).to(DEVICE, dtype)
            rewritten.load_state_dict(original.state_dict())
            out[(label, shape)] = (rewritten, original)
        # torch's own RMSNorm (OLMo-2's form: (n * weight).to(x.dtype)) vs the kernel in that form
        builtin = nn.RMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)

        class Kernel(nn.Module):
            def __init__(self, weight):
                super().__init__()
                self.weight = weight

            def forward(self, x):
                from adopter.kernels import rms_norm

                return rms_norm(x, self.weight, 1e-6, weight_before_cast=True)

        out[("nn.RMSNorm: adopter kernel vs built-in", shape)] = (Kernel(builtin.weight), builtin)
        out[("F.rms_norm: adopter kernel vs built-in", shape)] = (Kernel(builtin.weight), _Functional(builtin.weight))
    return out


ROWS: list[dict] = []


def main(rounds: int, builtin_only: bool = False) -> str:
    warnings.filterwarnings("ignore")
    lines = [
        f"device: {DEVICE.type}, torch {torch.__version__}, threads: {torch.get_num_threads()}, rounds: {rounds} "
        "(each timing repeats the call for >= ~50 ms); a = fused (rewritten class / adopter kernel), "
        "b = original class / torch built-in; times are medians per call in ms, ratio = median per-round a/b",
        "",
        "| form | dtype | shape | mode | a wall | b wall | a cpu | b cpu | wall ratio a/b | IQR | cpu ratio a/b |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dtypes = (torch.float32, torch.bfloat16) if DEVICE.type == "cpu" else (torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for (label, shape), (fused, ref) in _pairs(dtype, builtin_only).items():
            x = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
            for mode, make in (("fwd+bwd", _train_step), ("no-grad fwd", _infer_step)):
                r = paired(make(fused, x), make(ref, x), rounds)
                lines.append(
                    f"| {label} | {str(dtype).replace('torch.', '')} | {'x'.join(map(str, shape))} | {mode} "
                    f"| {r['a_wall'] * 1e3:.3f} | {r['b_wall'] * 1e3:.3f} | {r['a_cpu'] * 1e3:.3f} "
                    f"| {r['b_cpu'] * 1e3:.3f} | {r['ratio']:.2f} | {r['iqr'][0]:.2f}-{r['iqr'][1]:.2f} "
                    f"| {r['cpu_ratio']:.2f} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
                ROWS.append({"form": label, "dtype": str(dtype).replace("torch.", ""), "shape": list(shape),
                             "mode": mode, "a_wall_ms": r["a_wall"] * 1e3, "b_wall_ms": r["b_wall"] * 1e3,
                             "a_cpu_ms": r["a_cpu"] * 1e3, "b_cpu_ms": r["b_cpu"] * 1e3,
                             "wall_ratio_a_over_b": r["ratio"], "iqr": list(r["iqr"]),
                             "cpu_ratio_a_over_b": r["cpu_ratio"]})
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--builtin-only", action="store_true", help="only nn.RMSNorm / F.rms_norm vs the kernel")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    print(main(args.rounds, args.builtin_only), end="")
    if args.json is not None:
        import json
        import platform

        record = {"benchmark": "bench_rms_norm_forms.py", "device": DEVICE.type, "torch": torch.__version__,
                  "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                  "threads": torch.get_num_threads(), "rounds": args.rounds,
                  "a": "adopter kernel (rms_norm, or the rewritten class)", "b": "torch built-in / original class",
                  "rows": ROWS}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
