"""The "never slower" zoo: `adopter verify` on a zoo of models, original vs optimized, CPU, one thread.

    python benchmarks/bench_zoo.py --list                     # the cases and the verify command of each
    python benchmarks/bench_zoo.py                            # every case (about an hour on 2 shared cores)
    python benchmarks/bench_zoo.py --cases small-cnn-infer,llama-tiny-train --out /tmp/zoo.json

Each case runs ``python -m adopter verify ... --threads 1 --quiet`` in a fresh subprocess (one at a
time: on a shared machine run nothing else meanwhile), with ``--json`` and ``--benchmark-json`` into a
temporary directory, and the figures are read from that result: the optimized/original speed ratio
(``speed_ratio``, > 1: faster) with its bootstrap 95% interval, per batch size for an inference sweep;
the memory ratio (optimized / original, < 1: less); equivalence; the rules applied and which of them
verify left out (``not_applied``: the kernel cost more than it saved here, or never ran fused); the
speed ratio before that (``benchmark_with_every_rule``); and ``benchmark_skipped`` (no rule applied, say).

"Never slower": the low end of the speed ratio's 95% interval is at least ``NEVER_SLOWER`` (0.99) for
every measured batch size. A case whose benchmark was skipped because no rule applied runs the original
model, so it is never slower by construction (reported as such). Exit status 1 when any case run fails
"never slower" or equivalence, or its verify produced no result (reported with the last line of its
stderr); 0 otherwise.

Writes ``benchmarks/results/zoo_cpu.json`` (``--out``) and the markdown table next to it
(``zoo_cpu.md``). With ``--cases`` the cases run replace theirs in an existing ``--out`` file and the
others are kept as they were (each case records its own date and torch version).

Cases from your own code (``--model package.module:Name``) are the corpus files under ``tests/corpus``
(nanoGPT-, llama2.c-, ViT- and ResNet-style models), put on ``PYTHONPATH`` for the subprocess. Classes
taking a config object (nanoGPT's ``GPTConfig``, llama2.c's ``ModelArgs``) cannot get one from a
``--model-args`` JSON file, so they are built by the factories below (``bench_zoo:nanogpt``,
``bench_zoo:llama2c``: verify records the arguments the factory gave the class and builds the optimized
class the same way); their ``--model-args`` file gives the factory's keyword arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "zoo_cpu.json"
NEVER_SLOWER = 0.99  # the low end of the speed ratio's 95% interval must reach this
DEFAULT_ABLATION_SECONDS = 10.0
DEFAULT_TIMEOUT_S = 1800
FORMAT = 1

STYLES = "tests/corpus/styles"
LLM_STYLES = "tests/corpus/llm_styles"


@dataclass(frozen=True)
class Case:
    """One zoo entry: what ``adopter verify`` is told (``model`` and ``args``), the ``--model-args``
    JSON written for it (user code only) and the folders put on ``PYTHONPATH`` (repository-relative)."""

    name: str
    what: str
    model: str
    mode: str = "train"
    args: tuple[str, ...] = ()
    model_args: dict | None = None
    pythonpath: tuple[str, ...] = ()
    batch: str = ""  # how the table names the batch of a single-batch case (user code: from the inputs)

    def verify_argv(self, *, json_path: str, benchmark_json: str, model_args_path: str | None,
                    ablation_seconds: float, blocks: int | None = None,
                    bench_seconds: float | None = None) -> list[str]:
        """The ``adopter verify`` arguments of this case (after ``python -m adopter``)."""
        argv = ["verify", "--model", self.model]
        if self.model_args is not None:
            argv += ["--model-args", model_args_path or f"{self.name}.model-args.json"]
        argv += ["--mode", self.mode, *self.args, "--threads", "1"]
        if blocks is not None:
            argv += ["--blocks", str(blocks)]
        if bench_seconds is not None:
            argv += ["--bench-seconds", f"{bench_seconds:g}"]
        argv += ["--ablation-seconds", f"{ablation_seconds:g}", "--json", json_path,
                 "--benchmark-json", benchmark_json, "--quiet"]
        return argv


def _tokens(batch: int, seq: int, high: int) -> dict:
    return {"shape": [batch, seq], "dtype": "int64", "low": 0, "high": high}


CASES: tuple[Case, ...] = (
    Case("bert-base-train", "bert-base-uncased, training, batch 4 x 32 tokens (verify's default shape)",
         "bert-base-uncased", batch="4x32"),
    Case("bert-base-infer", "bert-base-uncased, inference, batch 1 and 8 x 128 tokens",
         "bert-base-uncased", "inference", ("--batch-sizes", "1,8", "--seq-len", "128")),
    Case("llama-tiny-train", "llama-tiny (4 layers, hidden 256, vocab 32000), training, 4 x 512 tokens",
         "llama-tiny", batch="4x512"),
    Case("nanogpt-v65-train",
         "nanoGPT-style GPT (corpus nanogpt_llm.py: 4 layers, 4 heads, n_embd 256, block 128, manual attention), "
         "vocab 65 (character level), training, 4 x 128 tokens",
         "bench_zoo:nanogpt", model_args={"kwargs": {"vocab_size": 65}},
         pythonpath=("benchmarks", LLM_STYLES), batch="4x128"),
    Case("nanogpt-v50304-train", "the same GPT at vocab 50304 (GPT-2's, padded), training, 4 x 128 tokens",
         "bench_zoo:nanogpt", model_args={"kwargs": {"vocab_size": 50304}},
         pythonpath=("benchmarks", LLM_STYLES), batch="4x128"),
    Case("llama2c-train",
         "llama2.c-style Llama (corpus llama2c_model.py) at stories15M's shape (dim 288, 6 layers, 6 heads, "
         "vocab 32000), training, 4 x 128 tokens",
         "bench_zoo:llama2c", pythonpath=("benchmarks", LLM_STYLES), batch="4x128"),
    Case("vit-small-train",
         "ViT (corpus vit_mixer.py VisionTransformer) at ViT-S width (384, 6 heads), depth 6, 64x64 images, "
         "patch 8, no dropout, training, batch 8",
         "vit_mixer:VisionTransformer",
         model_args={"kwargs": {"img_size": 64, "patch_size": 8, "embed_dim": 384, "depth": 6, "num_heads": 6,
                                "num_classes": 10, "drop_rate": 0.0, "drop_path_rate": 0.0},
                     "inputs": {"x": {"shape": [8, 3, 64, 64], "dtype": "float32"}}},
         pythonpath=(STYLES,), batch="8"),
    Case("resnet50-infer", "microsoft/resnet-50, inference (eval, no_grad), NCHW, batch 1 and 8, 224x224",
         "microsoft/resnet-50", "inference", ("--batch-sizes", "1,8")),
    Case("resnet50-infer-cl", "microsoft/resnet-50, inference, channels_last, batch 1 and 8, 224x224",
         "microsoft/resnet-50", "inference", ("--batch-sizes", "1,8", "--channels-last")),
    Case("small-cnn-infer",
         "small ResNet-style CNN (corpus torchvision_resnet.py resnet18, 10 classes), inference, batch 4, 64x64",
         "torchvision_resnet:resnet18", "inference",
         model_args={"kwargs": {"num_classes": 10}, "inputs": {"x": {"shape": [4, 3, 64, 64], "dtype": "float32"}}},
         pythonpath=(STYLES,), batch="4"),
)
CASES_BY_NAME = {c.name: c for c in CASES}


# ---------------------------------------------------------------- factories (verify imports them)
# Run by `adopter verify --model bench_zoo:<factory>` in the subprocess, with this folder and the
# corpus folder on PYTHONPATH: they build the corpus class with its config object and return the
# model with its example inputs (the batch the benchmark trains on).


def nanogpt(vocab_size: int = 65, n_layer: int = 4, n_head: int = 4, n_embd: int = 256, block_size: int = 128,
            batch_size: int = 4, flash: bool = False, seed: int = 0):
    """nanoGPT's GPT (``tests/corpus/llm_styles/nanogpt_llm.py``) with targets: training computes its loss."""
    import torch
    from nanogpt_llm import GPT, GPTConfig

    config = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       dropout=0.0, bias=True, flash=flash)
    model = GPT(config)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, block_size), generator=g)
    targets = torch.randint(0, vocab_size, (batch_size, block_size), generator=g)
    return model, {"idx": idx, "targets": targets}


