"""`adopter rewrite PATH...`: rewrite model source to use the kernels (bowler/fissix).

Default is ``--diff``: print unified diffs, change nothing. ``--write`` applies them
(atomically, only files whose result compiles), ``--check`` exits 1 when anything would
change (CI / pre-commit). Exit codes: 0 ok, 1 changes pending under --check, 2 when any file
could not be analysed or written (every other file is still processed). ``--write`` leaves alone,
with a message, a read-only file and a file that is (or lies through) a symbolic link out of
the paths given, unless ``--force``. A path that is not Python is skipped with a notice.
"""

from __future__ import annotations

import json
import os
import sys

HELP = "rewrite model source to use the optimized kernels (prints diffs unless --write)"


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories (recursive over *.py)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--diff", action="store_true", help="print unified diffs and change nothing (default)")
    mode.add_argument("--write", action="store_true", help="write the rewritten files (atomic, keeps encoding/newlines)")
    mode.add_argument("--check", action="store_true", help="exit 1 when any file would change; writes nothing")
    parser.add_argument("--rules", metavar="NAME,...", help="comma-separated rule names (default: all built-in rules)")
    parser.add_argument("--rules-file", metavar="FILE", action="append", default=[],
                        help="rules written in the DSL, applied by synthesis from their target patterns; used "
                             "instead of the built-in rules unless --rules also names some; may repeat")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("--jobs", "-j", type=int, default=0, metavar="N",
                        help="worker processes (default: CPU count; 1 = in process)")
    parser.add_argument("--verbose", "-v", action="store_true", help="also list every skipped match with its reason")
    parser.add_argument("--force", action="store_true",
                        help="with --write, also replace read-only files and files reached through a symbolic "
                             "link (the link's target is written; the link stays)")


_RULES: dict = {}  # (rule names, rule files) -> rules, built once per process

# A rewrite that changes what the code returns says so in a comment on the rewritten line
# (``# adopter: logits None when training with labels ...``); the summary repeats those.
_NOTE_COMMENT = "# adopter: "


def _rewrite_notes(results, write: bool) -> list[str]:
    """``<file>:<line>: <note>`` for each note comment a rewrite added (line numbers of the rewritten
    file; under --write only files written to disk)."""
    notes = []
    for r in results:
        if r.status != "changed" or (write and not r.written):
            continue
        line = 0
        for text in r.diff.splitlines():
            if text.startswith("@@"):
                # "@@ -a,b +c,d @@": the next line of the new file is c
                line = int(text.split("+", 1)[1].split(",", 1)[0].split(" ", 1)[0]) - 1
            elif text.startswith("+") and not text.startswith("+++"):
                line += 1
                if _NOTE_COMMENT in text:
                    notes.append(f"{r.path}:{line}: {text.split(_NOTE_COMMENT, 1)[1].strip()}")
            elif not text.startswith(("-", "\\")):
                line += 1
    return notes


def _rewrite_indexed(item):
    index, task = item
    return index, _rewrite_one(task)


def _init_worker() -> None:
    import gc

    from adopter.core.scan import GC_THRESHOLDS

    gc.freeze()  # what a forked worker inherits is never garbage
    gc.set_threshold(*GC_THRESHOLDS)


def _rewrite_one(task: tuple[str, str | None, tuple[str, ...], bool]):
    """Worker: rules travel as their names and rule files (rule objects hold closures that do
    not pickle) and are rebuilt here exactly as the parent validated them."""
    import argparse

    from adopter.commands.scan import select_rules
    from adopter.rewrite import FileRewrite, rewrite_file

    path, rule_names, rule_files, write = task
    key = (rule_names, tuple(rule_files))
    rules = _RULES.get(key)
    if rules is None:  # once per process
        rules = _RULES[key] = select_rules(argparse.Namespace(rules=rule_names, rules_file=list(rule_files)))
    try:
        return rewrite_file(path, rules, write=write)
    except Exception as exc:  # one bad file must not stop the run
        return FileRewrite(path, "failed", reason=f"internal error: {exc!r}")


