"""Helpers shared by the file-taking commands (scan, rewrite): which given paths are Python,
and which files a ``--write`` may replace. Not a command (``adopter.cli.COMMANDS`` lists those)."""

from __future__ import annotations

import os
import stat


def is_python_file(path: str) -> bool:
    """A ``*.py`` file, or a file whose first line is a python ``#!`` line (a script)."""
    if str(path).endswith(".py"):
        return True
    try:
        with open(path, "rb") as fh:
            first = fh.readline(200)
    except OSError:
        return True  # let the command report the read error itself
    return first.startswith(b"#!") and b"python" in first


def split_python_paths(paths: list[str]) -> tuple[list[str], list[dict]]:
    """(paths to analyse, skipped): a path naming an existing regular file that is not Python
    is skipped with a reason; directories (searched for ``*.py``) and missing paths (reported
    by the command as an error) are kept."""
    kept: list[str] = []
    skipped: list[dict] = []
    for raw in paths:
        if os.path.isfile(raw) and not is_python_file(raw):
            skipped.append({"file": str(raw), "reason": "not a Python file (no .py suffix, no python #! line)"})
        else:
            kept.append(raw)
    return kept, skipped


def _within(real: str, roots: frozenset[str]) -> bool:
    """Whether the resolved path ``real`` is one of ``roots`` or lies under one."""
    current = real
    while True:
        if current in roots:
            return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def write_protections(paths: list[str], given: list[str]) -> dict[str, str]:
    """path -> why ``--write`` must not replace it without ``--force`` ("" when it may): a
    file the user cannot write (read-only mode), or one that is a symbolic link, or lies
    through one, outside the paths given on the command line. The given paths are resolved
    once (per file, a run over hundreds of files named one by one was quadratic)."""
    roots = frozenset(os.path.realpath(g) for g in given)
    return {path: _protection(path, roots) for path in paths}


def _protection(path: str, roots: frozenset[str]) -> str:
    real = os.path.realpath(path)
    outside = "" if _within(real, roots) else ", outside the paths given"
    if os.path.islink(path):
        # os.replace would put a regular file in place of the link and leave its target as it was
        return f"is a symbolic link to {real}{outside}"
    if outside:
        return f"resolves to {real}{outside}"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    if not os.access(path, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"is read-only (mode {stat.S_IMODE(mode):04o})"
    return ""
