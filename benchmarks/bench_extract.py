"""Extraction benchmark: ``adopter.core.extract.extract_source`` over every installed
transformers ``models/*/modeling_*.py`` (static only: nothing imported or executed).

Writes to ``benchmarks/results/extract_transformers.json``: total and per-file time
(wall and CPU — the CPU figure is what counts on a shared machine), the part spent in
``ast.parse``, the slowest files, path/node counts and the entries whose path count hit
the cap::

    python benchmarks/bench_extract.py [--out benchmarks/results/extract_transformers.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import sys
import time
from pathlib import Path

TARGET_MS_PER_FILE = 50.0


def modeling_files() -> list[Path]:
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("transformers is not installed")
    return sorted((Path(next(iter(spec.submodule_search_locations))) / "models").glob("*/modeling_*.py"))


def run() -> dict:
    from adopter.core.extract import MAX_PATHS, extract_source

    files = [(f, f.read_text(encoding="utf-8")) for f in modeling_files()]
    cpu0 = time.process_time()
    for _f, text in files:
        ast.parse(text)
    parse_cpu = time.process_time() - cpu0

    per_file = []
    errors = []
    n_entries = n_paths = n_nodes = 0
    capped = []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for f, text in files:
        w, c = time.perf_counter(), time.process_time()
        try:
            fs = extract_source(text, str(f))
        except Exception as exc:  # recorded, never fatal
            errors.append(f"{f.parent.name}/{f.name}: {type(exc).__name__}: {exc}")
            continue
        per_file.append((time.process_time() - c, time.perf_counter() - w, f"{f.parent.name}/{f.name}"))
        for fn in fs.functions:
            n_entries += 1
            n_paths += len(fn.paths)
            n_nodes += sum(len(p.nodes) for p in fn.paths)
            if fn.capped:
                capped.append(f"{f.parent.name}/{f.name}::{fn.class_name + '.' if fn.class_name else ''}{fn.function}")
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    per_file.sort(reverse=True)
    cpu_ms = sorted(p[0] * 1000 for p in per_file)
    return {
        "files": len(files),
        "errors": errors,
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "cpu_seconds_in_ast_parse": round(parse_cpu, 2),
        "cpu_ms_per_file_mean": round(cpu * 1000 / max(1, len(files)), 1),
        "cpu_ms_per_file_median": round(cpu_ms[len(cpu_ms) // 2], 1) if cpu_ms else None,
        "cpu_ms_per_file_p95": round(cpu_ms[int(len(cpu_ms) * 0.95)], 1) if cpu_ms else None,
        "target_ms_per_file": TARGET_MS_PER_FILE,
        "slowest_files_cpu_s": [(round(c, 3), name) for c, _w, name in per_file[:10]],
        "entries": n_entries,
        "paths": n_paths,
        "nodes": n_nodes,
        "max_paths_per_entry": MAX_PATHS,
        "capped_entries": len(capped),
        "capped": capped,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "extract_transformers.json"))
    args = ap.parse_args(argv)
    result = run()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("files", "cpu_seconds", "cpu_seconds_in_ast_parse", "cpu_ms_per_file_mean",
                                      "cpu_ms_per_file_median", "paths", "capped_entries", "wall_seconds")}
    print(json.dumps(summary))
    print(f"errors: {len(result['errors'])}; written to {args.out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
