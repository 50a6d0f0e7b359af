"""Keep the user's statements for TorchScript: the last stage of a rewrite.

Guarded kernels take the user's modules and check Python facts at run time, which TorchScript
cannot compile (modules as arguments, variadic signatures, nested functions). So every rewritten
region of statements that calls a kernel function becomes

    if torch.jit.is_scripting():
        <the user's original statements>
    else:
        <the rewritten statements>

``torch.jit.is_scripting()`` is a compile-time constant to the TorchScript compiler, which never
compiles the other branch, and ``False`` to Python, fx, dynamo and export. A scripted model thus
compiles and runs exactly the user's code; every other mode runs the rewrite. Analysis skips
these branches (``extract/paths.py``), so a rewritten file scans clean and rewriting is idempotent.

The regions come from comparing the original and the rewritten text of each function,
statement by statement (compound statements with the same header are compared inside, so a
rewrite in a loop body guards the body's statements, not the loop); it runs once, after every
pass of the rewrite, so matches that chain across passes are not split by a guard.
"""
from __future__ import annotations

import ast
import difflib
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from adopter.rewrite.apply import KERNELS_MODULE

from adopter.core.source_file import source_lines

SCRIPTING_TEST = "torch.jit.is_scripting()"

# --torchscript (adopter rewrite) / optimize(torchscript=...): when a rewrite keeps the user's
# statements for TorchScript. "auto": only in code that uses TorchScript (see uses_torchscript) and
# only around functions TorchScript could compile (see scriptable); "always": every rewritten
# region (timm-style code scripted by its users); "never": no guard (most code: the doubled
# statements are two copies to keep in sync, and TorchScript is deprecated).
TORCHSCRIPT_CHOICES = ("auto", "always", "never")
# what code that scripts (or is scripted) writes: torch.jit.script / is_scripting / ignore /
# unused / export / interface, and `from torch.jit import script`
_TORCHSCRIPT_USE = re.compile(rb"\bjit\.(?:script|is_scripting|ignore|unused|export|interface)\b"
                              rb"|from\s+torch\.jit\s+import\s+[^\n]*\bscript\b")
_MAX_PACKAGE_FILES = 5000
_MAX_FILE_BYTES = 4 * 2**20
# A package counts as scripting when at least this share of its files names TorchScript: timm
# 1.0.31, whose models its users and tests script, 114 of 304 files (37%; its layers, e.g.
# layers/mlp.py, name nothing themselves); transformers 5.23, which scripts no model, 5 of 2,860
# (0.2%: @torch.jit.ignore left on a few helpers). Below it only a file that names TorchScript
# itself is guarded.
SCRIPTING_SHARE = 0.05


