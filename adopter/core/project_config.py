"""The project's own settings: the ``[tool.adopter]`` table of its ``pyproject.toml``.

Found as ruff finds its own: the nearest ``pyproject.toml`` holding a ``[tool.adopter]`` table,
walking up from the directory the paths given share (the working directory when none are given)
and stopping at the repository's root (the directory holding ``.git``); ``--config FILE`` names
one instead. Keys (all optional)::

    [tool.adopter]
    select = ["<rule>", "<rule>"]                # the rules in use (default: all built-in rules)
    ignore = ["<rule>"]                          # rules left out
    per-file-ignores = {"tests/*" = ["<rule>"], "legacy.py" = ["*"]}
    exclude = ["build/*", "*_pb2.py"]            # files never analysed
    max-file-size = "4M"                         # as --max-file-size
    torchscript = "auto"                         # as rewrite --torchscript: auto, always, never
    baseline = "adopter-baseline.json"           # as rewrite --baseline

Globs are matched against a file's path relative to the directory of the ``pyproject.toml``
(``*`` crosses ``/``; a glob without ``/`` also matches the file's name alone; ``**/`` may match
no directory). Command-line flags win over the table. A table that is not as above is a
:class:`ConfigError` (one line). Stdlib only (``tomllib``).
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass

__all__ = ["KEYS", "ConfigError", "ProjectConfig", "find_config", "load_config", "project_config"]

KEYS = ("select", "ignore", "per-file-ignores", "exclude", "max-file-size", "torchscript", "baseline")
TORCHSCRIPT_CHOICES = ("auto", "always", "never")  # (adopter.rewrite.scripting's, which core cannot import)


class ConfigError(ValueError):
    """A ``[tool.adopter]`` table that cannot be used (one line)."""


@dataclass(frozen=True)
class ProjectConfig:
    path: str = ""  # the pyproject.toml read ("" when none)
    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    exclude: tuple[str, ...] = ()
    max_file_size: str | None = None
    torchscript: str | None = None
    baseline: str | None = None  # absolute path

    @property
    def root(self) -> str:
        return os.path.dirname(self.path) if self.path else os.getcwd()

    def _relative(self, path: str) -> str:
        try:
            return os.path.relpath(os.path.abspath(path), os.path.abspath(self.root)).replace(os.sep, "/")
        except ValueError:
            return os.path.abspath(path).replace(os.sep, "/")

    def excluded(self, path: str) -> bool:
        return bool(self.exclude) and _matches_any(self._relative(path), self.exclude)

    def ignored_rules(self, path: str) -> frozenset[str]:
        """Lower-case names of the rules ``per-file-ignores`` switches off for ``path`` (``*``: all)."""
        rel = self._relative(path)
        out: set[str] = set()
        for pattern, rules in self.per_file_ignores:
            if _matches_any(rel, (pattern,)):
                out.update(r.lower() for r in rules)
        return frozenset(out)


def _matches_any(rel: str, patterns) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        pattern = pattern.replace(os.sep, "/").removeprefix("./")
        candidates = {pattern, pattern.replace("**/", "")}
        for p in candidates:
            if fnmatch.fnmatchcase(rel, p) or ("/" not in p and fnmatch.fnmatchcase(name, p)):
                return True
            if p.endswith("/") and rel.startswith(p):
                return True
    return False


def find_config(start: str) -> str | None:
    """The nearest ``pyproject.toml`` with a ``[tool.adopter]`` table from ``start`` up (module doc)."""
    here = os.path.abspath(start)
    if not os.path.isdir(here):
        here = os.path.dirname(here)
    while True:
        candidate = os.path.join(here, "pyproject.toml")
        if os.path.isfile(candidate) and _has_table(candidate):
            return candidate
        if os.path.exists(os.path.join(here, ".git")):
            return None
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _read(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _has_table(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return False
    if b"adopter" not in raw:
        return False
    data = _read(path)  # (a pyproject that names adopter and does not parse: said, not passed over)
    return isinstance(data.get("tool"), dict) and "adopter" in data["tool"]


def _strings(path: str, key: str, value) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: [tool.adopter] {key} must be a list of strings, got {value!r}")
    return tuple(value)


def load_config(path: str) -> ProjectConfig:
    """The ``[tool.adopter]`` table of ``path`` (an empty table when it has none)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file")
    tool = _read(path).get("tool", {})
    table = tool.get("adopter", {}) if isinstance(tool, dict) else {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.adopter] must be a table")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) in [tool.adopter]: {', '.join(unknown)} "
                          f"(known: {', '.join(KEYS)})")
    select = _strings(path, "select", table["select"]) if "select" in table else None
    ignore = _strings(path, "ignore", table.get("ignore", []))
    per_file = table.get("per-file-ignores", {})
    if not isinstance(per_file, dict):
        raise ConfigError(f"{path}: [tool.adopter] per-file-ignores must be a table of glob = [rules]")
    per_file_ignores = tuple((glob, _strings(path, f"per-file-ignores {glob!r}", rules))
                             for glob, rules in per_file.items())
    exclude = _strings(path, "exclude", table.get("exclude", []))
    size = table.get("max-file-size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (str, int))):
        raise ConfigError(f"{path}: [tool.adopter] max-file-size must be a size such as \"4M\" or a number of "
                          f"bytes, got {size!r}")
    torchscript = table.get("torchscript")
    if torchscript is not None and torchscript not in TORCHSCRIPT_CHOICES:
        raise ConfigError(f"{path}: [tool.adopter] torchscript must be one of {', '.join(TORCHSCRIPT_CHOICES)}, "
                          f"got {torchscript!r}")
    baseline = table.get("baseline")
    if baseline is not None and (not isinstance(baseline, str) or not baseline):
        raise ConfigError(f"{path}: [tool.adopter] baseline must be a file name, got {baseline!r}")
    return ProjectConfig(
        path=path, select=select, ignore=ignore, per_file_ignores=per_file_ignores, exclude=exclude,
        max_file_size=None if size is None else str(size), torchscript=torchscript,
        baseline=os.path.join(os.path.dirname(path), baseline) if baseline else None,
    )


def project_config(paths: list[str], explicit: str | None = None) -> ProjectConfig:
    """The configuration for a run over ``paths``: ``explicit`` (``--config``) when given, else the
    one found from the directory the paths share (module doc); an empty one when there is none."""
    if explicit:
        return load_config(explicit)
    if paths:
        try:
            start = os.path.commonpath([os.path.abspath(p) for p in paths])
        except ValueError:
            start = os.getcwd()
    else:
        start = os.getcwd()
    found = find_config(start)
    return load_config(found) if found else ProjectConfig()