def llama2c(dim: int = 288, n_layers: int = 6, n_heads: int = 6, vocab_size: int = 32000, seq_len: int = 128,
            batch_size: int = 4, multiple_of: int = 32, seed: int = 0):
    """llama2.c's Transformer (``tests/corpus/llm_styles/llama2c_model.py``) with targets (its loss goes to
    ``self.last_loss``; the model returns the logits, which verify's training step back-propagates)."""
    import torch
    from llama2c_model import ModelArgs, Transformer

    params = ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size, max_seq_len=seq_len,
                       multiple_of=multiple_of, dropout=0.0)
    model = Transformer(params)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    targets = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return model, {"tokens": tokens, "targets": targets}


# ---------------------------------------------------------------- summarizing (pure)


def _num(value) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return math.nan
    return out


def never_slower(low) -> bool:
    """The low end of the speed ratio's 95% interval reaches :data:`NEVER_SLOWER` (NaN: no)."""
    low = _num(low)
    return not math.isnan(low) and low >= NEVER_SLOWER


def _row(bench: dict, batch) -> dict:
    low = _num(bench.get("speed_ratio_low"))
    return {
        "batch": batch,
        "speed_ratio": _num(bench.get("speed_ratio")),
        "speed_ratio_low": low,
        "speed_ratio_high": _num(bench.get("speed_ratio_high")),
        "memory_ratio": _num(bench.get("memory_ratio")),
        "verdict": bench.get("verdict") or "",
        "never_slower": never_slower(low),
    }


