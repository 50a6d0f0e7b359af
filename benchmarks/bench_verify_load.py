"""The load test of issue 25: `adopter verify` on a quiet machine, then while other processes
saturate every core; the loaded verdict must agree with the quiet one or say it is inconclusive.

    python benchmarks/bench_verify_load.py                    # llama-tiny and tiny-bert
    python benchmarks/bench_verify_load.py llama-tiny --hogs 4

Each model runs twice in fresh processes, one after the other: quiet (nothing of ours beside it),
then loaded (``--hogs`` busy-looping processes, default twice the core count, started before and
stopped after). Writes ``benchmarks/results/verify_load_<model>.json``: both runs' speed figures
(the robust one the verdict and gate use, the wall-time one beside it), their wall/CPU load and
verdicts, and whether they are consistent. Exit 1 when a loaded verdict contradicts the quiet one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
MODELS = ["llama-tiny", "tiny-bert"]
INCONCLUSIVE = "inconclusive: machine too busy"


def _hog(stop) -> None:
    while not stop.is_set():
        pass


def run_verify(model: str, json_path: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "adopter", "verify", "--model", model, "--no-ablation", "--quiet",
           "--json", json_path, *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1) or not os.path.exists(json_path):
        raise SystemExit(f"verify {model} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    with open(json_path) as fh:
        bench = json.load(fh)["benchmark"]
    keys = ("speed_figure", "speed_ratio", "speed_ratio_low", "speed_ratio_high", "speed_ratio_wall",
            "speed_ratio_wall_low", "speed_ratio_wall_high", "speed_ratio_cpu", "load", "verdict", "verdict_detail",
            "blocks", "memory_ratio")
    return {"wall_s": round(elapsed, 1), **{k: bench.get(k) for k in keys}}


def consistent(quiet: dict, loaded: dict) -> bool:
    return loaded["verdict"] in (quiet["verdict"], INCONCLUSIVE)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=MODELS)
    parser.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 2))
    parser.add_argument("--bench-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    extra = ["--bench-seconds", str(args.bench_seconds)]
    worst = 0
    with tempfile.TemporaryDirectory(prefix="adopter-load-") as tmp:
        for model in args.models:
            print(f"{model}: quiet run", file=sys.stderr, flush=True)
            quiet = run_verify(model, os.path.join(tmp, "quiet.json"), extra)
            print(f"{model}: loaded run ({args.hogs} busy processes)", file=sys.stderr, flush=True)
            stop = multiprocessing.Event()
            hogs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
            for p in hogs:
                p.start()
            try:
                loaded = run_verify(model, os.path.join(tmp, "loaded.json"), extra)
            finally:
                stop.set()
                for p in hogs:
                    p.join(10)
            ok = consistent(quiet, loaded)
            worst = max(worst, 0 if ok else 1)
            record = {
                "model": model,
                "command": f"adopter verify --model {model} --no-ablation --bench-seconds {args.bench_seconds:g}",
                "hogs": args.hogs,
                "cpu_count": os.cpu_count(),
                "quiet": quiet,
                "loaded": loaded,
                "consistent": ok,
            }
            path = os.path.join(RESULTS, f"verify_load_{model}.json")
            with open(path, "w") as fh:
                json.dump(record, fh, indent=2)
                fh.write("\n")
            for name, r in (("quiet", quiet), ("loaded", loaded)):
                print(f"  {name:<6} {r['speed_figure']}: {r['speed_ratio']:.3f} [{r['speed_ratio_low']:.3f}-"
                      f"{r['speed_ratio_high']:.3f}]  wall: {r['speed_ratio_wall']:.3f} [{r['speed_ratio_wall_low']:.3f}-"
                      f"{r['speed_ratio_wall_high']:.3f}]  wall/CPU {r['load']:.2f}  -> {r['verdict']}", file=sys.stderr)
            print(f"  consistent: {ok}  ({os.path.relpath(path)})", file=sys.stderr)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
