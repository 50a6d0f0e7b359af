"""Does torch.compile stack on adopter's kernels? Four variants side by side, per case:

    python benchmarks/bench_stacking.py                          # all cases, ablation included
    python benchmarks/bench_stacking.py --cases llama-tiny --rounds 8 --no-ablation
    python benchmarks/bench_stacking.py --render        # the .md files again from the .json files

Variants: ``eager`` (the model as built), ``optimized`` (the class ``adopter.optimize`` returns,
built and measured as ``adopter verify`` does), ``compile`` (``torch.compile`` of the original,
inductor) and ``compile+optimized`` (``torch.compile`` of the optimized model). Cases, each in a
fresh subprocess (``resnet-50``: one per batch size): ``llama-tiny`` training (4 x 512 tokens),
``bert-base-uncased`` training (4 x 32), ``microsoft/resnet-50`` inference (eval, ``no_grad``,
batch 1 and 8, 224 x 224), ``bert-base-uncased-infer`` inference (batch 1 and 8 x 128 tokens). A training step is ``adopter verify``'s: forward + backward + AdamW
(``adopter.verification.benchmark.make_train_step``); the optimizer is not compiled.

Method: one thread (``torch.set_num_threads(1)``). Each variant is warmed up outside the timed
rounds (compile time reported: the warm-up steps of a compiled variant, compilation included);
peak memory is ``peak_step_memory`` (torch CPU allocator peak over one step, profiler). Rounds
alternate the variants (order reversed every other round); per step both wall time
(``perf_counter``) and process CPU time (``process_time``). Speed vs eager = the median over rounds
of the per-round ratio eager / variant, with a bootstrap 95% interval, for wall and CPU time.

Ablation (training cases, ``--no-ablation`` skips it): the same optimized (eager) model with
``adopter.kernels.policy.kernels_off``: "X alone" switches every other kernel off, "all but X"
switches X off; timed alternating with eager like the main table, in rounds of their own.

The stacking target (``verdict``): compile+optimized at least as fast as the faster of optimized and
compile (median of the paired per-round CPU-time ratios >= 1) and at most optimized's peak memory.
``--cold-compile`` disables inductor's on-disk caches, so the warm-up times are compilations from
scratch (by default the caches are used as found: a second run reports cache hits).

Writes ``benchmarks/results/stacking_<case>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20

# case -> (model id, mode, batch sizes, seq len)
CASES = {
    "llama-tiny": ("llama-tiny", "train", (4,), 512),
    "bert-base-uncased": ("bert-base-uncased", "train", (4,), 32),
    "resnet-50": ("microsoft/resnet-50", "infer", (1, 8), None),
    # issue 33's peer comparison: bert-base inference at batch 1 and 8 x 128 tokens
    "bert-base-uncased-infer": ("bert-base-uncased", "infer", (1, 8), 128),
}
VARIANTS = ("eager", "optimized", "compile", "compile+optimized")
# every kernel a guarded call asks adopter.kernels.policy about (policy_reason(<name>, ...))
KERNELS = ("linear_gelu", "dropout_add_layer_norm", "qkv", "conv_bn", "linear_bn", "gated_mlp",
           "linear_cross_entropy", "rms_norm", "rotary")


def bootstrap(values: list[float], samples: int = 2000, seed: int = 0) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(samples))
    return meds[int(0.025 * samples)], meds[int(0.975 * samples) - 1]


# ---------------------------------------------------------------- one case, in its own process


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0,
        "frames_ok": counters["frames"]["ok"],
    }


def _build(case: str, batch: int, say):
    import torch
    from adopter.tracing import build_model, make_example_inputs

    from adopter.optimizing.optimize import optimize, shrink_config

    model_id, mode, _, seq_len = CASES[case]
    built = build_model(model_id, device="cpu")
    original, config = built.model, built.config
    t = time.perf_counter()
    optimized_cls = optimize(type(original), config=shrink_config(config), device="cpu")
    say(f"optimize: {time.perf_counter() - t:.1f}s, applied {optimized_cls.adopter_report.applied_rules}")
    optimized = optimized_cls(copy.deepcopy(config)).to("cpu")
    optimized.load_state_dict(original.state_dict())
    inputs = make_example_inputs(original, config, batch_size=batch, seq_len=seq_len or 16, device="cpu")
    models = {
        "eager": original,
        "optimized": optimized,
        "compile": copy.deepcopy(original),
        "compile+optimized": copy.deepcopy(optimized),
    }
    for m in models.values():
        m.train(mode == "train")
    models["compile"] = torch.compile(models["compile"])
    models["compile+optimized"] = torch.compile(models["compile+optimized"])
    return models, inputs, optimized_cls.adopter_report.applied_rules, mode


def _steps(models: dict, inputs: dict, mode: str) -> dict:
    import torch

    from adopter.verification.benchmark import make_train_step
    from adopter.verification.equivalence import call_model

    steps = {}
    for name, model in models.items():
        if mode == "train":
            steps[name] = make_train_step(model, inputs)
        else:
            def infer(model=model):
                with torch.no_grad():
                    call_model(model, inputs)
            steps[name] = infer
    return steps


def _time_rounds(steps: dict, rounds: int, iterations: int, say, label: str) -> dict:
    """{variant: {"wall": [...], "cpu": [...]}} per round (seconds per step)."""
    names = list(steps)
    out = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iterations):
                steps[name]()
            out[name]["wall"].append((time.perf_counter() - w0) / iterations)
            out[name]["cpu"].append((time.process_time() - c0) / iterations)
        say(f"{label} round {r + 1}/{rounds}: " + ", ".join(f"{n} {out[n]['wall'][-1] * 1e3:.0f}ms" for n in names))
    return out


def _summary(times: dict, memory: dict, base: str = "eager") -> dict:
    rows = {}
    for name, t in times.items():
        row = {"memory_bytes": memory.get(name), "memory_vs_eager": (memory[name] / memory[base]
                                                                      if memory.get(base) else None)}
        for kind in ("wall", "cpu"):
            ratios = [b / v for b, v in zip(times[base][kind], t[kind]) if v > 0]
            lo, hi = bootstrap(ratios)
            row[f"{kind}_median_s"] = statistics.median(t[kind])
            row[f"{kind}_speed"] = statistics.median(ratios)
            row[f"{kind}_speed_ci95"] = [lo, hi]
            row[f"{kind}_s"] = [round(x, 6) for x in t[kind]]
        rows[name] = row
    return rows


def run_case(case: str, batch: int, rounds: int, ablation: bool, ablation_rounds: int) -> dict:
    import torch
    from adopter.kernels import count_kernel_calls
    from adopter.kernels.policy import kernels_off

    from adopter.verification.benchmark import peak_step_memory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{case} b{batch} {time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    models, inputs, applied, mode = _build(case, batch, say)
    steps = _steps(models, inputs, mode)
    device = torch.device("cpu")

    warmup = {}
    dynamo = {}
    for name, step in steps.items():
        before = _dynamo_counts()
        w = time.perf_counter()
        step()  # first call: compiles the compiled variants (forward and backward graphs)
        first = time.perf_counter() - w
        step()
        step()  # steady state (a recompile on the second call, an optimizer's lazy state)
        warmup[name] = {"first_step_s": first, "warmup_s": time.perf_counter() - w}
        after = _dynamo_counts()
        dynamo[name] = {k: after[k] - before[k] for k in after}
        say(f"warm-up {name}: first step {first:.1f}s, dynamo {dynamo[name]}")

    with count_kernel_calls() as counted:
        steps["optimized"]()
    calls = [c.to_json() for c in counted.calls]
    fused = sorted({c.kernel for c in counted.calls if c.fused})
    with count_kernel_calls() as counted_c:
        steps["compile+optimized"]()  # compiled code records while it is traced only; shown for completeness
    say(f"fused kernels in the optimized step: {fused}")

    memory = {}
    for name, step in steps.items():
        memory[name], metric = peak_step_memory(step, device)
    say("peak memory MiB: " + ", ".join(f"{n} {m / MIB:.0f}" for n, m in memory.items()))

    one = (warmup["eager"]["warmup_s"] - warmup["eager"]["first_step_s"]) / 2  # an eager step, warm
    iterations = max(1, math.ceil(0.25 / max(one, 1e-4)))
    times = _time_rounds(steps, rounds, iterations, say, "main")
    result = {
        "case": case, "model": CASES[case][0], "mode": mode, "batch": batch, "seq_len": CASES[case][3],
        "rounds": rounds, "iterations_per_round": iterations, "applied_rules": applied,
        "fused_kernels": fused, "kernel_calls_optimized_step": calls,
        "kernel_calls_compiled_step": [c.to_json() for c in counted_c.calls],
        "memory_metric": metric, "warmup": warmup,
        "cold_compile": os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1", "dynamo": dynamo,
        "variants": _summary(times, memory),
    }

    if ablation and mode == "train" and fused:
        opt_step = steps["optimized"]
        ab_steps = {"eager": steps["eager"], "optimized": opt_step}

        def switched(off):
            def step():
                with kernels_off(*off):
                    opt_step()
            return step

        for k in fused:
            ab_steps[f"{k} alone"] = switched([o for o in KERNELS if o != k])
            ab_steps[f"all but {k}"] = switched([k])
        ab_steps["none (all off)"] = switched(KERNELS)
        ab_mem = {}
        for name, step in ab_steps.items():
            step()
            ab_mem[name] = memory.get(name) or peak_step_memory(step, device)[0]
        ab_times = _time_rounds(ab_steps, ablation_rounds, iterations, say, "ablation")
        result["ablation"] = {"rounds": ablation_rounds, "variants": _summary(ab_times, ab_mem)}
    result["target"] = verdict(result)
    result["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "platform": platform.platform(), "threads": torch.get_num_threads(),
                             "cpu_count": os.cpu_count()}
    result["elapsed_s"] = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------- report


def paired(row: dict, base: dict, kind: str) -> tuple[float, float, float]:
    """Median over rounds of base / variant (``kind``: wall or cpu seconds), bootstrap 95% interval."""
    ratios = [b / v for b, v in zip(base[f"{kind}_s"], row[f"{kind}_s"]) if v > 0]
    lo, hi = bootstrap(ratios)
    return statistics.median(ratios), lo, hi


def _fmt_row(name: str, row: dict, ref: dict | None) -> str:
    def speed(kind, base=None):
        med, lo, hi = (row[f"{kind}_speed"], *row[f"{kind}_speed_ci95"]) if base is None else paired(row, base, kind)
        return f"{med:.2f} [{lo:.2f}, {hi:.2f}]"
    mem = row.get("memory_bytes")
    memtxt = f"{mem / MIB:,.0f} MiB ({row['memory_vs_eager']:.2f})" if mem is not None else "-"
    return (f"| {name} | {row['wall_median_s'] * 1e3:,.0f} ms | {speed('wall')} | {row['cpu_median_s'] * 1e3:,.0f} ms "
            f"| {speed('cpu')} | {speed('cpu', ref) if ref else '-'} | {memtxt} |")


def verdict(run: dict) -> dict:
    """The stacking target: compile+optimized at least as fast as the faster of optimized and compile
    (median paired CPU-time ratio >= 1), and at most optimized's peak memory."""
    v = run["variants"]
    c = v["compile+optimized"]
    out = {}
    for other in ("optimized", "compile"):
        for kind in ("cpu", "wall"):
            med, lo, hi = paired(c, v[other], kind)
            out[f"speed_vs_{other}_{kind}"] = [med, lo, hi]
    out["memory_vs_optimized"] = c["memory_bytes"] / v["optimized"]["memory_bytes"]
    out["met"] = (out["speed_vs_optimized_cpu"][0] >= 1 and out["speed_vs_compile_cpu"][0] >= 1
                  and out["memory_vs_optimized"] <= 1)
    return out


