"""Parsing one function of a scanned file without parsing the whole file.

Source-level checks need the AST of a single function; parsing a 5,000-line modeling file
for it would cost more than matching the file. The function's lines are found by its
``def`` header and indentation, dedented, and parsed alone (line numbers shifted back);
when that fails (odd formatting), the whole file is parsed once and cached.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from functools import lru_cache

from adopter.core.extract.driver import parsed_tree
from adopter.core.syntax import per_file


def parse_file(source: str) -> ast.Module | None:
    """The syntax tree of ``source`` (None when it does not parse); the tree extraction made
    of the same text when there is one. Shared: callers must not change it."""
    tree = parsed_tree(source)
    if tree is not None:
        return tree
    return _parse_file(source)


@per_file
@lru_cache(maxsize=16)
def _parse_file(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _find_in_tree(tree: ast.Module, qualname: str) -> ast.AST | None:
    scope = list(tree.body)
    found = None
    for part in qualname.split("."):
        found = next(
            (n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if found is None:
            return None
        scope = list(found.body)
    return found


@per_file
@lru_cache(maxsize=64)
def _lines(source: str) -> tuple[str, ...]:
    return tuple(source.split("\n"))


def source_lines(source: str) -> tuple[str, ...]:
    """The source's lines (``lines[n - 1]`` is line ``n``), split once per source."""
    return _lines(source)


@per_file
@lru_cache(maxsize=16)
def _byte_lines(source: str) -> tuple[bytes, ...]:
    # the line split of ast.get_source_segment (\n, \r\n, \r; not form feeds), UTF-8 encoded
    # because ast columns are byte offsets
    return tuple(source.encode().splitlines(keepends=True))


def source_segment(source: str, node: ast.AST) -> str | None:
    """``ast.get_source_segment(source, node)`` without splitting the file again per call (it
    does: a rule asking for many segments of a 5,000-line file spent seconds there)."""
    end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if end_line is None or end_col is None or getattr(node, "lineno", None) is None:
        return None
    lines = _byte_lines(source)
    first, last = node.lineno - 1, end_line - 1
    if not 0 <= first <= last < len(lines):
        return None
    if first == last:
        return lines[first][node.col_offset:end_col].decode()
    return (lines[first][node.col_offset:] + b"".join(lines[first + 1:last]) + lines[last][:end_col]).decode()


def _holds(fn: ast.AST, hint_line: int) -> bool:
    """``fn`` is the def asked for: its body holds ``hint_line``, or it starts after it."""
    return fn.lineno <= hint_line <= (fn.end_lineno or hint_line) or hint_line <= fn.lineno


@per_file
@lru_cache(maxsize=1024)
def function_ast(source: str, qualname: str, hint_line: int) -> ast.AST | None:
    """The ``FunctionDef`` of ``qualname`` (``Cls.method`` or ``fn``) whose body holds
    ``hint_line`` (1-based), with the file's line numbers."""
    name = qualname.rsplit(".", 1)[-1]
    lines = _lines(source)
    header = re.compile(r"^(\s*)(?:async\s+)?def\s+" + re.escape(name) + r"\s*\(")
    start = None
    for i in range(min(hint_line, len(lines)) - 1, -1, -1):
        m = header.match(lines[i])
        if m:
            start, indent = i, len(m.group(1))
            break
    if start is not None:
        # The tree extraction made of this text, when there is one, holds the same def:
        # no need to parse it again.
        tree = parsed_tree(source)
        fn = _find_in_tree(tree, qualname) if tree is not None else None
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno == start + 1 and _holds(fn, hint_line):
            return fn
        end = len(lines)
        body_started = False
        for j in range(start + 1, len(lines)):
            text = lines[j]
            stripped = text.strip()
            if not stripped or stripped.startswith("#"):
                continue
            ind = len(text) - len(text.lstrip())
            if ind > indent:
                body_started = True
                continue
            if body_started and not stripped.startswith((")", "]", "}")):
                end = j
                break
        # decorators do not matter; strip the common indentation of the header. Blank lines
        # in front give the file's line numbers (no ``ast.increment_lineno`` pass).
        segment = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[start:end]]
        try:
            tree = ast.parse("\n" * start + "\n".join(segment))
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None and tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = tree.body[0]
            if _holds(fn, hint_line):
                return fn
    tree = parse_file(source)
    return _find_in_tree(tree, qualname) if tree is not None else None


@per_file
@lru_cache(maxsize=256)
def class_init_ast(source: str, class_name: str) -> ast.AST | None:
    """``__init__`` of ``class_name`` (top-level class)."""
    lines = _lines(source)
    cls_header = re.compile(r"^class\s+" + re.escape(class_name) + r"\b")
    for i, line in enumerate(lines):
        if cls_header.match(line):
            init = re.compile(r"^\s+def\s+__init__\s*\(")
            for j in range(i + 1, len(lines)):
                if lines[j].startswith(("class ", "def ", "@")):
                    break
                if init.match(lines[j]):
                    fn = function_ast(source, f"{class_name}.__init__", j + 2)
                    return fn
            return None
    return None


def same_file_lineage(tree: ast.Module, cls: ast.ClassDef | None,
                      base_named: Callable[[str], ast.ClassDef | None] | None = None) -> list[ast.ClassDef]:
    """``cls`` and its bases defined at the top level of the same file (each once, bases named by a
    plain name): where a class's ``self.<attr>`` bindings can come from. ``base_named``: how a base's
    name is looked up (default: the classes of the module's body)."""
    if base_named is None:
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        base_named = classes.get
    out: list[ast.ClassDef] = []
    seen: set[str] = set()
    frontier = [cls] if cls is not None else []
    while frontier:
        c = frontier.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        out.append(c)
        frontier += [base for base in (base_named(b.id) for b in c.bases if isinstance(b, ast.Name))
                     if base is not None]
    return out
