"""Measure runtime confirmation (issue 5) and write ``benchmarks/results/trace.json``.

    python benchmarks/bench_trace.py              # bert-base (cpu), Llama-2-7B (meta), capture method per model
    python benchmarks/bench_trace.py bert llama   # some cases

Cases (each in a fresh subprocess, so peak RSS is the case's own):

* ``bert``:  bert-base-uncased at full size on CPU — capture + confirmation of the matches the
  scanner finds in its source must take <= 10 s.
* ``llama``: meta-llama/Llama-2-7b-hf config (32 layers, hidden 4096) built on ``meta`` — build,
  scan, capture and confirmation <= 60 s and peak RSS < 4 GiB.
* ``methods``: which capture method works for every known model id (small configs, CPU).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "trace.json")

LIMITS = {"bert": {"capture_confirm_s": 10.0}, "llama": {"total_s": 60.0, "peak_rss_mib": 4096.0}}

# Small configs for the capture-method survey (the structure, not the size, decides the method).
SMALL = {
    "tiny-bert": {},
    "bert-base-uncased": {"num_hidden_layers": 1},
    "roberta-base": {"num_hidden_layers": 1},
    "distilbert-base-uncased": {"n_layers": 1},
    "gpt2": {"n_layer": 1},
    "t5-small": {"num_layers": 1, "num_decoder_layers": 1},
    "facebook/bart-base": {"encoder_layers": 1, "decoder_layers": 1},
    "google/vit-base-patch16-224": {"num_hidden_layers": 1, "image_size": 64},
    "microsoft/resnet-50": {"depths": [1, 1, 1, 1], "image_size": 64},
    "Intel/dpt-large": {"num_hidden_layers": 4, "backbone_out_indices": [0, 1, 2, 3], "image_size": 96},
    "meta-llama/Llama-2-7b-hf": {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512,
                                 "num_attention_heads": 4, "num_key_value_heads": 4},
}


def _peak_rss_mib() -> float:
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _statuses(matches) -> dict:
    out: dict[str, int] = {}
    for m in matches:
        out[m.status] = out.get(m.status, 0) + 1
    return out


def trace_case(model_id: str, device: str, **build_kwargs) -> dict:
    start = time.perf_counter()
    from adopter.tracing import build_model, capture_model, confirm_matches

    from adopter.core.scan import scan_paths

    t_import = time.perf_counter() - start
    t0 = time.perf_counter()
    built = build_model(model_id, device=device, **build_kwargs)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = scan_paths(built.source_files)
    t_scan = time.perf_counter() - t0
    t0 = time.perf_counter()
    capture = capture_model(built.model, built.example_inputs)
    t_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    confirmed = confirm_matches(built.model, built.example_inputs, report.matches, capture=capture)
    t_confirm = time.perf_counter() - t0
    return {
        "model": model_id,
        "device": device,
        "class": type(built.model).__name__,
        "parameters": sum(p.numel() for p in built.model.parameters()),
        "capture_method": capture.method,
        "capture_failed": capture.errors,
        "graph_nodes": len(capture.graph_module.graph.nodes),
        "import_s": round(t_import, 3),
        "build_s": round(t_build, 3),
        "scan_s": round(t_scan, 3),
        "capture_s": round(t_capture, 3),
        "confirm_s": round(t_confirm, 3),
        "capture_confirm_s": round(t_capture + t_confirm, 3),
        "total_s": round(time.perf_counter() - start, 3),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "statuses": _statuses(confirmed),
        "matches": [
            {"rule": m.rule, "class": m.class_name, "function": m.function, "lines": m.lines, "status": m.status}
            for m in confirmed
        ],
    }


def methods_case() -> dict:
    from adopter.tracing import build_model, capture_model

    rows = {}
    for model_id, overrides in SMALL.items():
        t0 = time.perf_counter()
        try:
            built = build_model(model_id, device="cpu", config_overrides=overrides or None)
            cap = capture_model(built.model, built.example_inputs)
            rows[model_id] = {"method": cap.method, "failed": cap.errors, "seconds": round(time.perf_counter() - t0, 2)}
        except Exception as exc:  # recorded, not fatal: the survey shows what does not capture
            rows[model_id] = {"method": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return rows


def run_case(name: str) -> dict:
    if name == "bert":
        return trace_case("bert-base-uncased", "cpu")
    if name == "llama":
        return trace_case("meta-llama/Llama-2-7b-hf", "meta")
    if name == "methods":
        return methods_case()
    raise SystemExit(f"unknown case {name!r}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--case"]:
        print(json.dumps(run_case(argv[1])))
        return 0
    cases = [a for a in argv if not a.startswith("-")] or ["bert", "llama", "methods"]
    results = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            results = json.load(f)
    ok = True
    for name in cases:
        proc = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        checks = {}
        for key, limit in LIMITS.get(name, {}).items():
            checks[key] = {"value": row[key], "limit": limit, "ok": row[key] <= limit}
            ok &= row[key] <= limit
        if checks:
            row["limits"] = checks
        results[name] = row
        summary = {k: row.get(k) for k in ("capture_method", "build_s", "capture_confirm_s", "total_s", "peak_rss_mib")}
        print(name, json.dumps(summary if name != "methods" else {m: r.get("method") for m, r in row.items()}))
    results["environment"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": __import__("torch").__version__,
        "transformers": __import__("transformers").__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {RESULTS}" + ("" if ok else " (LIMIT EXCEEDED)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
