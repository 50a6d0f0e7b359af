"""Equivalence sweep: does every rewrite ``optimize`` applies keep real transformers models equivalent?

    nice python benchmarks/bench_equivalence_sweep.py [--timeout 60] [--only BertModel,GPT2Model]

For each model class below, runs ``adopter.optimize(cls)`` in its own subprocess (time-boxed:
a model over ``--timeout`` seconds is recorded as skipped) on a small config
(``adopter.optimizing.optimize.shrink_config`` of the class's default config; models with an attention
implementation switch run twice, default attention and ``_attn_implementation = "eager"``). Records per model: rules applied,
rules dropped as not equivalent (with the max |diff|), matches the rewrite or the trace skipped
(with reasons), and errors. Every drop or crash is a codemod/kernel bug a user would otherwise
hit. Writes ``benchmarks/results/equivalence_sweep.json`` and ``equivalence_sweep.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

# (class name, has an attention implementation switch?) — text encoders, decoders,
# encoder-decoders, vision, conv nets. Models with the switch run twice: default and eager.
MODELS: list[tuple[str, bool]] = [
    ("BertModel", True), ("RobertaModel", True), ("DistilBertModel", True), ("AlbertModel", True),
    ("ElectraModel", True), ("DebertaV2Model", True), ("XLMRobertaModel", True), ("GPT2Model", True),
    ("GPTNeoModel", True), ("OPTModel", True), ("BloomModel", True), ("T5Model", True),
    ("BartModel", True), ("ViTModel", True), ("DeiTModel", True), ("SwinModel", True),
    ("ConvNextModel", False), ("ResNetModel", False), ("RegNetModel", False),
    ("MobileNetV2Model", False), ("EfficientNetModel", False), ("DPTModel", True),
    ("LevitModel", False), ("SegformerModel", False), ("CLIPTextModel", True),
    ("LlamaModel", True), ("WhisperModel", True), ("MPNetModel", False), ("SqueezeBertModel", False),
    ("MistralModel", True), ("Qwen2Model", True), ("MBartModel", True), ("Wav2Vec2Model", True),
    ("BeitModel", False), ("MobileViTModel", False),
]  # fmt: skip


def run_one(name: str, eager: bool) -> dict:
    """optimize() one class; the record printed as JSON by the child process."""
    import warnings

    import transformers

    from adopter import optimize
    from adopter.optimizing.optimize import shrink_config

    cls = getattr(transformers, name)
    config = shrink_config(cls.config_class())
    if eager:
        config._attn_implementation = "eager"
    record: dict = {"model": name, "eager": eager}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new_cls = optimize(cls, config=config)
    except Exception as exc:  # noqa: BLE001 - recorded, it is what the sweep looks for
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        record["seconds"] = round(time.perf_counter() - start, 1)
        return record
    report = new_cls.adopter_report
    record["seconds"] = round(time.perf_counter() - start, 1)
    record["traced"] = report.traced
    record["applied"] = sorted({a.rule for a in report.applied})
    record["applied_sites"] = [a.where + " " + a.rule for a in report.applied]
    record["dropped"] = [
        {"rule": s.rule, "where": s.where, "reason": s.reason, "max_abs_diff": s.max_abs_diff}
        for s in report.skipped
        if s.reason.startswith(("not equivalent", "rewritten source fails", "rewritten class cannot"))
    ]
    record["skipped"] = [
        {"rule": s.rule, "where": s.where, "reason": s.reason}
        for s in report.skipped
        if not s.reason.startswith(("not equivalent", "rewritten source fails", "rewritten class cannot"))
    ]
    record["warnings"] = list(report.warnings)
    if report.equivalence is not None:
        record["final_max_abs_diff"] = report.equivalence.max_abs_diff
    # the second check: every config value a rewritten site reads, flipped (adopter.optimizing.config_flip)
    record["flips"] = [str(f) for f in report.flipped]
    record["flipped_note"] = report.flipped_note
    if report.flipped_equivalence is not None:
        record["flipped_equivalent"] = report.flipped_equivalence.equivalent
        record["flipped_max_abs_diff"] = report.flipped_equivalence.max_abs_diff
    calls: dict = {}  # check -> {"fused": n, "fallback": n}, over every applied site
    for a in report.applied:
        for check, counts in a.kernel_calls.items():
            tally = calls.setdefault(check, {"fused": 0, "fallback": 0})
            for backend, n in counts.items():
                tally["fallback" if backend == "original" else "fused"] += n
    record["kernel_calls"] = calls
    return record


def markdown(records: list[dict]) -> str:
    lines = [
        "# Equivalence sweep (`optimize` on small configs)",
        "",
        "Kernel calls are counted over both checks' forward passes (eval and train) at the applied sites:",
        "fused = the guarded kernel's preconditions held, fallback = it ran the original code.",
        "",
        "| model | s | applied | dropped (not equivalent / fails to load) | skipped | flipped config | "
        "flipped equivalent | calls analysed (fused/fallback) | calls flipped (fused/fallback) | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        dropped = "; ".join(f"{d['rule']} {d['where']} ({d['reason'][:80]})" for d in r.get("dropped", []))
        lines.append(
            f"| {r['model']}{' (eager)' if r.get('eager') else ''} | {r.get('seconds', '-')} "
            f"| {', '.join(r.get('applied', [])) or '-'} | {dropped or '-'} "
            f"| {len(r.get('skipped', []))} | {', '.join(r.get('flips', [])) or r.get('flipped_note') or '-'} "
            f"| {_yes_no(r.get('flipped_equivalent'))} | {_calls(r, 'analysed')} | {_calls(r, 'flipped')} "
            f"| {r.get('error', '') or '-'} |"
        )
    totals = {"analysed": [0, 0], "flipped": [0, 0]}
    for r in records:
        for check, t in r.get("kernel_calls", {}).items():
            totals[check][0] += t["fused"]
            totals[check][1] += t["fallback"]
    flipped = [r for r in records if "flipped_equivalent" in r]
    lines += [
        "",
        f"Runs: {len(records)}; with a flipped-config check: {len(flipped)}; not equivalent under the flipped "
        f"config: {sum(1 for r in flipped if not r['flipped_equivalent'])}; dropped as not equivalent: "
        f"{sum(len(r.get('dropped', [])) for r in records)}; errors: {sum(1 for r in records if r.get('error'))}.",
        f"Kernel calls, analysed config: fused {totals['analysed'][0]}, fallback {totals['analysed'][1]}; "
        f"flipped config: fused {totals['flipped'][0]}, fallback {totals['flipped'][1]}.",
    ]
    return "\n".join(lines) + "\n"


def _yes_no(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _calls(record: dict, check: str) -> str:
    t = record.get("kernel_calls", {}).get(check)
    return f"{t['fused']}/{t['fallback']}" if t else "-"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--only", default="", help="comma-separated class names")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(RESULTS / "equivalence_sweep.json"))
    parser.add_argument("--retry-timeouts", action="store_true",
                        help="re-run only the runs of --out that timed out, and update --out")
    args = parser.parse_args()
    if args.one:
        print("@@RECORD@@" + json.dumps(run_one(args.one, args.eager)))
        return 0
    only = {n for n in args.only.split(",") if n}
    records = []
    runs = [(name, eager) for name, switch in MODELS for eager in ((False, True) if switch else (False,))]
    previous = {}
    if args.retry_timeouts:
        previous = {(r["model"], r["eager"]): r for r in json.loads(Path(args.out).read_text())["models"]}
    for name, eager in runs:
        if only and name not in only:
            continue
        old = previous.get((name, eager))
        if old is not None and not old.get("error", "").startswith("skipped: over"):
            records.append(old)
            continue
        cmd = [sys.executable, __file__, "--one", name] + (["--eager"] if eager else [])
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            record = {"model": name, "eager": eager, "error": f"skipped: over {args.timeout:.0f} s"}
        else:
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@RECORD@@")), None)
            if line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                record = {"model": name, "eager": eager, "error": f"crashed (rc {proc.returncode}): {tail[0][:300]}"}
            else:
                record = json.loads(line[len("@@RECORD@@"):])
        record.setdefault("seconds", round(time.perf_counter() - start, 1))
        records.append(record)
        print(f"{name}{' (eager)' if eager else ''}: applied={record.get('applied')} dropped={len(record.get('dropped', []))} "
              f"error={record.get('error', '')}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"models": records}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(records))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
