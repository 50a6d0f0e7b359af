"""Scanning library: files -> extraction -> matching -> :class:`ScanReport`.

Never imports or executes the scanned code: extraction parses it with ``ast``.
A file that cannot be read, decoded or parsed becomes an entry in ``errors`` and the
scan goes on.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adopter.core.extract import extract_source
from adopter.core.match import match_structures
from adopter.core.rules import all_rules
from adopter.core.structures import Match

__all__ = [
    "ScanError", "ScanReport", "collect_files", "default_jobs", "relaxed_gc", "scan_file", "scan_paths", "scan_source",
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
        }


def collect_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Python files named by ``paths``: files as given, directories recursively (``*.py``,
    sorted, skipping VCS/cache directories). Raises ``FileNotFoundError`` for a path that
    does not exist and ``PermissionError`` for a file or directory that cannot be read."""
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"no such file or directory: {raw}")
        if p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK):
                raise PermissionError(f"directory not readable: {raw}")
            found = []
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
                found.extend(Path(root) / f for f in files if f.endswith(".py"))
            candidates = sorted(found)
        else:
            if not os.access(p, os.R_OK):
                raise PermissionError(f"file not readable: {raw}")
            candidates = [p]
        for c in candidates:
            key = c.resolve()
            if key not in seen:
                seen.add(key)
                out.append(c)
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


def scan_file(path: str | os.PathLike, rules: Iterable) -> list[Match]:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    return scan_source(text, str(p), rules)


def _scan_one(name: str, rules: list) -> tuple[list[Match], ScanError | None]:
    """Matches and error (``None`` when none) of one file; never raises but ``ImportError``."""
    try:
        text = Path(name).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return [], ScanError(name, f"not UTF-8 text: {exc.reason} at byte {exc.start}")
    except OSError as exc:
        return [], ScanError(name, f"cannot read: {exc.strerror or exc}")
    try:
        structures = extract_source(text, name)
    except SyntaxError as exc:
        return [], ScanError(name, _one_line(exc))
    except RecursionError:
        return [], ScanError(name, "too deeply nested to analyse")
    except ImportError:
        raise
    except Exception as exc:  # an extraction bug must not stop the scan
        return [], ScanError(name, "extraction failed: " + _one_line(exc))
    try:
        return with_refused(structures, rules, text), None
    except Exception as exc:
        return [], ScanError(name, "matching failed: " + _one_line(exc))


# Analysis allocates many objects and few reference cycles: with the default thresholds
# the cyclic collector runs (over every live object, syntax trees included) so often that
# it costs about a quarter of scan and rewrite time.
GC_THRESHOLDS = (1_000_000, 20, 20)


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    """Run the cyclic garbage collector less often inside the block (restored after)."""
    old = gc.get_threshold()
    if old[0] >= GC_THRESHOLDS[0] or not gc.isenabled():
        yield
        return
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


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


def _init_worker(rules: list) -> None:
    global _WORKER_RULES

    _WORKER_RULES = rules
    # Objects inherited from the parent are never garbage: keep the collector off them, and
    # collect less often (extraction allocates many short-lived objects, few cycles).
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _scan_chunk(chunk: list[tuple[int, str]]) -> list[tuple[int, list[Match], ScanError | None]]:
    rules = _WORKER_RULES if _WORKER_RULES is not None else []
    return [(index, *_scan_one(name, rules)) for index, name in chunk]


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
) -> ScanReport:
    """Scan files and directories with ``rules`` (all built-in rules when None).

    ``jobs``: worker processes (``None`` or 0: one per CPU, or in process for fewer than
    ``PARALLEL_MIN_FILES`` files; 1: in this process). Results
    do not depend on it: matches and errors come in file order.
    ``progress(done, total, file)`` is called after each file. Raises what
    :func:`collect_files` raises for missing/unreadable top-level paths; problems with
    individual files end up in ``ScanReport.errors``.
    """
    rules = list(all_rules() if rules is None else rules)
    start = time.perf_counter()
    files = collect_files(paths)
    report = ScanReport(files_scanned=0, seconds=0.0)
    if jobs is not None and jobs < 0:
        raise ValueError("jobs must be >= 0")
    if not jobs:  # automatic: a few files are not worth starting processes for
        jobs = default_jobs() if len(files) >= PARALLEL_MIN_FILES else 1
    jobs = min(jobs, len(files))
    context = _pool_context(rules) if jobs > 1 else None
    results: list[tuple[list[Match], ScanError | None] | None] = [None] * len(files)
    if context is None:
        with relaxed_gc():
            for i, f in enumerate(files):
                results[i] = _scan_one(str(f), rules)
                if progress is not None:
                    progress(i + 1, len(files), str(f))
    else:
        done = 0
        with context.Pool(jobs, initializer=_init_worker, initargs=(rules,)) as pool:
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
