"""Precision/recall of ``adopter scan`` on the hand-labelled corpora.

``transformers`` (``tests/corpus/labels.json``): installed transformers modeling files, scanned in
place. ``styles`` (``tests/corpus/styles/labels.json``): self-written non-HuggingFace model files
kept in the repository. ``heldout`` (``tests/corpus/heldout/labels.json``): self-written files
labelled blind to the scanner (measured, not tuned on). ``llm_styles``
(``tests/corpus/llm_styles/labels.json``): self-written LLM files in non-HuggingFace styles, labelled
blind to the scanner, scored with the LLM rule pack as well. ``wild``
(``tests/corpus/wild/labels.json``, issue 35): self-written training code in the wild styles
(nanoGPT, Meta-llama/llama2.c, a ViT package, CLIP, ConvNeXt, an einops library, look-alikes),
labelled blind to the scanner and scanned with every registered rule. ``wild2``
(``tests/corpus/wild2/labels.json``): self-written code in styles the others lack (fairseq, whisper,
mmdet, detectron2, SAM/DINOv2, MoE, diffusion, Mamba/RWKV, audio/graph/U-Net, look-alikes), labelled
blind to the scanner and scanned with every registered rule, as ``wild``. All are scanned statically (nothing
imported); matches are compared with the labels (same rule, file, class and overlapping forward lines). Only matches with status
``static``/``confirmed`` are predictions; others (``conditional``, ``refused``, ...) are listed
apart. Prints precision and recall per rule and overall with every false positive and false
negative, and writes one results file per corpus:

    python benchmarks/bench_corpus.py [--corpus transformers|styles|heldout|llm_styles|wild|wild2|all] [--out FILE]

    transformers -> benchmarks/results/corpus_precision.json
    styles       -> benchmarks/results/corpus_styles_precision.json
    heldout      -> benchmarks/results/corpus_heldout_precision.json
    llm_styles   -> benchmarks/results/corpus_llm_styles_precision.json
    wild         -> benchmarks/results/corpus_wild_precision.json
    wild2        -> benchmarks/results/corpus_wild2_precision.json

Exit status 0 even when the scores miss the targets (it is a measurement; the targets are asserted
by ``tests/analysis/test_corpus.py``); 2 when a requested corpus has no file that can be scanned.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "corpus"))

import corpus_eval

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS / "corpus_precision.json"
DEFAULT_OUTS = {"transformers": DEFAULT_OUT, "styles": RESULTS / "corpus_styles_precision.json",
                "heldout": RESULTS / "corpus_heldout_precision.json",
                "llm_styles": RESULTS / "corpus_llm_styles_precision.json",
                "wild": RESULTS / "corpus_wild_precision.json",
                "wild2": RESULTS / "corpus_wild2_precision.json"}
# the LLM-styles corpus is labelled for the LLM rule pack too, so it is scanned with it
LLM_STYLES_LABELS_PATH = ROOT / "tests" / "corpus" / "llm_styles" / "labels.json"
LLM_RULES = ("RMSNorm", "gated_MLP", "rotary_embedding", "linear_cross_entropy")
# the wild corpus (issue 35) is labelled for every rule, including ones written after it (a
# labelled rule the scanner does not know yet has its labels counted as misses)
WILD_LABELS_PATH = ROOT / "tests" / "corpus" / "wild" / "labels.json"
# wild2: more styles, labelled the same way for every rule, scanned like wild
WILD2_LABELS_PATH = ROOT / "tests" / "corpus" / "wild2" / "labels.json"
CORPUS_PATHS = {**corpus_eval.CORPORA, "llm_styles": LLM_STYLES_LABELS_PATH, "wild": WILD_LABELS_PATH,
                "wild2": WILD2_LABELS_PATH}
CORPUS_NAMES = ("transformers", "styles", "heldout", "llm_styles", "wild", "wild2")
EVERY_RULE_CORPORA = ("wild", "wild2")


def scan_corpus(name: str, files: corpus_eval.CorpusFiles):
    """``corpus_eval.scan`` (the Table 1 rules); for ``llm_styles`` the LLM rule pack as well; for
    ``wild`` and ``wild2`` every registered rule."""
    if name not in ("llm_styles",) + EVERY_RULE_CORPORA:
        return corpus_eval.scan(files)
    from adopter.core.rules import get_rules
    from adopter.core.scan import scan_paths

    if name in EVERY_RULE_CORPORA:
        return scan_paths([str(p) for _, p in sorted(files.paths.items())], None)

    rules = get_rules(list(corpus_eval.RULE_ORDER) + list(LLM_RULES))
    return scan_paths([str(p) for _, p in sorted(files.paths.items())], rules)


def analyzer_info() -> dict:
    """The adopter package that was imported, and the git commit of its checkout."""
    import adopter

    pkg = Path(adopter.__file__).resolve().parent
    proc = subprocess.run(["git", "-C", str(pkg.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"adopter": str(pkg), "git_commit": proc.stdout.strip() if proc.returncode == 0 else None}


def run_corpus(name: str, out: Path) -> int:
    corpus = corpus_eval.load_corpus(CORPUS_PATHS[name])
    files = corpus_eval.corpus_files(corpus)
    if not files.paths:
        print(f"{name}: no labelled file can be scanned: " + "; ".join(files.stale.values()), file=sys.stderr)
        return 2
    report = scan_corpus(name, files)
    score = corpus_eval.evaluate(corpus, report.matches, files)
    data = corpus_eval.report_json(corpus, score, report, files)
    data["python"] = platform.python_version()
    data["analyzer"] = analyzer_info()
    print(corpus_eval.format_report(data))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", choices=CORPUS_NAMES + ("all",),
                    default="transformers",
                    help="which labelled corpus to score (default: transformers)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (JSON; only with a single corpus; default per corpus, see above)")
    args = ap.parse_args(argv)
    names = list(CORPUS_NAMES) if args.corpus == "all" else [args.corpus]
    if args.out is not None and len(names) > 1:
        ap.error("--out needs a single --corpus")
    status = 0
    for i, name in enumerate(names):
        if i:
            print()
        status = max(status, run_corpus(name, args.out or DEFAULT_OUTS[name]))
    return status


if __name__ == "__main__":
    sys.exit(main())
