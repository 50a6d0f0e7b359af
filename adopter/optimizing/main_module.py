"""``optimize()`` of a class defined in module ``__main__``: the script being run, or a notebook.

The source is had where Python keeps it: a script's own file (``python train.py``), or, for a
notebook (IPython / Jupyter) or ``python -c``, the text :mod:`linecache` holds under the file
name its methods were compiled with (IPython registers every cell there). Every ``__main__``
class of the model must come from that one source (one script, or one notebook cell); else, or
when no source can be found (a class made with ``type()``), :class:`OptimizeError` says so.

The rewritten classes cannot be loaded as a module the usual way: executing the script again
would run it (and this ``optimize()`` call) again. So only its definitions run — the top-level
``import``/``from`` statements and the ``class``/``def`` statements of the rewritten text, in
a copy of ``__main__``'s current namespace (the values the script computed at top level, such
as constants and aliases, are taken as they are) — as module ``__main____adopter_<hash>``,
registered in ``sys.modules``; code objects carry the usual ``<adopter rewrite of FILE [hash]>``
file name, whose lines are in :mod:`linecache`. Nothing is written to the user's files.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import os
import sys
import types

from adopter.core.source_file import read_source
from adopter.errors import OptimizeError

__all__ = ["MAIN", "load_main_rewrite", "main_source_file", "source_text"]

MAIN = "__main__"
# The top-level statements executed from a rewritten script: definitions and imports only.
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_NOT_COPIED = {"__name__", "__spec__", "__loader__", "__file__", "__package__", "__cached__", "__doc__"}


def source_text(path: str) -> str:
    """The decoded text of ``path``: the file (decoded as the scan reads it), else the lines
    :mod:`linecache` holds for that name (a notebook cell). Raises ``OSError`` when neither,
    :class:`adopter.core.source_file.SourceReadError` for a file that cannot be read."""
    if os.path.isfile(path):
        return read_source(path).text
    lines = linecache.getlines(path)
    if not lines:
        raise OSError(f"no source for {path}")
    return "".join(lines)


def _code_file(cls: type) -> str | None:
    """The file name the class's own methods were compiled with (``forward``, ``__init__`` first)."""
    body = vars(cls)
    names = ["forward", "__init__"] + [n for n in body if n not in ("forward", "__init__")]
    for name in names:
        attr = body.get(name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        elif isinstance(attr, property):
            attr = attr.fget
        if callable(attr):
            code = getattr(inspect.unwrap(attr), "__code__", None)
            if code is not None:
                return code.co_filename
    return None


def _defines_class(text: str, name: str) -> bool:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == name for node in tree.body)


def _class_source(cls: type) -> str | None:
    """Where the source of a ``__main__`` class is (a file or a linecache name), or None."""
    candidates = [_code_file(cls)]
    try:
        candidates.append(inspect.getsourcefile(cls))  # a script's __main__ has a __file__
    except (TypeError, OSError):
        pass
    for name in candidates:
        if not name:
            continue
        try:
            text = source_text(name)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        if _defines_class(text, cls.__name__):
            return name
    return None


def main_source_file(model_cls: type, classes) -> str:
    """The real path of the one source (script or notebook cell) defining ``model_cls`` and
    every ``__main__`` class among ``classes`` (those of the model's modules); a cell's text is registered in :mod:`linecache` under that path too,
    so the scan, the trace and the rewrite all name it the same way."""
    where: dict[str, list[str]] = {}
    for cls in dict.fromkeys([model_cls, *classes]):
        if cls.__module__ != MAIN:
            continue
        name = _class_source(cls)
        if name is None:
            raise OptimizeError(
                f"{cls.__qualname__} is defined in __main__ and its source cannot be found (not in the script "
                "file, nor in linecache as a notebook cell's is); move it into a module and import it from there"
            )
        where.setdefault(name, []).append(cls.__qualname__)
    if len(where) > 1:
        parts = "; ".join(f"{', '.join(names)} in {name}" for name, names in where.items())
        raise OptimizeError(
            f"the __main__ classes of {model_cls.__name__} come from several sources ({parts}); "
            "define them in one notebook cell or script, or move them into a module"
        )
    (name,) = where
    real = os.path.realpath(name)
    if real != name and not os.path.isfile(real):
        lines = linecache.getlines(name)
        linecache.cache[real] = (sum(map(len, lines)), None, lines, real)  # mtime None: kept by checkcache
    return real


def load_main_rewrite(file: str, text: str) -> types.ModuleType:
    """Execute the definitions of the rewritten ``__main__`` source ``text`` (of ``file``) in a
    copy of ``__main__``'s namespace, as a new registered module (see the module docstring)."""
    tag = hashlib.sha1(f"{file}\0{text}".encode()).hexdigest()[:12]
    name = f"{MAIN}__adopter_{tag}"
    if name in sys.modules:
        return sys.modules[name]
    code_filename = f"<adopter rewrite of {file} [{tag}]>"
    tree = ast.parse(text, code_filename)
    tree.body = [node for node in tree.body if isinstance(node, _DEFINITIONS)]
    code = compile(tree, code_filename, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    main = sys.modules.get(MAIN)
    if main is not None:
        module.__dict__.update({k: v for k, v in vars(main).items() if k not in _NOT_COPIED})
    module.__file__ = file
    linecache.cache[code_filename] = (len(text), None, text.splitlines(keepends=True), code_filename)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - executing the rewritten definitions is the point
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
