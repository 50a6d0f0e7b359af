"""Run `adopter verify` on the issue's models and record each result.

    python benchmarks/bench_verify.py                       # all models below
    python benchmarks/bench_verify.py gpt2 t5-small@eager   # some of them (@eager: eager attention)
    python benchmarks/bench_verify.py --save-tiny-baseline  # refresh benchmarks/baselines/tiny-bert.json

Each run writes ``benchmarks/results/verify_<model>.json`` (the verify result: rules applied,
equivalence, throughput and memory of original vs optimized, ratios) and, next to it, the raw
pytest-benchmark JSON (``verify_<model>.pytest-benchmark.json``). Models run one after another
in this process: on a shared machine run nothing else meanwhile.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
BASELINE = os.path.join(HERE, "baselines", "tiny-bert.json")
# MODEL@eager: also with transformers' eager attention, the code path the attention and
# softmax rules rewrite (transformers 5 defaults to SDPA, which none of them touch).
MODELS = [
    "bert-base-uncased", "gpt2", "t5-small", "roberta-base", "microsoft/resnet-50", "gpt2@eager", "t5-small@eager",
]  # fmt: skip


def result_path(spec: str) -> str:
    name = spec.replace("/", "__").replace("@", "-")
    return os.path.relpath(os.path.join(RESULTS, f"verify_{name}.json"))


def verify_args(spec: str) -> list[str]:
    model, _, attn = spec.partition("@")
    return ["--model", model] + (["--attn-implementation", attn] if attn else [])


def main(argv: list[str]) -> int:
    from adopter.cli import main as adopter_main

    os.chdir(os.path.dirname(HERE))  # repository root: result files name relative paths

    if "--save-tiny-baseline" in argv:
        # More blocks than a plain run: the baseline's ratio should carry little noise.
        # One thread: on a shared 2-core CI machine two threads make step times swing 10x.
        return adopter_main(["verify", "--model", "tiny-bert", "--threads", "1", "--blocks", "60",
                             "--json", result_path("tiny-bert"), "--save-baseline", os.path.relpath(BASELINE)])
    models = [a for a in argv if not a.startswith("-")] or MODELS
    rows = []
    worst = 0
    for model in models:
        start = time.perf_counter()
        code = adopter_main(["verify", *verify_args(model), "--json", result_path(model)])
        worst = max(worst, code)
        elapsed = time.perf_counter() - start
        try:
            with open(result_path(model)) as fh:
                data = json.load(fh)
        except OSError:
            rows.append((model, code, elapsed, None))
            continue
        rows.append((model, code, elapsed, data))
    print("\nmodel                 exit  wall(s)  rules  equivalent  speed ratio  memory ratio", file=sys.stderr)
    for model, code, elapsed, data in rows:
        if data is None:
            print(f"{model:<21} {code:>4}  {elapsed:7.1f}  (no result)", file=sys.stderr)
            continue
        bench = data.get("benchmark") or {}
        print(
            f"{model:<21} {code:>4}  {elapsed:7.1f}  {len(data['rules_applied']):>5}  "
            f"{data['equivalence']['equivalent']!s:<10}  {bench.get('speed_ratio', float('nan')):11.3f}  "
            f"{bench.get('memory_ratio', float('nan')):12.3f}",
            file=sys.stderr,
        )
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
