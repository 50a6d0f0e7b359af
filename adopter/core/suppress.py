"""Sites the user (or an earlier ``adopter rewrite --model``) decided to leave alone: suppression
comments in the source and a baseline file. Stdlib only; reads text, never imports it.

A comment ``# adopter: ignore[<rule>, <rule>] -- why`` (rule names as ``adopter rules`` prints
them, any case; the ``-- why`` is free text) or a bare ``# adopter: ignore`` (every rule) suppresses
a match when it stands on a line the match's code spans: any physical line from the start to the
end of one of its matched expressions (so a call split over lines may carry it on any of them).
``# adopter: ignore-file`` (optionally ``[rules]``), on a line of its own anywhere in the file,
suppresses the file's matches of those rules (or all). The comment must be a real comment (inside
a string it is text), and ``ignore`` must be followed by ``[``, a space, ``--`` or the end.

A baseline (``adopter rewrite --save-baseline FILE``) records the sites a check would rewrite,
each keyed by file (relative to the baseline's directory), rule, enclosing ``Class.function`` and
a hash of the matched code's tokens (comments and layout left out): unrelated edits, lines moving,
reformatting keep an entry valid; two equal sites in one function are one entry with a count.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tokenize
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "BASELINE_VERSION", "Baseline", "BaselineError", "FileSuppressions", "SiteFilter", "Suppression",
    "comment_reason", "fingerprint", "parse_suppressions", "site_lines", "suppression_comment",
]

# "adopter: ignore", "adopter: ignore-file", each with an optional [rule, ...]
_DIRECTIVE = re.compile(r"adopter:\s*ignore(?P<file>-file)?(?:\[(?P<rules>[^\]]*)\])?(?=\s|$|--|#)", re.I)
_REASON = re.compile(r"\s*--\s*(?P<reason>[^#]*)")


@dataclass(frozen=True)
class Suppression:
    """One ``# adopter: ignore...`` directive."""

    line: int
    rules: frozenset[str] | None  # lower-case rule names; None: every rule
    reason: str = ""
    whole_file: bool = False

    def covers(self, rule: str) -> bool:
        return self.rules is None or rule.lower() in self.rules

    @property
    def text(self) -> str:
        names = "" if self.rules is None else "[" + ", ".join(sorted(self.rules)) + "]"
        return f"# adopter: ignore{'-file' if self.whole_file else ''}{names}"


@dataclass(frozen=True)
class FileSuppressions:
    by_line: dict[int, tuple[Suppression, ...]] = field(default_factory=dict)
    whole_file: tuple[Suppression, ...] = ()

    def all(self) -> list[Suppression]:
        return [*self.whole_file, *(s for group in self.by_line.values() for s in group)]

    def unknown_rules(self, known: Iterable[str]) -> list[tuple[int, str]]:
        """(line, name) of each rule name no rule in ``known`` has."""
        names = {k.lower() for k in known}
        return sorted((s.line, r) for s in self.all() for r in (s.rules or ()) if r not in names)


_EMPTY = FileSuppressions()


def _directives(comment: str, line: int, own_line: bool) -> list[Suppression]:
    out = []
    for found in _DIRECTIVE.finditer(comment):
        rules = None
        if found.group("rules") is not None:
            rules = frozenset(r.strip().lower() for r in found.group("rules").split(",") if r.strip())
        reason = _REASON.match(comment, found.end())
        whole = bool(found.group("file"))
        if whole and not own_line:
            continue  # (file-level only on a line of its own, as ruff's file-level directive)
        out.append(Suppression(line, rules, reason.group("reason").strip() if reason else "", whole))
    return out


def parse_suppressions(text: str) -> FileSuppressions:
    """Every suppression comment of ``text`` (nothing when it does not tokenize)."""
    if "adopter:" not in text and "ADOPTER:" not in text.upper():
        return _EMPTY
    by_line: dict[int, list[Suppression]] = {}
    whole: list[Suppression] = []
    lines = text.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.COMMENT or "adopter" not in tok.string.lower():
                continue
            line = tok.start[0]
            own_line = not lines[line - 1][: tok.start[1]].strip() if line <= len(lines) else True
            for s in _directives(tok.string, line, own_line):
                (whole if s.whole_file else by_line.setdefault(line, [])).append(s)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return _EMPTY
    return FileSuppressions({k: tuple(v) for k, v in by_line.items()}, tuple(whole))


def _spans(match) -> list:
    spans = [mn.node.span for mn in match.nodes if getattr(mn.node, "span", None) is not None]
    if not spans and match.sequential is not None:
        spans = [match.sequential]
    return spans


def site_lines(match) -> list[int]:
    """The physical lines a suppression comment of ``match`` may stand on (module doc)."""
    out: set[int] = set()
    for s in _spans(match):
        out.update(range(s.line, max(s.line, s.end_line or s.line) + 1))
    return sorted(out)


COMMENT_REASON = "suppressed by "  # (+ the comment and its line)


def comment_reason(match, suppressions: FileSuppressions) -> str:
    """Why a comment suppresses ``match`` ("" when none does)."""
    for s in suppressions.whole_file:
        if s.covers(match.rule):
            return f"{COMMENT_REASON}`{s.text}` (line {s.line})"
    for line in site_lines(match):
        for s in suppressions.by_line.get(line, ()):
            if s.covers(match.rule):
                return f"{COMMENT_REASON}`{s.text}` (line {s.line})"
    return ""


def suppression_comment(rule: str, reason: str = "") -> str:
    return f"# adopter: ignore[{rule}]" + (f" -- {reason}" if reason else "")


# ---------------------------------------------------------------- fingerprints and the baseline


