"""Scanning library: files -> extraction -> matching -> :class:`ScanReport`.

Never imports or executes the scanned code: extraction parses it with ``ast``.
A file that cannot be read, decoded or parsed becomes an entry in ``errors`` and the
scan goes on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adopter.core.structures import Match

__all__ = ["ScanError", "ScanReport", "collect_files", "scan_file", "scan_paths", "scan_source"]

SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".mypy_cache", ".pytest_cache", "node_modules"}


@dataclass(frozen=True)
class ScanError:
    file: str
    message: str

    def to_json(self) -> dict:
        return {"file": self.file, "message": self.message}


@dataclass
class ScanReport:
    files_scanned: int
    seconds: float
    errors: list[ScanError] = field(default_factory=list)
    matches: list[Match] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.matches:
            out[m.rule] = out.get(m.rule, 0) + 1
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


def _extract(text: str, filename: str):
    from adopter.core.extract import extract_source  # written in parallel; imported on first use

    return extract_source(text, filename)


def scan_source(text: str, filename: str, rules: Iterable, rejected: list[Match] | None = None) -> list[Match]:
    """Matches of ``rules`` in one source text (raises ``SyntaxError`` when it does not parse).
    Matches dropped by a rule precondition are appended to ``rejected`` when given."""
    from adopter.core.match import match_structures

    return match_structures(_extract(text, filename), list(rules), rejected, source=text)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        where = f"line {exc.lineno}" + (f", column {exc.offset}" if exc.offset else "")
        return f"syntax error: {exc.msg} ({where})"
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def scan_file(path: str | os.PathLike, rules: Iterable) -> list[Match]:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    return scan_source(text, str(p), rules)


def scan_paths(
    paths: Sequence[str | os.PathLike],
    rules: Iterable | None = None,
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> ScanReport:
    """Scan files and directories with ``rules`` (all built-in rules when None).

    ``progress(done, total, file)`` is called after each file. Raises what
    :func:`collect_files` raises for missing/unreadable top-level paths; problems with
    individual files end up in ``ScanReport.errors``.
    """
    from adopter.core.match import match_structures

    if rules is None:
        from adopter.core.rules import all_rules

        rules = all_rules()
    rules = list(rules)
    start = time.perf_counter()
    files = collect_files(paths)
    report = ScanReport(files_scanned=0, seconds=0.0)
    for i, f in enumerate(files):
        name = str(f)
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            report.errors.append(ScanError(name, f"not UTF-8 text: {exc.reason} at byte {exc.start}"))
        except OSError as exc:
            report.errors.append(ScanError(name, f"cannot read: {exc.strerror or exc}"))
        else:
            try:
                structures = _extract(text, name)
            except SyntaxError as exc:
                report.errors.append(ScanError(name, _one_line(exc)))
            except RecursionError:
                report.errors.append(ScanError(name, "too deeply nested to analyse"))
            except ImportError:
                raise
            except Exception as exc:  # an extraction bug must not stop the scan
                report.errors.append(ScanError(name, "extraction failed: " + _one_line(exc)))
            else:
                try:
                    report.matches.extend(match_structures(structures, rules, source=text))
                except Exception as exc:
                    report.errors.append(ScanError(name, "matching failed: " + _one_line(exc)))
        report.files_scanned += 1
        if progress is not None:
            progress(i + 1, len(files), name)
    report.seconds = time.perf_counter() - start
    return report
