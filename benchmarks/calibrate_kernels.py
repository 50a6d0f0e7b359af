"""The shipped CPU calibration of the per-call cost model (``adopter.kernels.cost``): every guarded
kernel against its original path over a range of sizes, training and inference, at 1 and 2 threads
(``adopter calibrate`` measures the same on a user's machine).

    OMP_NUM_THREADS=2 python benchmarks/calibrate_kernels.py [--rounds 9]

writes ``benchmarks/results/calibration_cpu.json`` (with a summary beside it, ``.md``) and the copy
the package ships, ``kernels/calibration/cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def render(data: dict) -> str:
    """The results' markdown: every point, then where the fused path runs (the decision rule of
    ``adopter.kernels.cost`` as it is now)."""
    from adopter.verification.calibrate import summary_lines

    table = ["| threads | kernel | mode | shape | original / fused | 95 % interval |", "|---|---|---|---|---|---|"]
    for threads, kernels in data["threads"].items():
        for kernel, modes in kernels.items():
            for mode, points in modes.items():
                table += [f"| {threads} | {kernel} | {mode} | {p['shape']} | {p['ratio']:.3f} | "
                          f"{p['low']:.3f}-{p['high']:.3f} |" for p in points]
    lines = list(summary_lines(data))
    return ("# CPU calibration of the per-call cost model\n\n" + f"`{data.get('command', '')}`, torch {data['torch']}\n\n"
            + "\n".join(table) + "\n\nWhere the fused path runs:\n\n" + "\n".join(f"    {line}" for line in lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--kernels", default=None)
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the results JSON")
    args = parser.parse_args()
    from adopter.verification.calibrate import calibrate, summary_lines, write

    results = ROOT / "benchmarks" / "results" / "calibration_cpu.json"
    if args.render:
        results.with_suffix(".md").write_text(render(json.loads(results.read_text())), encoding="utf-8")
        return 0
    data = calibrate(threads=[int(n) for n in args.threads.split(",")], rounds=args.rounds,
                     kernels=set(args.kernels.split(",")) if args.kernels else None,
                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    data["command"] = "python benchmarks/calibrate_kernels.py " + " ".join(sys.argv[1:])
    if args.kernels and results.is_file():
        # only some kernels measured again: the others' points stay as they were recorded
        previous = json.loads(results.read_text())
        for threads, kernels in previous["threads"].items():
            for kernel, modes in kernels.items():
                data["threads"].setdefault(threads, {}).setdefault(kernel, modes)
        data["skipped"] = [s for s in previous.get("skipped", []) if s["kernel"] not in args.kernels.split(",")] \
            + data.get("skipped", [])
        data["command"] = previous.get("command", "") + "; then " + data["command"]
        data["threads_dropped"] = previous.get("threads_dropped")
    write(data, results)
    results.with_suffix(".md").write_text(render(data), encoding="utf-8")
    shipped = ROOT / "kernels" / "calibration" / "cpu.json"
    shipped.parent.mkdir(exist_ok=True)
    shutil.copyfile(results, shipped)
    print("\n".join(summary_lines(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