def run(args) -> int:
    from adopter.commands._inputs import split_python_paths, write_protections
    from adopter.commands.scan import select_rules
    from adopter.core.scan import collect_files
    from adopter.errors import UserError

    select_rules(args)  # validate names and rule files once, with one-line errors
    if args.force and not args.write:
        raise UserError("--force only applies to --write")
    paths, not_python = split_python_paths(args.paths)
    try:
        files = [str(f) for f in collect_files(paths)]
    except (FileNotFoundError, PermissionError) as exc:
        raise UserError(str(exc)) from None
    if args.jobs < 0:
        raise UserError("--jobs must be >= 0")
    # A file --write must not replace (read-only; a symbolic link, or outside the paths given)
    # is still rewritten in memory, so the message can say whether it would have changed.
    protected = write_protections(files, paths) if args.write else {}
    if args.force:
        # through a link: write its target, so the link stays a link
        files = [os.path.realpath(f) if protected.get(f) else f for f in files]
        protected = {}
    tasks = [(f, args.rules, tuple(args.rules_file), bool(args.write) and not protected.get(f)) for f in files]
    from adopter.core.scan import default_jobs

    jobs = min(args.jobs or default_jobs(), max(len(tasks), 1))
    if jobs <= 1 or len(tasks) <= 1:
        results = [_rewrite_one(t) for t in tasks]
    else:
        import multiprocessing as mp

        import adopter.rewrite  # noqa: F401  (loaded before forking: workers start with it)

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)

        def size(path: str) -> int:
            try:
                return os.path.getsize(path)
            except OSError:
                return 0

        # Largest files first (the long ones start early, small ones fill in at the end);
        # results go back to input order: output is deterministic whatever finishes first.
        order = sorted(range(len(tasks)), key=lambda i: (-size(tasks[i][0]), i))
        results = [None] * len(tasks)
        with ctx.Pool(jobs, initializer=_init_worker) as pool:
            for index, result in pool.imap_unordered(_rewrite_indexed, [(i, tasks[i]) for i in order]):
                results[index] = result

    for r in results:
        why = protected.get(r.path)
        if why and r.status == "changed":
            r.status = "skipped"
            r.reason = f"not written: the file {why}; use --force to write it anyway"
    counts = {"changed": 0, "unchanged": 0, "skipped": 0, "failed": 0}
    applied = skipped_matches = 0
    for r in results:
        counts[r.status] += 1
        # Under --write, count only what reached the disk (not a file whose write failed).
        if r.written or not args.write:
            applied += sum(1 for o in r.outcomes if o.applied)
        skipped_matches += sum(1 for o in r.outcomes if not o.applied)
    counts["skipped"] += len(not_python)
    summary = (
        f"{counts['changed']} file(s) {'rewritten' if args.write else 'would change'}, "
        f"{counts['unchanged']} unchanged, {counts['skipped']} skipped, {counts['failed']} failed "
        f"({applied} rewrite(s) {'written to disk' if args.write else 'would be applied'}, "
        f"{skipped_matches} match(es) skipped)"
    )
    if args.format == "json":
        payload = {
            "mode": "write" if args.write else "check" if args.check else "diff",
            "files": [dict(r.to_json(), diff=r.diff) for r in results]
            + [{"file": s["file"], "status": "skipped", "reason": s["reason"], "applied": [], "skipped": [],
                "written": False, "diff": ""} for s in not_python],
            "summary": dict(counts, rewrites=applied, skipped_matches=skipped_matches),
            "notes": _rewrite_notes(results, bool(args.write)),
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out, err = sys.stdout, sys.stderr
        for s in not_python:
            err.write(f"{s['file']}: skipped: {s['reason']}\n")
        for r in results:
            if r.status == "changed":
                if args.write:
                    out.write(f"rewrote {r.path}\n")
                elif not args.check:
                    out.write(r.diff)
                else:
                    out.write(f"would rewrite {r.path}\n")
            elif r.status in ("skipped", "failed"):
                err.write(f"{r.path}: {r.status}: {r.reason}\n")
            if args.verbose:
                for o in r.outcomes:
                    if not o.applied:
                        lines = ",".join(str(n) for n in o.match.lines)
                        err.write(f"{r.path}:{lines}: {o.match.rule} ({o.match.class_name or o.match.function}) "
                                  f"skipped: {o.reason}\n")
        for note in _rewrite_notes(results, bool(args.write)):
            err.write(f"note: {note}\n")
        err.write(summary + "\n")
    if counts["failed"] or any(protected.get(r.path) and r.status == "skipped" for r in results):
        return 2  # some file could not be analysed, or could not be written
    if args.check and counts["changed"]:
        return 1
    return 0
