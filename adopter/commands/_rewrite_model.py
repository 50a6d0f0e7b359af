"""``adopter rewrite --model package.module:Class``: print, check or write exactly the rewritten
source ``optimize()`` proved equivalent for the class (``OptimizeReport.sources``: per file, the
text it read and the text the returned class was built from and checked).

A write goes through the same guards as the static ``rewrite --write``: read-only files and
symbolic links are left alone unless ``--force`` (:func:`write_protections`), the file is replaced
atomically keeping its encoding and newlines (:mod:`adopter.rewrite.source_io`), and only if it
still holds the text ``optimize()`` read. Not a command (``adopter.cli.COMMANDS`` lists those).
"""

from __future__ import annotations

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

    def to_json(self) -> dict:
        return {"file": self.shown, "status": self.status, "written": self.written, "diff": self.diff,
                "applied": self.rewrites, **({"reason": self.reason} if self.reason else {})}


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


def _optimize(args, user):
    """(optimized class, AdopterWarning texts); UserError when optimize() cannot run."""
    from adopter.commands.scan import select_rules
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
                                 torchscript=getattr(args, "torchscript", "auto"))
        except OptimizeError as exc:
            raise UserError(f"cannot optimize {user.label}: {cli_wording(str(exc))}") from None
    return optimized, [str(w.message) for w in recorded if issubclass(w.category, AdopterWarning)]


def run_model(args) -> int:
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
    user = resolve_user_model(args, needed=True)
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
    for path in sorted(sources):
        old, new = sources[path]
        shown = shown_path(path)
        entry = ModelFile(path, shown, diff=unified_diff(old, new, shown))
        entry.rewrites = [{"rule": a.rule, "lines": a.lines, "where": a.where, "status": a.status}
                          for a in report.applied if os.path.realpath(a.file) == os.path.realpath(path)]
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
