"""Precision/recall of ``adopter scan`` on the hand-labelled corpus (``tests/corpus/labels.json``).

Scans the labelled transformers modeling files in place (static, nothing imported), compares the
matches with the labels (same rule, file, class and overlapping forward lines) and prints/writes
precision and recall per rule and overall, with every false positive and false negative:

    python benchmarks/bench_corpus.py [--out benchmarks/results/corpus_precision.json]

Exit status 0 even when the scores miss the targets (it is a measurement; the targets are asserted
by ``tests/test_corpus.py``); 2 when no labelled file can be scanned.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "corpus"))

import corpus_eval

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "corpus_precision.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file (JSON)")
    args = ap.parse_args(argv)

    corpus = corpus_eval.load_corpus()
    files = corpus_eval.corpus_files(corpus)
    if not files.paths:
        print("no labelled file can be scanned: " + "; ".join(files.stale.values()), file=sys.stderr)
        return 2
    report = corpus_eval.scan(files)
    score = corpus_eval.evaluate(corpus, report.matches, files)
    data = corpus_eval.report_json(corpus, score, report, files)
    data["python"] = platform.python_version()
    print(corpus_eval.format_report(data))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
