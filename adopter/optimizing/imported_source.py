"""Whether a module's source file still holds the code that was imported from it.

``optimize()`` analyses and rewrites the *file*, then runs the rewrite beside the *imported*
class: when the file was edited or removed after the import, the two are different programs and
an equivalence check would compare the wrong things (it reported "not equivalent", or a bare
``FileNotFoundError``). The check compiles the current text and compares the code of every
function and method the module defines (CPython code objects compare by bytecode, constants,
names and line table, not by file name): any difference means the file changed since import.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator

from adopter.core.source_file import SourceReadError
from adopter.errors import OptimizeError

__all__ = ["changed_since_import", "read_imported_source"]


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    stack = [code]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))


def _functions_of(namespace: dict, module_name: str, depth: int = 0) -> Iterator[types.FunctionType]:
    for value in list(namespace.values()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            yield from (f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType))
            continue
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type) and value.__module__ == module_name and depth < 4:
            yield from _functions_of(dict(vars(value)), module_name, depth + 1)


def changed_since_import(module: types.ModuleType, text: str, path: str) -> str:
    """How ``text`` (the file's current source) differs from what ``module`` was imported from
    ("" when every function and method defined in ``path`` compiles to the same code)."""
    real = os.path.realpath(path)
    live = [f for f in _functions_of(dict(vars(module)), module.__name__)
            if os.path.realpath(f.__code__.co_filename) == real]
    if not live:
        return ""
    try:
        compiled = compile(text, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        return f"it no longer compiles: {exc}"
    fresh: dict[tuple[str, int], list[types.CodeType]] = {}
    for code in _code_objects(compiled):
        fresh.setdefault((code.co_name, code.co_firstlineno), []).append(code)
    for function in live:
        code = function.__code__
        if not any(code == other for other in fresh.get((code.co_name, code.co_firstlineno), ())):
            where = getattr(function, "__qualname__", code.co_name)
            return f"{where}, line {code.co_firstlineno}, is not what the file now holds"
    return ""


def read_imported_source(module_name: str, path: str, read) -> str:
    """The text of ``path`` (``read(path)``), checked to be the source ``module_name`` was imported
    from; :class:`OptimizeError` saying the source changed since import when it is not."""
    module = sys.modules.get(module_name)
    advice = "import it again (restart the interpreter, or importlib.reload) before optimize()"
    if not os.path.exists(path):
        raise OptimizeError(f"the source of {module_name} changed since import: {path} was removed; {advice}")
    try:
        text = read(path)
    except SourceReadError as exc:
        raise OptimizeError(f"cannot read the source of {module_name} ({path}): {exc.message}") from None
    except OSError as exc:
        raise OptimizeError(f"cannot read the source of {module_name} ({path}): {exc.strerror or exc}") from None
    if module is not None:
        why = changed_since_import(module, text, path)
        if why:
            raise OptimizeError(f"the source of {module_name} changed since import ({path}: {why}); {advice}")
    return text
