"""Scanning library: files -> extraction -> matching -> :class:`ScanReport`.

Never imports or executes the scanned code: extraction parses it with ``ast``.
A file that cannot be read, decoded or parsed becomes an entry in ``errors`` and the
scan goes on.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adopter.core.extract import extract_source
from adopter.core.match import match_structures
from adopter.core.rules import all_rules
from adopter.core.source_file import DEFAULT_MAX_BYTES, SourceReadError, file_kind, read_source
from adopter.core.structures import Match
from adopter.core.syntax import clear_file_caches

__all__ = [
    "CollectedFiles", "ScanError", "ScanReport", "collect_files", "default_jobs", "one_file", "scan_file", "scan_paths", "scan_source",
]

SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".mypy_cache", ".pytest_cache", "node_modules"}


@dataclass(frozen=True)
class ScanError:
    file: str
    message: str

    def to_json(self) -> dict:
        return {"file": self.file, "message": self.message}


@dataclass
class ScanReport:
    """``matches``: every match found, in file order — ``static`` and ``conditional`` ones and
    the ``refused`` ones (the pattern fits but a precision precondition fails; see
    :data:`adopter.core.match.PRECISION_CODES`): only ``static`` (after a trace, ``confirmed``)
    matches are predictions of where a kernel applies."""

    files_scanned: int
    seconds: float
    errors: list[ScanError] = field(default_factory=list)
    matches: list[Match] = field(default_factory=list)
    # Paths left alone with a notice (not regular files); ``named_skipped`` of them were named
    # on the command line (exit status 2).
    skipped: list[ScanError] = field(default_factory=list)
    named_skipped: int = 0

    def counts(self) -> dict[str, int]:
        """Matches per rule, ``refused`` ones left out (see :meth:`refused_counts`)."""
        out: dict[str, int] = {}
        for m in self.matches:
            if m.status != "refused":
                out[m.rule] = out.get(m.rule, 0) + 1
        return out

    def refused_counts(self) -> dict[str, int]:
        """``refused`` matches per precision code."""
        out: dict[str, int] = {}
        for m in self.matches:
            if m.status == "refused":
                out[m.code] = out.get(m.code, 0) + 1
        return out

    def to_json(self) -> dict:
        return {
            "files_scanned": self.files_scanned,
            "seconds": round(self.seconds, 3),
            "errors": [e.to_json() for e in self.errors],
            "matches": [m.to_json() for m in self.matches],
            "skipped": [{"file": e.file, "reason": e.message} for e in self.skipped],
        }


@dataclass
class CollectedFiles:
    """What :func:`collect_files` found: the files to read, those left alone with a notice
    (not regular files: FIFOs, devices, sockets; ``named`` ones were given on the command
    line), and paths that could not be searched or opened (a symbolic link loop, an
    unreadable directory): errors, the other files are still processed."""

    files: list[Path] = field(default_factory=list)
    skipped: list[ScanError] = field(default_factory=list)
    errors: list[ScanError] = field(default_factory=list)
    named_skipped: int = 0  # how many of ``skipped`` were named directly (exit status 2)


def collect_files(paths: Sequence[str | os.PathLike]) -> CollectedFiles:
    """Python files named by ``paths``: files as given, directories recursively (``*.py``,
    sorted, skipping VCS/cache directories); only regular files (see :class:`CollectedFiles`).
    Raises ``FileNotFoundError`` for a path that does not exist and ``PermissionError`` for a
    file or directory given that cannot be read."""
    out = CollectedFiles()
    seen: set[str] = set()
    for raw in paths:
        p = Path(raw)
        try:
            st = os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                out.errors.append(ScanError(str(raw), "symbolic link loop"))
                continue
            if not os.path.lexists(p):
                raise FileNotFoundError(f"no such file or directory: {raw}") from None
            out.errors.append(ScanError(str(raw), f"cannot read: {exc.strerror or exc}"))
            continue
        if stat.S_ISDIR(st.st_mode):
            if not os.access(p, os.R_OK | os.X_OK):
                raise PermissionError(f"directory not readable: {raw}")
            found = []

            def unreadable(exc: OSError) -> None:
                out.errors.append(ScanError(str(exc.filename), "directory not readable: "
                                            + (exc.strerror or str(exc)).lower() + "; its files were not checked"))

            for root, dirs, files in os.walk(p, onerror=unreadable):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
                found.extend(Path(root) / f for f in files if f.endswith(".py"))
            candidates, named = sorted(found), False
        else:
            if stat.S_ISREG(st.st_mode) and not os.access(p, os.R_OK):
                raise PermissionError(f"file not readable: {raw}")
            candidates, named = [p], True
        for c in candidates:
            try:
                mode = os.stat(c).st_mode
            except OSError as exc:
                message = "symbolic link loop" if exc.errno == errno.ELOOP else f"cannot read: {exc.strerror or exc}"
                out.errors.append(ScanError(str(c), message))
                continue
            if not stat.S_ISREG(mode):
                out.skipped.append(ScanError(str(c), f"not a regular file ({file_kind(mode)})"))
                out.named_skipped += named
                continue
            key = os.path.realpath(c)
            if key not in seen:
                seen.add(key)
                out.files.append(c)
    return out


def scan_source(
    text: str,
    filename: str,
    rules: Iterable,
    rejected: list[Match] | None = None,
    superseded: list[Match] | None = None,
    type_hints: dict | None = None,
) -> list[Match]:
    """Matches of ``rules`` in one source text (raises ``SyntaxError`` when it does not parse).
    Matches dropped by a rule precondition are appended to ``rejected`` when given, those
    set aside for an overlapping match of the same rule to ``superseded``. ``type_hints``: layer
    types seen at run time for attributes the source leaves unresolved (see ``extract_source``)."""
    return match_structures(
        extract_source(text, filename, type_hints), list(rules), rejected, source=text, superseded=superseded
    )


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        where = f"line {exc.lineno}" + (f", column {exc.offset}" if exc.offset else "")
        return f"syntax error: {exc.msg} ({where})"
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def with_refused(structures, rules: Iterable, text: str) -> list[Match]:
    """The matches of one file plus its ``refused`` ones (the pattern fits, a precision
    precondition fails: reported with their code, never rewritten), in source order."""
    rejected: list[Match] = []
    matches = match_structures(structures, rules, rejected, source=text)
    refused = [m for m in rejected if m.status == "refused"]
    if not refused:
        return matches
    return sorted(matches + refused, key=lambda m: (m.lines[:1] or [0], m.rule))


def scan_file(path: str | os.PathLike, rules: Iterable, max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[Match]:
    """Matches of ``rules`` in one file (raises :class:`SourceReadError`, ``SyntaxError``)."""
    return scan_source(read_source(path, max_bytes).text, str(path), rules)


def _scan_one(name: str, rules: list, max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[list[Match], ScanError | None]:
    """Matches and error (``None`` when none) of one file; never raises but ``ImportError``."""
    with one_file():
        return _scan_one_file(name, rules, max_bytes)


def _scan_one_file(name: str, rules: list, max_bytes: int | None) -> tuple[list[Match], ScanError | None]:
    try:
        text = read_source(name, max_bytes).text
    except SourceReadError as exc:
        return [], ScanError(name, exc.message)
    try:
        structures = extract_source(text, name)
    except SyntaxError as exc:
        return [], ScanError(name, _one_line(exc))
    except RecursionError:
        return [], ScanError(name, "too deeply nested to analyse")
    except MemoryError:
        return [], ScanError(name, "out of memory analysing it")
    except ImportError:
        raise
    except Exception as exc:  # an extraction bug must not stop the scan
        return [], ScanError(name, "extraction failed: " + _one_line(exc))
    try:
        return with_refused(structures, rules, text), None
    except MemoryError:
        return [], ScanError(name, "out of memory analysing it")
    except Exception as exc:
        return [], ScanError(name, "matching failed: " + _one_line(exc))


# Analysis allocates many objects and few reference cycles: with the default thresholds the
# cyclic collector runs (over every live object, syntax trees included) so often that it costs
# about a quarter of scan and rewrite time. Between files (the workers' own allocations) it runs
# this rarely; within one file it does not run at all (:func:`one_file`).
GC_THRESHOLDS = (1_000_000, 20, 20)

_FILE_DEPTH = [0]


@contextlib.contextmanager
def one_file() -> Iterator[None]:
    """The analysis of one file: the cyclic collector off inside (a file's analysis makes few
    cycles, and a collection in its middle traverses every tree and table it has built), then
    the file's caches dropped (:func:`adopter.core.syntax.clear_file_caches`: its trees go with
    them) and one collection of the young objects, the file's own cycles. Re-entrant: an inner
    block does nothing of its own."""
    _FILE_DEPTH[0] += 1
    enabled = gc.isenabled() if _FILE_DEPTH[0] == 1 else False
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        _FILE_DEPTH[0] -= 1
        if _FILE_DEPTH[0] == 0:
            clear_file_caches()
            gc.collect(0)
            if enabled:
                gc.enable()


def default_jobs() -> int:
    """Worker processes used when none are asked for: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# With jobs chosen automatically, fewer files than this are scanned in process.
