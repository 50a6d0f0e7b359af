"""`adopter rewrite PATH...`: rewrite model source to use the kernels (bowler/fissix).

Default is ``--diff``: print unified diffs, change nothing. ``--write`` applies them
(atomically, only files whose result compiles), ``--check`` exits 1 when anything would
change (CI / pre-commit). Exit codes: 0 ok, 1 changes pending under --check, 2 when any file
could not be analysed or written (every other file is still processed). ``--write`` leaves alone,
with a message, a read-only file and a file that is (or lies through) a symbolic link out of
the paths given, unless ``--force``. A path that is not Python is skipped with a notice.

``--model package.module:Class`` (with ``--model-args``) rewrites from a trace instead: it runs
``optimize()`` on the class and prints (``--write``: writes, ``--check``: checks) exactly the
rewritten source ``optimize()`` proved equivalent, conditional matches the trace confirmed
included (see :mod:`adopter.commands._rewrite_model`).
"""

from __future__ import annotations

import json
import os
import sys

HELP = "rewrite model source to use the optimized kernels (prints diffs unless --write)"

DESCRIPTION = """\
Rewrite model source to use the optimized kernels (prints diffs unless --write).

Statically (PATH...): every `static` match is rewritten; a `conditional` match (one that holds only
under a configuration the source does not settle, see `adopter scan --help`) and a `refused` one
never are. --check exits 1 when any file would change and writes nothing (CI, pre-commit).

From a trace (--model package.module:Class): adopter imports your class, builds it with the
arguments and example inputs of --model-args (or a factory's), and runs optimize() on it: scan,
torch.fx trace (which settles conditional matches), rewrite, equivalence check forward and
backward per rule and all together, and a second check with the config values the rewritten
sites read flipped. What is printed (--diff), checked (--check) or written (--write) is exactly
the rewritten source optimize() proved equivalent, for each file of the class's package it
changed under the working directory (or under PATH... when given), with diff paths relative
to the working directory. --write
replaces a file atomically, keeping its encoding and newlines, and only if it is still the text
optimize() read (else: changed since read, not written, exit 2); it leaves read-only files and
symbolic links alone unless --force, as the static --write does; on each site a static --check
would still rewrite but the trace decided against, it adds a `# adopter: ignore[rule] -- why`
comment, so that --check on the files written then passes.

Left alone, as the project says (docs/commands.md): a site whose line carries `# adopter:
ignore[rule, ...]` (or a bare `# adopter: ignore`), a file with `# adopter: ignore-file[...]`, the
rules and files [tool.adopter] in pyproject.toml switches off (select, ignore, per-file-ignores,
exclude), and the sites recorded in a baseline (--baseline FILE, or the table's `baseline`;
--save-baseline FILE records the sites a check would rewrite today)."""


def add_arguments(parser):
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="Python files or directories (recursive over *.py); with --model: where the files "
                             "optimize() rewrote may be changed (default: the working directory)")
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
    # (adopter.rewrite.scripting.TORCHSCRIPT_CHOICES, written out: importing it loads fissix for every
    # `adopter` command line; tests/cli/test_scan_cli.py keeps the two the same)
    parser.add_argument("--torchscript", choices=("auto", "always", "never"), default=None,
                        help="keep the original statements beside each rewritten region, under "
                             "`if torch.jit.is_scripting():`, for TorchScript: auto (default; [tool.adopter] "
                             "torchscript sets another) only in packages that "
                             "use TorchScript and only in functions it could compile; always; never")
    from adopter.commands._project import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--baseline", metavar="FILE", default=None,
                        help="leave alone the sites recorded in this baseline (default: [tool.adopter] baseline)")
    parser.add_argument("--save-baseline", metavar="FILE", default=None,
                        help="record every site that would be rewritten in FILE (a JSON baseline) and change "
                             "nothing: later runs with --baseline FILE leave them alone")
    from adopter.commands.scan import add_max_file_size

    add_max_file_size(parser)
    parser.add_argument("--force", action="store_true",
                        help="with --write, also replace read-only files and files reached through a symbolic "
                             "link (the link's target is written; the link stays)")
    from adopter.commands._model import USER_MODEL_EPILOG, add_model_args

    add_model_args(parser, user_only=True, help_prefix="rewrite what optimize() proves on this class (a trace "
                                                      "settles conditional matches) instead of the static matches of "
                                                      "PATH...: ")
    parser.add_argument("--device", default=None, help="with --model: where to build and check it (default: cpu)")
    parser.epilog = USER_MODEL_EPILOG + "\n" + (parser.epilog or "")


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


