"""x-transformers' RMSNorm (``F.normalize(x, dim=-1) * self.scale * self.gamma``) rewritten to the
guarded ``scaled_l2_norm`` kernel, side by side with the source's own module: the fixture's classes
(``tests/fixtures/rules/RMSNorm/positive_l2_normalize.py``) against their rewritten form (the
snapshot ``tests/rules/RMSNorm/positive_l2_normalize.rewritten.py``), fused path forced (the cost
model ignored: this measures where the fused path pays, which the calibration of
``benchmarks/calibrate_kernels.py --kernels scaled_l2_norm`` turns into the per-call decision).
Wall and CPU time per call, forward + backward and a no-grad forward, paired rounds as
``bench_rms_norm_forms.py`` (the two sides alternate; the ratio is the median per-round ratio).

    python benchmarks/bench_scaled_l2_norm.py --rounds 9 --json benchmarks/results/scaled_l2_norm.json

CPU threads: ``ADOPTER_BENCH_THREADS`` (default 1).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rms_norm_forms import _infer_step, _load, _train_step, paired  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL = ROOT / "tests" / "fixtures" / "rules" / "RMSNorm" / "positive_l2_normalize.py"
REWRITTEN = ROOT / "tests" / "rules" / "RMSNorm" / "positive_l2_normalize.rewritten.py"
# (rows..., hidden): a small model's batch, a BERT-base-sized batch, a 7B-sized hidden dimension
SHAPES = ((4, 32, 128), (8, 128, 768), (2, 128, 4096))
CLASSES = ("RMSNorm", "CastRMSNorm")


def main(rounds: int) -> tuple[str, list[dict]]:
    from adopter.kernels import cost

    warnings.filterwarnings("ignore")
    before, after = _load(ORIGINAL), _load(REWRITTEN)
    lines = [f"torch {torch.__version__}, threads {torch.get_num_threads()}, rounds {rounds}; a = rewritten "
             "(scaled_l2_norm, fused), b = original; ms per call (median); ratio = median per-round a/b "
             "(< 1: the kernel is faster)", "",
             "| class | dtype | shape | mode | a wall | b wall | wall ratio | IQR | cpu ratio |", "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    with cost.ignored():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in SHAPES:
                for name in CLASSES:
                    original = getattr(before, name)(shape[-1]).to(dtype)
                    rewritten = getattr(after, name)(shape[-1]).to(dtype)
                    rewritten.load_state_dict(original.state_dict())
                    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
                    for mode, make in (("fwd+bwd", _train_step), ("no-grad fwd", _infer_step)):
                        r = paired(make(rewritten, x), make(original, x), rounds)
                        row = {"class": name, "dtype": str(dtype).replace("torch.", ""), "shape": list(shape),
                               "mode": mode, "a_wall_ms": r["a_wall"] * 1e3, "b_wall_ms": r["b_wall"] * 1e3,
                               "wall_ratio_a_over_b": r["ratio"], "iqr": list(r["iqr"]),
                               "cpu_ratio_a_over_b": r["cpu_ratio"]}
                        rows.append(row)
                        lines.append(f"| {name} | {row['dtype']} | {'x'.join(map(str, shape))} | {mode} | "
                                     f"{row['a_wall_ms']:.3f} | {row['b_wall_ms']:.3f} | {r['ratio']:.2f} | "
                                     f"{r['iqr'][0]:.2f}-{r['iqr'][1]:.2f} | {r['cpu_ratio']:.2f} |")
                        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines) + "\n", rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    text, rows = main(args.rounds)
    print(text, end="")
    if args.json:
        args.json.write_text(json.dumps({"command": "python benchmarks/bench_scaled_l2_norm.py " + " ".join(sys.argv[1:]),
                                         "torch": torch.__version__, "machine": platform.machine(),
                                         "threads": torch.get_num_threads(), "rounds": args.rounds, "rows": rows},
                                        indent=1) + "\n", encoding="utf-8")