PARALLEL_MIN_FILES = 8

# Worker-process state: the rules, set once per process (inherited when forked).
_WORKER_RULES: list | None = None
_WORKER_MAX_BYTES: int | None = DEFAULT_MAX_BYTES


def _init_worker(rules: list, max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
    global _WORKER_RULES, _WORKER_MAX_BYTES

    _WORKER_RULES, _WORKER_MAX_BYTES = rules, max_bytes
    # Objects inherited from the parent are never garbage: keep the collector off them, and
    # collect less often (extraction allocates many short-lived objects, few cycles).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _scan_chunk(chunk: list[tuple[int, str]]) -> list[tuple[int, list[Match], ScanError | None]]:
    rules = _WORKER_RULES if _WORKER_RULES is not None else []
    return [(index, *_scan_one(name, rules, _WORKER_MAX_BYTES)) for index, name in chunk]


def _pool_context(rules: list):
    """A multiprocessing context whose workers can get ``rules``, or None (scan in process).

    Forked workers inherit the rules (rule objects may hold closures that do not pickle);
    elsewhere the rules must pickle."""
    import multiprocessing as mp

    if "fork" in mp.get_all_start_methods():
        return mp.get_context("fork")
    import pickle

    try:
        pickle.dumps(rules)
    except Exception:
        return None
    return mp.get_context()


def _chunks(files: list[Path], jobs: int) -> list[list[tuple[int, str]]]:
    """Files as ``(index, name)`` chunks, largest files first (the long ones start early and
    the small ones fill in at the end), chunks small enough to keep every worker busy."""
    def size(item):
        try:
            return item[1].stat().st_size
        except OSError:
            return 0

    order = sorted(enumerate(files), key=lambda item: (-size(item), item[0]))
    per_chunk = max(1, min(8, len(order) // (jobs * 8)))
    items = [(i, str(f)) for i, f in order]
    return [items[k:k + per_chunk] for k in range(0, len(items), per_chunk)]


def scan_paths(
    paths: Sequence[str | os.PathLike],
    rules: Iterable | None = None,
    *,
    progress: Callable[[int, int, str], None] | None = None,
    jobs: int | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> ScanReport:
    """Scan files and directories with ``rules`` (all built-in rules when None).

    ``jobs``: worker processes (``None`` or 0: one per CPU, or in process for fewer than
    ``PARALLEL_MIN_FILES`` files; 1: in this process). Results
    do not depend on it: matches and errors come in file order. ``max_bytes``: larger files
    are errors, not read (``None``/0: no limit).
    ``progress(done, total, file)`` is called after each file. Raises what
    :func:`collect_files` raises for missing/unreadable top-level paths; problems with
    individual files end up in ``ScanReport.errors``.
    """
    rules = list(all_rules() if rules is None else rules)
    start = time.perf_counter()
    collected = collect_files(paths)
    files = collected.files
    report = ScanReport(files_scanned=0, seconds=0.0, errors=list(collected.errors), skipped=collected.skipped,
                        named_skipped=collected.named_skipped)
    if jobs is not None and jobs < 0:
        raise ValueError("jobs must be >= 0")
    if not jobs:  # automatic: a few files are not worth starting processes for
        jobs = default_jobs() if len(files) >= PARALLEL_MIN_FILES else 1
    jobs = min(jobs, len(files))
    context = _pool_context(rules) if jobs > 1 else None
    results: list[tuple[list[Match], ScanError | None] | None] = [None] * len(files)
    if context is None:
        for i, f in enumerate(files):
            results[i] = _scan_one(str(f), rules, max_bytes)
            if progress is not None:
                progress(i + 1, len(files), str(f))
    else:
        done = 0
        with context.Pool(jobs, initializer=_init_worker, initargs=(rules, max_bytes)) as pool:
            for chunk in pool.imap_unordered(_scan_chunk, _chunks(files, jobs)):
                for index, matches, error in chunk:
                    results[index] = (matches, error)
                    done += 1
                    if progress is not None:
                        progress(done, len(files), str(files[index]))
    for matches, error in results:
        if error is not None:
            report.errors.append(error)
        report.matches.extend(matches)
        report.files_scanned += 1
    report.seconds = time.perf_counter() - start
    return report
