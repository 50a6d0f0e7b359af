"""Scan benchmark: ``adopter scan`` (all built-in rules, static only) over every installed
transformers ``models/*/modeling_*.py``, timed as a user runs it: wall time of the CLI
(parallel by default), start-up included.

    python benchmarks/bench_scan.py [--jobs N] [--reference SCAN.json] [--baseline-cmd CMD] [--rounds N]
                                    [--out benchmarks/results/scan_transformers.json]

``--reference``: a saved ``adopter scan ... --format json`` (e.g. of the whole ``models/``
dir by an older version); its matches and errors for the benchmarked files are compared
with this run's. ``--baseline-cmd``: another ``adopter`` executable (e.g. an older
version's venv) run on the same files right before this one, for a back-to-back timing
and, without ``--reference``, as the reference. ``--rounds``: that many rounds of (parse, baseline,
parse, this code, parse), the median round reported, each round's figures kept. Writes wall time, CPU time of the scan
processes, counts per rule, and the comparison.

pytest-benchmark variant (one representative file, cheap):

    pytest benchmarks/bench_scan.py --benchmark-max-time 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

TARGET_SECONDS = 15.0  # 2 cores
# issue 34: the scan's CPU time (all its processes) at most this many times the CPU time of
# ast.parse over the same files
TARGET_OVER_PARSE = 10.0


def transformers_models_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # locate only: transformers is not imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def modeling_files() -> list[Path]:
    return sorted(transformers_models_dir().glob("*/modeling_*.py"))


def parse_seconds(files: list[Path]) -> float:
    """CPU seconds of reading and ``ast.parse``-ing ``files`` once each, in this process."""
    import ast

    start = time.process_time()
    for f in files:
        ast.parse(f.read_bytes(), filename=str(f))
    return time.process_time() - start


_PARSE_SHARE = "import ast, sys\nfor f in sys.argv[1:]:\n    ast.parse(open(f, 'rb').read(), filename=f)\n"


def parse_seconds_like_the_scan(files: list[Path], jobs: int) -> float:
    """CPU seconds of ``ast.parse`` over ``files`` run the way the scan runs: ``jobs`` processes at
    once, each parsing its share (start-up excluded: an empty run of the same processes is taken off).
    Two processes on two cores that share a core's caches (or are hyperthreads of one) each run
    slower than one process alone, so a one-process yardstick would charge the scan for that."""
    def run(shares: list[list[str]]) -> float:
        cpu0 = _children_cpu()
        procs = [subprocess.Popen([sys.executable, "-c", _PARSE_SHARE, *share]) for share in shares]
        for proc in procs:
            proc.wait()
        return _children_cpu() - cpu0

    names = [str(f) for f in files]
    return max(run([names[i::jobs] for i in range(jobs)]) - run([[] for _ in range(jobs)]), 1e-9)


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_scan(cmd: list[str], files: list[Path], extra: list[str]) -> dict:
    """One ``adopter scan`` run: its JSON report plus wall and CPU seconds."""
    full = [*cmd, "scan", *map(str, files), "--format", "json", *extra]
    cpu0, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu0
    if not proc.stdout.strip():
        raise SystemExit(f"{shlex.join(full[:2])} ... failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"report": json.loads(proc.stdout), "wall": wall, "cpu": cpu, "returncode": proc.returncode}


def _key(m: dict) -> tuple:
    return (m["file"], m["rule"], m["class"], m["function"], tuple(m["lines"]), m["status"])


def _sortable(key: tuple) -> tuple:
    return tuple("" if part is None else part for part in key)


def compare(report: dict, reference: dict, files: list[Path]) -> dict:
    """Matches and errors of ``report`` vs ``reference`` restricted to ``files`` (in order)."""
    wanted = {str(f) for f in files}
    ref_matches = [m for m in reference["matches"] if m["file"] in wanted]
    ref_errors = [e for e in reference["errors"] if e["file"] in wanted]
    got, ref = [_key(m) for m in report["matches"]], [_key(m) for m in ref_matches]
    # (a match outside a class has class None: sorted with "" there, beside the named ones)
    missing = sorted(set(ref) - set(got), key=_sortable)
    extra = sorted(set(got) - set(ref), key=_sortable)
    return {
        "reference_matches": len(ref),
        "matches": len(got),
        "identical_matches": got == ref,
        "same_match_set": not missing and not extra,
        "missing": [list(k) for k in missing[:50]],
        "extra": [list(k) for k in extra[:50]],
        "identical_errors": report["errors"] == ref_errors,
    }


def run_benchmark(jobs: int, reference_path: str | None, baseline_cmd: str | None, rounds: int = 3) -> dict:
    files = modeling_files()
    result: dict = {
        "what": "adopter scan --format json, all built-in rules, transformers models/*/modeling_*.py (wall time "
                "of the CLI process, start-up included)",
        "transformers_dir": str(transformers_models_dir()),
        "files": len(files),
        "jobs": jobs or os.cpu_count(),
        "target_seconds": TARGET_SECONDS,
        "rounds": rounds,
    }
    reference = json.loads(Path(reference_path).read_text()) if reference_path else None
    jobs_used = min(jobs or os.cpu_count() or 1, len(files))
    # the yardstick of issue 34: Python's own parser over the same files, run as the scan runs (the same
    # number of processes), right before and right after each scan; a scan's CPU over the mean of the
    # two. The machine is shared: each round runs the baseline and this code side by side, and the
    # median round is reported
    per_round: list[dict] = []
    base = new = None
    for _ in range(max(1, rounds)):
        row: dict = {}
        parse_0 = parse_seconds_like_the_scan(files, jobs_used)
        if baseline_cmd:
            base = run_scan(shlex.split(baseline_cmd), files, ["--no-progress", "--jobs", str(jobs)])
            parse_1 = parse_seconds_like_the_scan(files, jobs_used)
            row["baseline"] = {"cpu_seconds": round(base["cpu"], 2), "wall_seconds": round(base["wall"], 2),
                               "parse_cpu_seconds": round((parse_0 + parse_1) / 2, 3),
                               "cpu_over_parse": round(base["cpu"] / max((parse_0 + parse_1) / 2, 1e-9), 2)}
            parse_0 = parse_1
        new = run_scan([sys.executable, "-m", "adopter"], files, ["--no-progress", "--jobs", str(jobs)])
        parse_2 = parse_seconds_like_the_scan(files, jobs_used)
        row.update({"cpu_seconds": round(new["cpu"], 2), "wall_seconds": round(new["wall"], 2),
                    "parse_cpu_seconds": round((parse_0 + parse_2) / 2, 3),
                    "cpu_over_parse": round(new["cpu"] / max((parse_0 + parse_2) / 2, 1e-9), 2)})
        per_round.append(row)
    assert new is not None
    report = new["report"]
    counts: dict[str, int] = {}
    for m in report["matches"]:
        counts[m["rule"]] = counts.get(m["rule"], 0) + 1

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                     + ordered[len(ordered) // 2]) / 2

    result.update({
        "wall_seconds": round(median([r["wall_seconds"] for r in per_round]), 2),
        "cpu_seconds": round(median([r["cpu_seconds"] for r in per_round]), 2),
        "scan_seconds_reported": report["seconds"],
        "within_target": median([r["wall_seconds"] for r in per_round]) <= TARGET_SECONDS,
        "files_scanned": report["files_scanned"],
        "errors": report["errors"],
        "matches_total": len(report["matches"]),
        "counts_per_rule": dict(sorted(counts.items())),
        "parse_cpu_seconds": round(median([r["parse_cpu_seconds"] for r in per_round]), 3),
        "parse_cpu_one_process": round(parse_seconds(files), 3),
        "scan_cpu_over_parse": round(median([r["cpu_over_parse"] for r in per_round]), 1),
        "target_over_parse": TARGET_OVER_PARSE,
        "per_round": per_round,
    })
    if baseline_cmd and base is not None:
        result["baseline"] = {
            "cmd": baseline_cmd,
            "wall_seconds": round(median([r["baseline"]["wall_seconds"] for r in per_round]), 2),
            "cpu_seconds": round(median([r["baseline"]["cpu_seconds"] for r in per_round]), 2),
            "matches": len(base["report"]["matches"]),
            "cpu_over_parse": round(median([r["baseline"]["cpu_over_parse"] for r in per_round]), 1),
        }
        result["speedup_vs_baseline"] = round(result["baseline"]["wall_seconds"] / max(result["wall_seconds"], 1e-9), 2)
        result["cpu_ratio_to_baseline"] = round(median([r["cpu_seconds"] / r["baseline"]["cpu_seconds"]
                                                        for r in per_round]), 3)
        if reference is None:
            reference, reference_path = base["report"], f"baseline run ({baseline_cmd})"
    if reference is not None:
        result["comparison"] = {"reference": reference_path, **compare(report, reference, files)}
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "platform": platform.platform(), "load_average_after": os.getloadavg()}
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", "-j", type=int, default=0, help="adopter scan --jobs (default 0: one per CPU)")
    ap.add_argument("--reference", metavar="SCAN.json", help="saved adopter scan --format json to compare with")
    ap.add_argument("--baseline-cmd", metavar="CMD", help="another adopter executable to time first (e.g. an "
                                                          "older version's venv/bin/adopter)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "scan_transformers.json"))
    ap.add_argument("--rounds", type=int, default=3, help="side-by-side rounds; the median is reported (default 3)")
    args = ap.parse_args(argv)
    result = run_benchmark(args.jobs, args.reference, args.baseline_cmd, args.rounds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("files", "jobs", "wall_seconds", "cpu_seconds", "within_target",
                                      "parse_cpu_seconds", "scan_cpu_over_parse", "matches_total", "cpu_ratio_to_baseline")
               if k in result}
    summary["errors"] = len(result["errors"])
    for k in ("baseline", "speedup_vs_baseline", "comparison"):
        if k in result:
            summary[k] = {kk: v for kk, v in result[k].items() if kk not in ("missing", "extra")} \
                if isinstance(result[k], dict) else result[k]
    print(json.dumps(summary, indent=2))
    comparison = result.get("comparison")
    return 0 if comparison is None or (comparison["identical_matches"] and comparison["identical_errors"]) else 1


# ---------------------------------------------------------------- pytest-benchmark variant


def test_scan_bert_file(benchmark):
    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_paths

    path = transformers_models_dir() / "bert" / "modeling_bert.py"
    rules = all_rules()
    report = benchmark(scan_paths, [path], rules, jobs=1)
    assert report.errors == [] and report.matches


if __name__ == "__main__":
    sys.exit(main())
