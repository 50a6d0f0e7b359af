"""Rewrite every installed transformers ``modeling_*.py`` (copied to a temp dir) and check it.

    python benchmarks/bench_rewrite.py [--jobs N] [--limit N]

Runs ``adopter rewrite --write --format json`` over the copies, then: every rewritten
file must compile, a second run must report zero changes, and every file without an
applied rewrite must be byte-identical to the original. Writes
``benchmarks/results/rewrite_transformers.json`` (rewrites per rule, wall time, skipped
files and skipped matches with reasons).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "rewrite_transformers.json"


def run_cli(paths: list[str], jobs: int, write: bool) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "adopter", "rewrite", *paths, "--format", "json", "--jobs", str(jobs)]
    cmd.append("--write" if write else "--check")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1, 2):
        raise SystemExit(f"adopter rewrite crashed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), wall


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--limit", type=int, default=0, help="only the first N files (smoke runs)")
    args = parser.parse_args()
    import transformers

    models = Path(transformers.__file__).parent / "models"
    originals = sorted(models.glob("*/modeling_*.py"))
    if args.limit:
        originals = originals[: args.limit]
    with tempfile.TemporaryDirectory(prefix="adopter-bench-rewrite-") as tmp:
        copies = []
        for src in originals:
            dst = Path(tmp) / src.parent.name / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            copies.append(dst)
        first, wall = run_cli([tmp], args.jobs, write=True)
        by_file = {f["file"]: f for f in first["files"]}
        rewrites = collections.Counter()
        skipped_matches = collections.Counter()
        skipped_files = []
        not_compiling = []
        changed_without_rewrite = []
        for src, dst in zip(originals, copies):
            entry = by_file.get(str(dst), {"status": "missing", "applied": [], "skipped": []})
            for a in entry["applied"]:
                rewrites[a["rule"]] += 1
            for s in entry["skipped"]:
                skipped_matches[(s["rule"], s["reason"].split(" (line")[0][:120])] += 1
            if entry["status"] in ("skipped", "failed", "missing"):
                skipped_files.append({"file": f"{src.parent.name}/{src.name}", "status": entry["status"],
                                      "reason": entry.get("reason", "")})
            new_bytes, old_bytes = dst.read_bytes(), src.read_bytes()
            if entry["status"] == "changed":
                try:
                    compile(new_bytes, str(dst), "exec", dont_inherit=True)
                except SyntaxError as exc:
                    not_compiling.append(f"{dst}: {exc}")
            elif new_bytes != old_bytes:
                changed_without_rewrite.append(str(dst))
        second, wall2 = run_cli([tmp], args.jobs, write=False)
        second_changes = [f["file"] for f in second["files"] if f["status"] == "changed"]
    result = {
        "transformers": transformers.__version__,
        "files": len(originals),
        "jobs": args.jobs,
        "wall_seconds_write_run": round(wall, 2),
        "wall_seconds_second_run": round(wall2, 2),
        "summary": first["summary"],
        "rewrites_per_rule": dict(sorted(rewrites.items())),
        "files_changed": sum(1 for f in first["files"] if f["status"] == "changed"),
        "rewritten_files_not_compiling": not_compiling,
        "second_run_changes": second_changes,
        "files_changed_without_rewrite": changed_without_rewrite,
        "skipped_files": skipped_files,
        "skipped_files_count": len(skipped_files),
        "skipped_matches_by_reason": [
            {"rule": rule, "reason": reason, "count": n}
            for (rule, reason), n in sorted(skipped_matches.items(), key=lambda kv: -kv[1])
        ],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    ok = not not_compiling and not second_changes and not changed_without_rewrite
    print(json.dumps({k: result[k] for k in ("files", "wall_seconds_write_run", "rewrites_per_rule",
                                             "files_changed", "skipped_files_count")}, indent=2))
    print("OK" if ok else "PROBLEMS: see " + str(RESULTS))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
