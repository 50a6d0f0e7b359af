"""`adopter scan PATH...`: find where the rules' kernels fit, without importing the scanned code."""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap

from adopter.core.structures import PRECISION_CODES

HELP = "find places in model source where a kernel rule applies (static; optional runtime confirmation)"

_CODE_WIDTH = max(map(len, PRECISION_CODES)) + 2  # (the longest code and two spaces before its text)

DESCRIPTION = """\
Find places in model source where a kernel rule applies, without importing the scanned code.

Each match has a status: `static` (the kernel applies), `conditional` (it applies only under a
configuration the source does not settle: the condition is shown; `--model` settles it by
tracing: confirmed or rejected), or `refused` (the pattern fits but a precision precondition
of the kernel fails; shown with its code). Codes:
""" + "".join(textwrap.fill(text, 96, initial_indent=f"  {code:<{_CODE_WIDTH}}", subsequent_indent=" " * (_CODE_WIDTH + 2))
              + "\n" for code, text in PRECISION_CODES.items()) + """\
Only `static` (and, with --model, `confirmed`) matches are predictions; `adopter rewrite` never
applies a conditional or refused match (`adopter rewrite --model package.module:Class` applies
the ones a trace confirms). With --model every match gets a runtime status (confirmed,
not-executed, untraced, rejected, runtime-only); refused ones stay refused; an untraced,
not-executed or rejected one names its cause in JSON and SARIF as trace_code (not-in-model,
lines-not-run, runtime-check...: adopter.tracing.TRACE_CODES). --model imports and runs the
model's code; without it nothing scanned is imported.

--format sarif writes SARIF 2.1.0 (GitHub code scanning and other SARIF viewers): one result per
match, ruleId the rule, level warning for static/confirmed/runtime-only, note for conditional,
none (kind informational) for refused/rejected/not-executed/untraced; the message says the
status and its reason or condition, the region the matched lines; tool.driver.rules describes
the rules in use. Paths are relative to the working directory (%SRCROOT%)."""

PROGRESS_MIN_FILES = 20


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories (recursive over *.py)")
    parser.add_argument("--format", choices=("text", "json", "sarif"), default="text",
                        help="output format (default: text; sarif: SARIF 2.1.0, described above)")
    parser.add_argument("--rules", metavar="NAME,...", help="comma-separated rule names (default: all built-in rules)")
    parser.add_argument("--rules-file", metavar="FILE", action="append", default=[],
                        help="rules written in the DSL (syntax: `pydoc adopter.core.dsl_text`); used instead of the "
                             "built-in rules unless --rules also names some; may repeat")
    from adopter.commands._model import USER_MODEL_EPILOG, add_model_args

    add_model_args(parser, help_prefix="confirm matches by tracing this model (imports torch): ")
    parser.epilog = USER_MODEL_EPILOG + "\n" + (parser.epilog or "")
    parser.add_argument("--device", metavar="DEV", default=None, help="device for --model tracing (default: cpu)")
    parser.add_argument("--no-progress", action="store_true", help="never draw a progress bar on stderr")
    parser.add_argument("--jobs", "-j", type=int, default=0, metavar="N",
                        help="worker processes (default: one per CPU; 1 = in process)")
    add_max_file_size(parser)
    from adopter.commands._project import add_config_argument

    add_config_argument(parser)


def add_max_file_size(parser) -> None:
    from adopter.core.source_file import DEFAULT_MAX_BYTES, format_size

    parser.add_argument("--max-file-size", metavar="SIZE", default=None,
                        help=f"larger files are reported and not read (default: {format_size(DEFAULT_MAX_BYTES)}; "
                             "e.g. 8M, 512K, 0 = no limit): analysis needs about 200x a file's size in memory")


def max_file_size(args) -> int | None:
    """Bytes from ``--max-file-size`` (the default when not given; None: no limit)."""
    from adopter.core.source_file import DEFAULT_MAX_BYTES, parse_size
    from adopter.errors import UserError

    raw = getattr(args, "max_file_size", None)
    if raw is None:
        return DEFAULT_MAX_BYTES
    try:
        return parse_size(raw) or None
    except ValueError as exc:
        raise UserError(f"--max-file-size: {exc}") from None


