"""Same-file layers the rules see as torch layers: subclasses of a ``torch.nn`` layer that only
fix ``__init__`` (:func:`layer_subclass_aliases`) and same-file helper functions folded back
into one call (:func:`fold_inlined_calls`)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from adopter.core.dsl import Arg, Layer, Node, Span, TensorOp, Var
from adopter.core.match.source import parse_file
from adopter.core.match.source_uses import class_attribute_reads
from adopter.core.structures import ClassInfo, FileStructures
from adopter.core.syntax import descendants, dotted_name, statements, walk

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


def norm_act_aliases(structures: FileStructures, source: str | None) -> dict[str, str]:
    """Same-file norm+act classes: a direct ``nn.BatchNorm2d`` subclass defining only ``__init__``,
    ``forward`` (and ``extra_repr``) whose forward applies submodules to its batch norm and computes
    nothing else (:func:`adopter.catalogue.norm_act_form`, the reader the kernel uses at run time):
    type -> ``torch.nn.BatchNorm2d``, for the rules whose kernel takes such a module
    (``Rule.match_norm_act``). Classes of other files come from extraction
    (``FileStructures.foreign_layers``)."""
    from adopter.catalogue import BATCH_NORM_2D, norm_act_form

    imports = dict(structures.imports)
    out: dict[str, str] = {}
    for cls, node in _class_definitions(structures, source, lambda c: c.bases == (BATCH_NORM_2D,)):
        methods = {st.name: st for st in node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if "forward" not in methods or set(methods) - {"__init__", "forward", "extra_repr"}:
            continue
        if norm_act_form(methods["forward"], lambda dotted: _imported(dotted, imports)) is not None:
            for ty in local_type_names(structures, cls.name):
                out[ty] = BATCH_NORM_2D
    return out


def _class_definitions(structures: FileStructures, source: str | None,
                       wanted: Callable[[ClassInfo], bool]) -> list[tuple[ClassInfo, ast.ClassDef]]:
    """The scanned file's top-level classes ``wanted`` says are candidates, each with its
    definition (the file parsed only when there is one)."""
    if source is None:
        return []
    candidates = [c for c in structures.classes if wanted(c)]
    if not candidates:
        return []
    tree = parse_file(source)
    if tree is None:
        return []
    defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    return [(c, defs[c.name]) for c in candidates if c.name in defs]


def _imported(dotted: str, imports: dict[str, str]) -> str | None:
    """The qualified name of ``dotted`` (``nn.functional.relu``) through the file's imports, or None."""
    head, _, rest = dotted.partition(".")
    base = imports.get(head)
    return None if base is None else f"{base}.{rest}" if rest else base


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
        simple = [st for st in statements(fn) if st is not fn
                  and not isinstance(st, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith,
                                          ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not type(st).__name__ in ("Match", "TryStar")]
        for st in simple:
            for c in descendants(st):
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


# ---------------------------------------------------------------- methods inherited by subclasses


def inherited_dependence(structures: FileStructures, accepted: dict, found_on: dict) -> list[tuple]:
    """``[(key, match, ("needs-config", condition))]`` for accepted matches in a method that
    extraction ran once per class with its own layers (a base ``forward`` whose layers each
    subclass binds, :func:`adopter.core.extract.driver._inherited_entries`) and that hold for
    some of those classes only: the base's code runs in all of them, the kernel fits in some
    (a trace of a model settles which classes it builds).

    The classes are the entries analysing one method (same ``def``); the base's own entry counts
    only when it binds every module the match calls itself (else it is abstract: its layers come
    from subclasses)."""
    groups: dict[tuple, list[int]] = {}
    for i, fs in enumerate(structures.functions):
        if fs.class_name is not None and fs.span is not None:
            groups.setdefault((fs.function, fs.span.line, fs.span.col), []).append(i)
    if all(len(g) < 2 for g in groups.values()):
        return []
    classes = {c.name: c for c in structures.classes}
    out = []
    for key, m in accepted.items():
        if m.status != "static" or m.sequential is not None:
            continue
        where = {f for f, _ in found_on.get(key, ())}
        if not where:
            continue
        missing: list[str] = []
        holds: list[str] = []
        for f_index in sorted(where):
            fs = structures.functions[f_index]
            group = groups.get((fs.function, fs.span.line, fs.span.col), []) if fs.span is not None else []
            if len(group) < 2:
                continue
            for g in group:
                name = structures.functions[g].class_name
                if g in where:
                    holds.append(name)
                elif _binds_all(structures, classes.get(name), m) and name not in missing:
                    missing.append(name)
        missing = [n for n in missing if n not in holds]
        if missing and holds:
            shown = ", ".join(dict.fromkeys(holds))
            out.append((key, m, ("needs-config", f"the layers {m.function} calls fit in {shown}, "
                                                 f"not in {', '.join(missing)} (each binds its own)")))
    return out


def _binds_all(structures: FileStructures, cls, m) -> bool:
    """``cls`` (or a same-file base) binds every module the match calls."""
    if cls is None:
        return False
    from adopter.core.match.init_match import class_init_bindings

    bound = {ib.attr for ib in class_init_bindings(structures, cls)}
    bound |= {ib.container for ib in class_init_bindings(structures, cls) if ib.container}
    modules = [mn.node.module.name for mn in m.nodes if isinstance(mn.node, Layer) and mn.node.module is not None]
    return all(mod in bound or mod.split("[", 1)[0] in bound for mod in modules)


# ---------------------------------------------------------------- subclasses that only cast

# torch layer -> (functional it computes, its parameters in order: what each must be)
_CAST_PARENTS = {
    "torch.nn.Linear": ("torch.nn.functional.linear", ("X", "W", "B")),
    "torch.nn.LayerNorm": ("torch.nn.functional.layer_norm", ("X", "SHAPE", "W", "B", "EPS")),
}
_FUNCTIONAL_PARAMS = {
    "torch.nn.functional.linear": ("input", "weight", "bias"),
    "torch.nn.functional.layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
}
_SELF_PARTS = {"weight": "W", "bias": "B", "normalized_shape": "SHAPE", "eps": "EPS"}
_CASTS = {"float", "half", "bfloat16", "double", "contiguous"}
_DTYPES = {"float", "float32", "float16", "half", "bfloat16", "float64", "double"}
_TENSORS = ("X", "W", "B", "OUT")


def cast_subclass_aliases(structures: FileStructures, source: str | None) -> dict[str, str]:
    """Same-file subclasses of ``nn.Linear``/``nn.LayerNorm`` whose ``forward`` computes the
    parent's function up to dtype casts: type -> the torch layer, for matching.

    open_clip's ``LayerNormFp32`` (``F.layer_norm(x.to(torch.float32), self.normalized_shape,
    self.weight, self.bias, self.eps).to(orig_type)``), a ``LayerNorm`` returning
    ``super().forward(x.float()).type_as(x)``, a ``Linear`` computing ``F.linear(x,
    self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))``: the
    forward is read from the source and evaluated over what each value is (the input, the
    weight, the bias, a dtype) up to casts (``.to(dtype)``, ``.type(...)``, ``.type_as(t)``,
    ``.float()``...). Anything else in it (another op, another argument, a statement that is not
    an assignment, a method besides ``__init__``) and the class is not one. The kernels get the
    instance and check at run time what it is (an overridden ``forward`` takes the original path
    unless the kernel accepts it)."""
    imports = dict(structures.imports)
    out: dict[str, str] = {}
    for cls, node in _class_definitions(structures, source,
                                        lambda c: len(c.bases) == 1 and c.bases[0] in _CAST_PARENTS):
        parent = cls.bases[0]
        if _casts_only(node, parent, imports):
            for ty in local_type_names(structures, cls.name):
                out[ty] = parent
    return out


def _casts_only(node: ast.ClassDef, parent: str, imports: dict[str, str]) -> bool:
    forward = None
    for st in node.body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue  # docstring
        if isinstance(st, ast.FunctionDef) and st.name == "__init__":
            continue
        if isinstance(st, ast.FunctionDef) and st.name == "forward" and not st.decorator_list:
            forward = st
            continue
        return False
    if forward is None:
        return False
    a = forward.args
    params = a.posonlyargs + a.args
    if len(params) != 2 or a.vararg or a.kwarg or a.kwonlyargs or a.defaults:
        return False
    ev = _CastEval(params[0].arg, params[1].arg, parent, imports)
    return ev.body(forward.body) == "OUT"


class _CastEval:
    """What each value of a one-input ``forward`` is, up to dtype casts: ``X`` (the input),
    ``W``/``B``/``SHAPE``/``EPS`` (the layer's own), ``DT`` (a dtype), ``NONE``, ``OUT`` (the
    parent's function of them); None for anything else."""

    def __init__(self, self_name: str, x: str, parent: str, imports: dict[str, str]):
        self.self_name = self_name
        self.env: dict[str, str] = {x: "X"}
        self.parent = parent
        self.imports = imports

    def fqn(self, e: ast.AST) -> str | None:
        dotted = dotted_name(e)
        if dotted is None or dotted.partition(".")[0] in self.env:
            return None
        return _imported(dotted, self.imports)

    def body(self, stmts: list) -> str | None:
        for st in stmts:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                self.env[st.targets[0].id] = self.value(st.value)
                continue
            if isinstance(st, ast.Return):
                return self.value(st.value) if st.value is not None else None
            if isinstance(st, ast.With) and all(
                isinstance(i.context_expr, ast.Call) and (self.fqn(i.context_expr.func) or "").endswith("autocast")
                and i.optional_vars is None for i in st.items
            ):
                # ``with torch.autocast(..., enabled=False):`` around the computation
                return self.body(st.body)
            return None
        return None

    def value(self, e: ast.AST) -> str | None:
        if isinstance(e, ast.Constant):
            return "NONE" if e.value is None else None
        if isinstance(e, ast.Name):
            return self.env.get(e.id)
        if isinstance(e, ast.Attribute):
            if isinstance(e.value, ast.Name) and e.value.id == self.self_name:
                return _SELF_PARTS.get(e.attr)
            if e.attr == "dtype" and self.value(e.value) in _TENSORS:
                return "DT"
            fq = self.fqn(e)
            return "DT" if fq is not None and fq.startswith("torch.") and fq[6:] in _DTYPES else None
        if isinstance(e, ast.IfExp):
            return self.guarded(e)
        if isinstance(e, ast.Call):
            return self.call(e)
        return None

    def guarded(self, e: ast.IfExp) -> str | None:
        """``None if self.bias is None else <bias cast>`` (either order): the parameter itself."""
        t = e.test
        if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Is, ast.IsNot))
                and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value is None):
            return None
        tested = self.value(t.left)
        if tested not in ("W", "B"):
            return None
        when_none, otherwise = (e.body, e.orelse) if isinstance(t.ops[0], ast.Is) else (e.orelse, e.body)
        return tested if self.value(when_none) == "NONE" and self.value(otherwise) == tested else None

    def call(self, e: ast.Call) -> str | None:
        f = e.func
        if isinstance(f, ast.Attribute):
            # ``super().forward(x)``, ``super(Cls, self).forward(x)``, ``nn.Linear.forward(self, x)``
            if f.attr == "forward":
                args = list(e.args)
                is_super = isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) \
                    and f.value.func.id == "super"
                if not is_super and self.fqn(f.value) == self.parent and args and isinstance(args[0], ast.Name) \
                        and args[0].id == self.self_name:
                    is_super, args = True, args[1:]
                if is_super and len(args) == 1 and not e.keywords and self.value(args[0]) == "X":
                    return "OUT"
                return None
            fq = self.fqn(f)
            if fq is None:
                recv = self.value(f.value)
                if recv not in _TENSORS:
                    return None
                if f.attr in _CASTS and not e.args and not e.keywords:
                    return recv
                if f.attr in ("to", "type", "type_as") and len(e.args) + len(e.keywords) == 1:
                    arg = e.args[0] if e.args else e.keywords[0].value
                    if e.keywords and e.keywords[0].arg != "dtype":
                        return None
                    kind = self.value(arg)
                    if kind == "DT" or (f.attr != "type" and kind in _TENSORS):
                        return recv
                return None
        else:
            fq = self.fqn(f)
        if fq is None:
            return None
        functional, wanted = _CAST_PARENTS[self.parent]
        if fq != functional or any(isinstance(a, ast.Starred) for a in e.args):
            return None
        names = _FUNCTIONAL_PARAMS[functional]
        given = dict(zip(names, e.args))
        for k in e.keywords:
            if k.arg not in names or k.arg in given:
                return None
            given[k.arg] = k.value
        if set(given) != set(names):
            return None  # a parameter left at its default (no bias): not the parent's function
        return "OUT" if all(self.value(given[n]) == w for n, w in zip(names, wanted)) else None


