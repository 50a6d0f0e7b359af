"""``rewrite_source`` / ``rewrite_file``: matches in, rewritten text (and per-match outcomes) out.

Pipeline per file: analysis of every match on the original source (codemods, stdlib
``ast``) -> edits applied one by one on the fissix tree through a bowler fixer (in place;
a failing edit leaves nothing half done: the tree is rebuilt without it) -> kernel imports ->
``compile()`` of the result -> diff. Only the top-level statements that edits touch are
parsed with fissix (:mod:`adopter.rewrite.partial`). A result that does not compile is
discarded as a whole: the file stays as it was and every match reports why.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from adopter.rewrite import cst
from adopter.rewrite.apply import KERNELS_MODULE, add_kernel_imports, apply_edit
from adopter.rewrite.line_length import line_limit, wrap_long_lines
from adopter.rewrite.partial import PartialTree
from adopter.rewrite.scripting import GuardError, guard_options, keep_original_for_torchscript
from adopter.rewrite.source_io import WriteRefused, read_source, unified_diff, write_atomic

from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit
from adopter.core.codemod.generic import generic_codemod
from adopter.core.codemod.sequential import SEQUENTIAL_CALL_CODEMOD, SEQUENTIAL_CODEMOD
from adopter.core.match.sequential import is_sequential_expansion
from adopter.core.rules import find_rule
from adopter.core.source_file import DEFAULT_MAX_BYTES, SourceReadError
from adopter.core.structures import Match

__all__ = [
    "FileRewrite", "MatchOutcome", "RewriteResult", "codemod_for", "rewrite_file", "rewrite_passes", "rewrite_source",
    "unsettled_reason",
]


@dataclass(frozen=True)
class MatchOutcome:
    match: Match
    applied: bool
    reason: str = ""
    # The rewrite was meant to apply but its place in the source could not be found (or its
    # codemod failed): an analysis bug, always reported, never a silent skip.
    unplaced: bool = False

    def to_json(self) -> dict:
        out = {"rule": self.match.rule, "class": self.match.class_name, "function": self.match.function,
               "lines": self.match.lines}
        if not self.applied:
            out["reason"] = self.reason
        if self.unplaced:
            out["unplaced"] = True
        return out


@dataclass
class RewriteResult:
    new_text: str
    outcomes: list[MatchOutcome] = field(default_factory=list)
    diff: str = ""
    error: str = ""  # set when the file as a whole could not be handled
    # Some match was not applied because another one claimed its statements: once that one
    # is rewritten, the next scan may find it again in a form that applies.
    deferred: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.diff)

    @property
    def applied(self) -> list[MatchOutcome]:
        return [o for o in self.outcomes if o.applied]

    @property
    def skipped(self) -> list[MatchOutcome]:
        return [o for o in self.outcomes if not o.applied]


def unsettled_reason(match: Match) -> str:
    """Why ``match`` must not be rewritten as it stands ("" when it may): a ``refused`` match
    (a precision precondition of the kernel fails) never; a ``conditional`` one only after a
    trace confirmed it (its status is then ``confirmed``)."""
    if match.status == "refused":
        return f"refused ({match.code}): {match.reason}"
    if match.status == "conditional":
        return (f"conditional ({match.code}): {match.condition}; not applied without a trace confirming it "
                "(adopter rewrite --model package.module:Class --write, or optimize() in Python)")
    return ""


def codemod_for(match: Match, rules: Sequence = ()):
    """The codemod of ``match``'s rule (looked up in ``rules``, then the registry): the rule's
    own, else the synthesis from its DSL target; None when neither exists."""
    rule = find_rule(match.rule, rules)
    if match.sequential is not None and rule is not None and getattr(rule, "in_sequential", False):
        return SEQUENTIAL_CODEMOD
    if rule is not None and getattr(rule, "in_sequential", False) and is_sequential_expansion(match):
        # (the match driver keeps these only for a Sequential another file builds)
        return SEQUENTIAL_CALL_CODEMOD
    if rule is not None and getattr(rule, "codemod", None) is not None:
        return rule.codemod
    return generic_codemod(match, rule)


def _all_skipped(text: str, matches: Sequence[Match], reason: str, filename: str) -> RewriteResult:
    return RewriteResult(
        new_text=text, outcomes=[MatchOutcome(m, False, reason) for m in matches], diff="", error=reason
    )


def _edit_lines(edit: Edit) -> set[tuple[int, int]]:
    out = set()
    if edit.forward is not None:
        out |= set(edit.forward.statements) | set(edit.forward.delete) | {edit.forward.anchor}
    for init in edit.init:
        out |= {init.replace} | set(init.delete)
    # a method added below another: claimed, so two rewrites through one helper add it once
    out |= {m.after for m in edit.methods}
    return out


def _touched_lines(edit: Edit) -> set[int]:
    """Every line an edit looks up a statement or expression on."""
    lines = {line for line, _ in _edit_lines(edit)}
    if edit.forward is not None:
        lines |= {at[0] for at in (e.at for e in edit.forward.statement_edits)}
        lines |= {e.extent[0] for e in edit.forward.expr_edits}
    return lines


_FIXER = None
_CURRENT: list = []  # (edit, errors) of the edit being applied


def _modify(node, capture, filename):
    from fissix.fixer_util import find_root

    edit, errors = _CURRENT[-1]
    try:
        apply_edit(find_root(node), edit)
    except BaseException as exc:  # surfaced after the traversal
        errors.append(exc)


def _bowler_apply(tree, edit: Edit, filename: str):
    """Run one edit as a bowler fixer (``select_root().modify(...)``) over the tree, in
    process: bowler builds and matches the fixer, we own reading and writing files."""
    global _FIXER
    if _FIXER is None:
        from bowler import Query

        _FIXER = Query().select_root().modify(_modify).compile()[0]
    fixer = _FIXER({"print_function": True}, [])
    fixer.set_filename(filename)
    errors: list[BaseException] = []
    _CURRENT.append((edit, errors))
    if not hasattr(tree, "used_names"):
        tree.used_names = set()  # set by the parser; clones lack it and BaseFix reads it
    try:
        fixer.start_tree(tree, filename)
        results = fixer.match(tree)
        if not results:
            raise Skip("bowler root selector did not match the module")
        fixer.transform(tree, results)
        fixer.finish_tree(tree, filename)
    finally:
        _CURRENT.pop()
    if errors:
        raise errors[0]
    return tree


def rewrite_source(
    text: str,
    matches: Iterable[Match],
    *,
    filename: str = "<string>",
    rules: Sequence = (),
    torchscript_guard: bool = True,
    scriptable_only: bool = False,
) -> RewriteResult:
    """Rewrite ``text`` (``\\n`` newlines) for ``matches``. Never raises for bad input:
    problems come back as outcomes (per match) or ``error`` (whole file).

    ``rules``: the rules in use (a match's rule is looked up there first, then in the registry).
    ``torchscript_guard``: keep the original statements for TorchScript
    (:mod:`adopter.rewrite.scripting`); a caller that rewrites in several passes guards once,
    after the last. ``scriptable_only``: only in functions TorchScript could compile."""
    matches = list(matches)
    try:
        ctx = FileContext(text, filename=filename)
    except SyntaxError as exc:
        return _all_skipped(text, matches, f"syntax error: {exc.msg} (line {exc.lineno})", filename)
    except (ValueError, RecursionError) as exc:  # null bytes; absurdly deep nesting
        return _all_skipped(text, matches, f"cannot analyze: {exc}", filename)

    outcomes: dict[int, MatchOutcome] = {}
    planned: list[tuple[int, Match, Edit]] = []
    deferred = False
    seen_keys: dict[tuple, int] = {}
    for index, match in enumerate(matches):
        key = match.key()
        if key in seen_keys:
            outcomes[index] = MatchOutcome(match, False, "duplicate of an earlier match")
            deferred = True
            continue
        seen_keys[key] = index
        unsettled = unsettled_reason(match)
        if unsettled:
            outcomes[index] = MatchOutcome(match, False, unsettled)
            continue
        # Rules without a hand-written codemod (user rules): synthesized from their DSL target.
        codemod = codemod_for(match, rules)
        if codemod is None:
            outcomes[index] = MatchOutcome(match, False, f"no codemod for rule {match.rule}")
            continue
        try:
            edit = codemod.analyze(match, ctx)
        except Skip as exc:
            outcomes[index] = MatchOutcome(match, False, str(exc), unplaced="not found" in str(exc))
            continue
        except Exception as exc:  # a codemod bug must not take the file down with it
            outcomes[index] = MatchOutcome(match, False, f"internal error in {match.rule} codemod: {exc!r}",
                                           unplaced=True)
            continue
        planned.append((index, match, edit))

    if not planned:
        return RewriteResult(new_text=text, outcomes=[outcomes[i] for i in range(len(matches))], deferred=deferred)
    # Only the top-level statements the edits touch are parsed with fissix (plus the header,
    # where kernel imports go): the rest of the file is copied as it is.
    edited_lines = {line for _, _, edit in planned for line in _touched_lines(edit)}
    try:
        partial = PartialTree.parse(text, ctx.tree, edited_lines, KERNELS_MODULE)
    except cst.ParseFailure as exc:
        return _all_skipped(text, matches, str(exc), filename)

    # Bigger matches first (a whole attention core beats a single op inside it), then by position.
    planned.sort(key=lambda item: (-len(item[1].nodes), min(item[1].lines or [0]), item[0]))
    claimed: dict[tuple[int, int], str] = {}
    applied_edits: list[Edit] = []
    imports: list[str] = []
    for index, match, edit in planned:
        if any(_same_change(edit, done) for done in applied_edits):
            # another pair of the same nn.Sequential: its rewrite is already there
            outcomes[index] = MatchOutcome(match, True)
            continue
        lines = _edit_lines(edit)
        clash = next((claimed[p] for p in lines if p in claimed), None)
        if clash is not None:
            outcomes[index] = MatchOutcome(match, False, f"overlaps a {clash} rewrite of the same statements")
            deferred = True
            continue
        # Edited in place (cloning the whole tree per edit was most of the apply time); an
        # edit that fails may leave the tree half done: it is then rebuilt from the text by
        # replaying the edits applied so far (deterministic; failures are rare).
        try:
            _bowler_apply(partial.root, edit, filename)
        except Skip as exc:
            outcomes[index] = MatchOutcome(match, False, str(exc), unplaced="not found" in str(exc))
            partial = _replay(partial.reparse(), applied_edits, filename)
            continue
        except Exception as exc:
            outcomes[index] = MatchOutcome(match, False, f"internal error applying {match.rule}: {exc!r}",
                                           unplaced=True)
            partial = _replay(partial.reparse(), applied_edits, filename)
            continue
        applied_edits.append(edit)
        for p in lines:
            claimed[p] = match.rule
        imports.extend(edit.imports)
        outcomes[index] = MatchOutcome(match, True)

    if imports:
        add_kernel_imports(partial.root, imports)
    try:
        spliced = partial.spliced()
    except cst.ParseFailure:
        # An edit replaced or moved a top-level statement, so the cut points between parsed
        # segments are lost: do it again on a tree of the whole file.
        partial = _replay(PartialTree.parse(text, ctx.tree, None, KERNELS_MODULE), applied_edits, filename)
        if imports:
            add_kernel_imports(partial.root, imports)
        spliced = partial.spliced()
    new_text = spliced.text
    segments = spliced.changed_segments
    if torchscript_guard and new_text != text:
        try:
            new_text = keep_original_for_torchscript(text, new_text, scriptable_only)
        except GuardError as exc:
            reason = f"cannot keep the original for TorchScript ({exc}); file left unchanged"
            return _all_failed(text, outcomes, matches, reason)
        segments = [(1, new_text)]
    if new_text != text:
        problem = _compile_problem(segments, filename)
        if problem:
            reason = f"rewritten code does not compile ({problem}); file left unchanged"
            return _all_failed(text, outcomes, matches, reason)
    ordered = [outcomes[i] for i in range(len(matches))]
    return RewriteResult(
        new_text=new_text, outcomes=ordered, diff=unified_diff(text, new_text, filename), deferred=deferred
    )


def _all_failed(text: str, outcomes: dict, matches: list, reason: str) -> RewriteResult:
    """The file left as it was: every match that applied reports ``reason``."""
    ordered = (outcomes[i] for i in range(len(matches)))
    return RewriteResult(
        new_text=text, outcomes=[MatchOutcome(o.match, False, reason) if o.applied else o for o in ordered],
        error=reason,
    )


def _same_change(a: Edit, b: Edit) -> bool:
    return a.forward == b.forward and a.init == b.init and a.imports == b.imports


def _compile_problem(segments: Sequence[tuple[int, str]], filename: str) -> str:
    """What keeps the first of ``segments`` ((first line, text) of each changed part of a
    file) from compiling, at its place in the file ("" when they all compile)."""
    for first_line, segment in segments:
        problem = _check_compiles("\n" * (first_line - 1) + segment, filename)
        if problem:
            return problem
    return ""


def _check_compiles(text: str, filename: str) -> str:
    """What keeps ``text`` from compiling ("" when nothing)."""
    try:
        compile(text, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        return f"{exc.msg} at line {exc.lineno}"
    return ""


def _replay(fresh: PartialTree, edits: Sequence[Edit], filename: str) -> PartialTree:
    """``fresh`` (a tree no edit touched yet) with ``edits`` applied (they all applied
    before, in this order)."""
    for edit in edits:
        _bowler_apply(fresh.root, edit, filename)
    return fresh


# ---------------------------------------------------------------- files


@dataclass
class FileRewrite:
    """What happened to one file. ``status``: changed | unchanged | skipped | failed."""

    path: str
    status: str
    outcomes: list[MatchOutcome] = field(default_factory=list)
    diff: str = ""
    reason: str = ""
    written: bool = False

    def to_json(self) -> dict:
        return {
            "file": self.path,
            "status": self.status,
            **({"reason": self.reason} if self.reason else {}),
            "applied": [o.to_json() for o in self.outcomes if o.applied],
            "skipped": [o.to_json() for o in self.outcomes if not o.applied],
            "written": self.written,
        }


MAX_PASSES = 3


def rewrite_file(
    path: str | os.PathLike, rules: Iterable | None = None, write: bool = False,
    max_bytes: int | None = DEFAULT_MAX_BYTES, torchscript: str = "auto",
    site_filter: MatchFilter | None = None,
) -> FileRewrite:
    """Scan ``path`` with ``rules`` (all when None), rewrite, and write when asked.
    ``torchscript``: when rewritten statements keep the original beside them for TorchScript
    (``auto``, ``always``, ``never``: :data:`adopter.rewrite.scripting.TORCHSCRIPT_CHOICES`).
    ``site_filter(matches, text)``: per match, why it is left alone ("" when it is not: suppression
    comments, per-file ignores, a baseline; :class:`adopter.core.suppress.SiteFilter`); the
    matches it names are reported as skipped with that reason.

    Every byte outside the edited lines stays as it was (line endings, encoding, BOM, final
    newline); the file is replaced atomically, only when the rewritten text compiles and only
    while the file is still what was read (:func:`adopter.rewrite.source_io.write_atomic`).
    ``max_bytes``: larger files are not read (``None``/0: no limit)."""
    from adopter.core.scan import one_file

    with one_file():
        return _rewrite_file(path, rules, write, max_bytes, torchscript, site_filter)


# (matches, text) -> per match, why it is left alone ("" when it is not)
MatchFilter = Callable[[Sequence[Match], str], Sequence[str]]


def rewrite_passes(text: str, name: str, rules: list, site_filter: MatchFilter | None = None,
                   ) -> tuple[str, list[MatchOutcome], FileRewrite | None]:
    """The scans and rewrites of one text up to the fixed point (see :func:`rewrite_file`), before
    the TorchScript guard and line wrapping: (rewritten text, outcomes, the file's result when it
    could not be rewritten). What ``adopter rewrite --check`` decides on, for a text in memory."""
    from adopter.core.scan import scan_source

    source_text = text
    outcomes: list[MatchOutcome] = []
    for number in range(MAX_PASSES):
        superseded: list[Match] = []
        try:
            matches = scan_source(text, name, rules, superseded=superseded)
        except SyntaxError as exc:
            return text, outcomes, FileRewrite(name, "failed", reason=f"syntax error: {exc.msg} (line {exc.lineno})")
        except RecursionError:
            return text, outcomes, FileRewrite(name, "failed", reason="file too deeply nested to analyze")
        except MemoryError:
            return text, outcomes, FileRewrite(name, "failed", reason="out of memory analysing it")
        left_alone: list[MatchOutcome] = []
        if site_filter is not None and matches:
            reasons = site_filter(matches, text)
            left_alone = [MatchOutcome(m, False, r) for m, r in zip(matches, reasons) if r]
            matches = [m for m, r in zip(matches, reasons) if not r]
        if not matches:
            if number == 0:
                outcomes.extend(left_alone)
            break
        result = rewrite_source(text, matches, filename=name, rules=rules, torchscript_guard=False)
        if result.error:
            if text != source_text:
                break  # keep what earlier passes achieved
            status = "skipped" if result.error.startswith("fissix") else "failed"
            return text, outcomes, FileRewrite(name, status, left_alone + result.outcomes, reason=result.error)
        # Later passes only add what is new: matches skipped again are reported once.
        outcomes.extend(result.applied if number else left_alone + result.outcomes)
        if not result.changed:
            break
        text = result.new_text
        if not (superseded or result.deferred):
            break
    return text, outcomes, None


def _rewrite_file(path: str | os.PathLike, rules: Iterable | None, write: bool, max_bytes: int | None,
                  torchscript: str = "auto", site_filter: MatchFilter | None = None) -> FileRewrite:
    name = str(path)
    try:
        source = read_source(name, max_bytes)
    except SourceReadError as exc:
        return FileRewrite(name, "skipped" if exc.skipped else "failed", reason=exc.message)
    if rules is None:
        from adopter.core.rules import all_rules

        rules = all_rules()
    rules = list(rules)
    # Scan and rewrite until nothing is left: a match set aside for another one on the same
    # statements (the matcher keeps one match per set of nodes; the engine one rewrite per
    # statement) may apply once the other is rewritten, so that needs another pass. A run
    # therefore reaches the fixed point and running it again changes nothing. Without such
    # a match the next scan would find only what this pass skipped for its own reasons
    # (measured on the 530 transformers model files: a later pass applied something in
    # one file, which had such a match), so it is not run.
    text, outcomes, stopped = rewrite_passes(source.text, name, rules, site_filter)
    if stopped is not None:
        return stopped
    if text == source.text:
        return FileRewrite(name, "unchanged", outcomes)
    guard = guard_options(torchscript, name, source.text)
    try:
        if guard["torchscript_guard"]:
            text = keep_original_for_torchscript(source.text, text, guard["scriptable_only"])
    except GuardError as exc:
        reason = f"cannot keep the original for TorchScript ({exc}); file left unchanged"
        return FileRewrite(name, "failed", [MatchOutcome(o.match, False, reason) if o.applied else o for o in outcomes],
                           reason=reason)
    text = wrap_long_lines(source.text, text, line_limit(name, source.text))  # the user's line length
    result = RewriteResult(new_text=text, outcomes=outcomes, diff=unified_diff(source.text, text, name))
    written = False
    if write:
        try:
            written = write_atomic(name, source.encode_text(result.new_text), source.stamp)
        except WriteRefused as exc:
            return FileRewrite(name, "failed", result.outcomes, result.diff, reason=str(exc))
        except (OSError, UnicodeEncodeError) as exc:
            return FileRewrite(name, "failed", result.outcomes, result.diff, reason=f"cannot write: {exc}")
        if not written:  # another run wrote this very rewrite meanwhile: not this run's write
            return FileRewrite(name, "unchanged", result.outcomes, result.diff,
                               reason="already rewritten meanwhile (by another run)")
    return FileRewrite(name, "changed", result.outcomes, result.diff, written=written)