def summarize(result: dict | None, *, mode: str = "train", batch: str = "", error: str | None = None) -> dict:
    """The zoo figures of one verify result (its ``--json``): ``rows`` (one per measured batch size),
    ``equivalent``, ``never_slower``, ``passed`` and the rule counts. ``result`` None (verify wrote no
    result): an error entry that does not pass, ``error`` saying why."""
    if result is None:
        return {"mode": mode, "rows": [], "equivalent": None, "never_slower": None, "passed": False,
                "rules_applied": 0, "rules_not_applied": [], "error": error or "no result"}
    equivalence = result.get("equivalence") or {}
    equivalent = bool(equivalence.get("equivalent"))
    channels_last = result.get("equivalence_channels_last")
    if channels_last is not None:
        equivalent = equivalent and bool(channels_last.get("equivalent"))
    applied = result.get("rules_applied") or []
    bench = result.get("benchmark") or {}
    mode = bench.get("mode") or mode
    if bench.get("sweep"):
        rows = [_row(b, b.get("batch_size")) for b in bench["sweep"]]
    elif bench:
        rows = [_row(bench, batch or bench.get("batch_size"))]
    else:
        rows = []
    every = result.get("benchmark_with_every_rule")
    with_every = None
    if every:
        with_every = ([_row(b, b.get("batch_size")) for b in every["sweep"]] if every.get("sweep")
                      else [_row(every, batch or every.get("batch_size"))])
    skipped = result.get("benchmark_skipped")
    identical = bool(result.get("identical_to_original"))
    if identical and equivalent:
        # every applied rule was dropped: the model measured as optimized is the original itself,
        # so it is never slower by construction (its rows measure the machine's noise)
        slower_ok = True
    elif rows:
        slower_ok = all(r["never_slower"] for r in rows)
    elif skipped and not applied and equivalent:
        slower_ok = True  # nothing rewritten: the optimized model is the original
    else:
        slower_ok = False  # not measured (not equivalent, or the benchmark was switched off)
    summary = {
        "mode": mode,
        "rows": rows,
        "equivalent": equivalent,
        "never_slower": slower_ok,
        "passed": equivalent and slower_ok,
        "rules_applied": len(applied),
        "rules_not_applied": [f"{a.get('rule')} ({a.get('class') or a.get('function') or '?'})"
                              for a in applied if "not_applied" in a],
        "rules": sorted({a.get("rule") for a in applied if a.get("rule")}),
    }
    if with_every is not None:
        summary["benchmark_with_every_rule"] = with_every
    if identical:
        summary["identical_to_original"] = True
    if skipped:
        summary["benchmark_skipped"] = skipped
    if error:
        summary["error"] = error
    return summary