def _segment(lines: Sequence[str], span) -> str:
    """The source of ``span`` (ast positions: 1-based lines, 0-based columns; ``end_col`` in
    UTF-8 bytes as ``ast`` gives it)."""
    first, last = span.line - 1, max(span.line, span.end_line or span.line) - 1
    if first < 0 or last >= len(lines):
        return ""
    if first == last:
        raw = lines[first].encode("utf-8")
        return raw[span.col if span.col <= len(raw) else 0: span.end_col or len(raw)].decode("utf-8", "replace")
    parts = [lines[first].encode("utf-8")[span.col:].decode("utf-8", "replace"), *lines[first + 1:last],
             lines[last].encode("utf-8")[: span.end_col or None].decode("utf-8", "replace")]
    return "\n".join(parts)


def _normalised(code: str) -> str:
    """``code``'s tokens joined by one space: comments, line breaks and layout left out."""
    try:
        toks = [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                  tokenize.DEDENT, tokenize.ENDMARKER)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return " ".join(code.split())
    return " ".join(toks)


def scope_of(match) -> str:
    return ".".join(p for p in (match.class_name, match.function) if p)


def fingerprint(match, text: str) -> str:
    """A hash of the matched code's tokens (not its position)."""
    lines = text.split("\n")
    code = "\n".join(_normalised(_segment(lines, s)) for s in _spans(match))
    return hashlib.sha256(f"{match.rule}\n{code}".encode()).hexdigest()[:16]


class BaselineError(ValueError):
    """A baseline file that cannot be read (one line)."""


BASELINE_VERSION = 1


def _key(file: str, rule: str, scope: str, digest: str) -> tuple[str, str, str, str]:
    return (file, rule, scope, digest)


@dataclass
class Baseline:
    """Sites recorded as accepted: (file relative to ``root``, rule, scope, fingerprint) -> count."""

    root: str
    counts: Counter = field(default_factory=Counter)

    def relative(self, path: str) -> str:
        real = os.path.realpath(path)
        try:
            rel = os.path.relpath(real, os.path.realpath(self.root))
        except ValueError:  # (another drive)
            return real.replace(os.sep, "/")
        return rel.replace(os.sep, "/")

    def for_file(self, path: str) -> dict:
        rel = self.relative(path)
        return {k: n for k, n in self.counts.items() if k[0] == rel}

    def add(self, path: str, match, text: str) -> None:
        self.counts[_key(self.relative(path), match.rule, scope_of(match), fingerprint(match, text))] += 1

    @classmethod
    def load(cls, path: str) -> Baseline:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise BaselineError(f"baseline {path}: no such file (adopter rewrite --save-baseline {path} writes "
                                "one)") from None
        except OSError as exc:
            raise BaselineError(f"baseline {path}: cannot read: {exc.strerror or exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BaselineError(f"baseline {path}: not valid JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("version") != BASELINE_VERSION or not isinstance(
                data.get("sites"), list):
            raise BaselineError(f"baseline {path}: not an adopter rewrite baseline (version {BASELINE_VERSION} "
                                "with a list of sites)")
        counts: Counter = Counter()
        for i, site in enumerate(data["sites"]):
            try:
                key = _key(*(str(site[k]) for k in ("file", "rule", "scope", "fingerprint")))
                count = int(site.get("count", 1))
            except (KeyError, TypeError, ValueError, AttributeError):
                raise BaselineError(f"baseline {path}: site {i} needs file, rule, scope and fingerprint") from None
            counts[key] += max(count, 1)
        return cls(os.path.dirname(os.path.abspath(path)), counts)

    def to_json(self) -> dict:
        sites = [{"file": f, "rule": r, "scope": s, "fingerprint": d, "count": n}
                 for (f, r, s, d), n in sorted(self.counts.items())]
        return {"version": BASELINE_VERSION, "tool": "adopter rewrite --save-baseline", "sites": sites}


# ---------------------------------------------------------------- one file's filter


BASELINE_REASON = "in the baseline"
RECORDED_REASON = "recorded in the baseline"
PER_FILE_REASON = "ignored for this file by [tool.adopter] per-file-ignores"


@dataclass(frozen=True)
class SiteFilter:
    """What a rewrite of one file leaves alone (pickles: it travels to the worker processes).

    ``ignored_rules``: rules switched off for this file (lower-case); ``baseline``: this file's
    baseline entries ((file, rule, scope, fingerprint) -> count, file relative to the baseline);
    ``record``: every site that would be rewritten is left alone as ``RECORDED_REASON`` (the
    caller writes a baseline of them)."""

    ignored_rules: frozenset[str] = frozenset()
    baseline: tuple = ()  # ((key, count), ...)
    baseline_file: str = ""  # this file's path as the baseline names it
    record: bool = False
    comments: bool = True

    def __call__(self, matches: Sequence, text: str) -> list[str]:
        """Per match: why it is left alone ("" when it is not)."""
        sups = parse_suppressions(text) if self.comments else _EMPTY
        left = Counter(dict(self.baseline))
        out = []
        for m in matches:
            reason = comment_reason(m, sups)
            if not reason and (m.rule.lower() in self.ignored_rules or "*" in self.ignored_rules):
                reason = PER_FILE_REASON
            if not reason and left and m.status in ("static", "confirmed"):
                key = _key(self.baseline_file, m.rule, scope_of(m), fingerprint(m, text))
                if left[key] > 0:
                    left[key] -= 1
                    reason = BASELINE_REASON
            if not reason and self.record and m.status in ("static", "confirmed"):
                reason = RECORDED_REASON
            out.append(reason)
        return out
