"""Scan benchmark: all nine rules over the installed transformers ``models/`` (every
``modeling_*.py``), static only (nothing imported or executed).

Writes counts per rule, files/second, wall time and the split between extraction and
matching to ``benchmarks/results/scan_transformers.json``:

    python benchmarks/bench_scan.py [--out benchmarks/results/scan_transformers.json]

pytest-benchmark variant (one representative file, cheap):

    pytest benchmarks/bench_scan.py --benchmark-max-time 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

TARGET_SECONDS = 60.0


def transformers_models_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # locate only: transformers is not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def modeling_files() -> list[Path]:
    return sorted(transformers_models_dir().glob("*/modeling_*.py"))


def run_benchmark() -> dict:
    from adopter.core.extract import extract_source
    from adopter.core.match import match_structures
    from adopter.core.rules import all_rules
    from adopter.core.scan import ScanError, ScanReport

    rules = all_rules()
    files = modeling_files()
    report = ScanReport(files_scanned=0, seconds=0.0)
    extract_s = match_s = 0.0
    slowest: list[tuple[float, str]] = []
    per_file: dict[str, dict[str, int]] = {}
    start = time.perf_counter()
    for f in files:
        t0 = time.perf_counter()
        try:
            text = f.read_text(encoding="utf-8")
            structures = extract_source(text, str(f))
        except Exception as exc:  # recorded, never fatal
            report.errors.append(ScanError(str(f), f"{type(exc).__name__}: {exc}"))
            report.files_scanned += 1
            continue
        t1 = time.perf_counter()
        try:
            matches = match_structures(structures, rules, source=text)
        except Exception as exc:
            report.errors.append(ScanError(str(f), f"matching: {type(exc).__name__}: {exc}"))
            matches = []
        t2 = time.perf_counter()
        extract_s += t1 - t0
        match_s += t2 - t1
        slowest.append((t2 - t0, f.parent.name + "/" + f.name))
        report.matches.extend(matches)
        report.files_scanned += 1
        for m in matches:
            per_file.setdefault(f.parent.name, {}).setdefault(m.rule, 0)
            per_file[f.parent.name][m.rule] += 1
    wall = time.perf_counter() - start
    counts = {r.name: 0 for r in rules}
    counts.update(report.counts())
    slowest.sort(reverse=True)
    return {
        "what": "adopter scan, 9 rules, transformers models/*/modeling_*.py",
        "transformers_dir": str(transformers_models_dir()),
        "files": len(files),
        "files_scanned": report.files_scanned,
        "errors": [e.to_json() for e in report.errors],
        "matches_total": len(report.matches),
        "counts_per_rule": counts,
        "wall_seconds": round(wall, 2),
        "extract_seconds": round(extract_s, 2),
        "match_seconds": round(match_s, 2),
        "files_per_second": round(len(files) / wall, 2) if wall else None,
        "target_seconds": TARGET_SECONDS,
        "within_target": wall <= TARGET_SECONDS,
        "slowest_files": [{"file": n, "seconds": round(s, 3)} for s, n in slowest[:10]],
        "per_model": per_file,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "scan_transformers.json"))
    args = ap.parse_args(argv)
    result = run_benchmark()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("files", "wall_seconds", "extract_seconds", "match_seconds",
                                      "files_per_second", "within_target", "counts_per_rule")}
    summary["errors"] = len(result["errors"])
    print(json.dumps(summary, indent=2))
    return 0


# ---------------------------------------------------------------- pytest-benchmark variant


def test_scan_bert_file(benchmark):
    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_paths

    path = transformers_models_dir() / "bert" / "modeling_bert.py"
    rules = all_rules()
    report = benchmark(scan_paths, [path], rules)
    assert report.errors == [] and report.matches


if __name__ == "__main__":
    sys.exit(main())
