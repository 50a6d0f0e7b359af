"""``adopter rewrite --model package.module:Class``: print, check or write exactly the rewritten
source ``optimize()`` proved equivalent for the class (``OptimizeReport.sources``: per file, the
text it read and the text the returned class was built from and checked).

A write goes through the same guards as the static ``rewrite --write``: read-only files and
symbolic links are left alone unless ``--force`` (:func:`write_protections`), the file is replaced
atomically keeping its encoding and newlines (:mod:`adopter.rewrite.source_io`), and only if it
still holds the text ``optimize()`` read. Not a command (``adopter.cli.COMMANDS`` lists those).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field


@dataclass
class ModelFile:
    path: str  # real path, as optimize() read it
    shown: str  # relative to the working directory when under it
    status: str = "changed"  # changed | skipped | failed
    diff: str = ""
    reason: str = ""
    written: bool = False
    rewrites: list[dict] = field(default_factory=list)
    # the suppression comments added so that a static --check agrees: {"rule", "line", "reason"}
    suppressions: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"file": self.shown, "status": self.status, "written": self.written, "diff": self.diff,
                "applied": self.rewrites, "suppressions": self.suppressions,
                **({"reason": self.reason} if self.reason else {})}


def shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies under it, else as it is."""
    cwd = os.path.realpath(os.getcwd())
    real = os.path.realpath(path)
    if real.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(real, cwd)
    return path


def _under(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _honouring_suppressions(config):
    """optimize()'s rewrite step, leaving alone the sites a suppression comment or a per-file
    ignore names (reported as not applied, with the comment)."""
    from adopter.core.suppress import SiteFilter
    from adopter.optimizing.optimize import Pipeline, RewriteOutput

    default = Pipeline().rewrite

    def rewrite(text, matches, filename, rules=()):
        reasons = SiteFilter(ignored_rules=config.ignored_rules(filename))(matches, text)
        kept = [m for m, r in zip(matches, reasons) if not r]
        out = default(text, kept, filename, rules=rules) if kept else RewriteOutput(text, [], [], "")
        out.failed = [(m, r) for m, r in zip(matches, reasons) if r] + out.failed
        return out

    return Pipeline(rewrite=rewrite)


def _optimize(args, user):
    """(optimized class, AdopterWarning texts); UserError when optimize() cannot run. The project's
    settings (``args.project_config``, from the rewrite command) say which sites it leaves alone."""
    from adopter.commands.scan import select_rules
    from adopter.core.project_config import ProjectConfig
    from adopter.errors import UserError
    from adopter.optimizing.optimize import AdopterWarning, OptimizeError, optimize
    from adopter.tracing.user_model import cli_wording

    rules = select_rules(args) if (args.rules or args.rules_file) else None
    device = args.device or "cpu"
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always", AdopterWarning)
        try:
            optimized = optimize(user.model_cls, rules=rules, init_args=user.init_args, init_kwargs=user.init_kwargs,
                                 example_inputs=user.inputs_on(device), device=device,
                                 torchscript=getattr(args, "torchscript", None) or "auto",
                                 pipeline=_honouring_suppressions(getattr(args, "project_config", None)
                                                                  or ProjectConfig()))
        except OptimizeError as exc:
            raise UserError(f"cannot optimize {user.label}: {cli_wording(str(exc))}") from None
    return optimized, [str(w.message) for w in recorded if issubclass(w.category, AdopterWarning)]


# SkippedRewrite.kind -> why, in the suppression comment written for a site --check would rewrite
_DECIDED = {
    "not-executed": "not executed under the trace",
    "untraced": "not reached by the trace",
    "rejected": "rejected by the trace",
    "runtime-only": "runtime-only under the trace",
    "not-equivalent": "not equivalent under the trace",
    "not-equivalent-combined": "not equivalent with the other rewrites",
    "not-equivalent-flipped": "not equivalent under a flipped config",
    "rewrite-failed": "its rewrite failed under --model",
    "load-failed": "its rewrite does not load",
    "build-failed": "its rewrite does not build",
}
_UNDECIDED = "not applied by adopter rewrite --model"


def _old_lines(old: str, new: str) -> dict[int, int]:
    """Line of ``new`` -> the same line of ``old`` (1-based), for the lines the rewrite kept."""
    import difflib

    out: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, old.split("\n"), new.split("\n"), autojunk=False)
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            out.update({j1 + k + 1: i1 + k + 1 for k in range(i2 - i1)})
    return out


