"""Keep the user's line length: wrap the rewritten lines that run past it (the last stage of a
file rewrite, after the TorchScript guard).

The limit is the project's own: ``line-length`` (ruff, black) or ``max-line-length`` (flake8,
pycodestyle) of the nearest ``pyproject.toml``, ``ruff.toml``, ``.ruff.toml``, ``setup.cfg``,
``tox.ini`` or ``.flake8`` above the file; without one, the length the file's own lines keep to (its
99th percentile, at least 88), so a file is never wrapped tighter than it is written.

Only statements holding a line the rewrite added are touched, and only the shape the codemods
write: a statement whose value is one call (``x = kernel(a, b, c)``, ``return kernel(...)``, on one
line or already split), wrapped black-style: the arguments on one indented line when they fit,
else one per line, each with a trailing comma; a comment after the statement's first line (the
codemods' ``# adopter: ...`` notes) moves to its own line above. A statement of another shape, or
with comments among its arguments, stays as written. The wrapped text must parse to the same
syntax tree as before (layout only), else the rewrite keeps its long lines.
"""
from __future__ import annotations

import ast
import configparser
import io
import re
import tokenize
from functools import lru_cache
from pathlib import Path

from adopter.core.syntax import statements

DEFAULT_LIMIT = 88
_TOML_LIMIT = re.compile(r"^\s*line[-_]length\s*=\s*(\d+)", re.M)


def line_limit(path: str | Path | None, text: str) -> int:
    """The line length the project of ``path`` asks for, else what ``text`` keeps to (module doc)."""
    if path is not None:
        configured = _configured_limit(str(Path(path).resolve().parent))
        if configured:
            return configured
    lengths = sorted(len(line) for line in text.splitlines())
    if not lengths:
        return DEFAULT_LIMIT
    return max(DEFAULT_LIMIT, lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))])


@lru_cache(maxsize=64)
def _configured_limit(folder: str) -> int | None:
    here = Path(folder)
    for directory in (here, *here.parents):
        for name in ("pyproject.toml", "ruff.toml", ".ruff.toml"):
            config = directory / name
            if config.is_file():
                try:
                    found = _TOML_LIMIT.search(config.read_text(errors="replace"))
                except OSError:
                    found = None
                if found:
                    return int(found.group(1))
        for name in ("setup.cfg", "tox.ini", ".flake8"):
            config = directory / name
            if config.is_file():
                parser = configparser.ConfigParser(interpolation=None)
                try:
                    parser.read(config)
                except (configparser.Error, OSError, UnicodeDecodeError):
                    continue
                for section in ("flake8", "pycodestyle", "tool:pycodestyle"):
                    value = parser.get(section, "max-line-length", fallback=None)
                    if value and value.strip().isdigit():
                        return int(value)
        if (directory / ".git").exists():
            break  # (the project's root: nothing above it is the user's configuration)
    return None


def wrap_long_lines(original: str, rewritten: str, limit: int) -> str:
    """``rewritten`` with the lines the rewrite added that run past ``limit`` wrapped (module doc)."""
    new_lines = rewritten.split("\n")
    # the long lines the rewrite wrote: no line of the original reads the same (a line the user
    # wrote that long is theirs to keep, wherever the rewrite moved it)
    long_lines = [i for i, line in enumerate(new_lines) if len(line) > limit]
    if long_lines:
        old_lines = set(original.split("\n"))
        long_lines = [i for i in long_lines if new_lines[i] not in old_lines]
    if not long_lines:
        return rewritten
    try:
        tree = ast.parse(rewritten)
    except SyntaxError:
        return rewritten
    simple = [node for node in statements(tree)
              if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return))]
    out = list(new_lines)
    done: set[int] = set()
    for i in reversed(long_lines):
        stmt = min((n for n in simple if n.lineno - 1 <= i <= n.end_lineno - 1),
                   key=lambda n: n.end_lineno - n.lineno, default=None)
        if stmt is None or stmt.lineno in done:
            continue
        done.add(stmt.lineno)
        wrapped = _wrapped(new_lines[stmt.lineno - 1:stmt.end_lineno], stmt, limit)
        if wrapped is not None:
            out[stmt.lineno - 1:stmt.end_lineno] = wrapped
    text = "\n".join(out)
    return text if _same_program(tree, new_lines, text) else rewritten  # (layout only: the program proven)


def _same_program(tree: ast.Module, lines: list[str], text: str) -> bool:
    """``text`` parses to ``tree`` (the tree of ``lines``): the same top-level statements, each
    compared as a syntax tree where its text changed (unchanged text parses the same)."""
    try:
        new_tree = ast.parse(text)
    except SyntaxError:
        return False
    if len(new_tree.body) != len(tree.body):
        return False
    new_lines = text.split("\n")
    for before, after in zip(tree.body, new_tree.body):
        if lines[before.lineno - 1:before.end_lineno] != new_lines[after.lineno - 1:after.end_lineno] \
                and ast.dump(before) != ast.dump(after):
            return False
    return True


def _comments(lines: list[str]) -> list[tuple[int, int, str]]:
    """(line index, column, text) of every comment in ``lines``; None when they do not tokenize."""
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if tok.type == tokenize.COMMENT:
                found.append((tok.start[0] - 1, tok.start[1], tok.string))
    except (tokenize.TokenError, IndentationError):
        return [(-1, 0, "")]
    return found


def _wrapped(lines: list[str], stmt: ast.stmt, limit: int) -> list[str] | None:
    """The statement's ``lines`` wrapped black-style (module doc), or None when it has another shape."""
    first = lines[0]
    indent = first[: len(first) - len(first.lstrip())]
    comments = _comments(lines)
    if len(comments) > 1 or (comments and comments[0][0] != 0):
        return None  # (comments inside the arguments: left as written)
    note = comments[0][2] if comments else ""
    code = [first[: comments[0][1]].rstrip() if comments else first, *lines[1:]]
    if note and len(code) == 1 and len(code[0]) <= limit:
        return [f"{indent}{note}", code[0]]  # (only the note ran past the limit)
    value = getattr(stmt, "value", None)
    if not isinstance(value, ast.Call) or value.func.lineno != stmt.lineno or value.end_lineno != stmt.end_lineno:
        return None
    base = stmt.lineno
    raw = [line.encode() for line in code]

    def segment(node: ast.AST) -> str:
        if node.lineno == node.end_lineno:
            return raw[node.lineno - base][node.col_offset:node.end_col_offset].decode()
        parts = [raw[node.lineno - base][node.col_offset:]] + raw[node.lineno - base + 1:node.end_lineno - base] + \
            [raw[node.end_lineno - base][:node.end_col_offset]]
        return b"\n".join(parts).decode()

    pieces = [segment(a) for a in value.args]
    for keyword in value.keywords:
        text = segment(keyword.value)
        pieces.append(f"**{text}" if keyword.arg is None else f"{keyword.arg}={text}")
    if any("\n" in piece for piece in pieces):
        return None  # (an argument spanning lines: left as written)
    head = raw[0][: value.func.end_col_offset].decode()
    tail = raw[-1][value.end_col_offset:].decode().rstrip()
    step = indent + "    "
    together = f"{step}{', '.join(pieces)}"
    body = [together] if len(together) <= limit else [f"{step}{piece}," for piece in pieces]
    return [*([f"{indent}{note}"] if note else []), f"{head}(", *body, f"{indent}){tail}"]