def _left_alone(results) -> dict[str, int]:
    """Matches left alone on the project's word, by kind: a suppression comment or per-file
    ignore (``suppressed``), the baseline (``in baseline``), recorded by --save-baseline."""
    from adopter.core.suppress import BASELINE_REASON, COMMENT_REASON, PER_FILE_REASON, RECORDED_REASON

    out = {"suppressed": 0, "in baseline": 0, "recorded": 0}
    for r in results:
        for o in r.outcomes:
            if o.applied:
                continue
            if o.reason == BASELINE_REASON:
                out["in baseline"] += 1
            elif o.reason == RECORDED_REASON:
                out["recorded"] += 1
            elif o.reason.startswith(COMMENT_REASON) or o.reason == PER_FILE_REASON:
                out["suppressed"] += 1
    return out


def _outcome_texts(results, reason: str):
    """(path, text, matches) per file holding outcomes left alone for ``reason`` (the text their
    positions refer to: nothing was rewritten before them)."""
    from adopter.core.source_file import SourceReadError
    from adopter.rewrite.source_io import read_source

    for r in results:
        matches = [o.match for o in r.outcomes if not o.applied and o.reason == reason]
        if not matches:
            continue
        try:
            text = read_source(r.path, None).text
        except SourceReadError:
            continue
        yield r.path, text, matches