def diagnostics(result: dict) -> dict:
    """What explains a ratio: per applied rule the kernel backends and fallbacks of the measured step,
    the ablation's per-kernel verdicts, and the benchmark's blocks, load and notes per batch size."""
    bench = result.get("benchmark") or {}
    benches = bench.get("sweep") or ([bench] if bench else [])
    return {
        "rules": [{"rule": a.get("rule"), "site": a.get("where") or f"{a.get('path') or a.get('file')}:{(a.get('lines') or ['?'])[0]}",
                   "kernel_calls": {k: v for k, v in (a.get("kernel_calls") or {}).items() if k != "calls"},
                   **({"not_applied": a["not_applied"]} if "not_applied" in a else {})}
                  for a in result.get("rules_applied") or []],
        "ablation": [{k: v for k, v in kernel.items()
                      if k in ("kernel", "speed", "speed_low", "speed_high", "memory", "effect", "why", "pays")}
                     for kernel in (result.get("ablation") or {}).get("kernels") or []],
        "not_fused_here": (result.get("ablation") or {}).get("not_fused_here"),
        "benchmarks": [{k: b.get(k) for k in ("batch_size", "blocks", "iterations", "speed_figure", "load", "verdict",
                                              "speed_ratio_wall", "speed_ratio_of_medians", "notes")}
                       for b in benches],
    }


