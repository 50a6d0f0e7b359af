"""Score the scanner against the hand-labelled corpus in ``labels.json``.

Used by ``tests/test_corpus.py`` (assertions) and ``benchmarks/bench_corpus.py`` (report).
Nothing here imports transformers: the corpus files are located with ``importlib.util.find_spec``
and scanned statically, as ``adopter scan`` does.

A scanner match *equals* a label when the rule, the file (basename), the reported class and the
matched forward lines overlap (at least one line in common). Each label is credited at most once;
a second match overlapping an already credited label is a false positive (a duplicate).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

LABELS_PATH = Path(__file__).with_name("labels.json")
RULE_ORDER = (
    "BertSelfAttention", "T5Attention", "GPT2Attention", "softmax", "Dropout_LayerNorm",
    "biased_GeLU", "Conv_BatchNorm", "Linear_BatchNorm", "fused_QKV",
)


def transformers_models_dir() -> Path | None:
    spec = importlib.util.find_spec("transformers")  # locate only, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def load_corpus(path: Path = LABELS_PATH) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@dataclass
class CorpusFiles:
    paths: dict[str, Path]  # basename -> path of the labelled file
    stale: dict[str, str] = field(default_factory=dict)  # basename -> why it cannot be used


def corpus_files(corpus: dict, models_dir: Path | None = None) -> CorpusFiles:
    """The labelled files, checked against the recorded sha256 (labels are only valid for that text)."""
    models_dir = models_dir or transformers_models_dir()
    out = CorpusFiles(paths={})
    for name, info in corpus["files"].items():
        if models_dir is None:
            out.stale[name] = "transformers is not installed"
            continue
        p = models_dir / info["path"]
        if not p.is_file():
            out.stale[name] = f"missing: {p}"
            continue
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        if digest != info["sha256"]:
            out.stale[name] = f"{p} changed since labelling (transformers {corpus['transformers_version']})"
            continue
        out.paths[name] = p
    return out


@dataclass
class Outcome:
    rule: str
    file: str
    cls: str | None
    lines: list[int]
    why: str

    def where(self) -> str:
        return f"{self.file}:{self.lines[0] if self.lines else '?'}"

    def to_json(self) -> dict:
        return {"rule": self.rule, "file": self.file, "class": self.cls, "lines": self.lines, "why": self.why}


@dataclass
class Score:
    tp: list[Outcome] = field(default_factory=list)
    fp: list[Outcome] = field(default_factory=list)
    fn: list[Outcome] = field(default_factory=list)
    fn_doc_scope: int = 0  # false negatives among labels inside the rule docs' stated scope
    labels_doc_scope: int = 0

    @staticmethod
    def ratio(num: int, den: int) -> float | None:
        return round(num / den, 4) if den else None

    def per_rule(self) -> dict[str, dict]:
        rules = {o.rule for o in self.tp + self.fp + self.fn}
        ordered = [r for r in RULE_ORDER if r in rules] + sorted(rules - set(RULE_ORDER))
        out = {}
        for r in ordered:
            tp = sum(o.rule == r for o in self.tp)
            fp = sum(o.rule == r for o in self.fp)
            fn = sum(o.rule == r for o in self.fn)
            out[r] = {"labels": tp + fn, "tp": tp, "fp": fp, "fn": fn,
                      "precision": self.ratio(tp, tp + fp), "recall": self.ratio(tp, tp + fn)}
        return out

    @property
    def precision(self) -> float | None:
        return self.ratio(len(self.tp), len(self.tp) + len(self.fp))

    @property
    def recall(self) -> float | None:
        return self.ratio(len(self.tp), len(self.tp) + len(self.fn))

    @property
    def recall_doc_scope(self) -> float | None:
        return self.ratio(self.labels_doc_scope - self.fn_doc_scope, self.labels_doc_scope)


def _overlaps(a, b) -> bool:
    return bool(set(a) & set(b))


def evaluate(corpus: dict, matches, files: CorpusFiles) -> Score:
    """Compare ``matches`` (``adopter.core.structures.Match`` objects or their JSON dicts) with the labels
    of the files in ``files.paths``."""
    usable = set(files.paths)
    labels = [l for l in corpus["labels"] if l["file"] in usable]
    negatives = [n for n in corpus.get("negatives", []) if n["file"] in usable]
    credited: dict[int, int] = {}  # label index -> match index
    score = Score()
    found = []
    for m in matches:
        d = m if isinstance(m, dict) else m.to_json()
        found.append({"rule": d["rule"], "file": os.path.basename(d["file"]), "class": d.get("class"),
                      "lines": sorted(d.get("lines") or []), "function": d.get("function")})
    # credit the best-overlapping label first, so a broad match cannot steal a neighbour's label
    for mi, m in enumerate(found):
        cands = [(len(set(m["lines"]) & set(l["lines"])), li) for li, l in enumerate(labels)
                 if li not in credited and l["rule"] == m["rule"] and l["file"] == m["file"]
                 and l["class"] == m["class"] and _overlaps(l["lines"], m["lines"])]
        if cands:
            credited[max(cands)[1]] = mi
            continue
        why = _fp_reason(m, labels, negatives, credited, found)
        score.fp.append(Outcome(m["rule"], m["file"], m["class"], m["lines"], why))
    for li, l in enumerate(labels):
        if l.get("doc_scope", True):
            score.labels_doc_scope += 1
        if li in credited:
            m = found[credited[li]]
            score.tp.append(Outcome(l["rule"], l["file"], l["class"], m["lines"], l["why"]))
            continue
        if l.get("doc_scope", True):
            score.fn_doc_scope += 1
        near = [m for m in found if m["rule"] == l["rule"] and m["file"] == l["file"]
                and _overlaps(m["lines"], l["lines"])]
        why = l["why"]
        if not l.get("doc_scope", True):
            why = "[outside the rule doc's stated scope] " + why
        if near:
            why += f" -- scanner reported it with class {near[0]['class']!r} and lines {near[0]['lines']}"
        score.fn.append(Outcome(l["rule"], l["file"], l["class"], l["lines"], why))
    return score


def _fp_reason(m, labels, negatives, credited, found) -> str:
    for n in negatives:
        if n["rule"] == m["rule"] and n["file"] == m["file"] and n["class"] == m["class"] \
                and _overlaps(n["lines"], m["lines"]):
            return "labelled not-a-match: " + n["why"]
    for li, l in enumerate(labels):
        if l["rule"] == m["rule"] and l["file"] == m["file"] and _overlaps(l["lines"], m["lines"]):
            if li in credited and l["class"] == m["class"]:
                first = found[credited[li]]["lines"]
                return f"duplicate: label already credited to the match at lines {first}"
            if l["class"] != m["class"]:
                return f"class {m['class']!r} differs from the label's {l['class']!r} (lines {l['lines']})"
    return "no label: not an applicable location (see labels.json / README for the labelling rules)"


def scan(files: CorpusFiles):
    """Static scan of the corpus files with every built-in rule -> ``ScanReport``."""
    from adopter.core.rules import all_rules
    from adopter.core.scan import scan_paths

    return scan_paths([str(p) for _, p in sorted(files.paths.items())], all_rules())


def report_json(corpus: dict, score: Score, report, files: CorpusFiles) -> dict:
    return {
        "transformers_version": corpus["transformers_version"],
        "files": len(files.paths),
        "stale_files": files.stale,
        "scan_seconds": round(report.seconds, 3),
        "scan_errors": [e.to_json() for e in report.errors],
        "labels": len(score.tp) + len(score.fn),
        "labels_doc_scope": score.labels_doc_scope,
        "matches": len(score.tp) + len(score.fp),
        "precision": score.precision,
        "recall": score.recall,
        "recall_doc_scope": score.recall_doc_scope,
        "per_rule": score.per_rule(),
        "false_positives": [o.to_json() for o in score.fp],
        "false_negatives": [o.to_json() for o in score.fn],
    }


def format_report(data: dict) -> str:
    head = (
        f"corpus: {data['files']} files, {data['labels']} labels "
        f"({data['labels_doc_scope']} inside the rule docs' scope), {data['matches']} matches, "
        f"scan {data['scan_seconds']} s"
    )
    lines = [head]
    lines.append(f"{'rule':<20}{'labels':>7}{'tp':>5}{'fp':>5}{'fn':>5}{'precision':>11}{'recall':>8}")
    for rule, r in data["per_rule"].items():
        p = "-" if r["precision"] is None else f"{r['precision']:.2f}"
        rc = "-" if r["recall"] is None else f"{r['recall']:.2f}"
        lines.append(f"{rule:<20}{r['labels']:>7}{r['tp']:>5}{r['fp']:>5}{r['fn']:>5}{p:>11}{rc:>8}")
    lines.append(f"overall precision {data['precision']}  recall {data['recall']}  "
                 f"recall (rule-doc scope) {data['recall_doc_scope']}")
    for title, key in (("false positives", "false_positives"), ("false negatives", "false_negatives")):
        lines.append(f"{title} ({len(data[key])}):")
        for o in data[key]:
            first = o["lines"][0] if o["lines"] else "?"
            lines.append(f"  {o['file']}:{first} {o['rule']} [{o['class']}] lines {o['lines']}: {o['why']}")
    for name, why in data["stale_files"].items():
        lines.append(f"skipped {name}: {why}")
    for e in data["scan_errors"]:
        lines.append(f"scan error {e['file']}: {e['message']}")
    return "\n".join(lines)