def _save_baseline(path: str, results) -> str:
    from adopter.core.suppress import RECORDED_REASON, Baseline
    from adopter.errors import UserError

    baseline = Baseline(os.path.dirname(os.path.abspath(path)))
    for file, text, matches in _outcome_texts(results, RECORDED_REASON):
        for m in matches:
            baseline.add(file, m, text)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(baseline.to_json(), fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write baseline {path}: {exc.strerror or exc}") from None
    total = sum(baseline.counts.values())
    return f"recorded {total} site(s) in {path}: adopter rewrite --check --baseline {path} leaves them alone"


def _stale_entries(baseline, results) -> int:
    """Entries of the baseline, for the files this run checked, that no site used."""
    from collections import Counter

    from adopter.core.suppress import BASELINE_REASON, fingerprint, scope_of

    used: Counter = Counter()
    for file, text, matches in _outcome_texts(results, BASELINE_REASON):
        for m in matches:
            used[(baseline.relative(file), m.rule, scope_of(m), fingerprint(m, text))] += 1
    checked = {baseline.relative(r.path) for r in results if r.status in ("changed", "unchanged")}
    return sum(max(n - used[k], 0) for k, n in baseline.counts.items() if k[0] in checked)


def _rewrite_indexed(item):
    index, task = item
    return index, _rewrite_one(task)


def _init_worker() -> None:
    import gc

    from adopter.core.scan import GC_THRESHOLDS

    gc.freeze()  # what a forked worker inherits is never garbage
    gc.set_threshold(*GC_THRESHOLDS)


def _rewrite_one(task: tuple[str, str | None, tuple[str, ...], bool, int | None, str, object]):
    """Worker: rules travel as their names and rule files (rule objects hold closures that do
    not pickle) and are rebuilt here exactly as the parent validated them."""
    import argparse

    from adopter.commands.scan import select_rules
    from adopter.rewrite import FileRewrite, rewrite_file

    path, rule_names, rule_files, write, max_bytes, torchscript, site_filter = task
    key = (rule_names, tuple(rule_files))
    rules = _RULES.get(key)
    if rules is None:  # once per process
        rules = _RULES[key] = select_rules(argparse.Namespace(rules=rule_names, rules_file=list(rule_files)))
    try:
        return rewrite_file(path, rules, write=write, max_bytes=max_bytes, torchscript=torchscript,
                            site_filter=site_filter)
    except Exception as exc:  # one bad file must not stop the run
        return FileRewrite(path, "failed", reason=f"internal error: {exc!r}")


def run(args) -> int:
    from adopter.commands._inputs import split_python_paths, write_protections
    from adopter.commands._project import load_baseline, load_project, site_filter, warn_unknown_names
    from adopter.commands.scan import max_file_size, select_rules
    from adopter.core.scan import collect_files
    from adopter.errors import UserError
    from adopter.rewrite import FileRewrite

    config = load_project(args, args.paths)  # [tool.adopter]: what the command line leaves open
    rules = select_rules(args)  # validate names and rule files once, with one-line errors
    if args.force and not args.write:
        raise UserError("--force only applies to --write")
    if args.save_baseline and (args.write or args.model or args.model_args):
        raise UserError("--save-baseline records the static sites and writes no source: not with --write or --model")
    if args.model or args.model_args:
        from adopter.commands._rewrite_model import run_model

        return run_model(args, config)
    if args.device:
        raise UserError("--device only applies to --model")
    if not args.paths:
        raise UserError("give the PATHs to rewrite, or --model package.module:Class to rewrite from a trace")
    paths, not_python = split_python_paths(args.paths)
    max_bytes = max_file_size(args)
    try:
        collected = collect_files(paths)
    except (FileNotFoundError, PermissionError) as exc:
        raise UserError(str(exc)) from None
    files = [str(f) for f in collected.files if not config.excluded(str(f))]
    excluded = len(collected.files) - len(files)
    # what a --save-baseline run records starts from no baseline
    baseline = None if args.save_baseline else load_baseline(args.baseline or config.baseline)
    # not regular files (a FIFO, a device): a notice, counted as skipped (exit 2 when named)
    not_python += [{"file": e.file, "reason": e.message} for e in collected.skipped]
    if args.jobs < 0:
        raise UserError("--jobs must be >= 0")
    # A file --write must not replace (read-only; a symbolic link, or outside the paths given)
    # is still rewritten in memory, so the message can say whether it would have changed.
    protected = write_protections(files, paths) if args.write else {}
    if args.force:
        # through a link: write its target, so the link stays a link
        files = [os.path.realpath(f) if protected.get(f) else f for f in files]
        protected = {}
    filters = {f: site_filter(f, config, baseline, record=bool(args.save_baseline)) for f in files}
    tasks = [(f, args.rules, tuple(args.rules_file), bool(args.write) and not protected.get(f), max_bytes,
              args.torchscript, filters.get(f))
             for f in files]
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

    # paths that could not be searched or opened (a symbolic link loop, an unreadable directory)
    results = [FileRewrite(e.file, "failed", reason=e.message) for e in collected.errors] + results
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
    left_alone = _left_alone(results)
    summary = (
        f"{counts['changed']} file(s) {'rewritten' if args.write else 'would change'}, "
        f"{counts['unchanged']} unchanged, {counts['skipped']} skipped, {counts['failed']} failed "
        f"({applied} rewrite(s) {'written to disk' if args.write else 'would be applied'}, "
        f"{skipped_matches} match(es) skipped"
        + "".join(f", {n} {what}" for what, n in left_alone.items() if n)
        + (f"; {excluded} file(s) excluded by [tool.adopter]" if excluded else "") + ")"
    )
    notes: list[str] = []
    if args.save_baseline:
        notes.append(_save_baseline(args.save_baseline, results))
    elif baseline is not None:
        stale = _stale_entries(baseline, results)
        if stale:
            notes.append(f"{stale} baseline entr{'y' if stale == 1 else 'ies'} of the files checked match no site "
                         "any more (fixed or removed); --save-baseline rewrites the baseline without them")
    not_written = sum(1 for r in results if protected.get(r.path) and r.status == "skipped")
    if not_written:
        # the exit status is 2 for these: say so where the counts are
        summary += f"; {not_written} file(s) not written (read-only or a link; --force writes them): exit status 2"
    if args.format == "json":
        payload = {
            "mode": "write" if args.write else "check" if args.check else "diff",
            "files": [dict(r.to_json(), diff=r.diff) for r in results]
            + [{"file": s["file"], "status": "skipped", "reason": s["reason"], "applied": [], "skipped": [],
                "written": False, "diff": ""} for s in not_python],
            "summary": dict(counts, rewrites=applied, skipped_matches=skipped_matches, not_written=not_written,
                            **{what.replace(" ", "_"): n for what, n in left_alone.items()}, excluded=excluded),
            "notes": _rewrite_notes(results, bool(args.write)) + notes,
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out, err = sys.stdout, sys.stderr
        for s in not_python:
            err.write(f"{s['file']}: skipped: {s['reason']}\n")
        warn_unknown_names(files, rules, err)
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
            for o in r.outcomes:
                if o.unplaced and not args.verbose:  # an analysis bug: never silent
                    lines = ",".join(str(n) for n in o.match.lines)
                    err.write(f"{r.path}:{lines}: warning: {o.match.rule} ({o.match.class_name or o.match.function}) "
                              f"could not be placed in the source, not applied: {o.reason}\n")
            if args.verbose:
                for o in r.outcomes:
                    if not o.applied:
                        lines = ",".join(str(n) for n in o.match.lines)
                        err.write(f"{r.path}:{lines}: {o.match.rule} ({o.match.class_name or o.match.function}) "
                                  f"skipped: {o.reason}\n")
        for note in _rewrite_notes(results, bool(args.write)) + notes:
            err.write(f"note: {note}\n")
        conditional = sum(1 for r in results for o in r.outcomes if not o.applied and o.match.status == "conditional")
        if conditional:
            err.write(f"note: {conditional} conditional match(es) not applied: a trace settles them; "
                      "adopter rewrite --model package.module:Class [--model-args FILE.json] --write applies the "
                      "ones it confirms (see adopter rewrite --help)\n")
        err.write(summary + "\n")
    if counts["failed"] or not_written or collected.named_skipped:
        return 2  # some file could not be analysed, or could not be written
    if args.check and counts["changed"]:
        return 1
    return 0