def _ratio(value) -> str:
    value = _num(value)
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _finite(value):
    """``value`` with every NaN / infinity replaced by None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def markdown_table(entries: list[dict]) -> str:
    """The zoo table: one line per case and measured batch size (``entries``: the JSON's ``cases``)."""
    lines = [
        "| case | mode | batch | speed ratio [95% low-high] | memory ratio | equivalent | never slower | rules "
        "(not applied) | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        s = entry["summary"]
        notes = []
        if s.get("error"):
            notes.append(f"error: {s['error']}")
        if s.get("benchmark_skipped"):
            notes.append(f"benchmark skipped: {s['benchmark_skipped']}")
        if s.get("identical_to_original"):
            notes.append("no rule pays here: the optimized model is the original (the ratio measures noise)")
        for every in s.get("benchmark_with_every_rule") or []:
            notes.append(f"with every kernel (batch {every['batch']}): {_ratio(every['speed_ratio'])} "
                         f"[{_ratio(every['speed_ratio_low'])}-{_ratio(every['speed_ratio_high'])}]")
        for r in s["rows"]:
            if str(r.get("verdict", "")).startswith("inconclusive"):
                notes.append(f"batch {r['batch']}: {r['verdict']}")
        rules = str(s.get("rules_applied", 0))
        if s.get("rules_not_applied"):
            rules += f" ({', '.join(s['rules_not_applied'])})"
        equivalent = {True: "yes", False: "**no**", None: "n/a"}[s.get("equivalent")]
        note = "; ".join(notes).replace("|", "\\|")
        rows = s["rows"] or [None]
        for r in rows:
            if r is None:
                speed, memory = "n/a", "n/a"
                batch = entry.get("batch") or ""
                slower = ("yes (original model)" if s.get("never_slower") and s.get("equivalent")
                          else "n/a" if s.get("never_slower") is None else "**no**")
            else:
                speed = (f"{_ratio(r['speed_ratio'])} [{_ratio(r['speed_ratio_low'])}-"
                         f"{_ratio(r['speed_ratio_high'])}]")
                memory = _ratio(r["memory_ratio"])
                batch = r["batch"]
                slower = "yes" if r["never_slower"] else "**no**"
            lines.append(f"| {entry['case']} | {s.get('mode', '')} | {batch} | {speed} | {memory} | {equivalent} | "
                         f"{slower} | {rules} | {note} |")
    return "\n".join(lines) + "\n"


def render_markdown(doc: dict) -> str:
    passed = [e["case"] for e in doc["cases"] if e["summary"].get("passed")]
    failed = [e["case"] for e in doc["cases"] if not e["summary"].get("passed")]
    head = [
        "# Never slower: the zoo on CPU",
        "",
        f"`adopter verify` per case, one thread (`--threads 1`), torch {doc.get('torch', '?')}, "
        f"updated {doc.get('updated', '?')} (`python benchmarks/bench_zoo.py`; each case's command line and date "
        "are in the JSON next to this file).",
        "",
        "Speed ratio: optimized / original throughput, median of the paired CPU-time ratios with its bootstrap 95% "
        f"interval (> 1: faster). Memory ratio: optimized / original peak (< 1: less). Never slower: the interval's "
        f"low end >= {NEVER_SLOWER} at every batch size.",
        "",
        markdown_table(doc["cases"]),
        f"Passed: {len(passed)} of {len(doc['cases'])}" + (f"; failed: {', '.join(failed)}" if failed else "") + ".",
        "",
    ]
    return "\n".join(head)


def exit_status(entries: list[dict]) -> int:
    """1 when any entry failed "never slower" or equivalence, or has no result; else 0."""
    return 0 if all(e["summary"].get("passed") for e in entries) else 1


# ---------------------------------------------------------------- running


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def case_env(case: Case) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / p) for p in case.pythonpath] + [str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def command_line(case: Case, argv: list[str]) -> str:
    """The shell command a person types at the repository root to run the case again."""
    prefix = ""
    if case.pythonpath:
        prefix = "PYTHONPATH=" + os.pathsep.join(case.pythonpath) + " "
    return prefix + shlex.join(["python", "-m", "adopter", *argv])


def run_case(case: Case, args, tmp: Path) -> dict:
    json_path = tmp / f"{case.name}.json"
    bench_json = tmp / f"{case.name}.pytest-benchmark.json"
    model_args_path = None
    if case.model_args is not None:
        model_args_path = tmp / f"{case.name}.model-args.json"
        model_args_path.write_text(json.dumps(case.model_args, indent=1))
    argv = case.verify_argv(json_path=str(json_path), benchmark_json=str(bench_json),
                            model_args_path=str(model_args_path) if model_args_path else None,
                            ablation_seconds=args.ablation_seconds, blocks=args.blocks,
                            bench_seconds=args.bench_seconds)
    shown = case.verify_argv(json_path=f"{case.name}.json", benchmark_json=f"{case.name}.pytest-benchmark.json",
                             model_args_path=f"{case.name}.model-args.json" if model_args_path else None,
                             ablation_seconds=args.ablation_seconds, blocks=args.blocks,
                             bench_seconds=args.bench_seconds)
    print(f"[zoo] {case.name}: {command_line(case, shown)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    error = None
    returncode = None
    stderr = ""
    try:
        proc = subprocess.run([sys.executable, "-m", "adopter", *argv], cwd=ROOT, env=case_env(case),
                              capture_output=True, text=True, timeout=args.timeout, check=False)
        returncode, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        error = f"timed out after {args.timeout} s" + (f" ({last_line(err)})" if last_line(err) else "")
    except OSError as exc:
        error = f"could not start verify: {exc}"
    elapsed = time.perf_counter() - start
    result = None
    if error is None:
        try:
            result = json.loads(json_path.read_text())
        except (OSError, ValueError):
            error = f"exit {returncode}: " + (last_line(stderr) or "verify wrote no result")
    summary = summarize(result, mode=case.mode, batch=case.batch, error=error)
    entry = {
        "case": case.name,
        "what": case.what,
        "batch": case.batch,
        "command": command_line(case, shown),
        "model_args": case.model_args,
        "exit_code": returncode,
        "wall_s": round(elapsed, 1),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": ((result or {}).get("environment") or {}).get("torch") or torch_version(),
        "summary": summary,
    }
    if result is not None:
        entry["model"] = result.get("model")
        entry["phases_s"] = result.get("phases_s")
        entry["warnings"] = result.get("warnings")
        if result.get("note"):
            entry["note"] = result["note"]
        entry["diagnostics"] = diagnostics(result)
        if returncode not in (0, 1):
            entry["stderr_last_line"] = last_line(stderr)
    verdict = "pass" if summary["passed"] else "FAIL"
    ratios = ", ".join(f"b{r['batch']} {_ratio(r['speed_ratio'])} [{_ratio(r['speed_ratio_low'])}-"
                       f"{_ratio(r['speed_ratio_high'])}]" for r in summary["rows"]) or summary.get("error") or \
        summary.get("benchmark_skipped") or "not measured"
    print(f"[zoo] {case.name}: {verdict} in {elapsed:.0f} s: {ratios}", file=sys.stderr, flush=True)
    return entry


def measured_slower(entry: dict) -> bool:
    """The case ran and matched the original, but an interval's low end missed :data:`NEVER_SLOWER`
    (what a busy machine can cause; an error or a mismatch is not retried)."""
    summary = entry["summary"]
    return (not summary.get("passed") and not summary.get("error") and bool(summary.get("equivalent"))
            and any(not r["never_slower"] for r in summary.get("rows") or ()))


def run_with_retries(case: Case, args, tmp: Path) -> dict:
    entry = run_case(case, args, tmp)
    earlier = []
    while measured_slower(entry) and len(earlier) < max(0, args.retry):
        earlier.append({"date": entry["date"], "rows": entry["summary"]["rows"]})
        print(f"[zoo] {case.name}: measured slower, running it again ({len(earlier)} of {args.retry})",
              file=sys.stderr, flush=True)
        entry = run_case(case, args, tmp)
    if earlier:
        entry["earlier_attempts"] = earlier
    return entry


def torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001
        return "?"


def parse_cases(spec: str | None) -> list[Case]:
    """``--cases NAME,NAME`` (None or empty: every case); ValueError naming what is unknown."""
    if not spec:
        return list(CASES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES_BY_NAME]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES_BY_NAME)}")
    return [CASES_BY_NAME[n] for n in dict.fromkeys(names)]