HEADER = ("| variant | wall/step | wall speed vs eager | CPU/step | CPU speed vs eager | CPU speed vs {ref} "
          "| peak memory |\n|---|---|---|---|---|---|---|")


def markdown(case: str, runs: list[dict]) -> str:
    lines = [f"# torch.compile stacked on adopter: {case}", "",
             "Generated by `benchmarks/bench_stacking.py` (one thread; variants alternating round by round; "
             "speed = median over rounds of the per-round ratio reference / variant, bootstrap 95% interval; "
             "memory = peak torch CPU allocator delta over one step, ratio to eager in parentheses).", ""]
    for run in runs:
        what = "training (forward + backward + AdamW)" if run["mode"] == "train" else "inference (eval, no_grad)"
        shape = f"batch {run['batch']}" + (f" x {run['seq_len']}" if run["seq_len"] else "")
        v = run["variants"]
        lines += [f"## {run['model']}: {what}, {shape}", "",
                  f"{run['rounds']} rounds x {run['iterations_per_round']} step(s); applied rules: "
                  f"{', '.join(run['applied_rules']) or 'none'}; fused kernels in a step of the optimized model: "
                  f"{', '.join(run['fused_kernels']) or 'none'}.", "", HEADER.format(ref="optimized")]
        lines += [_fmt_row(n, r, v["optimized"]) for n, r in v.items()]
        t = verdict(run)

        def fmt(x):
            return f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]"
        lines += ["", f"Target (compile+optimized >= max(optimized, compile) in speed, <= optimized in memory): "
                  f"**{'met' if t['met'] else 'not met'}** — compile+optimized vs optimized: CPU "
                  f"{fmt(t['speed_vs_optimized_cpu'])}, wall {fmt(t['speed_vs_optimized_wall'])}; vs compile: CPU "
                  f"{fmt(t['speed_vs_compile_cpu'])}, wall {fmt(t['speed_vs_compile_wall'])}; memory "
                  f"{t['memory_vs_optimized']:.2f}x optimized's."]
        cache = "cold (inductor caches disabled)" if run.get("cold_compile") else "inductor's on-disk caches as found"
        lines += ["", f"Warm-up (3 steps, compilation included; {cache}) and dynamo counters:", "",
                  "| variant | first step | warm-up | graphs | graph breaks | recompiles |", "|---|---|---|---|---|---|"]
        for n in VARIANTS:
            w, d = run["warmup"][n], run["dynamo"][n]
            lines.append(f"| {n} | {w['first_step_s']:.1f} s | {w['warmup_s']:.1f} s | {d['unique_graphs']} | "
                         f"{d['graph_breaks']} | {d['recompiles']} |")
        if "ablation" in run:
            ab = run["ablation"]
            none = ab["variants"].get("none (all off)")
            lines += ["", f"### Per-kernel ablation (the optimized model, eager; `kernels_off`; {ab['rounds']} rounds)",
                      "", "`none (all off)` is the optimized model with every kernel switched off: the reference that "
                      "isolates the kernels (same model object, same allocations as eager's code path).", "",
                      HEADER.format(ref="none (all off)")]
            lines += [_fmt_row(n, r, none) for n, r in ab["variants"].items()]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=10, help="alternating rounds of the four variants")
    ap.add_argument("--ablation-rounds", type=int, default=5)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--render", action="store_true", help="rewrite the .md files from the existing .json files")
    ap.add_argument("--cold-compile", action="store_true",
                    help="disable inductor's on-disk caches (compile time from scratch)")
    ap.add_argument("--worker", nargs=2, metavar=("CASE", "BATCH"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        case, batch = args.worker[0], int(args.worker[1])
        result = run_case(case, batch, args.rounds, not args.no_ablation, args.ablation_rounds)
        Path(args.worker_out).write_text(json.dumps(result, indent=1))
        return 0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.render:
        for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
            path = out_dir / f"stacking_{case.replace('/', '__')}.json"
            if path.exists():
                data = json.loads(path.read_text())
                for run in data["runs"]:
                    run["target"] = verdict(run)
                path.write_text(json.dumps(data, indent=1))
                path.with_suffix(".md").write_text(markdown(case, data["runs"]))
        return 0
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if case not in CASES:
            ap.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
        runs = []
        for batch in CASES[case][2]:
            tmp = out_dir / f".stacking_{case}_b{batch}.json"
            cmd = [sys.executable, __file__, "--worker", case, str(batch), "--worker-out", str(tmp),
                   "--rounds", str(args.rounds), "--ablation-rounds", str(args.ablation_rounds)]
            if args.no_ablation:
                cmd.append("--no-ablation")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if args.cold_compile:
                env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
            subprocess.run(cmd, check=True, env=env)
            runs.append(json.loads(tmp.read_text()))
            tmp.unlink()
        safe = case.replace("/", "__")
        (out_dir / f"stacking_{safe}.json").write_text(json.dumps({"case": case, "runs": runs}, indent=1))
        (out_dir / f"stacking_{safe}.md").write_text(markdown(case, runs))
        print(markdown(case, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
