"""Per-kernel contribution on a shipped model, with a longer budget than `adopter verify` gives it:
the evidence behind ``adopter.kernels.policy.BACKEND_POLICY`` entries.

    python benchmarks/bench_ablation.py --model llama-tiny --seconds 170
    python benchmarks/bench_ablation.py --model llama-tiny --kernels rotary --seconds 120 --all-kernels-on

The optimized class is built as ``adopter verify`` builds it (``optimize`` on the shrunk config,
the full-size model with the original's weights); each fused kernel is switched off in turn
(``adopter.verification.ablation.ablate_kernels``: alternating blocks, process CPU time and wall
time per step, one thread; peak memory of a step). ``--all-kernels-on`` measures with every
backend policy lifted (what the kernel would contribute if it ran: how a policy entry is
re-examined). Writes ``benchmarks/results/ablation_<model>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--kernels", default=None, help="comma-separated (default: every kernel that runs fused)")
    parser.add_argument("--seconds", type=float, default=170.0)
    parser.add_argument("--all-kernels-on", action="store_true", help="lift every BACKEND_POLICY entry")
    args = parser.parse_args(argv)

    import torch
    from adopter.kernels import policy
    from adopter.tracing import build_model, make_example_inputs

    from adopter import configs
    from adopter.optimizing.optimize import optimize, shrink_config
    from adopter.verification.ablation import ablate_kernels
    from adopter.verification.benchmark import make_train_step, step_kernel_calls

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if args.all_kernels_on:
        policy.BACKEND_POLICY.clear()
    settings = configs.load_config_dict(args.model).get("_adopter_verify") or {}
    batch, seq = int(settings.get("batch_size", 4)), int(settings.get("seq_len", 32))
    built = build_model(args.model, device="cpu")
    optimized_cls = optimize(type(built.model), config=shrink_config(built.config), device="cpu")
    optimized = optimized_cls(built.config)
    optimized.load_state_dict(built.model.state_dict())
    inputs = make_example_inputs(optimized, built.config, batch_size=batch, seq_len=seq, device="cpu")
    fused = sorted({c.kernel for c in step_kernel_calls(make_train_step(optimized, inputs)) if c.fused})
    kernels = args.kernels.split(",") if args.kernels else fused
    out = ablate_kernels(lambda: make_train_step(optimized, inputs), kernels, device=torch.device("cpu"),
                         json_path=os.path.join("/tmp", f"adopter-ablation-{os.getpid()}.json"),
                         time_budget_s=args.seconds, min_blocks=10, max_blocks=40,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    record = {
        "command": "python benchmarks/bench_ablation.py " + " ".join(argv),
        "what": f"{args.model} training step (forward+backward+AdamW), batch {batch} x {seq}, 1 thread, CPU: "
                "each kernel switched off in turn on the optimized model; speed = step time without / with all "
                "(process CPU time, median of alternating blocks, bootstrap 95% interval); memory = peak without / "
                "with all (> 1: the kernel saves memory)",
        "backend_policy_lifted": args.all_kernels_on,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "kernels": [c.to_json() for c in out],
    }
    path = os.path.join(HERE, "results", f"ablation_{args.model}.json")
    with open(path, "w") as fh:
        json.dump(record, fh, indent=2)
        fh.write("\n")
    for c in out:
        print(f"{c.kernel:<22} speed x{c.speed:.3f} [{c.speed_low:.3f}-{c.speed_high:.3f}]  memory x{c.memory:.3f}  "
              f"{c.effect}: {c.why}")
    print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
