"""Extraction of one file: symbol tables, class bases and module-ness, ``__init__``
bindings, then the forward interpretation of every entry function."""

from __future__ import annotations

import ast
import os
import re

from adopter.core.dsl import Arg, Const, Layer, Var
from adopter.core.extract.init_bindings import _InitExtractor
from adopter.core.extract.interp import _Interp
from adopter.core.extract.symbols import _ClassCtx, _dotted, _File, _is_module, _span
from adopter.core.extract.values import _TEST_NAMES, _UNPARSED, SOURCE_LINES, UNKNOWN_TYPE
from adopter.core.source_file import source_lines
from adopter.core.structures import ClassInfo, FileStructures, InitBinding, SequentialBuild, SequentialEntry
from adopter.core.syntax import walk

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


def extract_source(text: str, filename: str = "<string>", type_hints: dict | None = None) -> FileStructures:
    """Extract the model structures of one Python source file (never imports or runs it).

    ``type_hints``: ``{(class name, "self.<attr>"): (layer type, ...)}`` observed at run time (the
    classes of a traced model's submodules); used only for attributes whose type the source does
    not resolve (a norm class passed in by the caller, a factory imported from elsewhere).
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
        return _extract_tree(tree, filename, source_lines(text), type_hints or {})
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


def _unresolved(type_: str) -> bool:
    """A binding type that says nothing about the layer: unknown, or a function (a factory)
    defined outside torch."""
    last = type_.rsplit(".", 1)[-1]
    return type_ == UNKNOWN_TYPE or (not type_.startswith("torch.") and last[:1].islower())


def _apply_type_hints(fc: _File, hints: dict) -> None:
    by_class: dict[str, list] = {}
    for (class_name, attr), types in hints.items():
        by_class.setdefault(class_name, []).append((attr, tuple(types)))
    for name, items in by_class.items():
        cls = fc.classes.get(name)
        if cls is None:
            continue
        for attr, types in items:
            own = [b for c in cls.mro() for b in c.bindings if b.attr == attr and b.container is None]
            if (own and not all(_unresolved(b.layer.type) for b in own)) or not types:
                continue
            # constructor arguments are not in the trace: opaque values a pattern may bind
            unknown_args = tuple(Arg(Const(f"<{attr} argument {i} at run time>")) for i in range(4))
            cls.bindings = [b for b in cls.bindings if not (b.attr == attr and b.container is None)] + [
                InitBinding(attr=attr, layer=Layer(t, unknown_args, Var(attr)), conditional=len(types) > 1, runtime=True)
                for t in types
            ]


def _extract_tree(tree: ast.Module, filename: str, lines: list[str], type_hints: dict) -> FileStructures:
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
    if type_hints:
        _apply_type_hints(fc, type_hints)
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
        # Every method is an entry, not only ``forward``: a pair that ``forward_intermediates``
        # (or any other method a user calls) runs must get the rewrite ``forward`` gets, or one
        # model answers two ways. Matches a method shares with ``forward`` (inlined) are one match.
        called = _called_methods(cls)
        for name, method in cls.methods.items():
            if name == "forward" or (
                cls.is_module and _is_entry_method(name) and name not in called and not _drives_the_model(method)
                and not _samples_tokens(method)
            ):
                functions.append(interp.entry(cls, method, f"{cls.name}.{name}"))
        # Methods inherited from a same-file base, run with this class's own bindings (a base
        # ``forward`` calling ``self.fc``/``self.act`` that each subclass's ``__init__`` binds)
        # (positions name the defining class's method: a match is reported there, once for every
        # subclass it holds in)
        for name, method, owner in _inherited_entries(cls):
            functions.append(interp.entry(cls, method, f"{owner.name}.{name}", owner))
    for name, fdef in fc.functions.items():
        if not _samples_tokens(fdef):
            functions.append(interp.entry(None, fdef, name))
    return FileStructures(
        file=filename, classes=tuple(classes), functions=tuple(functions), imports=dict(fc.imports),
        sequentials=_sequential_builds(fc), foreign_layers=dict(fc.foreign_layers),
    )


def _inherited_entries(cls) -> list[tuple[str, ast.FunctionDef, object]]:
    """``(name, method, defining class)`` of the entry methods ``cls`` inherits from a same-file base and runs
    with layers of its own: the class binds in its own ``__init__`` (or a helper it calls) an
    attribute the inherited method reads, so the base's own analysis (its bindings, often none)
    says nothing about what runs in an instance of ``cls``. Each such class is analysed on its
    own; one that binds nothing the method reads runs what the base's analysis found."""
    if not cls.is_module or not cls.local_bases or "__init__" not in cls.methods or not cls.bindings:
        return []
    own = {b.attr.split(".", 1)[1] for b in cls.bindings if b.attr.startswith("self.")}
    out = []
    seen = set(cls.methods)
    for base in list(cls.mro())[1:]:
        called = _called_methods(base)
        for name, method in base.methods.items():
            if name in seen:
                continue
            seen.add(name)
            if name != "forward" and (
                not _is_entry_method(name) or name in called or _drives_the_model(method) or _samples_tokens(method)
            ):
                continue
            if _reads_any(method, own, cls):
                out.append((name, method, base))
    return out