def _decision(match, path: str, skipped, old_line: dict[int, int]) -> str:
    """Why optimize() left ``match`` (a site of the rewritten text) alone, in a few words."""
    from adopter.core.suppress import site_lines

    lines = {old_line[n] for n in site_lines(match) if n in old_line}
    real = os.path.realpath(path)
    for s in skipped:
        if s.rule == match.rule and os.path.realpath(s.file) == real and lines & set(s.lines):
            return _DECIDED.get(s.kind, _UNDECIDED)
    return _UNDECIDED


def _with_comment(text: str, line: int, comment: str, limit: int) -> str | None:
    """``text`` with ``comment`` after the code of ``line`` (after a comment already there), its
    ``-- reason`` dropped when the line would pass ``limit``; None when a comment cannot end that
    line (it ends inside a string) or the program would change."""
    import ast
    import io
    import tokenize

    lines = text.split("\n")
    if not 0 < line <= len(lines):
        return None
    base = lines[line - 1].rstrip()
    candidate = f"{base}  {comment}"
    if len(candidate) > limit and " -- " in comment:
        candidate = f"{base}  {comment.split(' -- ', 1)[0]}"
    new_lines = [*lines[: line - 1], candidate, *lines[line:]]
    new = "\n".join(new_lines)
    try:
        lands = any(t.type == tokenize.COMMENT and t.start[0] == line and t.string.endswith(candidate[len(base) + 2:])
                    for t in tokenize.generate_tokens(io.StringIO(new).readline))
        if not lands or ast.dump(ast.parse(new)) != ast.dump(ast.parse(text)):
            return None
    except (SyntaxError, tokenize.TokenError, ValueError):
        return None
    return new


def _settle_for_check(path: str, old: str, new: str, skipped, rules, site_filter, limit: int
                      ) -> tuple[str, list[dict], list[str]]:
    """``new`` with a suppression comment on each site a static ``adopter rewrite --check`` would
    still rewrite (the trace decided against it), so that the check agrees with what --model wrote:
    (text, the comments added, sites no comment could be placed on)."""
    from adopter.core.scan import scan_source
    from adopter.core.suppress import site_lines, suppression_comment
    from adopter.rewrite import rewrite_source

    old_line = _old_lines(old, new)  # (a comment added at a line's end moves no line)
    text, added, unplaced = new, [], []
    for _ in range(10):  # (each round comments every site the check's first pass would rewrite)
        try:
            matches = scan_source(text, path, rules)
        except (SyntaxError, RecursionError, MemoryError):
            break
        reasons = site_filter(matches, text)
        matches = [m for m, r in zip(matches, reasons) if not r]
        if not matches:
            break
        result = rewrite_source(text, matches, filename=path, rules=rules, torchscript_guard=False)
        applied = [o.match for o in result.outcomes if o.applied]
        if result.error or not result.changed or not applied:
            break
        before = text
        for m in applied:
            reason = _decision(m, path, skipped, old_line)
            comment = suppression_comment(m.rule, reason)
            placed = next((t for t in (_with_comment(text, n, comment, limit) for n in site_lines(m)) if t), None)
            if placed is None:
                unplaced.append(f"{m.rule} at line {min(site_lines(m) or [0])}")
                continue
            text = placed
            added.append({"rule": m.rule, "line": min(n for n in site_lines(m)), "reason": reason})
        if text == before:
            break
    return text, added, unplaced


