"""Extraction of one file: symbol tables, class bases and module-ness, ``__init__``
bindings, then the forward interpretation of every entry function."""

from __future__ import annotations

import ast
import os
import re

from adopter.core.extract.init_bindings import _InitExtractor
from adopter.core.extract.interp import _Interp
from adopter.core.extract.symbols import _ClassCtx, _dotted, _File, _is_module, _span
from adopter.core.extract.values import _TEST_NAMES, _UNPARSED, SOURCE_LINES, UNKNOWN_TYPE
from adopter.core.structures import ClassInfo, FileStructures, SequentialBuild, SequentialEntry

_SELF_ATTR = re.compile(r"\bself\.([A-Za-z_][A-Za-z_0-9]*)(?!\s*(?:=(?!=)|:[^=\n]*=(?!=)))")


def _attr_uses(cls: _ClassCtx, lines: list[str]) -> dict[str, tuple[int, ...]]:
    """``self.<attr>`` reads (not plain stores) in every method but ``__init__``, by line.

    A regex over the method's lines (much faster than walking the tree); an attribute
    named in a comment or string counts as used, which only keeps an init statement.
    """
    uses: dict[str, set[int]] = {}
    for name, fn in cls.methods.items():
        if name == "__init__":
            continue
        first = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
        for ln in range(first, fn.end_lineno + 1):
            line = lines[ln - 1]
            if "self." not in line:
                continue
            for m in _SELF_ATTR.finditer(line):
                uses.setdefault("self." + m.group(1), set()).add(ln)
    return {k: tuple(sorted(v)) for k, v in uses.items()}


def extract_source(text: str, filename: str = "<string>") -> FileStructures:
    """Extract the model structures of one Python source file (never imports or runs it).

    Raises ``SyntaxError`` unchanged when ``text`` does not parse.
    """
    _LAST_PARSE[:] = [None, None]  # the previous file's tree is not kept alive meanwhile
    tree = ast.parse(text, filename=filename)
    _LAST_PARSE[:] = [text, tree]
    _UNPARSED.clear()
    _TEST_NAMES.clear()
    # UTF-8 as ast columns are bytes; bytes.splitlines splits where ast counts lines
    # (\n, \r\n, \r; not at form feeds)
    SOURCE_LINES[:] = text.encode().splitlines(keepends=True)
    try:
        return _extract_tree(tree, filename, text.splitlines())
    finally:
        _UNPARSED.clear()
        _TEST_NAMES.clear()
        SOURCE_LINES.clear()


# The text and syntax tree of the file extracted last: matching reads the same file's tree
# (:func:`parsed_tree`) instead of parsing it again. Extraction never changes the tree.
_LAST_PARSE: list = [None, None]


def parsed_tree(text: str) -> ast.Module | None:
    """The tree :func:`extract_source` parsed for ``text`` when it was the last file it
    extracted, else None. Callers must not change it."""
    last = _LAST_PARSE[0]
    if last is not None and (last is text or last == text):
        return _LAST_PARSE[1]
    return None


def _extract_tree(tree: ast.Module, filename: str, lines: list[str]) -> FileStructures:
    fc = _File(tree, filename)
    # bases and module-ness first: bindings of subclasses are looked up through them
    for cls in fc.classes.values():
        bases = []
        for b in cls.node.bases:
            d = _dotted(b)
            if d is None:
                continue
            if d in fc.classes:
                bases.append(fc.class_type(d))
                if fc.classes[d] is not cls:
                    cls.local_bases.append(fc.classes[d])
            else:
                bases.append(fc.fqn(d) or d)
        cls.bases = tuple(bases)
    for cls in fc.classes.values():
        cls.is_module = _is_module(fc, cls)
    for cls in fc.classes.values():
        init = cls.methods.get("__init__")
        if init is not None:
            cls.bindings = _InitExtractor(fc, cls, init).run()
    # Sequentials built anywhere else (``_make_layer``, a factory nobody here calls): visited
    # for their entries only
    for owner, fdef in _functions_building_sequentials(fc, lines):
        _InitExtractor(fc, owner, fdef, sweep=True).run()
    interp = _Interp(fc)
    functions = []
    classes = []
    for cls in fc.classes.values():
        node = cls.node
        classes.append(
            ClassInfo(
                name=cls.name,
                bases=cls.bases,
                is_module=cls.is_module,
                init_bindings=tuple(cls.bindings),
                span=_span(node, cls.name, node),
                attr_uses=_attr_uses(cls, lines),
            )
        )
        fwd = cls.methods.get("forward")
        if fwd is not None:
            functions.append(interp.entry(cls, fwd, f"{cls.name}.forward"))
    for name, fdef in fc.functions.items():
        functions.append(interp.entry(None, fdef, name))
    return FileStructures(
        file=filename, classes=tuple(classes), functions=tuple(functions), imports=dict(fc.imports),
        sequentials=_sequential_builds(fc),
    )


def _functions_building_sequentials(fc: _File, lines: list[str]):
    """(class or None, function) of every function whose text names ``Sequential``, but ``__init__``s."""
    candidates = [(None, f) for f in fc.functions.values()]
    for cls in fc.classes.values():
        candidates += [(cls, f) for name, f in cls.methods.items() if name != "__init__"]
    for owner, fdef in candidates:
        if any("Sequential" in lines[i - 1] for i in range(fdef.lineno, (fdef.end_lineno or fdef.lineno) + 1)):
            yield owner, fdef


def _sequential_builds(fc: _File) -> tuple[SequentialBuild, ...]:
    out = []
    for rec in fc.seq_builds.values():
        call = rec.call
        entries = []
        for _name, entry in rec.entries:
            vals = [v for v in entry.values if v[3] is not None and v[0] != UNKNOWN_TYPE]
            types = tuple(dict.fromkeys(v[0] for v in vals))
            expr = entry.expr
            span = _span(expr, rec.function, rec.stmt) if expr is not None and hasattr(expr, "lineno") else None
            entries.append(SequentialEntry(types, vals[0][1] if vals else (), span, entry.many))
        f = call.func
        out.append(SequentialBuild(
            class_name=rec.class_name, function=rec.function, span=_span(call, rec.function, rec.stmt),
            callee=(f.lineno, f.col_offset, f.end_lineno, f.end_col_offset), entries=tuple(entries),
        ))
    out.sort(key=lambda b: (b.span.line, b.span.col))
    return tuple(out)


def torch_base_of(structures: FileStructures, type_: str) -> str | None:
    """The ``torch.nn`` layer class a same-file layer type behaves as, or None.

    ``modeling_efficientnet.EfficientNetDepthwiseConv2d`` (``class ...(nn.Conv2d)`` with
    no ``forward`` of its own, directly or through same-file bases) -> ``torch.nn.Conv2d``.
    A class that defines ``forward`` anywhere on the way computes something else: None.
    """
    module, _, name = type_.rpartition(".")
    classes = {c.name: c for c in structures.classes}
    with_forward = {f.class_name for f in structures.functions if f.class_name and f.function == "forward"}
    seen = set()
    while name in classes and name not in seen and name not in with_forward:
        seen.add(name)
        bases = classes[name].bases
        torch_bases = [b for b in bases if b.startswith("torch.nn.") and b.rsplit(".", 1)[-1] != "Module"]
        if torch_bases:
            return torch_bases[0]
        local = [b.rpartition(".")[2] for b in bases if b.rpartition(".")[0] == module]
        if not local:
            return None
        name = local[0]
    return None


def extract_file(path) -> FileStructures:
    """Read ``path`` (UTF-8) and extract it; ``SyntaxError`` propagates unchanged."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return extract_source(text, path)