def list_cases(args) -> str:
    out = []
    for case in CASES:
        argv = case.verify_argv(json_path=f"{case.name}.json", benchmark_json=f"{case.name}.pytest-benchmark.json",
                                model_args_path=f"{case.name}.model-args.json" if case.model_args is not None
                                else None, ablation_seconds=args.ablation_seconds, blocks=args.blocks,
                                bench_seconds=args.bench_seconds)
        out.append(f"{case.name}: {case.what}\n    {command_line(case, argv)}")
        if case.model_args is not None:
            out.append(f"    {case.name}.model-args.json: {json.dumps(case.model_args)}")
    return "\n".join(out) + "\n"


def merge_entries(previous: list[dict], fresh: list[dict]) -> list[dict]:
    """Entries of ``fresh`` replace those of ``previous`` with the same case; zoo order."""
    by_case = {e.get("case"): e for e in previous if isinstance(e, dict) and "summary" in e}
    by_case.update({e["case"]: e for e in fresh})
    order = {c.name: i for i, c in enumerate(CASES)}
    return sorted(by_case.values(), key=lambda e: order.get(e["case"], len(order)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", help="comma-separated case names (default: every case; --list names them)")
    ap.add_argument("--list", action="store_true", help="list the cases and the verify command of each, then exit")
    ap.add_argument("--ablation-seconds", type=float, default=DEFAULT_ABLATION_SECONDS,
                    help="verify's --ablation-seconds (default %(default)s)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="verify's --blocks (default: verify's, as many as fit its --bench-seconds)")
    ap.add_argument("--bench-seconds", type=float, default=None, help="verify's --bench-seconds (default: verify's)")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S,
                    help="seconds one case may run before it is stopped and reported (default %(default)s)")
    ap.add_argument("--retry", type=int, default=0,
                    help="run a case that measured slower (equivalent, but its interval's low end below "
                         f"{NEVER_SLOWER}) again, up to this many times; the last run counts and the entry records "
                         "the earlier ones (make gate: 1, as verify's own gate retries once on a busy machine)")
    ap.add_argument("--keep", metavar="DIR",
                    help="write each case's verify outputs (--json, --benchmark-json, --model-args) into DIR and keep "
                         "them (default: a temporary directory, removed)")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="results JSON; the markdown table goes next to it, .md (default %(default)s)")
    args = ap.parse_args(argv)
    if args.blocks is not None and args.blocks < 1:
        ap.error("--blocks must be at least 1")
    try:
        cases = parse_cases(args.cases)
    except ValueError as exc:
        ap.error(str(exc))
    if args.list:
        sys.stdout.write(list_cases(args))
        return 0

    out = Path(args.out)
    md = out.with_suffix(".md")
    entries = []
    if args.keep:
        keep = Path(args.keep)
        keep.mkdir(parents=True, exist_ok=True)
        for case in cases:
            entries.append(run_with_retries(case, args, keep))
    else:
        with tempfile.TemporaryDirectory(prefix="adopter-zoo-") as tmp:
            for case in cases:
                entries.append(run_with_retries(case, args, Path(tmp)))
    previous = []
    if args.cases and out.exists():
        try:
            previous = json.loads(out.read_text()).get("cases") or []
        except (OSError, ValueError, AttributeError):
            previous = []
    doc = {
        "format": FORMAT,
        "what": "adopter verify per zoo case, CPU, one thread: optimized/original speed ratio with its 95% interval, "
                f"memory ratio, equivalence; never slower = speed ratio low >= {NEVER_SLOWER} at every batch size",
        "never_slower_threshold": NEVER_SLOWER,
        "torch": torch_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "cases": merge_entries(previous, entries),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    md.write_text(render_markdown(doc))
    print(f"[zoo] wrote {out} and {md}", file=sys.stderr)
    sys.stdout.write(markdown_table(entries))
    return exit_status(entries)


if __name__ == "__main__":
    sys.exit(main())