def select_rules(args) -> list:
    """Rules from ``--rules`` / ``--rules-file`` (all built-in ones when neither is given)."""
    from adopter.core.dsl_text import DSLSyntaxError
    from adopter.core.rules import UnknownRuleError, all_rules, get_rules, load_rules_file
    from adopter.core.source_file import SourceReadError
    from adopter.errors import UserError

    rules = []
    if args.rules:
        try:
            rules = get_rules(args.rules.split(","))
        except UnknownRuleError as exc:
            raise UserError(str(exc)) from None
        if not rules:
            raise UserError("--rules names no rule")
    for path in args.rules_file:
        try:
            rules.extend(load_rules_file(path))
        except SourceReadError as exc:
            raise UserError(exc.message) from None
        except OSError as exc:
            raise UserError(f"cannot read rules file {path}: {exc.strerror or exc}") from None
        except DSLSyntaxError as exc:
            raise UserError(f"bad rules file: {exc}") from None
    if not args.rules and not args.rules_file:
        rules = all_rules()
    return rules


class _Progress:
    def __init__(self, stream):
        self.stream = stream
        self.width = 30

    def __call__(self, done: int, total: int, name: str) -> None:
        filled = int(self.width * done / max(total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\rscanning [{bar}] {done}/{total}")
        if done == total:
            self.stream.write("\r" + " " * (self.width + 30) + "\r")
        self.stream.flush()


def _format_lines(lines: list[int]) -> str:
    if not lines:
        return "-"
    lo, hi = min(lines), max(lines)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _status_text(m) -> str:
    """``static``, ``conditional (needs-config: GeLU only if ...)``, ``refused (dim-not-last: ...)``,
    ``confirmed (runs ...; condition: ...)``."""
    if m.status == "refused":
        return f"refused ({m.code}: {m.reason})"
    if m.status == "conditional":
        return f"conditional ({m.code}: {m.condition})" + (f" [{m.reason}]" if m.reason else "")
    detail = [m.reason] if m.reason else []
    if m.condition:
        detail.append(f"{m.code or 'condition'}: {m.condition}")
    return m.status + (f" ({'; '.join(detail)})" if detail else "")


def suppressed_matches(report, config) -> dict[int, str]:
    """index in ``report.matches`` -> why a suppression comment or per-file ignore of the project
    leaves that match alone (what ``adopter rewrite`` does with it); the text is read again."""
    from adopter.core.source_file import SourceReadError, read_source
    from adopter.core.suppress import SiteFilter

    by_file: dict[str, list[int]] = {}
    for i, m in enumerate(report.matches):
        by_file.setdefault(m.file, []).append(i)
    out: dict[int, str] = {}
    for file, indexes in by_file.items():
        try:
            text = read_source(file, None).text
        except SourceReadError:
            continue
        reasons = SiteFilter(ignored_rules=config.ignored_rules(file))([report.matches[i] for i in indexes], text)
        out.update((i, r) for i, r in zip(indexes, reasons) if r)
    return out


def format_text(report, confirmed: bool, skipped: int = 0, suppressed: dict[int, str] | None = None) -> str:
    out: list[str] = []
    suppressed = suppressed or {}
    by_file: dict[str, list] = {}
    for i, m in enumerate(report.matches):
        by_file.setdefault(m.file, []).append((i, m))
    for file in sorted(by_file):
        out.append(file)
        rows = []
        for i, m in sorted(by_file[file], key=lambda item: (item[1].lines[:1] or [0], item[1].rule)):
            where = f"{m.class_name}.{m.function}" if m.class_name else m.function
            status = _status_text(m) + (f" [{suppressed[i]}]" if i in suppressed else "")
            rows.append((f"line {_format_lines(m.lines)}", m.rule, where, status))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            out.append("  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
        out.append("")
    for e in report.errors:
        out.append(f"error: {e.file}: {e.message}")
    if report.errors:
        out.append("")
    counts = report.counts()
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    found = sum(counts.values())
    conditional = sum(m.status == "conditional" for m in report.matches)
    refused = report.refused_counts()
    if conditional:
        summary += f"; {conditional} conditional"
    if refused:
        summary += f"; refused {sum(refused.values())}: " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items()))
    if suppressed:
        summary += f"; {len(suppressed)} suppressed"
    matched_files = len({m.file for m in report.matches if m.status != "refused"})
    out.append(
        f"{found} match{'es' if found != 1 else ''} in {matched_files} "
        f"file{'s' if matched_files != 1 else ''} ({report.files_scanned} scanned, "
        + (f"{skipped} skipped, " if skipped else "")
        + f"{len(report.errors)} "
        f"error{'s' if len(report.errors) != 1 else ''}, {report.seconds:.2f} s)" + (f": {summary}" if summary else "")
    )
    return "\n".join(out)


def run(args) -> int:
    from adopter.commands._inputs import split_python_paths
    from adopter.commands._project import load_project, warn_unknown_names
    from adopter.core.scan import collect_files, scan_paths
    from adopter.errors import UserError

    config = load_project(args, args.paths)  # [tool.adopter]: what the command line leaves open
    rules = select_rules(args)
    from adopter.commands._model import resolve_user_model

    # --model package.module:Name imports the user's module (opt-in); stdout is the report's, so
    # what the model's code prints while it is imported, built and traced goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        user = resolve_user_model(args)
    # A named file that is not Python: a one-line notice, counted as skipped (text and JSON).
    args.paths, not_python = split_python_paths(args.paths)
    max_bytes = max_file_size(args)
    try:
        files = collect_files(args.paths).files
    except (FileNotFoundError, PermissionError) as exc:
        raise UserError(str(exc)) from None
    if config.exclude:
        kept = [f for f in files if not config.excluded(str(f))]
        if len(kept) != len(files):  # (a directory given holds excluded files: scan the others by name)
            files, args.paths = kept, [str(f) for f in kept]
    progress = None
    if not args.no_progress and len(files) > PROGRESS_MIN_FILES and sys.stderr.isatty():
        progress = _Progress(sys.stderr)
    jobs = getattr(args, "jobs", 0) or 0
    if jobs < 0:
        raise UserError("--jobs must be >= 0")
    report = scan_paths(args.paths, rules, progress=progress, jobs=jobs, max_bytes=max_bytes)
    # A path that is not a Python source (not Python; not a regular file: a FIFO, a device):
    # a one-line notice, counted as skipped (text and JSON).
    not_python += [{"file": e.file, "reason": e.message} for e in report.skipped]
    for s in not_python:
        print(f"adopter scan: skipping {s['file']}: {s['reason']}", file=sys.stderr)

    if args.model:
        try:
            from adopter.tracing import confirm_model_id
        except ImportError as exc:
            raise UserError(f"--model needs the tracing extras: {exc}") from None
        import inspect

        kwargs = {}
        if "scanned_files" in inspect.signature(confirm_model_id).parameters:
            kwargs["scanned_files"] = [str(f) for f in files]
            kwargs["rules"] = rules
        target = args.model
        device = args.device
        if user is not None:
            from adopter.tracing.models import default_device

            device = device or default_device()
            target = user.model_cls
            kwargs.update(user.build_kwargs(device))
        try:
            with contextlib.redirect_stdout(sys.stderr):
                report.matches = list(confirm_model_id(report.matches, target, device=device, **kwargs))
        except UserError:
            raise
        except Exception as exc:
            msg = str(exc).strip().splitlines()
            first = msg[0] if msg else type(exc).__name__
            if user is not None:
                from adopter.tracing.models import TracingError
                from adopter.tracing.user_model import cli_wording

                if isinstance(exc, TracingError):  # the user's model cannot be built or fed
                    raise UserError(f"--model {args.model}: {cli_wording(first)}") from None
            raise UserError(f"tracing {args.model} failed: {first}") from None

    suppressed = suppressed_matches(report, config)
    if args.format == "json":
        payload = report.to_json()
        for i, reason in suppressed.items():
            payload["matches"][i]["suppressed"] = reason
        payload["skipped"] = not_python
        sys.stdout.write(json.dumps(payload) + "\n")
    elif args.format == "sarif":
        from adopter.commands._sarif import to_sarif

        sys.stdout.write(json.dumps(to_sarif(report, rules, skipped=not_python, suppressed=suppressed), indent=1)
                         + "\n")
    else:
        warn_unknown_names([str(f) for f in files], rules)
        print(format_text(report, confirmed=bool(args.model), skipped=len(not_python), suppressed=suppressed))
    # Keep going past a file that cannot be analysed (every other file is scanned and
    # reported), then say so in the exit status: 2, as for every command (`adopter --help`);
    # also for a path named on the command line that is not a regular file.
    return 2 if report.errors or report.named_skipped else 0
