"""Same-file layers the rules see as torch layers: subclasses of a ``torch.nn`` layer that only
fix ``__init__`` (:func:`layer_subclass_aliases`) and same-file helper functions folded back
into one call (:func:`fold_inlined_calls`)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import replace

from adopter.core.dsl import Arg, Layer, Node, Span, TensorOp, Var
from adopter.core.match.source import parse_file
from adopter.core.match.source_uses import class_attribute_reads
from adopter.core.structures import FileStructures

# ---------------------------------------------------------------- same-file layer subclasses


def layer_subclass_aliases(
    structures: FileStructures, source: str | None, layer_types: Iterable[str] | None = None
) -> dict[str, str]:
    """Layer types defined in the file that behave as a ``torch.nn`` layer: type -> that layer.

    A class qualifies when it derives (directly or through classes of the same file) from a
    ``torch.nn`` class other than ``Module``/containers and neither it nor those same-file
    bases define any method but ``__init__`` — its forward is the torch layer's
    (``class EfficientNetDepthwiseConv2d(nn.Conv2d)`` only fixes ``groups`` in ``__init__``).
    Needs the source (methods are read from its ``ast``); without it, none qualifies.
    ``layer_types`` (the torch layers the rules name) limits the parents looked for.
    """
    if source is None or not structures.classes:
        return {}
    wanted = set(layer_types) if layer_types is not None else None
    if not any(
        b.startswith("torch.nn.") and b.rsplit(".", 1)[-1] not in _NOT_LAYERS and (wanted is None or b in wanted)
        for c in structures.classes for b in c.bases
    ):
        return {}  # no class derives from such a layer: skip reading the methods (parses the file)
    methods_of = {name: methods for name, (_bases, methods) in class_attribute_reads(source).items()}
    by_name = {c.name: c for c in structures.classes}
    out: dict[str, str] = {}
    for cls in structures.classes:
        name, seen, torch_base = cls.name, set(), None
        while name in by_name and name not in seen:
            seen.add(name)
            if name not in methods_of or methods_of[name]:
                break  # unknown, or defines forward/other methods: computes something else
            bases = by_name[name].bases
            torch_bases = [b for b in bases if b.startswith("torch.nn.") and b.rsplit(".", 1)[-1] not in _NOT_LAYERS]
            local = [b.rsplit(".", 1)[-1] for b in bases if b.rsplit(".", 1)[-1] in by_name]
            if len(bases) != 1:
                break  # mixins: another class may change the behaviour
            if torch_bases:
                torch_base = torch_bases[0]
                break
            if not local:
                break
            name = local[0]
        if torch_base is None:
            continue
        for ty in local_type_names(structures, cls.name):
            out[ty] = torch_base
    return out


_NOT_LAYERS = {"Module", "ModuleList", "ModuleDict", "Sequential", "ParameterList", "ParameterDict"}


def local_type_names(structures: FileStructures, class_name: str) -> list[str]:
    """How extraction names a layer of a class defined in the scanned file (``modeling_x.Cls``)."""
    stem = structures.file.replace("\\", "/").rsplit("/", 1)[-1]
    stem = stem.removesuffix(".py")
    return [f"{stem}.{class_name}", class_name]


# ---------------------------------------------------------------- folded same-file helper functions


def _call_sites(source: str, names: Iterable[str]) -> dict[tuple[int, str], list]:
    """``(line, name) -> [(call, qualified function, enclosing simple statement)]`` for every call
    ``name(...)`` in the file's functions (``Cls.method`` or ``func``)."""
    wanted = set(names)
    out: dict[tuple[int, str], list] = {}
    tree = parse_file(source)
    if tree is None:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return out

    def visit_function(fn, qual: str) -> None:
        simple = [st for st in ast.walk(fn) if isinstance(st, ast.stmt) and st is not fn
                  and not isinstance(st, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith,
                                          ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not type(st).__name__ in ("Match", "TryStar")]
        for st in simple:
            for c in ast.walk(st):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in wanted:
                    out.setdefault((c.lineno, c.func.id), []).append((c, qual, st))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit_function(node, node.name)
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit_function(m, f"{node.name}.{m.name}")
    return out


def fold_inlined_calls(structures: FileStructures, fold: dict[str, str], source: str | None) -> FileStructures:
    """``structures`` with each inlined call of a same-file function named in ``fold`` (name ->
    layer type) replaced by one functional ``Layer`` of that type at the call expression.

    Extraction inlines ``gelu(h)`` of ``def gelu(x): return x * 0.5 * (1.0 + torch.erf(...))``
    into its arithmetic; a rule that knows the function computes one op sees it as that op.
    A run is folded only when it is unambiguous: one call of the name on its line (in a simple
    statement), the run's nodes contiguous, functional (no module call), reading one outside
    value, and no temporary of the run read after it. Otherwise the nodes stay as they are.
    """
    if not fold or source is None:
        return structures
    sites = _call_sites(source, fold)
    if not sites:
        return structures
    changed = False
    functions = []
    for fs in structures.functions:
        paths = []
        for path in fs.paths:
            nodes = _fold_path(path.nodes, fold, sites)
            if nodes is not path.nodes:
                changed = True
                path = replace(path, nodes=nodes)
            paths.append(path)
        functions.append(replace(fs, paths=tuple(paths)) if paths != list(fs.paths) else fs)
    return replace(structures, functions=tuple(functions)) if changed else structures


def _fold_path(nodes: Sequence[Node], fold: dict[str, str], sites: dict) -> Sequence[Node]:
    out: list[Node] = []
    i, changed = 0, False
    while i < len(nodes):
        n = nodes[i]
        sp = getattr(n, "span", None)
        if sp is None or sp.function not in fold or not sp.inlined_at:
            out.append(n)
            i += 1
            continue
        j = i
        while j < len(nodes) and getattr(nodes[j], "span", None) is not None \
                and nodes[j].span.function == sp.function and nodes[j].span.inlined_at == sp.inlined_at:
            j += 1
        folded = _fold_run(nodes, i, j, fold[sp.function], sites.get((sp.inlined_at[-1], sp.function), []))
        if folded is None:
            out.extend(nodes[i:j])
        else:
            out.append(folded)
            changed = True
        i = j
    return tuple(out) if changed else nodes


def _fold_run(nodes: Sequence[Node], i: int, j: int, layer_type: str, calls: list) -> Layer | None:
    if len(calls) != 1:
        return None  # several calls on the line (or none seen): the run cannot be placed
    call, qual, stmt = calls[0]
    run = nodes[i:j]
    made: set = set()
    inputs: set = set()
    for n in run:
        if isinstance(n, Layer) and n.module is not None:
            return None
        if not isinstance(n, (Layer, TensorOp)):
            return None
        for a in n.args:
            v = a.value
            if isinstance(v, Var) and (v.name, v.version) not in made:
                inputs.add((v.name, v.version))
        out = getattr(n, "output", None)
        if isinstance(out, Var):
            made.add((out.name, out.version))
    last = run[-1].output
    if len(inputs) != 1 or not isinstance(last, Var):
        return None
    temps = made - {(last.name, last.version)}
    for n in nodes[j:]:
        if any(isinstance(a.value, Var) and (a.value.name, a.value.version) in temps for a in n.args):
            return None  # an intermediate of the helper is read later: not one opaque op
    (name, version), = inputs
    sp = run[0].span
    span = Span(line=call.lineno, col=call.col_offset, end_line=call.end_lineno, end_col=call.end_col_offset,
                function=qual, stmt_line=stmt.lineno, stmt_end_line=stmt.end_lineno, inlined_at=sp.inlined_at[:-1])
    return Layer(type=layer_type, args=(Arg(Var(name, version)),), output=last, module=None, span=span)
