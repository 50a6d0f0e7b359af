"""Differential kernel fuzzing, long tier: many more seeds and mode combinations than the fast tier
(``tests/kernels/test_kernel_fuzz.py``), same tables and comparison (``tests/kernels/fuzz_cases.py``).

    OMP_NUM_THREADS=1 python benchmarks/fuzz_kernels.py --seeds 4 [--random 600] [--no-compile]
        [--rows conv_bn,qkv] [--out benchmarks/results/kernel_fuzz.json] [--time-budget 540]

For every kernel row x every mode of the fast tier's list, ``--seeds`` seeds (different axis draws
from the fast tier's); then ``--random`` cases with random rows, seeds and random modes (an exec
mode, an autograd mode and a sequence of up to three state changes); compile modes (a few per row)
unless ``--no-compile``. Writes counts per kernel x mode (cases, matches, mismatches, crashes the
original does not have, documented differences, skips with their reasons, cases where both sides
raise, calls that took the fused path) and every failing case with its choices and differences, so
each one reproduces from its id::

    cd tests && python -c "import fuzz_cases as f; print(f.run_case(*f.case_from_id('ID')).report())"

``--fast`` runs exactly the fast tier's cases and prints the ``KNOWN_BUGS`` entries for its failures.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fuzz_cases as fc  # noqa: E402
import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

COMPILE_MODES = [
    fc.Mode("compile_aot_eager", "no_grad"),
    fc.Mode("compile_aot_eager", "grad"),
    fc.Mode("compile_eager", "no_grad", ("requires_grad_off", "data_mul")),
    fc.Mode("compile_inductor", "no_grad"),
]


def lift_policies() -> None:
    """What tests/conftest.py does for the session: the measured backend policy (e.g. rotary takes
    the original ops on CPU) and the calibrated cost model (small calls take the original ops) are
    lifted so that the fused math is what is compared."""
    from adopter.kernels import cost, policy

    policy.BACKEND_POLICY.clear()
    cost.ENABLED = False


def plan(seeds: int, n_random: int, compile_ok: bool, rows: list[str], rng: random.Random) -> list[tuple]:
    cases = []
    for r, row in enumerate(rows):
        for m, mode in enumerate(fc.FAST_MODES):
            for k in range(seeds):
                cases.append((row, mode, 100_000 + 1000 * k + 17 * r + m))
        if compile_ok:
            for m, mode in enumerate(COMPILE_MODES):
                cases.append((row, mode, 200_000 + 17 * r + m))
    for i in range(n_random):
        cases.append((rng.choice(rows), fc.random_mode(rng, compile_ok), 300_000 + i))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds per kernel row x fast-tier mode")
    ap.add_argument("--random", type=int, default=400, help="extra cases with random rows and modes")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile modes out")
    ap.add_argument("--rows", default="", help="comma-separated rows (default: all)")
    ap.add_argument("--out", default=str(RESULTS / "kernel_fuzz.json"))
    ap.add_argument("--time-budget", type=float, default=0, help="stop starting cases after this many seconds")
    ap.add_argument("--fast", action="store_true", help="run the fast tier's cases; print KNOWN_BUGS entries")
    ap.add_argument("--cases", default="", help="comma-separated case ids to run and report")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    lift_policies()
    torch.set_num_threads(1)
    rows = [r for r in args.rows.split(",") if r] or list(fc.ROWS)
    if args.cases:
        for cid in args.cases.split(","):
            print(fc.run_case(*fc.case_from_id(cid)).report())
        return 0
    if args.fast:
        cases = fc.fast_cases(seeds_per_mode=3)
    else:
        cases = plan(args.seeds, args.random, not args.no_compile, rows, random.Random(args.seeds))

    table: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    skips: dict = collections.defaultdict(collections.Counter)
    failures, documented = [], []
    start = time.perf_counter()
    ran = 0
    for row, mode, seed in cases:
        if args.time_budget and time.perf_counter() - start > args.time_budget:
            break
        t = time.perf_counter()
        o = fc.run_case(row, mode, seed)
        ran += 1
        c = table[row][mode.name]
        c["cases"] += 1
        c[o.status] += 1
        c["both_raise"] += o.both_raise
        c["fused_calls"] += o.fused
        c["original_calls"] += o.original
        c["layout_differs"] += "layout:" in o.note
        if o.status == "skip":
            skips[row][o.problems[0] if o.problems else "?"] += 1
        elif o.status in ("mismatch", "crash"):
            bug = fc.classify(o)
            c[f"bug:{bug}"] += 1
            failures.append({"case": o.case, "status": o.status, "bug": bug, "problems": o.problems[:8],
                             "choices": o.choices, "note": o.note, "seconds": round(time.perf_counter() - t, 2)})
            if not args.quiet:
                print(o.report(), flush=True)
        elif o.status == "documented":
            documented.append({"case": o.case, "problems": o.problems[:3], "choices": o.choices})
    elapsed = time.perf_counter() - start

    totals = collections.Counter()
    per_kernel = {}
    for row, modes in sorted(table.items()):
        row_total = collections.Counter()
        for counts in modes.values():
            row_total.update(counts)
        totals.update(row_total)
        per_kernel[row] = {"total": dict(row_total), "modes": {m: dict(c) for m, c in sorted(modes.items())},
                           "skipped": dict(skips.get(row, {}))}
    summary = {k: totals.get(k, 0) for k in ("cases", "match", "mismatch", "crash", "documented", "skip",
                                             "both_raise", "layout_differs", "fused_calls")}
    print(f"{ran} cases in {elapsed:.0f}s: " + ", ".join(f"{k} {v}" for k, v in summary.items()))

    by_bug = collections.Counter(f["bug"] for f in failures)
    print("failures by bug: " + ", ".join(f"{b} {n}" for b, n in by_bug.most_common()))
    if args.fast:
        print("\nKNOWN_BUGS entries (case id -> bug):")
        for f in failures:
            print(f"    {f['case']!r}: {f['bug']!r},  # {f['problems'][0][:110]}")
        return 0

    def git(*a: str) -> str:
        import subprocess

        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""

    result = {
        # (the kernels are what was compared: the commit, and kernel files changed since it)
        "git_head": git("rev-parse", "HEAD"), "kernels_modified": git("status", "--porcelain", "kernels").splitlines(),
        "command": "python benchmarks/fuzz_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "seconds": round(elapsed, 1), "cases_planned": len(cases), "cases_run": ran,
        "summary": summary,
        "status_meaning": {
            "match": "same outputs, gradients, state, RNG and hook calls (an exception on both sides included)",
            "mismatch": "a difference the original does not have (or the original raises and the kernel returns)",
            "crash": "the kernel raised where the original did not",
            "documented": "a difference after changing weights under adopter.kernels.freeze() without unfreeze()",
            "skip": "the configuration does not apply (reason counted under 'skipped')",
        },
        "bugs": {b: {"description": fc.BUGS.get(b, "not classified: see the failures"), "cases": n,
                     "kernels": sorted({f["case"].split("|")[0] for f in failures if f["bug"] == b})}
                 for b, n in by_bug.most_common()},
        "kernels": per_kernel,
        "failures": failures,
        "documented": documented[:50],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