def _suppress_what_check_would_apply(args, config, report, sources: dict, roots: list[str], notes: list[str]
                                     ) -> dict[str, list[dict]]:
    """Per file of the class under ``roots``: the suppression comments added to ``sources`` (file ->
    (text read, text to write), files optimize() did not change included) for the sites a static
    --check, with the same rules and project settings, would still rewrite."""
    from adopter.commands._project import load_baseline, site_filter
    from adopter.commands.scan import select_rules
    from adopter.core.project_config import ProjectConfig
    from adopter.core.source_file import SourceReadError
    from adopter.rewrite.line_length import line_limit
    from adopter.rewrite.source_io import read_source

    config = config or ProjectConfig()
    rules = select_rules(args)
    baseline = load_baseline(getattr(args, "baseline", None) or config.baseline)
    added: dict[str, list[dict]] = {}
    for path in sorted(set(sources) | set(getattr(report, "files", ()))):
        if not os.path.isfile(path) or not _under(path, roots) or config.excluded(path):
            continue
        if path in sources:
            old, new = sources[path]
        else:
            try:
                old = new = read_source(path).text
            except SourceReadError:
                continue
        text, comments, unplaced = _settle_for_check(path, old, new, report.skipped, rules,
                                                     site_filter(path, config, baseline), line_limit(path, old))
        if comments:
            sources[path] = (old, text)
            added[path] = comments
        notes.extend(f"{shown_path(path)}: {u}: no line of it can carry a suppression comment; adopter rewrite "
                     "--check would still rewrite it" for u in unplaced)
    return added