def uses_torchscript(path: str | os.PathLike | None, text: str = "") -> bool:
    """Whether the code a file belongs to uses TorchScript: the file's own ``text`` names it, or
    at least :data:`SCRIPTING_SHARE` of the ``.py`` files of the package holding ``path`` (the
    outermost directory of the ``__init__.py`` chain) do. A file outside a package answers for
    itself. Read-only, never imports."""
    if _TORCHSCRIPT_USE.search(text.encode("utf-8", "surrogatepass")):
        return True
    if path is None:
        return False
    try:
        folder = Path(path).resolve().parent
    except OSError:
        return False
    if not (folder / "__init__.py").is_file():
        return False
    while (folder.parent / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return _package_uses_torchscript(str(folder))


@lru_cache(maxsize=64)
def _package_uses_torchscript(root: str) -> bool:
    seen = naming = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py") or seen >= _MAX_PACKAGE_FILES:
                continue
            seen += 1
            try:
                with open(os.path.join(folder, name), "rb") as fh:
                    naming += bool(_TORCHSCRIPT_USE.search(fh.read(_MAX_FILE_BYTES)))
            except OSError:
                continue
    return seen > 0 and naming >= SCRIPTING_SHARE * seen


def wants_guard(choice: str, path: str | os.PathLike | None, text: str) -> bool:
    """Whether a rewrite of ``text`` (at ``path``) keeps the original for TorchScript under ``choice``."""
    if choice not in TORCHSCRIPT_CHOICES:
        raise ValueError(f"torchscript must be one of {', '.join(TORCHSCRIPT_CHOICES)}, got {choice!r}")
    return choice == "always" or (choice == "auto" and uses_torchscript(path, text))


def guard_options(choice: str, path: str | os.PathLike | None, text: str) -> dict:
    """``rewrite_source``'s ``torchscript_guard`` and ``scriptable_only`` for ``choice``: what every
    caller (file rewrites, optimize()) asks of the guard."""
    return {"torchscript_guard": wants_guard(choice, path, text), "scriptable_only": choice == "auto"}


def scriptable(fn: ast.AST) -> bool:
    """Whether TorchScript could compile ``fn``: no ``*args``/``**kwargs`` (it compiles no variadic
    signature) and no ``@torch.jit.ignore``/``@torch.jit.unused`` (it leaves those to Python)."""
    args = getattr(fn, "args", None)
    if args is not None and (args.vararg is not None or args.kwarg is not None):
        return False
    for d in getattr(fn, "decorator_list", ()):
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr in ("ignore", "unused"):
            return False
    return True


@dataclass(frozen=True)
class _Region:
    """Lines ``first..last`` (1-based, inclusive) of the rewritten text that replace lines
    ``orig_first..orig_last`` of the original (``orig_first > orig_last``: nothing)."""

    first: int
    last: int
    orig_first: int
    orig_last: int
    indent: str
    step: str  # the file's indentation unit


class GuardError(ValueError):
    """A region that cannot be guarded (the reason is the message)."""


def keep_original_for_torchscript(original: str, rewritten: str, scriptable_only: bool = False) -> str:
    """``rewritten`` with every changed region that calls a kernel function guarded (module doc);
    ``scriptable_only``: only in functions TorchScript could compile (:func:`scriptable`).
    Raises :class:`GuardError` when a region cannot be (a multi-line string in it, a statement
    sharing a line with another)."""
    if original == rewritten:
        return rewritten
    new_tree = ast.parse(rewritten)
    kernel_functions = _kernel_function_names(new_tree)
    if not kernel_functions:
        return rewritten
    old_functions = _functions(ast.parse(original))
    orig_lines = source_lines(original, keepends=True)
    new_lines = source_lines(rewritten, keepends=True)
    regions: list[_Region] = []
    for qualname, new_fn in _functions(new_tree).items():
        old_fn = old_functions.get(qualname)
        if old_fn is None or (scriptable_only and not scriptable(new_fn)):
            continue
        step = _step(new_fn, new_lines)
        _compare(old_fn.body, new_fn.body, orig_lines, new_lines, kernel_functions, regions, step)
    if not regions:
        return rewritten
    out = list(new_lines)
    for region in sorted(regions, key=lambda r: r.first, reverse=True):
        out[region.first - 1:region.last] = _guarded(region, orig_lines, new_lines)
    text = "".join(out)
    if not _binds_torch(new_tree):
        text = _add_torch_import(text, new_tree)
    return text


# ---------------------------------------------------------------- comparison


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(prefix + node.name, node)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return out


def _kernel_function_names(tree: ast.Module) -> set[str]:
    """Local names of the functions imported from ``adopter.kernels`` (classes, capitalized, are
    modules TorchScript compiles themselves)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == KERNELS_MODULE and not node.level:
            names |= {a.asname or a.name for a in node.names if not a.name[:1].isupper()}
    return names


def _key(stmt: ast.stmt) -> str:
    return ast.dump(stmt)


def _header(stmt: ast.stmt) -> str | None:
    """What a compound statement is apart from its bodies (None for a simple statement)."""
    if isinstance(stmt, ast.If):
        return "if " + ast.dump(stmt.test) + f" {bool(stmt.orelse)}"
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        return "for " + ast.dump(stmt.target) + ast.dump(stmt.iter) + f" {bool(stmt.orelse)}"
    if isinstance(stmt, ast.While):
        return "while " + ast.dump(stmt.test) + f" {bool(stmt.orelse)}"
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return "with " + "".join(ast.dump(i) for i in stmt.items)
    if isinstance(stmt, ast.Try):
        return "try " + " ".join(ast.dump(h.type) if h.type else "_" for h in stmt.handlers) + \
            f" {bool(stmt.orelse)} {bool(stmt.finalbody)}"
    return None


def _bodies(stmt: ast.stmt) -> list[list[ast.stmt]]:
    bodies = [stmt.body]
    bodies += [h.body for h in getattr(stmt, "handlers", [])]
    bodies += [b for b in (getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])) if b]
    return bodies


def _is_scripting_guard(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and ast.unparse(stmt.test) == SCRIPTING_TEST


def _compare(old: list, new: list, orig_lines, new_lines, kernels: set[str], regions: list, step: str) -> None:
    matcher = difflib.SequenceMatcher(a=[_key(s) for s in old], b=[_key(s) for s in new], autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        if op == "replace" and i2 - i1 == j2 - j1 and all(
            _header(o) is not None and _header(o) == _header(n) for o, n in zip(old[i1:i2], new[j1:j2])
        ):
            for o, n in zip(old[i1:i2], new[j1:j2]):
                pairs = list(zip(_bodies(o), _bodies(n)))
                if _is_scripting_guard(o):
                    pairs = pairs[:1]  # the rewritten branch never runs under TorchScript
                for ob, nb in pairs:
                    _compare(ob, nb, orig_lines, new_lines, kernels, regions, step)
            continue
        stmts = new[j1:j2]
        if not any(isinstance(n, ast.Name) and n.id in kernels for s in stmts for n in ast.walk(s)):
            continue  # nothing TorchScript cannot compile (a module swapped in __init__, ...)
        if not stmts:
            continue
        first, last = stmts[0], stmts[-1]
        _whole_lines(first, last, new_lines)
        if old[i1:i2]:
            _whole_lines(old[i1], old[i2 - 1], orig_lines)
            orig_first, orig_last = _first_line(old[i1]), old[i2 - 1].end_lineno
        else:
            orig_first, orig_last = 1, 0
        for s in stmts + old[i1:i2]:
            if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.end_lineno > n.lineno
                   for n in ast.walk(s)):
                raise GuardError(f"line {s.lineno}: a multi-line string among the rewritten statements")
        indent = new_lines[first.lineno - 1][: first.col_offset]
        new_first = _first_line(first)
        # Comment lines right above the region stay above the guard. Where the rewrite deleted the
        # region's first statements, the rewritten region's first statement has more of them than
        # the original's (the comment of the rewritten line, now right below the other's): those
        # belong to the rewritten statement and go into the rewritten copy, not above the ``if``.
        shared = orig_first - _comments_above(orig_first, orig_lines) if old[i1:i2] else 0
        new_first -= max(0, new_first - _comments_above(new_first, new_lines) - shared)
        regions.append(_Region(new_first, last.end_lineno, orig_first, orig_last, indent, step))


def _comments_above(line: int, lines: list[str]) -> int:
    """The first line of the comment lines right above ``line`` (``line`` when none)."""
    while line > 1 and lines[line - 2].lstrip().startswith("#"):
        line -= 1
    return line


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno] + [d.lineno - 1 for d in decorators])


def _whole_lines(first: ast.stmt, last: ast.stmt, lines: list[str]) -> None:
    line = lines[first.lineno - 1]
    if line[: first.col_offset].strip():
        raise GuardError(f"line {first.lineno}: a rewritten statement shares its line with another")
    tail = lines[last.end_lineno - 1][last.end_col_offset:]
    if tail.strip() and not tail.strip().startswith("#"):
        raise GuardError(f"line {last.end_lineno}: a rewritten statement shares its line with another")


# ---------------------------------------------------------------- text


def _step(fn: ast.AST, lines: list[str]) -> str:
    """The file's indentation unit, read off a function: its body's indent beyond the ``def``'s."""
    body_line = lines[fn.body[0].lineno - 1]
    body_indent = body_line[: len(body_line) - len(body_line.lstrip())]
    def_line = lines[fn.lineno - 1]
    def_indent = def_line[: len(def_line) - len(def_line.lstrip())]
    return body_indent[len(def_indent):] if body_indent.startswith(def_indent) and body_indent != def_indent else "    "


def _reindented(lines: list[str], old_indent: str, new_indent: str) -> list[str]:
    out = []
    for line in lines:
        if not line.strip():
            out.append(line)
        elif line.startswith(old_indent):
            out.append(new_indent + line[len(old_indent):])
        else:
            out.append(new_indent + line.lstrip(" \t"))
    return out


def _guarded(region: _Region, orig_lines: list[str], new_lines: list[str]) -> list[str]:
    ind = region.indent
    body = ind + region.step
    if region.orig_first <= region.orig_last:
        first = orig_lines[region.orig_first - 1]
        orig_indent = first[: len(first) - len(first.lstrip())]
        original = _reindented(orig_lines[region.orig_first - 1:region.orig_last], orig_indent, body)
    else:
        original = [body + "pass\n"]
    rewritten = _reindented(new_lines[region.first - 1:region.last], ind, body)
    for part in (original, rewritten):
        if part and not part[-1].endswith("\n"):
            part[-1] += "\n"
    return [f"{ind}if {SCRIPTING_TEST}:\n", *original, f"{ind}else:\n", *rewritten]


def _binds_torch(tree: ast.Module) -> bool:
    """Whether the module's top level binds ``torch`` (``import torch``, ``import torch.nn``)."""
    return any(
        isinstance(stmt, ast.Import) and any(a.asname is None and a.name.split(".")[0] == "torch" for a in stmt.names)
        for stmt in tree.body
    )


def _add_torch_import(text: str, tree: ast.Module) -> str:
    """``import torch`` on the line before the kernel import."""
    kernel_import = next(
        s for s in tree.body if isinstance(s, ast.ImportFrom) and s.module == KERNELS_MODULE and not s.level
    )
    lines = source_lines(text, keepends=True)
    at = kernel_import.lineno - 1
    return "".join(lines[:at] + ["import torch\n"] + lines[at:])


def python_view(text: str) -> str:
    """``text`` as Python runs it: each ``if torch.jit.is_scripting():`` guard replaced by its
    ``else`` branch, dedented (for reading a rewrite, and for tests of what a rewrite does)."""
    lines = source_lines(text, keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped != f"if {SCRIPTING_TEST}:":
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        i += 1
        while i < len(lines) and not (lines[i].startswith(indent + "else:") and lines[i].strip() == "else:"):
            i += 1  # the branch TorchScript compiles
        i += 1
        body_indent = None
        while i < len(lines):
            current = lines[i]
            if current.strip():
                current_indent = current[: len(current) - len(current.lstrip())]
                if len(current_indent) <= len(indent):
                    break
                if body_indent is None:
                    body_indent = current_indent
                current = indent + current[len(body_indent):] if current.startswith(body_indent) else current
            out.append(current)
            i += 1
    return "".join(out)