def _reads_any(method: ast.FunctionDef, attrs: set[str], cls) -> bool:
    """``method`` reads ``self.<a>`` for one of ``attrs``, directly or in a method of ``cls``
    it calls (``self._sa_block(x)``), a few calls deep."""
    todo, seen = [method], set()
    while todo and len(seen) < 16:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        self_name = fn.args.args[0].arg if fn.args.args else "self"
        for node in walk(fn):
            if type(node) is ast.Attribute and type(node.value) is ast.Name and node.value.id == self_name:
                if node.attr in attrs:
                    return True
                callee, _owner = cls.find_method(node.attr)
                if callee is not None:
                    todo.append(callee)
    return False


def _is_entry_method(name: str) -> bool:
    """A method other than ``forward`` whose body may run layer pairs: not ``__init__`` (its
    bindings are read as such) nor another dunder."""
    return not (name.startswith("__") and name.endswith("__"))


def _drives_the_model(method: ast.FunctionDef) -> bool:
    """A method that calls the model itself (``self(...)``, ``self.forward(...)``): a loop around
    the model (``generate``, sampling, a training step), whose own ops (normalizing one step's
    logits) are not the model's structure."""
    for node in walk(method):
        if type(node) is ast.Call:
            f = node.func
            if (type(f) is ast.Name and f.id == "self") or (
                type(f) is ast.Attribute and f.attr in ("forward", "__call__") and type(f.value) is ast.Name
                and f.value.id == "self"
            ):
                return True
    return False


def _samples_tokens(fn: ast.FunctionDef) -> bool:
    """A decoding loop: a loop that draws from a distribution (``torch.multinomial``,
    ``probs.multinomial(1)``) — ``generate``/``sample`` calling a submodule or a model passed in
    (``logits = model(idx)``), where ``_drives_the_model`` does not see ``self(...)``. Its
    normalization of one step's logits runs once per generated token, outside training, under
    ``no_grad``: torch's op is already one kernel there, and it is not the model's structure."""
    if fn.name == "forward":
        return False
    for loop in walk(fn):
        if type(loop) in (ast.For, ast.While, ast.AsyncFor):
            for node in walk(loop):
                if type(node) is ast.Call:
                    f = node.func
                    name = f.attr if type(f) is ast.Attribute else f.id if type(f) is ast.Name else ""
                    if name == "multinomial":
                        return True
    return False


def _called_methods(cls) -> set[str]:
    """Methods another method of the class calls (``self.name(...)``): analysed where they are
    called (inlined), not again as entries of their own."""
    called = set()
    for name, method in cls.methods.items():
        for node in walk(method):
            f = node.func if type(node) is ast.Call else None
            if type(f) is ast.Attribute and type(f.value) is ast.Name and f.value.id == "self" and f.attr != name:
                called.add(f.attr)
    return called


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
        for alternative in rec.alternatives:
            out.append(_sequential_build(rec, alternative))
    out.sort(key=lambda b: (b.span.line, b.span.col))
    return tuple(out)


def _sequential_build(rec, alternative) -> SequentialBuild:
    """One way a recorded ``nn.Sequential(...)`` call was built, as plain data."""
    call = rec.call
    entries = []
    for _name, entry in alternative:
        vals = [v for v in entry.values if v[3] is not None and v[0] != UNKNOWN_TYPE]
        types = tuple(dict.fromkeys(v[0] for v in vals))
        expr = entry.expr
        span = _span(expr, rec.function, rec.stmt) if expr is not None and hasattr(expr, "lineno") else None
        entries.append(SequentialEntry(types, vals[0][1] if vals else (), span, entry.many))
    f = call.func
    return SequentialBuild(
        class_name=rec.class_name, function=rec.function, span=_span(call, rec.function, rec.stmt),
        callee=(f.lineno, f.col_offset, f.end_lineno, f.end_col_offset), entries=tuple(entries),
    )


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