# ---------------------------------------------------------------- one call shared by two branches


def shared_call_dependence(structures: FileStructures, accepted: dict, source: str | None) -> list[tuple]:
    """``[(key, match, ("needs-config", condition))]`` for accepted matches holding a call inside a
    helper that the matched function also reaches from the other branch of an ``if`` on the
    configuration (nn.TransformerEncoderLayer: ``_sa_block`` ends with ``self.dropout1(x)``;
    ``if self.norm_first:`` adds it to the residual and normalizes with ``norm2`` a statement
    later, the ``else`` branch normalizes at once with ``norm1``; ``_ff_block``'s ``dropout2`` is
    normalized on the ``else`` branch only). Which fusion, if any, the shared call takes part in
    is a configuration fact (a trace settles it); a rewrite of the call would change both."""
    if not source:
        return []
    candidates = [(key, m) for key, m in accepted.items() if m.status == "static" and m.sequential is None
                  and any(mn.node.span is not None and mn.node.span.inlined_at for mn in m.nodes)]
    if not candidates:
        return []
    sites: dict[tuple, dict[tuple, set]] = {}  # entry -> (line, col, function) -> call sites in it
    for fs in structures.functions:
        entry = (fs.class_name, fs.function)
        if not any((m.class_name, m.function) == entry for _k, m in candidates):
            continue
        calls = sites.setdefault(entry, {})
        for path in fs.paths:
            for n in path.nodes:
                sp = n.span
                if sp is not None and sp.inlined_at:
                    calls.setdefault((sp.line, sp.col, sp.function), set()).add(sp.inlined_at[0])
    out = []
    for key, m in candidates:
        calls = sites.get((m.class_name, m.function), {})
        for mn in m.nodes:
            sp = mn.node.span
            if sp is None or not sp.inlined_at:
                continue
            others = sorted(calls.get((sp.line, sp.col, sp.function), set()) - {sp.inlined_at[0]})
            cond = _branch_between(source, m, sp.inlined_at[0], others) if others else None
            if cond is not None:
                out.append((key, m, ("needs-config", f"fuses so only if {cond}: the call at line {sp.line} "
                                                     f"also runs on the other branch (line {others[0]})")))
                break
    return out


def _branch_between(source: str, m, site: int, others: list[int]) -> str | None:
    """The test (or its negation) of the ``if`` of the match's function whose one branch holds line
    ``site`` and whose other branch holds one of ``others``, when it reads the configuration only
    (``self.<attr>``, constants)."""
    from adopter.core.match.source import function_ast

    entry = f"{m.class_name}.{m.function}" if m.class_name else m.function
    fn = function_ast(source, entry, site)
    if fn is None:
        return None

    def holds(body, line: int) -> bool:
        return bool(body) and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno)

    for node in walk(fn):
        if not isinstance(node, ast.If) or not _config_test(node.test):
            continue
        test = ast.unparse(node.test)
        for other in others:
            if holds(node.body, site) and holds(node.orelse, other):
                return test
            if holds(node.orelse, site) and holds(node.body, other):
                return f"not ({test})"
    return None


def _config_test(test: ast.AST) -> bool:
    """A test on ``self.<attr>`` values and constants only (no tensor, no call)."""
    saw_self = False
    for n in walk(test):
        if isinstance(n, (ast.Call, ast.Subscript, ast.Lambda, ast.NamedExpr)):
            return False
        if isinstance(n, ast.Name) and n.id != "self":
            return False
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            saw_self = True
    return saw_self
