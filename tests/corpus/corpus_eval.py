"""Score the scanner against a hand-labelled corpus.

Three corpora: ``labels.json`` (installed transformers modeling files, located with
``importlib.util.find_spec``, never imported), ``styles/labels.json`` and ``heldout/labels.json``
(self-written files kept in the repository, paths relative to the labels file; ``heldout`` was
labelled blind to the scanner and is measured, not tuned on). A corpus whose JSON records a
``transformers_version`` is of the first kind; any other is resolved next to its labels file.

Used by ``tests/test_corpus.py`` (assertions) and ``benchmarks/bench_corpus.py`` (report).
The files are scanned statically, as ``adopter scan`` does.

Predictions are the matches whose status is ``static`` or ``confirmed``
(``PREDICTION_STATUSES``); a match with any other status (``conditional``, ``refused``, ...) is
not a prediction: it is listed apart (``Score.other_status``) and counts neither as a true nor a
false positive.

A prediction *equals* a label when the rule, the file (basename), the reported class and the
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
STYLES_LABELS_PATH = Path(__file__).with_name("styles") / "labels.json"
HELDOUT_LABELS_PATH = Path(__file__).with_name("heldout") / "labels.json"
CORPORA = {"transformers": LABELS_PATH, "styles": STYLES_LABELS_PATH, "heldout": HELDOUT_LABELS_PATH}
PREDICTION_STATUSES = ("static", "confirmed")
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
    """The labels file as a dict; ``_labels_path`` (not in the file) records where it was read."""
    with open(path, encoding="utf-8") as fh:
        corpus = json.load(fh)
    corpus["_labels_path"] = str(Path(path).resolve())
    return corpus


def in_repo(corpus: dict) -> bool:
    """True for a corpus whose files live next to its labels file (no transformers version)."""
    return "transformers_version" not in corpus


@dataclass
class CorpusFiles:
    paths: dict[str, Path]  # basename -> path of the labelled file
    stale: dict[str, str] = field(default_factory=dict)  # basename -> why it cannot be used


def corpus_files(corpus: dict, models_dir: Path | None = None, base_dir: Path | None = None) -> CorpusFiles:
    """The labelled files, checked against the recorded sha256 (labels are only valid for that text).

    Transformers corpus: paths relative to ``models_dir`` (default: the installed
    ``transformers/models``). In-repo corpus: relative to ``base_dir`` (default: the folder of the
    labels file the corpus was loaded from)."""
    repo = in_repo(corpus)
    if repo:
        base = base_dir or (Path(corpus["_labels_path"]).parent if "_labels_path" in corpus else None)
    else:
        base = models_dir or transformers_models_dir()
    out = CorpusFiles(paths={})
    for name, info in corpus["files"].items():
        if base is None:
            out.stale[name] = ("no base folder for the corpus files" if repo
                               else "transformers is not installed")
            continue
        p = base / info["path"]
        if not p.is_file():
            out.stale[name] = f"missing: {p}"
            continue
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        # another transformers release: labels follow their code (an in-repo file is ours: stale)
        if digest != info["sha256"] and (repo or not _relocate(corpus, name, p)):
            since = "" if repo else f" (transformers {corpus['transformers_version']})"
            out.stale[name] = f"{p} changed since labelling{since} and a labelled line is gone"
            continue
        out.paths[name] = p
    return out


def _relocate(corpus: dict, name: str, path: Path) -> bool:
    """Move the labels of ``name`` to where their recorded code stands in ``path`` now (another
    patch release of transformers shifts lines): each entry's code lines, with their relative
    offsets, at the occurrence nearest the recorded line. False (nothing moved) when some
    entry's code is not in the file any more."""
    text = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    entries = [e for e in corpus["labels"] + corpus["negatives"] if e["file"] == name]
    moves = []
    for entry in entries:
        code = sorted((int(line), c) for line, c in entry["code"].items())
        if not code:
            continue
        first = code[0][0]
        starts = [i + 1 for i, t in enumerate(text) if t == code[0][1]
                  and all(0 < i + 1 + ln - first <= len(text) and text[i + ln - first] == c for ln, c in code)]
        if not starts:
            return False
        moves.append((entry, min(starts, key=lambda s: abs(s - first)) - first))
    for entry, delta in moves:
        entry["lines"] = [line + delta for line in entry["lines"]]
        entry["code"] = {str(int(line) + delta): c for line, c in entry["code"].items()}
    return True


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
    # matches in the labelled files whose status is not a prediction (why = status: reason)
    other_status: list[Outcome] = field(default_factory=list)

    def other_status_counts(self) -> dict[str, dict[str, int]]:
        """rule -> status -> number of non-prediction matches."""
        out: dict[str, dict[str, int]] = {}
        for o in self.other_status:
            status = o.why.split(":", 1)[0]
            per = out.setdefault(o.rule, {})
            per[status] = per.get(status, 0) + 1
        return out

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
    of the files in ``files.paths``. Only matches with a status in ``PREDICTION_STATUSES`` (a dict
    without ``status`` counts as ``static``) are predictions; the others go to ``other_status``."""
    usable = set(files.paths)
    labels = [l for l in corpus["labels"] if l["file"] in usable]
    negatives = [n for n in corpus.get("negatives", []) if n["file"] in usable]
    credited: dict[int, int] = {}  # label index -> match index
    score = Score()
    found = []
    for m in matches:
        d = m if isinstance(m, dict) else m.to_json()
        entry = {"rule": d["rule"], "file": os.path.basename(d["file"]), "class": d.get("class"),
                 "lines": sorted(d.get("lines") or []), "function": d.get("function")}
        status = d.get("status") or "static"
        if status not in PREDICTION_STATUSES:
            reason = d.get("reason") or ""
            score.other_status.append(Outcome(entry["rule"], entry["file"], entry["class"], entry["lines"],
                                              f"{status}: {reason}" if reason else status))
            continue
        found.append(entry)
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
    """Static scan of the corpus files with the rules they are labelled for (``RULE_ORDER``:
    a rule added later, such as the LLM rule pack, has no labels here and is measured by its
    own benchmark) -> ``ScanReport``."""
    from adopter.core.rules import get_rules
    from adopter.core.scan import scan_paths

    return scan_paths([str(p) for _, p in sorted(files.paths.items())], get_rules(list(RULE_ORDER)))


def corpus_name(corpus: dict) -> str:
    return corpus.get("corpus") or ("transformers" if not in_repo(corpus) else "corpus")


def report_json(corpus: dict, score: Score, report, files: CorpusFiles) -> dict:
    head = {"corpus": corpus_name(corpus)}
    if not in_repo(corpus):
        head["transformers_version"] = corpus["transformers_version"]
    return {
        **head,
        "prediction_statuses": list(PREDICTION_STATUSES),
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
        "not_predictions": len(score.other_status),
        "not_predictions_per_rule": score.other_status_counts(),
        "not_prediction_matches": [o.to_json() for o in score.other_status],
    }


def format_report(data: dict) -> str:
    head = (
        f"corpus {data.get('corpus', 'transformers')}: {data['files']} files, {data['labels']} labels "
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
    others = data.get("not_prediction_matches", [])
    if others:
        lines.append(f"not predictions (status other than {'/'.join(data['prediction_statuses'])}; "
                     f"not scored) ({len(others)}):")
        for o in others:
            first = o["lines"][0] if o["lines"] else "?"
            lines.append(f"  {o['file']}:{first} {o['rule']} [{o['class']}] lines {o['lines']}: {o['why']}")
    for name, why in data["stale_files"].items():
        lines.append(f"skipped {name}: {why}")
    for e in data["scan_errors"]:
        lines.append(f"scan error {e['file']}: {e['message']}")
    return "\n".join(lines)
