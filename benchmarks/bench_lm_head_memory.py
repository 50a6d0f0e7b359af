"""Training-step peak memory of a nanoGPT-style model at GPT-2's vocabulary, before and after ``optimize``.

    python benchmarks/bench_lm_head_memory.py             # writes benchmarks/results/lm_head_memory.{json,md}
    python benchmarks/bench_lm_head_memory.py --rounds 3  # fewer alternating rounds

The model is the nanoGPT-style ``GPT`` of the LLM-styles corpus (tests/corpus/llm_styles/nanogpt_llm.py,
loaded by path, unchanged). Config: vocab 50,304 (GPT-2's, padded to a multiple of 64 as nanoGPT
does), block_size 512, batch 4 x 512 tokens, but only 2 layers of width 128 (4 heads) and
``flash=True`` (nanoGPT's default on torch >= 2: SDPA, no T x T attention matrix kept). Why this
size: the memory of a step at this vocabulary and batch is in the LM head, whatever the depth —
the logits are B*T*V = 4*512*50,304 floats = 412 MB, ``cross_entropy`` keeps their log-softmax
(another 412 MB) and backward makes their gradient (412 MB more) — while a GPT-2-small body
(12 x 768) would make a CPU step take minutes without moving that memory. What this does not
show: at GPT-2-small depth the body's activations (~12 layers x a few B*T*C tensors) are a larger
share, so the ratio there is higher than here.

Steps:

1. ``adopter.optimize(GPT, config=..., example_inputs=...)`` on the config above (example batch
   1 x 64 tokens: the analysis does not need the full batch), and the rules it applied;
2. equivalence at the measured size: the original and optimized models on the same weights, one
   training forward/backward on the 4 x 512 batch: loss and every gradient ``allclose``;
3. memory and time: each measurement in a fresh subprocess (original and optimized alternating,
   ``--rounds`` pairs). The child loads the model file (the optimized child loads the rewritten
   source ``optimize`` returned its class from: ``adopter_report.sources``, the text it proved
   equivalent), builds the model and AdamW, then runs two training steps (zero_grad, forward with
   targets, backward, ``AdamW.step``). Per step, the peak RSS increase: the kernel's RSS high-water
   mark (``VmHWM``) is reset just before the step (``echo 5 > /proc/self/clear_refs``) and read after
   it, minus ``VmRSS`` just before it. Step 1 allocates the gradients and the AdamW state too;
   step 2 is the steady state. glibc's malloc is pinned to mmap every allocation over 128 KiB
   (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave RSS and the history of a process does
   not hide an allocation; one thread (``torch.set_num_threads(1)``), so process CPU time is one
   core's work. Reported: the median over rounds of the per-round ratio optimized / original, for
   peak memory and for step-2 wall and process CPU time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = ROOT / "tests" / "corpus" / "llm_styles" / "nanogpt_llm.py"
OUT = ROOT / "benchmarks" / "results" / "lm_head_memory.json"
OUT_MD = OUT.with_suffix(".md")
CONFIG = {"block_size": 512, "vocab_size": 50304, "n_layer": 2, "n_head": 4, "n_embd": 128,
          "dropout": 0.0, "bias": True, "flash": True}
BATCH, SEQ = 4, 512
GOAL = 0.5
MIB = 1024 * 1024


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class body runs
    spec.loader.exec_module(module)
    return module


def batch(seed: int = 1234):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g),
            torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g))


# --------------------------------------------------------------------------- child: one measurement


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(model_file: str, out: str) -> None:
    import warnings

    import torch
    from adopter.kernels import LogitsNotComputedWarning

    # the benchmark reads only the loss: the fused head's "no logits in training" notice is expected here
    warnings.simplefilter("ignore", LogitsNotComputedWarning)

    torch.set_num_threads(1)
    module = load_module(Path(model_file), "bench_lm_head_memory_model")
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(**CONFIG)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x, y = batch()
    steps = []
    for _ in range(2):
        before = _status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        wall, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, targets=y)
        loss.backward()
        opt.step()
        loss = loss.detach()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = _status_kib("VmHWM")
        steps.append({"rss_before_mib": before / 1024, "peak_increase_mib": (peak - before) / 1024,
                      "wall_s": wall, "cpu_s": cpu, "loss": loss.item()})
        del loss
    Path(out).write_text(json.dumps(steps))


def measure(model_file: Path) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        subprocess.run([sys.executable, __file__, "--child", str(model_file), str(out)], check=True, env=env)
        return json.loads(out.read_text())


# --------------------------------------------------------------------------- parent


def optimized_source(module) -> tuple[type, dict, str]:
    """(optimized class, its report as JSON, the rewritten text of the model file)."""
    import torch

    from adopter import optimize

    g = torch.Generator().manual_seed(0)
    example = {"idx": torch.randint(0, CONFIG["vocab_size"], (1, 64), generator=g),
               "targets": torch.randint(0, CONFIG["vocab_size"], (1, 64), generator=g)}
    optimized = optimize(module.GPT, config=module.GPTConfig(**CONFIG), example_inputs=example)
    report = optimized.adopter_report
    texts = [new for path, (_, new) in report.sources.items() if os.path.realpath(path) == os.path.realpath(MODEL_FILE)]
    if not texts:
        raise SystemExit(f"optimize rewrote nothing in {MODEL_FILE.name}:\n{report}")
    return optimized, report.to_json(), texts[0]


def equivalence(module, optimized: type) -> dict:
    """One training forward/backward of both models on the same weights and the measured batch."""
    import torch

    torch.manual_seed(0)
    original = module.GPT(module.GPTConfig(**CONFIG)).train()
    candidate = optimized(module.GPTConfig(**CONFIG)).train()
    candidate.load_state_dict(original.state_dict(), strict=True)
    x, y = batch()
    losses = []
    for model in (original, candidate):
        _, loss = model(x, targets=y)
        loss.backward()
        losses.append(loss.detach())
    grads = dict(candidate.named_parameters())
    worst, worst_name, close = 0.0, "", True
    rtol, atol = 1e-4, 1e-5
    for name, p in original.named_parameters():
        q = grads[name].grad
        if (p.grad is None) != (q is None):
            return {"equivalent": False, "error": f"gradient of {name} missing on one side"}
        if p.grad is None:
            continue
        diff = float((q - p.grad).abs().max())
        close = close and torch.allclose(q, p.grad, rtol=rtol, atol=atol)
        if diff > worst:
            worst, worst_name = diff, name
    loss_close = torch.allclose(losses[1], losses[0], rtol=rtol, atol=atol)
    return {"equivalent": bool(close and loss_close), "rtol": rtol, "atol": atol,
            "loss_original": float(losses[0]), "loss_optimized": float(losses[1]),
            "loss_abs_diff": float((losses[1] - losses[0]).abs()),
            "grad_max_abs_diff": worst, "grad_worst_param": worst_name}


def markdown(record: dict) -> str:
    s = record["summary"]
    eq = record["equivalence"]
    rows = [
        ("peak RSS increase, step 1 (MiB)", "step1_peak_increase_mib"),
        ("peak RSS increase, step 2 (MiB)", "step2_peak_increase_mib"),
        ("step 2 wall (s)", "step2_wall_s"),
        ("step 2 process CPU (s)", "step2_cpu_s"),
    ]
    lines = [
        f"nanoGPT-style GPT, vocab {CONFIG['vocab_size']}, batch {BATCH} x {SEQ}, "
        f"{CONFIG['n_layer']} layers x {CONFIG['n_embd']}, CPU, 1 thread, {record['rounds']} alternating rounds "
        f"(medians); rules applied: {', '.join(record['rules_applied'])}; "
        f"equivalent (loss + grads allclose): {eq['equivalent']}",
        "",
        "| training step | original | optimized | optimized / original |",
        "|---|---:|---:|---:|",
    ]
    for label, key in rows:
        digits = 0 if key.endswith("mib") else 2
        lines.append(f"| {label} | {s[key]['original']:.{digits}f} | {s[key]['optimized']:.{digits}f} "
                     f"| {s[key]['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", nargs=2, metavar=("MODEL_FILE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0

    import torch

    torch.set_num_threads(1)
    module = load_module(MODEL_FILE, "bench_lm_head_memory_original")
    started = time.perf_counter()
    optimized, report, new_text = optimized_source(module)
    optimize_s = time.perf_counter() - started
    rules = sorted({a["rule"] for a in report["applied"]})
    print(f"optimize: {optimize_s:.1f} s; applied: {', '.join(a['rule'] + ' at ' + a['where'] for a in report['applied'])}")
    flipped = report["flipped_config"]
    print(f"flipped config: {[str(f['field']) + '=' + repr(f['flipped']) for f in flipped['flips']]} "
          f"{'equivalent' if (flipped['equivalence'] or {}).get('equivalent') else ''} {flipped['note']}")
    eq = equivalence(module, optimized)
    print(f"equivalence at {BATCH} x {SEQ}: {eq}")

    with tempfile.TemporaryDirectory() as tmp:
        rewritten = Path(tmp) / MODEL_FILE.name
        rewritten.write_text(new_text)
        runs: dict[str, list] = {"original": [], "optimized": []}
        for r in range(args.rounds):
            # alternate which goes first, so drift in the machine's load falls on both
            order = ("original", "optimized") if r % 2 == 0 else ("optimized", "original")
            for which in order:
                runs[which].append(measure(MODEL_FILE if which == "original" else rewritten))
            o, p = runs["original"][-1], runs["optimized"][-1]
            print(f"round {r + 1}: peak MiB step1 {o[0]['peak_increase_mib']:.0f} -> {p[0]['peak_increase_mib']:.0f}, "
                  f"step2 {o[1]['peak_increase_mib']:.0f} -> {p[1]['peak_increase_mib']:.0f}; step2 wall "
                  f"{o[1]['wall_s']:.2f} -> {p[1]['wall_s']:.2f} s, cpu {o[1]['cpu_s']:.2f} -> {p[1]['cpu_s']:.2f} s",
                  flush=True)

    summary = {}
    for key, step, field in (("step1_peak_increase_mib", 0, "peak_increase_mib"),
                             ("step2_peak_increase_mib", 1, "peak_increase_mib"),
                             ("step2_wall_s", 1, "wall_s"), ("step2_cpu_s", 1, "cpu_s")):
        o = [run[step][field] for run in runs["original"]]
        p = [run[step][field] for run in runs["optimized"]]
        summary[key] = {"original": statistics.median(o), "optimized": statistics.median(p),
                        "ratio": statistics.median(b / a for a, b in zip(o, p)),
                        "ratios": [b / a for a, b in zip(o, p)]}
    logits_mib = BATCH * SEQ * CONFIG["vocab_size"] * 4 / MIB
    record = {
        "model": str(MODEL_FILE.relative_to(ROOT)), "config": CONFIG, "batch": [BATCH, SEQ],
        "logits_mib": logits_mib, "rounds": args.rounds, "threads": 1,
        "method": "per step: VmHWM after the step minus VmRSS before it, the high-water mark reset just before "
                  "(/proc/self/clear_refs 5); fresh subprocess per measurement, MALLOC_MMAP_THRESHOLD_=131072; "
                  "medians over alternating rounds; ratio = optimized / original per round",
        "goal_peak_ratio_at_most": GOAL,
        "rules_applied": rules, "applied": [{k: a[k] for k in ("rule", "where", "status")} for a in report["applied"]],
        "flipped_config": flipped, "optimize_s": optimize_s, "equivalence": eq, "summary": summary, "runs": runs,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    OUT_MD.write_text(markdown(record))
    print(markdown(record))
    ok = eq["equivalent"] and summary["step1_peak_increase_mib"]["ratio"] <= GOAL
    print(f"goal peak ratio <= {GOAL}: {'met' if ok else 'NOT met'} (logits alone: {logits_mib:.0f} MiB)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