def run_model(args, config=None) -> int:
    from adopter.commands._inputs import split_python_paths, write_protections
    from adopter.commands._model import resolve_user_model
    from adopter.core.source_file import SourceReadError
    from adopter.errors import UserError
    from adopter.rewrite.line_length import line_limit, wrap_long_lines
    from adopter.rewrite.source_io import WriteRefused, read_source, unified_diff, write_atomic

    if args.model_args and not args.model:
        raise UserError("--model-args needs --model package.module:Class")
    paths, not_python = split_python_paths(args.paths)
    for p in paths:
        if not os.path.exists(p):
            raise UserError(f"no such file or directory: {p}")
    # stdout is the diff's / report's: what the model's code prints goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        user = resolve_user_model(args, needed=True)
    args.project_config = config
    with contextlib.redirect_stdout(sys.stderr):
        optimized, notes = _optimize(args, user)
    report = optimized.adopter_report

    # the files that may change: under the paths given, else under the working directory (not the
    # installed packages a class may draw from)
    roots = [os.path.realpath(p) for p in paths] or [os.path.realpath(os.getcwd())]
    outside = "not under the paths given" if paths else "outside the working directory (give its directory as PATH)"
    files: list[ModelFile] = []
    # what optimize() proved, laid out to the project's line length as `adopter rewrite PATH` does
    # (rewrite/line_length.py: layout only, the syntax tree stays the one proven)
    sources = {path: (old, wrap_long_lines(old, new, line_limit(path, old)))
               for path, (old, new) in report.sources.items()}
    added = _suppress_what_check_would_apply(args, config, report, sources, roots, notes)
    for path in sorted(sources):
        old, new = sources[path]
        shown = shown_path(path)
        entry = ModelFile(path, shown, diff=unified_diff(old, new, shown))
        entry.rewrites = [{"rule": a.rule, "lines": a.lines, "where": a.where, "status": a.status}
                          for a in report.applied if os.path.realpath(a.file) == os.path.realpath(path)]
        entry.suppressions = added.get(path, [])
        if not _under(path, roots):
            entry.status, entry.reason = "skipped", outside
        files.append(entry)

    protected = write_protections([f.path for f in files], roots) if args.write else {}
    failed = False
    for f in files:
        if f.status != "changed" or not args.write:
            continue
        why = "" if args.force else protected.get(f.path)
        if why:
            f.status, f.reason = "skipped", f"not written: the file {why}; use --force to write it anyway"
            failed = True
            continue
        target = os.path.realpath(f.path) if args.force else f.path
        old, new = sources[f.path]
        try:
            current = read_source(target)
        except SourceReadError as exc:
            f.status, f.reason = "failed", exc.message
            failed = True
            continue
        if current.text != old:
            f.status, f.reason = "failed", "changed since optimize() read it; not written (run again)"
            failed = True
            continue
        try:
            written = write_atomic(target, current.encode_text(new), current.stamp)
        except WriteRefused as exc:
            f.status, f.reason = "failed", str(exc)
            failed = True
            continue
        except (OSError, UnicodeEncodeError) as exc:
            f.status, f.reason = "failed", f"cannot write: {exc}"
            failed = True
            continue
        if not written:  # another run wrote this very text meanwhile
            f.status, f.reason = "unchanged", "already rewritten meanwhile (by another run)"
            continue
        f.written = True

    changed = [f for f in files if f.status == "changed"]
    rewrites = sum(len(f.rewrites) for f in changed if f.written or not args.write)
    eq = report.equivalence
    proof = ("equivalent to the original" if eq is not None and eq.equivalent else "not checked")
    if report.flipped_equivalence is not None:
        proof += ", and under the flipped config" if report.flipped_equivalence.equivalent else ""
    summary = (
        f"{user.label}: {len(changed)} file(s) {'rewritten' if args.write else 'would change'}, "
        f"{sum(f.status == 'skipped' for f in files) + len(not_python)} skipped, "
        f"{sum(f.status == 'failed' for f in files)} failed ({rewrites} rewrite(s) "
        f"{'written to disk' if args.write else 'would be applied'}, {len(report.skipped)} match(es) not applied; "
        f"{'traced' if report.traced else 'not traced'}; {proof})"
    )
    if args.format == "json":
        payload = {
            "mode": "write" if args.write else "check" if args.check else "diff",
            "model": user.ref,
            "class": user.label,
            "files": [f.to_json() for f in files]
            + [{"file": s["file"], "status": "skipped", "reason": s["reason"], "written": False, "diff": "",
                "applied": []} for s in not_python],
            "summary": {"changed": len(changed), "rewrites": rewrites, "traced": report.traced,
                        "equivalent": bool(eq is not None and eq.equivalent)},
            "warnings": notes,
            "report": report.to_json(),
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out, err = sys.stdout, sys.stderr
        for s in not_python:
            err.write(f"{s['file']}: skipped: {s['reason']}\n")
        for f in files:
            if f.status == "changed":
                if args.write:
                    out.write(f"rewrote {f.shown}\n")
                elif args.check:
                    out.write(f"would rewrite {f.shown}\n")
                else:
                    out.write(f.diff)
            else:
                err.write(f"{f.shown}: {f.status}: {f.reason}\n")
        for a in report.applied:
            err.write(f"applied {a.rule} at {shown_path(a.file)}:{a.lines[0] if a.lines else '?'} [{a.status}]\n")
        for f in files:
            for s in f.suppressions:
                err.write(f"suppressed {s['rule']} at {f.shown}:{s['line']} (# adopter: ignore, so that "
                          f"adopter rewrite --check agrees): {s['reason']}\n")
        if args.verbose:
            for s in report.skipped:
                err.write(f"not applied {s.rule} at {s.where}: {s.reason}\n")
        elif report.skipped:
            err.write(f"{len(report.skipped)} match(es) not applied (-v lists them with the reason)\n")
        for note in notes:
            err.write(f"warning: {note}\n")
        err.write(summary + "\n")
    if failed:
        return 2
    if args.check and changed:
        return 1
    return 0
