"""Model-structure extraction from source with the stdlib ``ast`` (paper §3.2).

``extract_source(text, filename) -> FileStructures`` never imports or executes the
scanned code. For every class it records the ``__init__`` layer bindings (following
``self._init_x(...)`` helpers; ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
contents as ``container`` bindings ``self.layers[*]``, ``self.seq[0]``; ``ACT2FN[...]``
/ ``get_activation(...)`` resolved through :data:`adopter.core.extract_tables.ACTIVATIONS`).
For every entry function (each class's ``forward`` and each module-level function) it
enumerates the control-flow paths, inlining ``self.<method>(...)``, ``super().<m>(...)``
and calls of module-level/nested functions of the same file (also through local
aliases such as ``attention_interface``), and writes each path as a sequence of DSL
nodes (:mod:`adopter.core.dsl`) in SSA form.

How paths are enumerated (an abstract interpretation over *states*):

* A state is (node list, environment). Statements run on every live state; ``if``,
  loops, ``try`` and conditional expressions run each branch on a copy.
* At the join, states that added no DL node in any branch are merged back into one:
  variables that differ get a fresh SSA version (a "phi", recorded in
  ``FunctionStructures.sources``), so a branch with no DL node never forks paths.
  States whose *aliases* differ (``attention_interface`` bound to
  ``eager_attention_forward`` in one branch and to ``ALL_ATTENTION_FUNCTIONS[...]`` in
  the other) stay apart, because the callee decides which nodes follow.
* An ``if`` on a condition already decided on the path (same text, same SSA versions of
  the names it reads) takes the same branch again; ``if x is None`` on a parameter that
  holds a literal (an inlined function's default) is decided statically.
* Loops run their body once (paper: each loop is expanded once); loops that do not
  iterate over a module container also keep the zero-trip path.
* ``raise`` kills a path; ``return`` ends it. A path that is a prefix of another
  (an early return before any further DL node) is dropped from the entry's result.
* At most :data:`MAX_PATHS` paths per entry, and after :data:`MAX_STEPS` statement
  executions branches stop forking (``FunctionStructures.capped`` says when either cut
  paths off); inlining stops at :data:`MAX_INLINE_DEPTH` and on recursion. An inlined
  callee runs once per distinct (call site, arguments) and its nodes are replayed on
  every path that reaches the call.

SSA: every assignment gets a version keyed by its statement and inlining context,
so the same statement has the same version on every path; temporaries for nested
calls are ``tmp_<n>``. Parameters and never-assigned names are version 0. A node
returned by an inlined callee writes straight into the caller's assignment target
(``q = self._split_heads(x)``: the callee's ``permute`` outputs ``q#1``).

Node kinds: module calls ``Layer(type, module=Var("self.x"))`` (type from the
``__init__`` binding; one path variant per type when conditional bindings differ);
functions ``Layer("torch.nn.functional.softmax")``; tensor methods
``Layer("torch.Tensor.view", args=(self_tensor, ...))``; operators ``TensorOp``.
Calls that are no DL computation (builtins, shape queries, tensor factories, logging,
``print``, ``warnings``, transformers utilities) produce no node; unresolvable calls of
``self.<attr>`` in a module produce a barrier ``Layer(UNKNOWN_TYPE)``.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
from collections.abc import Iterable

from adopter.core import extract_tables as T
from adopter.core.dsl import Arg, Const, Layer, Span, TensorOp, Var
from adopter.core.structures import ClassInfo, FileStructures, FunctionStructures, InitBinding, PathStructure

__all__ = [
    "extract_source",
    "extract_file",
    "format_structure",
    "torch_base_of",
    "MAX_PATHS",
    "MAX_INLINE_DEPTH",
    "UNKNOWN_TYPE",
    "ATTENTION_TABLE_TYPE",
]

MAX_PATHS = 128
MAX_INLINE_DEPTH = 6
# Budget of statement executions per entry; past it, branches no longer fork
# (their nodes are kept on the first branch only) so pathological files stay fast.
MAX_STEPS = 5_000
# Type of a call whose callee cannot be resolved statically (``self.foo(x)`` with no
# binding of ``foo``, calling a parameter).
UNKNOWN_TYPE = "?"
# Calls through transformers' runtime attention dispatch table.
ATTENTION_TABLE_TYPE = "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS"

_OPS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>",
}
_UNARY = {ast.USub: "-", ast.Invert: "~", ast.UAdd: "+"}
_BUILTINS = frozenset(dir(builtins))
_CONTAINERS = ("torch.nn.ModuleList", "torch.nn.Sequential", "torch.nn.ModuleDict")
_TENSOR_HOLDERS = ("torch.nn.Parameter", "torch.nn.Buffer", "torch.nn.parameter.Parameter")
# ``self.<name>(...)`` with no binding and no method in the file: inherited utilities
# (PreTrainedModel) rather than layers, so no barrier node.
_NOT_LAYER_METHODS = (
    "get_", "set_", "warn", "post_init", "loss_function", "size", "__init__", "register_", "invert_attention_mask",
    "_prepare_4d", "_update_causal_mask", "_update_full_mask", "_update_cross_attn_mask", "num_parameters",
)
_OPAQUE_CLASS_SUFFIXES = ("Output", "Config", "Cache", "Mixin", "Kwargs", "Dict")

LIVE, RET, DEAD, BRK, CONT = range(5)
_INDEX = re.compile(r"\[\d+\]")
_SIMPLE = (ast.Name, ast.Constant, ast.Attribute)


# ---------------------------------------------------------------- values and states


class _V:
    """Abstract value of an expression.

    ``var`` set: a data value (node output, parameter, assigned name). ``alias`` set:
    a callable or module reference (``("mod", "self.LayerNorm")``, ``("fn", fqn)``,
    ``("local", name)``, ``("method", name)``, ``("def", id)``, ``("class", name)``,
    ``("act", type, key)``, ``("table", fqn)``, ``("self",)``). Otherwise a constant /
    other expression kept as text (``expr`` unparsed lazily, or ``text``).
    ``tensor`` says whether the value may be a tensor (decides whether ``a + b`` is a
    TensorOp). ``elts`` holds element values of a tuple/list display.
    """

    __slots__ = ("var", "expr", "text", "tensor", "alias", "elts")

    def __init__(self, var=None, expr=None, text=None, tensor=False, alias=None, elts=None):
        self.var = var
        self.expr = expr
        self.text = text
        self.tensor = tensor
        self.alias = alias
        self.elts = elts

    def value(self):
        if self.var is not None:
            return self.var
        if self.text is None:
            if self.elts is not None:
                inner = ", ".join(str(e.value()) for e in self.elts)
                self.text = f"({inner},)" if len(self.elts) == 1 else f"({inner})"
            elif self.expr is not None:
                key = id(self.expr)
                text = _UNPARSED.get(key)
                if text is None:
                    text = _UNPARSED[key] = ast.unparse(self.expr)
                self.text = text
            else:
                self.text = "None"
        return Const(self.text)


# id(ast expr) -> ast.unparse(expr) for the tree being extracted (cleared per file):
# the same expression is written into nodes on many paths.
_UNPARSED: dict[int, str] = {}

_NONE = _V(text="None")
_TRUE = _V(text="True")
_FALSE = _V(text="False")
# id(if test) -> names it reads (cleared per file with _UNPARSED)
_TEST_NAMES: dict[int, list[str]] = {}
_SELF = _V(alias=("self",), text="self")


class _St:
    __slots__ = ("nodes", "env", "flow", "ret")

    def __init__(self, nodes, env, flow=LIVE, ret=None):
        self.nodes = nodes  # cons list: (node, previous) or None
        self.env = env
        self.flow = flow
        self.ret = ret

    def fork(self) -> "_St":
        return _St(self.nodes, dict(self.env), self.flow, self.ret)


def _cons_to_tuple(cell) -> tuple:
    out = []
    while cell is not None:
        out.append(cell[0])
        cell = cell[1]
    out.reverse()
    return tuple(out)


# ---------------------------------------------------------------- file context


def _dotted(expr) -> str | None:
    parts = []
    while type(expr) is ast.Attribute:
        parts.append(expr.attr)
        expr = expr.value
    if type(expr) is ast.Name:
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def _module_info(filename: str) -> tuple[str, str | None]:
    """(module name for classes of this file, package for relative imports or None)."""
    if filename.startswith("<"):
        return "module", None
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    stem = os.path.splitext(parts[-1])[0]
    module = stem if stem.isidentifier() else "module"
    package = None
    if "transformers" in parts[:-1]:
        i = len(parts) - 2 - parts[:-1][::-1].index("transformers")
        package = ".".join(parts[i:-1])
    return module, package


def _resolve_from(module: str | None, level: int, package: str | None) -> str:
    if level == 0:
        return module or ""
    if package:
        pkg = package.split(".")
        base = pkg[: len(pkg) - (level - 1)] if level > 1 else pkg
        return ".".join(base + ([module] if module else []))
    return "." * level + (module or "")


def _join(base: str, name: str) -> str:
    if not base:
        return name
    return base + name if base.endswith(".") else f"{base}.{name}"


def _is_module_base(fqn: str) -> bool:
    last = fqn.rsplit(".", 1)[-1]
    if fqn in ("torch.nn.Module", "torch.nn.modules.module.Module", "nn.Module"):
        return True
    if last.endswith("PreTrainedModel") or last in ("GradientCheckpointingLayer", "Module"):
        return True
    if fqn.startswith("torch.nn.") and last[:1].isupper() and last not in ("Parameter", "Buffer"):
        return True
    if ".modeling_" in fqn and last[:1].isupper() and not last.endswith(_OPAQUE_CLASS_SUFFIXES):
        return True
    return fqn.endswith("pytorch_utils.Conv1D")


class _ClassCtx:
    def __init__(self, node: ast.ClassDef):
        self.node = node
        self.name = node.name
        self.methods: dict[str, ast.FunctionDef] = {}
        for st in node.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.methods[st.name] = st
        self.bases: tuple[str, ...] = ()
        self.local_bases: list[_ClassCtx] = []
        self.bindings: list[InitBinding] = []
        self.is_module = False
        self._types: dict[str, list[str]] = {}
        # Sequential container name -> alternatives, each ((element name, type), ...) in order
        self.seq_variants: dict[str, list[tuple]] = {}
        self._method_cache: dict[str, tuple] = {}

    def mro(self) -> Iterable["_ClassCtx"]:
        seen = set()
        todo = [self]
        while todo:
            c = todo.pop(0)
            if id(c) in seen:
                continue
            seen.add(id(c))
            yield c
            todo.extend(c.local_bases)

    def find_method(self, name: str):
        """(FunctionDef, defining class) of ``self.<name>`` in this class or same-file bases."""
        r = self._method_cache.get(name)
        if r is None:
            r = (None, None)
            for c in self.mro():
                if name in c.methods:
                    r = (c.methods[name], c)
                    break
            self._method_cache[name] = r
        return r

    def types_of(self, var: str) -> list[str]:
        """Distinct layer types bound to ``self.x`` (or a container element ``self.x[*]``)."""
        r = self._types.get(var)
        if r is None:
            r = []
            for c in self.mro():
                for b in c.bindings:
                    name = b.container if b.container is not None else b.attr
                    if (name == var or (b.container is not None and _INDEX.sub("[*]", name) == var)) and (
                        b.layer.type not in r
                    ):
                        r.append(b.layer.type)
                if r:
                    break
            self._types[var] = r
        return r

    def has_binding_prefix(self, prefix: str) -> bool:
        for c in self.mro():
            for b in c.bindings:
                if b.container is not None and b.container.startswith(prefix):
                    return True
        return False


class _File:
    def __init__(self, tree: ast.Module, filename: str):
        self.filename = filename
        self.module, self.package = _module_info(filename)
        self.imports: dict[str, str] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.classes: dict[str, _ClassCtx] = {}
        self.dicts: dict[str, ast.Dict] = {}
        self.local_class_alias: dict[str, str] = {}
        self._name_cache: dict[str, _V] = {}
        self._collect(tree.body)

    def _collect(self, body):
        for st in body:
            t = type(st)
            if t is ast.Import:
                for a in st.names:
                    if a.asname:
                        self.imports[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = top
            elif t is ast.ImportFrom:
                base = _resolve_from(st.module, st.level, self.package)
                for a in st.names:
                    if a.name != "*":
                        self.imports[a.asname or a.name] = _join(base, a.name)
            elif t in (ast.FunctionDef, ast.AsyncFunctionDef):
                self.functions[st.name] = st
            elif t is ast.ClassDef:
                self.classes[st.name] = _ClassCtx(st)
            elif t in (ast.If, ast.Try):
                self._collect(st.body)
                for h in getattr(st, "handlers", ()):
                    self._collect(h.body)
                self._collect(st.orelse)
            elif t is ast.Assign and len(st.targets) == 1 and type(st.targets[0]) is ast.Name:
                name = st.targets[0].id
                v = st.value
                if type(v) is ast.Dict:
                    self.dicts[name] = v
                else:
                    d = _dotted(v)
                    if d is not None:
                        if d in self.classes:
                            self.local_class_alias[name] = d
                        else:
                            fq = self.fqn(d)
                            if fq is not None:
                                self.imports[name] = fq

    def fqn(self, dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        base = self.imports.get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def class_type(self, name: str) -> str:
        return f"{self.module}.{name}"


# ---------------------------------------------------------------- helpers


def _const_args(call: ast.Call) -> tuple[Arg, ...]:
    out = []
    for a in call.args:
        if type(a) is ast.Starred:
            out.append(Arg(Const("*" + ast.unparse(a.value))))
        else:
            out.append(Arg(Const(ast.unparse(a))))
    for k in call.keywords:
        if k.arg is None:
            out.append(Arg(Const("**" + ast.unparse(k.value))))
        else:
            out.append(Arg(Const(ast.unparse(k.value)), k.arg))
    return tuple(out)


def _activation_type(key: ast.AST) -> tuple[str, tuple[Arg, ...], str]:
    """Type, constructor args and key text of ``ACT2FN[key]`` / ``get_activation(key)``."""
    text = ast.unparse(key)
    if type(key) is ast.Constant and isinstance(key.value, str) and key.value in T.ACTIVATIONS:
        return T.ACTIVATIONS[key.value], (), text
    return T.ACT2FN_TYPE, (Arg(Const(text)),), text


def _activation_instance(fq: str) -> str | None:
    """Type of a module-level activation instance of ``transformers.activations``
    (``gelu = get_activation("gelu")``, imported as ``from ...activations import gelu``)."""
    module, _, name = fq.rpartition(".")
    if not module.endswith("activations"):
        return None
    if name == "linear_act":
        name = "linear"
    return T.ACTIVATIONS.get(name)


def _annotation_is_tensor(ann) -> bool:
    if ann is None:
        return True
    text = ast.unparse(ann) if not isinstance(ann, str) else ann
    if "Tensor" in text or "tensor" in text:
        return True
    return False


def _span(node, function: str, stmt, inlined_at: tuple[int, ...] = ()) -> Span:
    return Span(
        node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, function,
        stmt.lineno if stmt is not None else node.lineno,
        stmt.end_lineno if stmt is not None else node.end_lineno,
        inlined_at,
    )


# ---------------------------------------------------------------- __init__ bindings


class _InitExtractor:
    """Collects ``self.<attr> = <layer>(...)`` bindings of one ``__init__``."""

    def __init__(self, fc: _File, cls: _ClassCtx, fn: ast.FunctionDef):
        self.fc = fc
        self.cls = cls
        self.fn = fn
        self.qual = f"{cls.name}.{fn.name}"
        self.out: list[InitBinding] = []
        # local name -> list of (type, args, activation, site expr) it may hold
        self.local: dict[str, list[tuple]] = {}
        # local list name -> element values
        self.lists: dict[str, list[tuple]] = {}
        self.self_name = fn.args.args[0].arg if fn.args.args else "self"
        self.stmt = None

    def run(self) -> list[InitBinding]:
        self.visiting = {self.fn.name}
        self.block(self.fn.body, False)
        return self.out

    def helper(self, fn: ast.FunctionDef, conditional: bool):
        """``self._init_weights_of_x(config)`` called from ``__init__``: its bindings count too."""
        saved = (self.qual, self.local, self.lists, self.self_name, self.stmt)
        self.visiting.add(fn.name)
        self.qual = f"{self.cls.name}.{fn.name}"
        self.local, self.lists = {}, {}
        self.self_name = fn.args.args[0].arg if fn.args.args else "self"
        try:
            self.block(fn.body, conditional)
        finally:
            self.visiting.discard(fn.name)
            self.qual, self.local, self.lists, self.self_name, self.stmt = saved

    # -- resolution
    def callee_types(self, f) -> list[str]:
        t = type(f)
        if t is ast.Name:
            if f.id in self.local:
                return [v[0] for v in self.local[f.id] if v[3] is None]
            if f.id in self.fc.classes:
                return [self.fc.class_type(f.id)]
            if f.id in self.fc.local_class_alias:
                return [self.fc.class_type(self.fc.local_class_alias[f.id])]
            if f.id in self.fc.functions:
                return [f"{self.fc.module}.{f.id}"]
            fq = self.fc.imports.get(f.id)
            return [fq] if fq else []
        if t is ast.Attribute:
            d = _dotted(f)
            if d is not None and not d.startswith(self.self_name + "."):
                fq = self.fc.fqn(d)
                return [fq] if fq else []
            return []
        if t is ast.IfExp:
            return self.callee_types(f.body) + self.callee_types(f.orelse)
        if t is ast.Subscript and type(f.value) is ast.Name and f.value.id in self.fc.dicts:
            d = self.fc.dicts[f.value.id]
            key = f.slice
            vals = d.values
            if type(key) is ast.Constant:
                vals = [v for k, v in zip(d.keys, d.values) if type(k) is ast.Constant and k.value == key.value]
            out = []
            for v in vals:
                for ty in self.callee_types(v):
                    if ty not in out:
                        out.append(ty)
            return out
        return []

    def is_act2fn(self, expr) -> bool:
        d = _dotted(expr)
        if d is None:
            return False
        fq = self.fc.fqn(d) or d
        return fq.rsplit(".", 1)[-1] == "ACT2FN"

    def values(self, v) -> list[tuple]:
        """Candidate (type, args, activation, layer-holder-call) for an assigned value."""
        t = type(v)
        if t is ast.Call:
            f = v.func
            if type(f) is ast.Subscript and self.is_act2fn(f.value):
                ty, args, key = _activation_type(f.slice)
                return [(ty, args, key, v)]
            fd = _dotted(f)
            fq = (self.fc.fqn(fd) if fd else None) or fd or ""
            if fq.rsplit(".", 1)[-1] == "get_activation" and v.args:
                ty, args, key = _activation_type(v.args[0])
                return [(ty, args, key, v)]
            if type(f) is ast.Name and f.id in self.local:
                # calling a local that holds a class (``attention_class(config)``)
                return [(ty, _const_args(v), None, v) for ty, a, k, site in self.local[f.id] if site is None]
            return [(ty, _const_args(v), None, v) for ty in self.callee_types(f)]
        if t is ast.Subscript and self.is_act2fn(v.value):
            ty, args, key = _activation_type(v.slice)
            return [(ty, args, key, v)]
        if t is ast.IfExp:
            return self.values(v.body) + self.values(v.orelse)
        if t is ast.BoolOp:
            return [x for operand in v.values for x in self.values(operand)]
        if t is ast.Name:
            if v.id in self.local:
                return [x for x in self.local[v.id] if x[3] is not None]
            fq = self.fc.imports.get(v.id)
            if fq and v.id not in self.fc.classes:
                return [(_activation_instance(fq) or fq, (), None, v)]
            if v.id in self.fc.functions:
                return [(f"{self.fc.module}.{v.id}", (), None, v)]
            return []
        if t is ast.Attribute:
            d = _dotted(v)
            if d is not None and not d.startswith(self.self_name + "."):
                fq = self.fc.fqn(d)
                if fq and (fq.startswith("torch.") or fq.startswith("transformers.activations")):
                    return [(fq, (), None, v)]
            return []
        return []

    def class_refs(self, v) -> list[tuple]:
        """A local bound to a class/function (``attention_class = A if c else B``)."""
        return [(ty, None, None, None) for ty in self.callee_types(v)]

    # -- recording
    def record(self, attr: str, vals: list[tuple], conditional: bool, container_of: str | None = None):
        multi = len(vals) > 1
        for ty, args, key, site in vals:
            if site is None:
                continue
            span = _span(site, self.qual, self.stmt)
            out_name = container_of if container_of is not None else attr
            self.out.append(
                InitBinding(
                    attr=attr,
                    layer=Layer(ty, args, Var(out_name), None, span),
                    conditional=conditional or multi,
                    container=container_of,
                    span=span,
                    activation=key,
                )
            )
            if ty in _CONTAINERS and type(site) is ast.Call:
                # contents, also of containers inside containers (a Sequential in a ModuleList)
                self.contents(attr, out_name, ty, site, conditional)

    def contents(self, attr: str, prefix: str, ty: str, call: ast.Call, conditional: bool):
        """Bindings for the layers inside ``nn.ModuleList/Sequential/ModuleDict(...)``."""
        items: list[tuple[str, ast.AST]] = []  # (container name, element expr)
        lists: list[tuple[str, list]] = []
        args = call.args
        if ty == "torch.nn.Sequential" and args and all(type(a) is not ast.Starred for a in args):
            if len(args) == 1 and type(args[0]) is ast.Call and (_dotted(args[0].func) or "").endswith("OrderedDict"):
                pass
            else:
                items = [(f"{prefix}[{i}]", a) for i, a in enumerate(args)]
                # the element types of this Sequential, in order: ``self.seq(x)`` in forward
                # is expanded into one node per element (one variant per Sequential when a
                # container holds several differently built ones)
                variant = []
                for name, a in items:
                    vals = [v for v in self.values(a) if v[3] is not None]
                    if len(vals) != 1:
                        variant = None
                        break
                    variant.append((name, vals[0][0]))
                if variant:
                    self.cls.seq_variants.setdefault(prefix, []).append(tuple(variant))
        else:
            for a in args:
                a = a.value if type(a) is ast.Starred else a
                ta = type(a)
                if ta in (ast.List, ast.Tuple):
                    items += [(f"{prefix}[*]", e) for e in a.elts]
                elif ta in (ast.ListComp, ast.GeneratorExp):
                    items.append((f"{prefix}[*]", a.elt))
                elif ta is ast.Dict:
                    items += [(f"{prefix}[*]", e) for e in a.values]
                elif ta is ast.Name and a.id in self.lists:
                    lists.append((f"{prefix}[*]", self.lists[a.id]))
        for name, e in items:
            self.record(attr, self.values(e), conditional, container_of=name)
        for name, vals in lists:
            self.record(attr, vals, conditional, container_of=name)

    # -- statements
    def block(self, body, conditional: bool):
        for st in body:
            self.stmt = st
            self.statement(st, conditional)

    def statement(self, st, conditional: bool):
        t = type(st)
        if t in (ast.Assign, ast.AnnAssign):
            value = st.value
            if value is None:
                return
            targets = st.targets if t is ast.Assign else [st.target]
            for tg in targets:
                self.assign(tg, value, conditional)
        elif t is ast.AugAssign:
            if type(st.target) is ast.Name and st.target.id in self.lists and type(st.value) in (ast.List, ast.Tuple):
                for e in st.value.elts:
                    self.lists[st.target.id].extend(self.values(e))
        elif t is ast.Expr and type(st.value) is ast.Call:
            self.call_stmt(st.value, conditional)
        elif t is ast.If:
            self.block(st.body, True)
            self.block(st.orelse, True)
        elif t in (ast.For, ast.AsyncFor):
            self.block(st.body, conditional)
            self.block(st.orelse, True)
        elif t is ast.While:
            self.block(st.body, True)
            self.block(st.orelse, True)
        elif t in (ast.With, ast.AsyncWith):
            self.block(st.body, conditional)
        elif t is ast.Try or t.__name__ == "TryStar":
            self.block(st.body, conditional)
            for h in st.handlers:
                self.block(h.body, True)
            self.block(st.orelse, True)
            self.block(st.finalbody, conditional)

    def assign(self, tg, value, conditional: bool):
        tt = type(tg)
        if tt is ast.Attribute and type(tg.value) is ast.Name and tg.value.id == self.self_name:
            attr = f"self.{tg.attr}"
            vals = self.values(value)
            if type(value) is ast.Name and value.id in self.lists:
                # ``self.layers = layers`` for a plain list: no module container
                return
            # ``nn.Dropout(p) if p > 0 else None``: bound on one branch only
            self.record(attr, vals, conditional or type(value) in (ast.IfExp, ast.BoolOp))
        elif tt is ast.Name:
            name = tg.id
            vt = type(value)
            if vt in (ast.List, ast.Tuple):
                self.lists[name] = [v for e in value.elts for v in self.values(e)]
                self.local.pop(name, None)
            elif vt in (ast.ListComp, ast.GeneratorExp):
                self.lists[name] = self.values(value.elt)
                self.local.pop(name, None)
            else:
                vals = self.values(value)
                refs = self.class_refs(value) if vt in (ast.Name, ast.Attribute, ast.IfExp, ast.Subscript) else []
                # a reference to a class/function also counts: ``norm = nn.LayerNorm``
                self.local[name] = [v for v in vals if v[3] is not None] + refs
                self.lists.pop(name, None)

    def call_stmt(self, call: ast.Call, conditional: bool):
        f = call.func
        if (
            type(f) is ast.Attribute and type(f.value) is ast.Name and f.value.id == self.self_name
            and f.attr in self.cls.methods and f.attr not in self.visiting
        ):
            self.helper(self.cls.methods[f.attr], conditional)
            return
        if type(f) is not ast.Attribute or f.attr not in ("append", "extend", "add_module", "insert"):
            return
        recv = f.value
        elems: list = []
        if f.attr == "append" and call.args:
            elems = [call.args[0]]
        elif f.attr == "insert" and len(call.args) > 1:
            elems = [call.args[1]]
        elif f.attr == "extend" and call.args and type(call.args[0]) in (ast.List, ast.Tuple):
            elems = list(call.args[0].elts)
        elif f.attr == "add_module" and len(call.args) > 1 and type(recv) is ast.Name and recv.id == self.self_name:
            if type(call.args[0]) is ast.Constant and isinstance(call.args[0].value, str):
                self.record(f"self.{call.args[0].value}", self.values(call.args[1]), conditional)
            return
        if type(recv) is ast.Name and recv.id in self.lists:
            for e in elems:
                self.lists[recv.id].extend(self.values(e))
        elif type(recv) is ast.Attribute and type(recv.value) is ast.Name and recv.value.id == self.self_name:
            attr = f"self.{recv.attr}"
            for e in elems:
                self.record(attr, self.values(e), conditional, container_of=f"{attr}[*]")


# ---------------------------------------------------------------- forward interpretation


class _Interp:
    def __init__(self, fc: _File):
        self.fc = fc
        self.defs: dict[int, tuple[ast.FunctionDef, str]] = {}
        self.synthetic: dict[int, ast.Call] = {}

    # -- entry
    def entry(self, cls: _ClassCtx | None, fdef: ast.FunctionDef, qual: str) -> FunctionStructures:
        self.cls = cls
        self.owner = cls
        self.vers: dict = {}
        self.vcount: dict[str, int] = {}
        self.tmps: dict = {}
        self.ntmp = 0
        self.ctx: tuple = ()
        self.inlined_at: tuple[int, ...] = ()
        self.qual = qual
        self.stack = [id(fdef)]
        self.ret_dest = None
        self.sources: dict = {}
        self.memo: dict = {}
        self.spans: dict = {}
        self.stmt = fdef
        self.capped = False
        self.steps = 0
        self.no_fork = False
        env = {}
        params = list(fdef.args.posonlyargs) + list(fdef.args.args)
        if cls is not None and params:
            env[params[0].arg] = _SELF
            params = params[1:]
        for p in params + list(fdef.args.kwonlyargs):
            env[p.arg] = _V(var=Var(p.arg), tensor=_annotation_is_tensor(p.annotation))
        for p in (fdef.args.vararg, fdef.args.kwarg):
            if p is not None:
                env[p.arg] = _V(text=p.arg)
        states = self.block(fdef.body, [_St(None, env)])
        heads = [s.nodes for s in states if s.flow != DEAD]
        paths = self._paths(heads)
        span = _span(fdef, qual, fdef)
        return FunctionStructures(
            class_name=cls.name if cls is not None else None,
            function=fdef.name,
            paths=paths,
            span=span,
            capped=self.capped,
            sources=self.sources,
        )

    @staticmethod
    def _paths(heads) -> tuple[PathStructure, ...]:
        interior: set[int] = set()
        uniq = []
        seen = set()
        for h in heads:
            if h is None or id(h) in seen:
                continue
            seen.add(id(h))
            uniq.append(h)
            cell = h[1]
            while cell is not None and id(cell) not in interior:
                interior.add(id(cell))
                cell = cell[1]
        kept = [h for h in uniq if id(h) not in interior]
        if not kept:
            return (PathStructure(()),)
        return tuple(PathStructure(_cons_to_tuple(h)) for h in kept)

    # -- versions and temporaries
    def new_var(self, name: str, site) -> Var:
        key = (name, id(site), self.ctx)
        v = self.vers.get(key)
        if v is None:
            n = self.vcount.get(name, 0) + 1
            self.vcount[name] = n
            v = self.vers[key] = Var(name, n)
        return v

    def tmp(self, site, extra=0) -> Var:
        key = (id(site), extra, self.ctx)
        v = self.tmps.get(key)
        if v is None:
            self.ntmp += 1
            v = self.tmps[key] = Var(f"tmp_{self.ntmp}")
        return v

    def span(self, node) -> Span:
        # the same expression in the same inlining context always has the same span
        key = (id(node), self.ctx)
        sp = self.spans.get(key)
        if sp is None:
            sp = self.spans[key] = _span(node, self.qual, self.stmt, self.inlined_at)
        return sp

    # -- statements
    def block(self, body, states: list[_St]) -> list[_St]:
        for s in body:
            live = [x for x in states if x.flow == LIVE]
            if not live:
                break
            if len(live) != len(states):
                done = [x for x in states if x.flow != LIVE]
            else:
                done = []
            self.stmt = s
            self.steps += len(live)
            if self.steps > MAX_STEPS:
                if not self.no_fork:
                    self.no_fork = True
                    self.capped = True
                if len(live) > 1:
                    live = live[:1]
            new = self.statement(s, live)
            states = done + new if done else new
            if len(states) > MAX_PATHS:
                states = states[:MAX_PATHS]
                self.capped = True
        return states

    def statement(self, s, live: list[_St]) -> list[_St]:
        t = type(s)
        if t is ast.Assign or t is ast.AnnAssign:
            if s.value is None:
                return live
            out = []
            for st in live:
                out.extend(self.assign(s, st))
            return out
        if t is ast.Expr:
            v = s.value
            tv = type(v)
            if tv is ast.Await:
                v = v.value
                tv = type(v)
            if tv is not ast.Call and tv is not ast.NamedExpr:
                return live
            if tv is ast.Call and self.extraneous(v):
                return live
            out = []
            for st in live:
                out.extend(st2 for st2, _ in self.ev(v, st))
            return out
        if t is ast.Return:
            out = []
            for st in live:
                if s.value is None:
                    st.flow, st.ret = RET, _NONE
                    out.append(st)
                else:
                    # in an inlined callee, the returned node writes straight into the
                    # caller's assignment target (``q = self._split_heads(x)``: permute -> q#1)
                    for st2, v in self.ev(s.value, st, self.ret_dest):
                        st2.flow, st2.ret = RET, v
                        out.append(st2)
            return out
        if t is ast.If:
            return self.if_(s, live)
        if t is ast.For or t is ast.AsyncFor or t is ast.While:
            return self.loop(s, live)
        if t is ast.AugAssign:
            out = []
            for st in live:
                out.extend(self.augassign(s, st))
            return out
        if t is ast.With or t is ast.AsyncWith:
            for st in live:
                for item in s.items:
                    if item.optional_vars is not None:
                        self.bind(item.optional_vars, _V(expr=item.context_expr), st, s, None)
            return self.block(s.body, live)
        if t is ast.Try or t.__name__ == "TryStar":
            return self.try_(s, live)
        if t is ast.Raise:
            for st in live:
                st.flow = DEAD
            return live
        if t is ast.Break or t is ast.Continue:
            for st in live:
                st.flow = BRK if t is ast.Break else CONT
            return live
        if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            self.defs[id(s)] = (s, f"{self.qual}.{s.name}")
            v = _V(alias=("def", id(s)), text=s.name)
            for st in live:
                st.env[s.name] = v
            return live
        if t is ast.Match:
            out = []
            for st in live:
                res = []
                for case in s.cases:
                    res.extend(self.block(case.body, [st.fork()]))
                res.append(st)
                out.extend(self.merge(res, s))
            return out
        return live  # pass, assert, import, global, delete, ...

    def extraneous(self, call: ast.Call) -> bool:
        d = _dotted(call.func)
        if d is None:
            return False
        head = d.split(".", 1)[0]
        if d == "print" or head in T.LOGGER_NAMES or d.startswith("self.logger"):
            return True
        fq = self.fc.fqn(d) or ""
        return fq in T.EXTRANEOUS_CALLS or fq.startswith(("warnings.", "logging."))

    def if_(self, s: ast.If, live: list[_St]) -> list[_St]:
        test = s.test
        if type(test) is ast.Constant:
            return self.block(s.body if test.value else s.orelse, live)
        out = []
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            # Remember the decision on each branch: a later ``if`` on the same condition
            # (same names, same SSA versions) takes the same branch, so ``if
            # self.use_batch_norm:`` twice in a forward gives 2 paths, not 4.
            dkey = self.decision_key(test, st)
            d = st.env.get(dkey)
            known = (d is _TRUE) if (d is _TRUE or d is _FALSE) else self.truth(test, st)
            if known is not None:
                out.extend(self.block(s.body if known else s.orelse, [st]))
                continue
            taken = st.fork()
            taken.env[dkey] = _TRUE
            body = self.block(s.body, [taken])
            self.stmt = s
            if self.no_fork and any(b.nodes is not st.nodes for b in body if b.flow != DEAD):
                out.extend(body)
                continue
            st.env[dkey] = _FALSE
            orelse = self.block(s.orelse, [st]) if s.orelse else [st]
            self.stmt = s
            out.extend(self.merge(body + orelse, s))
        return out

    def decision_key(self, test, st: _St) -> str:
        names = _TEST_NAMES.get(id(test))
        if names is None:
            names = _TEST_NAMES[id(test)] = sorted(
                {n.id for n in ast.walk(test) if type(n) is ast.Name}
                | {"self." + n.attr for n in ast.walk(test) if type(n) is ast.Attribute and type(n.value) is ast.Name}
            )
        text = _UNPARSED.get(id(test))
        if text is None:
            text = _UNPARSED[id(test)] = ast.unparse(test)
        parts = [text]
        env = st.env
        for n in names:
            v = env.get(n)
            if v is not None:
                if v.var is not None:
                    parts.append(f"{n}={v.var}")
                elif v.alias is not None:
                    parts.append(f"{n}={v.alias}")
                else:
                    parts.append(f"{n}=`{v.value()}`")
        return "?" + "|".join(parts)

    def truth(self, test, st: _St) -> bool | None:
        """Statically known truth of an ``if`` test, or None. Only decides tests on names
        that hold a literal constant on this path (an inlined function's ``None`` default):
        ``if scaling is None``, ``if dropout``, ``not x``, ``and``/``or`` of those."""
        t = type(test)
        if t is ast.Name:
            v = st.env.get(test.id)
            if v is not None and v.var is None and type(v.expr) is ast.Constant:
                return bool(v.expr.value)
            return None
        if t is ast.Compare:
            if len(test.ops) != 1 or type(test.left) is not ast.Name:
                return None
            op = type(test.ops[0])
            right = test.comparators[0]
            if op not in (ast.Is, ast.IsNot) or type(right) is not ast.Constant or right.value is not None:
                return None
            v = st.env.get(test.left.id)
            if v is None:
                return None
            if v is _NONE or (v.var is None and type(v.expr) is ast.Constant and v.expr.value is None):
                is_none = True
            elif v.alias is not None or v.elts is not None or (
                v.var is None and v.expr is not None and type(v.expr) not in (ast.Name, ast.Subscript)
            ):
                # a literal or an expression like ``self.scaling`` passed for the parameter
                is_none = False
            else:
                return None
            return is_none if op is ast.Is else not is_none
        if t is ast.UnaryOp and type(test.op) is ast.Not:
            r = self.truth(test.operand, st)
            return None if r is None else not r
        if t is ast.BoolOp:
            vals = [self.truth(v, st) for v in test.values]
            if type(test.op) is ast.And:
                if any(v is False for v in vals):
                    return False
                return True if all(v is True for v in vals) else None
            if any(v is True for v in vals):
                return True
            return False if all(v is False for v in vals) else None
        return None

    def loop(self, s, live: list[_St]) -> list[_St]:
        out = []
        is_for = type(s) is not ast.While
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            zero_trip = True
            once = st.fork()
            if is_for:
                zero_trip = not self.bind_loop_target(s, once)
            if self.no_fork:
                zero_trip = False
            res = self.block(s.body, [once])
            self.stmt = s
            exits = [st] if zero_trip else []
            broke = []
            ended = []
            for r in res:
                if r.flow == LIVE or r.flow == CONT:
                    r.flow = LIVE
                    exits.append(r)
                elif r.flow == BRK:
                    r.flow = LIVE
                    broke.append(r)
                else:
                    ended.append(r)
            if s.orelse and exits:
                exits = self.block(s.orelse, exits)
                self.stmt = s
            out.extend(self.merge(exits + broke + ended, s))
        return out

    def bind_loop_target(self, s, st: _St) -> bool:
        """Bind the loop variable(s) for one iteration; True if iterating a module container."""
        elem = self.element(s.iter, st)
        self.bind(s.target, elem, st, s, None)
        return _has_module(elem)

    def element(self, it, st: _St) -> _V:
        """Abstract value of one element of iterable ``it`` (``enumerate``/``zip`` give tuples)."""
        t = type(it)
        if t is ast.Call:
            fname = _dotted(it.func)
            if fname == "range":
                return _V(text="i")
            if fname in ("enumerate", "zip") and it.args and not any(type(a) is ast.Starred for a in it.args):
                elts = [self.element(a, st) for a in it.args]
                if fname == "enumerate":
                    elts = [_V(text="i"), elts[0]]
                return _V(elts=elts)
            if fname in ("reversed", "list", "tuple", "iter") and len(it.args) == 1:
                return self.element(it.args[0], st)
            if type(it.func) is ast.Attribute and it.func.attr in ("values", "children"):
                return self.element(it.func.value, st)
            return _V(text="item", tensor=True)
        if t is ast.Subscript and type(it.slice) is ast.Slice:  # self.layers[:n]
            it = it.value
        base = None
        if type(it) is ast.Attribute and type(it.value) is ast.Name:
            bv = st.env.get(it.value.id)
            if bv is _SELF:
                base = self.self_attr(it.attr, st, it)
        elif type(it) is ast.Name:
            base = st.env.get(it.id)
        if base is not None and base.alias is not None and base.alias[0] == "mod":
            return _V(alias=("mod", base.alias[1] + "[*]"), text=ast.unparse(it) + "[i]")
        if base is not None and base.elts:
            return base.elts[0]
        return _V(text="item", tensor=True)

    def try_(self, s, live: list[_St]) -> list[_St]:
        out = []
        for st in live:
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            start = st.fork()
            body = self.block(s.body, [st])
            self.stmt = s
            ok = [b for b in body if b.flow == LIVE]
            rest = [b for b in body if b.flow != LIVE]
            if s.orelse and ok:
                ok = self.block(s.orelse, ok)
            res = ok + rest
            for h in () if self.no_fork else s.handlers:
                hs = start.fork()
                if h.name:
                    hs.env[h.name] = _V(text=h.name)
                res.extend(self.block(h.body, [hs]))
            if s.finalbody:
                fin_live = [r for r in res if r.flow == LIVE]
                res = [r for r in res if r.flow != LIVE] + self.block(s.finalbody, fin_live)
            self.stmt = s
            out.extend(self.merge(res, s))
        return out

    # -- join
    def merge(self, states: list[_St], site) -> list[_St]:
        states = [s for s in states if s.flow != DEAD]
        if len(states) <= 1:
            return states
        coarse: dict = {}
        for s in states:
            coarse.setdefault((id(s.nodes), s.flow), []).append(s)
        if len(coarse) == len(states):
            return states
        out = []
        for g0 in coarse.values():
            if len(g0) == 1:
                out.append(g0[0])
                continue
            first = g0[0]
            fenv = first.env
            keys = set(fenv)
            for s in g0:
                if s.env is not fenv:
                    keys.update(s.env)
            diff = []
            alias_keys = []
            for k in keys:
                v0 = fenv.get(k)
                vals = [s.env.get(k) for s in g0]
                if all(v is v0 for v in vals):
                    continue
                diff.append(k)
                if any(v is not None and v.alias is not None for v in vals):
                    alias_keys.append(k)
            ret_alias = first.flow == RET and any(s.ret is not None and s.ret.alias is not None for s in g0)
            if alias_keys or ret_alias:
                # states whose callables differ stay apart: they lead to different nodes
                sub: dict = {}
                for s in g0:
                    sig = tuple(None if s.env.get(k) is None else s.env[k].alias for k in alias_keys)
                    if ret_alias:
                        sig += (None if s.ret is None else s.ret.alias,)
                    sub.setdefault(sig, []).append(s)
                groups = list(sub.values())
            else:
                groups = [g0]
            for g in groups:
                out.append(g[0] if len(g) == 1 else self.join(g, diff, site))
        return out

    def join(self, g: list[_St], diff: list[str], site) -> _St:
        first = g[0]
        env = dict(first.env)
        for k in diff:
            vals = [s.env.get(k) for s in g]
            v0 = vals[0]
            if all(v is v0 for v in vals):
                continue
            if v0 is not None and v0.alias is not None:
                continue  # the same callable on every state (grouped by it)
            if k[0] == "?":  # a branch decision that differs: unknown after the join
                env.pop(k, None)
                continue
            phi = self.new_var(k, site)
            env[k] = _V(var=phi, tensor=any(v is None or v.tensor for v in vals))
            self.add_sources(phi, vals)
        ret = first.ret
        if first.flow == RET and any(s.ret is not ret for s in g) and (ret is None or ret.alias is None):
            phi = self.tmp(site, "ret")
            ret = _V(var=phi, tensor=any(s.ret is None or s.ret.tensor for s in g))
            self.add_sources(phi, [s.ret for s in g])
        return _St(first.nodes, env, first.flow, ret)

    def add_sources(self, var: Var, vals) -> None:
        srcs = []
        for v in vals:
            if v is not None and v.var is not None and v.var != var and v.var not in srcs:
                srcs.append(v.var)
        if srcs:
            old = self.sources.get(var)
            if old:
                srcs = list(old) + [x for x in srcs if x not in old]
            self.sources[var] = tuple(srcs)

    # -- assignment
    def assign(self, s, st: _St) -> list[_St]:
        targets = s.targets if type(s) is ast.Assign else [s.target]
        dest = None
        if len(targets) == 1:
            tg = targets[0]
            if type(tg) is ast.Name:
                dest = self.new_var(tg.id, s)
            elif type(tg) is ast.Attribute and type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
                dest = self.new_var(f"self.{tg.attr}", s)
        out = []
        for st2, v in self.ev(s.value, st, dest):
            for tg in targets:
                self.bind(tg, v, st2, s, dest)
            out.append(st2)
        return out

    def bind(self, tg, v: _V, st: _St, site, dest: Var | None) -> None:
        t = type(tg)
        if t is ast.Name:
            if v.alias is not None:
                st.env[tg.id] = v
            else:
                var = dest if dest is not None else self.new_var(tg.id, site)
                if v.var is not None and v.var != var:
                    self.add_sources(var, (v,))
                st.env[tg.id] = _V(var=var, tensor=v.tensor, elts=v.elts)
        elif t is ast.Tuple or t is ast.List:
            elts = tg.elts
            if v.elts is not None and len(v.elts) == len(elts) and not any(type(e) is ast.Starred for e in elts):
                for e, ev in zip(elts, v.elts):
                    self.bind(e, ev, st, site, None)
            else:
                item = _V(tensor=v.tensor or v.var is not None, text="item")
                for e in elts:
                    self.bind(e.value if type(e) is ast.Starred else e, item, st, site, None)
        elif t is ast.Attribute:
            if type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
                key = f"self.{tg.attr}"
                if v.alias is not None:
                    st.env[key] = v
                else:
                    var = dest if dest is not None else self.new_var(key, site)
                    st.env[key] = _V(var=var, tensor=v.tensor)
        elif t is ast.Subscript:
            base = tg.value
            if type(base) is ast.Name and base.id in st.env:
                old = st.env[base.id]
                if old.alias is None:
                    st.env[base.id] = _V(var=self.new_var(base.id, tg), tensor=old.tensor)
        elif t is ast.Starred:
            self.bind(tg.value, v, st, site, dest)

    def augassign(self, s: ast.AugAssign, st: _St) -> list[_St]:
        tg = s.target
        if type(tg) is ast.Name:
            old = st.env.get(tg.id) or self.name(tg.id, st)
            key = tg.id
        elif type(tg) is ast.Attribute and type(tg.value) is ast.Name and st.env.get(tg.value.id) is _SELF:
            key = f"self.{tg.attr}"
            old = self.self_attr(tg.attr, st, tg)
        else:
            return [x for x, _ in self.ev(s.value, st)]
        out = []
        for st2, rv in self.ev(s.value, st):
            var = self.new_var(key, s)
            op = _OPS.get(type(s.op))
            if op is not None and (old.tensor or rv.tensor):
                node = TensorOp(op, (Arg(old.value()), Arg(rv.value())), var, self.span(s))
                st2.nodes = (node, st2.nodes)
            st2.env[key] = _V(var=var, tensor=old.tensor or rv.tensor)
            out.append(st2)
        return out

    # -- expressions: every evaluator returns [(state, value)], usually one
    def ev(self, e, st: _St, dest: Var | None = None) -> list:
        t = type(e)
        if t is ast.Name:
            return [(st, self.name(e.id, st))]
        if t is ast.Constant:
            return [(st, _V(expr=e))]
        if t is ast.Call:
            return self.call(e, st, dest)
        if t is ast.Attribute:
            return self.attribute(e, st)
        if t is ast.BinOp:
            return self.binop(e, st, dest)
        if t is ast.Subscript:
            return self.subscript(e, st)
        if t is ast.UnaryOp:
            op = _UNARY.get(type(e.op))
            out = []
            for st2, v in self.ev(e.operand, st):
                if op is not None and v.tensor:
                    var = dest or self.tmp(e)
                    st2.nodes = (TensorOp(op, (Arg(v.value()),), var, self.span(e)), st2.nodes)
                    out.append((st2, _V(var=var, tensor=True)))
                else:
                    out.append((st2, _V(expr=e)))
            return out
        if t is ast.Tuple or t is ast.List:
            res = [(st, [])]
            for el in e.elts:
                if type(el) is ast.Starred:
                    res = [(s2, acc + [_V(expr=el, tensor=True)]) for s2, acc in res]
                    continue
                nres = []
                for s2, acc in res:
                    for s3, v in self.ev(el, s2):
                        nres.append((s3, acc + [v]))
                res = nres
            # a tuple/list display is never itself a tensor (its elements may be)
            return [(s2, _V(elts=acc)) for s2, acc in res]
        if t is ast.IfExp:
            return self.ifexp(e, st, dest)
        if t is ast.Await:
            return self.ev(e.value, st, dest)
        if t is ast.NamedExpr:
            out = []
            for st2, v in self.ev(e.value, st):
                self.bind(e.target, v, st2, e, None)
                out.append((st2, v))
            return out
        if t is ast.Starred:
            return [(st, _V(expr=e, tensor=True))]
        if t is ast.Compare or t is ast.BoolOp:
            return [(st, _V(expr=e, tensor=False))]
        if t is ast.ListComp or t is ast.GeneratorExp or t is ast.SetComp:
            return self.comprehension(e, st)
        return [(st, _V(expr=e))]

    def comprehension(self, e, st: _St) -> list:
        """``[layer(h) for layer in self.layers]``: the element expression once, like a loop body."""
        if len(e.generators) != 1 or e.generators[0].is_async:
            return [(st, _V(expr=e))]
        gen = e.generators[0]
        names = [n.id for n in ast.walk(gen.target) if type(n) is ast.Name]
        saved = {n: st.env.get(n) for n in names}
        self.bind(gen.target, self.element(gen.iter, st), st, e, None)
        out = []
        for st2, _v in self.ev(e.elt, st):
            for n, old in saved.items():  # comprehension variables do not leak
                if old is None:
                    st2.env.pop(n, None)
                else:
                    st2.env[n] = old
            out.append((st2, _V(expr=e)))
        return out

    def name(self, ident: str, st: _St) -> _V:
        v = st.env.get(ident)
        if v is not None:
            return v
        cache = self.fc._name_cache
        v = cache.get(ident)
        if v is None:
            fc = self.fc
            if ident in fc.functions:
                v = _V(alias=("local", ident), text=ident)
            elif ident in fc.classes:
                v = _V(alias=("class", ident), text=ident)
            elif ident in fc.local_class_alias:
                v = _V(alias=("class", fc.local_class_alias[ident]), text=ident)
            elif ident in fc.imports:
                v = _V(alias=("fn", fc.imports[ident]), text=ident)
            else:
                v = _V(text=ident)
            cache[ident] = v
        return v

    def self_attr(self, attr: str, st: _St, e) -> _V:
        key = "self." + attr
        v = st.env.get(key)
        if v is not None:
            return v
        cls = self.cls
        if cls is not None:
            types = cls.types_of(key)
            if types:
                if all(ty in _TENSOR_HOLDERS for ty in types):
                    return _V(var=Var(key), tensor=True)
                return _V(alias=("mod", key), expr=e)
            if cls.find_method(attr)[0] is not None:
                return _V(alias=("method", attr), expr=e)
        return _V(expr=e, tensor=False)

    def attribute(self, e: ast.Attribute, st: _St) -> list:
        base = e.value
        if type(base) is ast.Name:
            bv = self.name(base.id, st)
            a = bv.alias
            if a is not None:
                if a[0] == "self":
                    return [(st, self.self_attr(e.attr, st, e))]
                if a[0] == "fn":
                    return [(st, _V(alias=("fn", f"{a[1]}.{e.attr}"), expr=e))]
                if a[0] == "mod":
                    return [(st, _V(expr=e, tensor=e.attr in ("weight", "bias")))]
                return [(st, _V(expr=e))]
            return [(st, _V(expr=e, tensor=self.attr_tensor(bv, e.attr)))]
        out = []
        for st2, bv in self.ev(base, st):
            a = bv.alias
            if a is not None:
                if a[0] == "fn":
                    out.append((st2, _V(alias=("fn", f"{a[1]}.{e.attr}"), expr=e)))
                elif a[0] == "mod":
                    out.append((st2, _V(expr=e, tensor=e.attr in ("weight", "bias"))))
                else:
                    out.append((st2, _V(expr=e)))
            else:
                out.append((st2, _V(expr=e, tensor=self.attr_tensor(bv, e.attr))))
        return out

    @staticmethod
    def attr_tensor(bv: _V, attr: str) -> bool:
        if attr in T.META_ATTRS:
            return False
        if attr in T.TENSOR_ATTRS:
            return True
        return bv.tensor and bv.var is not None

    def subscript(self, e: ast.Subscript, st: _St) -> list:
        out = []
        for st2, bv in self.ev(e.value, st):
            a = bv.alias
            if a is None:
                if bv.elts is not None and type(e.slice) is ast.Constant and isinstance(e.slice.value, int):
                    i = e.slice.value
                    if -len(bv.elts) <= i < len(bv.elts):
                        out.append((st2, bv.elts[i]))
                        continue
                out.append((st2, _V(expr=e, tensor=bv.tensor)))
                continue
            kind = a[0]
            if kind == "mod":
                name = a[1]
                sl = e.slice
                if type(sl) is ast.Constant and isinstance(sl.value, int) and self.cls is not None:
                    cand = f"{name}[{sl.value}]"
                    if self.cls.types_of(cand):
                        out.append((st2, _V(alias=("mod", cand), expr=e)))
                        continue
                if type(sl) is ast.Slice:
                    out.append((st2, bv))
                else:
                    out.append((st2, _V(alias=("mod", name + "[*]"), expr=e)))
            elif kind == "fn":
                last = a[1].rsplit(".", 1)[-1]
                if last == "ACT2FN":
                    ty, _args, key = _activation_type(e.slice)
                    out.append((st2, _V(alias=("act", ty, key), expr=e)))
                elif "ALL_ATTENTION_FUNCTIONS" in a[1]:
                    out.append((st2, _V(alias=("table", ATTENTION_TABLE_TYPE), expr=e)))
                else:
                    out.append((st2, _V(expr=e, tensor=True)))
            else:
                out.append((st2, _V(expr=e)))
        return out

    def binop(self, e: ast.BinOp, st: _St, dest) -> list:
        out = []
        for st1, lv in self.ev(e.left, st):
            for st2, rv in self.ev(e.right, st1):
                if lv.tensor or rv.tensor:
                    var = dest or self.tmp(e)
                    node = TensorOp(_OPS[type(e.op)], (Arg(lv.value()), Arg(rv.value())), var, self.span(e))
                    st2.nodes = (node, st2.nodes)
                    out.append((st2, _V(var=var, tensor=True)))
                else:
                    out.append((st2, _V(expr=e)))
        return out

    def ifexp(self, e: ast.IfExp, st: _St, dest) -> list:
        if type(e.body) in _SIMPLE and type(e.orelse) in _SIMPLE:
            # plain values: no node can come out, no state to fork
            both = self.ev(e.body, st) + self.ev(e.orelse, st)
            if all(v.alias is None for _, v in both):
                return [(st, _V(expr=e, tensor=any(v.tensor for _, v in both)))]
        a = self.ev(e.body, st.fork(), dest)
        b = self.ev(e.orelse, st.fork(), dest)
        both = a + b
        if all(s.nodes is st.nodes and v.alias is None for s, v in both):
            return [(st, _V(expr=e, tensor=any(v.tensor for _, v in both)))]
        if self.no_fork:
            return a[:1]
        if all(s.nodes is st.nodes for s, _ in both) and len({v.alias for _, v in both}) == 1:
            return [(st, both[0][1])]
        return both

    # -- calls
    def call(self, e: ast.Call, st: _St, dest) -> list:
        f = e.func
        tf = type(f)
        if tf is ast.Attribute:
            root = f.value
            if type(root) is ast.Call and type(root.func) is ast.Name and root.func.id == "super":
                return self.call_super(f.attr, e, st, dest)
            while type(root) is ast.Attribute:
                root = root.value
            if type(root) is ast.Name and root.id not in st.env:
                d = _dotted(f)
                fq = self.fc.fqn(d) if d else None
                if fq is not None:
                    return self.call_fqn(fq, e, st, dest)
                if root.id in T.LOGGER_NAMES:
                    return [(st, _V(expr=e))]
            out = []
            for st1, rv in self.ev(f.value, st):
                out.extend(self.call_method(rv, f.attr, e, st1, dest))
            return out
        if tf is ast.Name:
            v = self.name(f.id, st)
            if v.alias is None and v.var is None:
                return self.call_global(f.id, e, st)
            return self.call_value(v, e, st, dest)
        out = []
        for st1, fv in self.ev(f, st):
            out.extend(self.call_value(fv, e, st1, dest))
        return out

    def call_super(self, attr: str, e: ast.Call, st: _St, dest) -> list:
        """``super().<attr>(...)``: inline the method of a base class in the same file."""
        owner = self.owner
        if owner is not None:
            for base in owner.local_bases:
                fdef, found = base.find_method(attr)
                if fdef is not None:
                    static = any(_dotted(d) == "staticmethod" for d in fdef.decorator_list)
                    return self.inline(fdef, f"{found.name}.{attr}", found, e, st, dest, bound_self=not static)
        return self.opaque(e, st, True)

    def call_global(self, name: str, e: ast.Call, st: _St) -> list:
        if name in _BUILTINS:
            if name in ("tuple", "list") and e.args:
                return self.ev(e.args[0], st)
            return [(st, _V(expr=e, tensor=False))]
        return self.opaque(e, st, tensor=True)

    def opaque(self, e: ast.Call, st: _St, tensor: bool) -> list:
        """A call that is no DL node: its arguments may still hold some."""
        out = []
        for st2, _pos, _kw in self.eval_args(e, st):
            out.append((st2, _V(expr=e, tensor=tensor)))
        return out

    def call_method(self, rv: _V, attr: str, e: ast.Call, st: _St, dest) -> list:
        a = rv.alias
        if a is not None:
            kind = a[0]
            if kind == "self":
                av = self.self_attr(attr, st, e.func)
                if av.alias is not None:
                    if av.alias[0] == "act":  # instance stored on self in forward
                        return self.emit(av.alias[1], e, st, dest, module=Var("self." + attr))
                    return self.call_value(av, e, st, dest)
                if self.cls is not None and self.cls.is_module and not attr.startswith(_NOT_LAYER_METHODS):
                    return self.emit(UNKNOWN_TYPE, e, st, dest, module=Var("self." + attr))
                return self.opaque(e, st, True)
            if kind == "fn":
                return self.call_fqn(f"{a[1]}.{attr}", e, st, dest)
            if kind == "mod" and attr == "forward":
                return self.call_value(rv, e, st, dest)
            return self.opaque(e, st, True)
        if attr in T.SHAPE_METHODS:
            return [(st, _V(expr=e, tensor=False))]
        if attr in T.TENSOR_METHODS and rv.tensor:
            out = self.emit("torch.Tensor." + attr, e, st, dest, recv=rv)
            recv = e.func.value
            if attr[-1] == "_" and type(recv) is ast.Name and rv.var is not None:
                # in-place method (``x.masked_fill_(...)``): later reads of ``x`` see its result
                for st2, v in out:
                    if st2.env.get(recv.id) is rv:
                        st2.env[recv.id] = _V(var=v.var, tensor=True)
            return out
        return self.opaque(e, st, rv.tensor)

    def call_value(self, v: _V, e: ast.Call, st: _St, dest) -> list:
        a = v.alias
        if a is None:
            if v.var is not None:  # calling a data value (a parameter holding a function)
                return self.emit(UNKNOWN_TYPE, e, st, dest)
            return self.opaque(e, st, True)
        kind = a[0]
        if kind == "mod":
            return self.call_module(a[1], e, st, dest)
        if kind == "fn":
            return self.call_fqn(a[1], e, st, dest)
        if kind == "local":
            fdef = self.fc.functions[a[1]]
            return self.inline(fdef, a[1], None, e, st, dest, bound_self=False)
        if kind == "method":
            fdef, owner = self.cls.find_method(a[1])
            static = any(_dotted(d) == "staticmethod" for d in fdef.decorator_list)
            return self.inline(fdef, f"{owner.name}.{a[1]}", owner, e, st, dest, bound_self=not static)
        if kind == "def":
            fdef, qual = self.defs[a[1]]
            return self.inline(fdef, qual, None, e, st, dest, bound_self=False, closure=True)
        if kind == "class":
            cls = self.fc.classes.get(a[1])
            if cls is not None and cls.is_module:
                # constructing a module in forward: calling the instance is the node
                return [(st, _V(alias=("act", self.fc.class_type(a[1]), ""), expr=e))]
            return self.opaque(e, st, True)
        if kind == "act":
            if a[1] == T.ACT2FN_TYPE and a[2]:
                # ``ACT2FN[config.hidden_act](x)``: the key travels as a keyword argument
                return self.emit(a[1], e, st, dest, extra=(Arg(Const(a[2]), "activation"),))
            if a[1] == "torch.nn.GELU" and a[2] in ("'gelu'", '"gelu"'):
                # ``ACT2FN["gelu"](x)`` called in place: exactly ``nn.functional.gelu(x)``
                return self.emit("torch.nn.functional.gelu", e, st, dest)
            return self.emit(a[1], e, st, dest)
        if kind == "table":
            return self.emit(a[1], e, st, dest)
        return self.emit(UNKNOWN_TYPE, e, st, dest)

    def call_fqn(self, fq: str, e: ast.Call, st: _St, dest) -> list:
        last = fq.rsplit(".", 1)[-1]
        if fq.startswith("torch."):
            if fq in T.NON_DL_TORCH or fq.startswith(T.NON_DL_TORCH_PREFIXES) or fq.startswith("torch.nn.init."):
                return [(st, _V(expr=e, tensor=True))]
            if last[:1].isupper() and fq.startswith("torch.nn."):
                # ``nn.Softmax(dim=-1)(x)``, ``loss_fct = CrossEntropyLoss()``: the call of the
                # instance is the node, not its construction
                return [(st, _V(alias=("act", fq, ""), expr=e))]
            return self.emit(fq, e, st, dest)
        if last == "get_activation" and e.args:
            ty, _args, key = _activation_type(e.args[0])
            return [(st, _V(alias=("act", ty, key), expr=e))]
        if last == "get_interface" and "ALL_ATTENTION_FUNCTIONS" in fq:
            default = e.args[1] if len(e.args) > 1 else None
            for k in e.keywords:
                if k.arg in ("default", "default_interface"):
                    default = k.value
            table = _V(alias=("table", ATTENTION_TABLE_TYPE), expr=e)
            if default is None:
                return [(st, table)]
            out = []
            for st2, dv in self.ev(default, st.fork()):
                out.append((st2, dv))
            if self.no_fork:
                return out[:1]
            out.append((st, table))
            return out
        if last == "apply_chunking_to_forward" and len(e.args) >= 4:
            syn = self.synthetic.get(id(e))
            if syn is None:
                syn = ast.Call(func=e.args[0], args=list(e.args[3:]), keywords=[])
                ast.copy_location(syn, e)
                syn.end_lineno, syn.end_col_offset = e.end_lineno, e.end_col_offset
                self.synthetic[id(e)] = syn
            return self.call(syn, st, dest)
        if fq in T.EXTRANEOUS_CALLS or fq.startswith(("warnings.", "logging.", "math.", "numpy.", "typing.")):
            return [(st, _V(expr=e, tensor=False))]
        if fq.startswith(("einops.", "flash_attn", "xformers.", "apex.", "liger_kernel.", "epoi.", "adopter.kernels")):
            return self.emit(fq, e, st, dest)
        act = _activation_instance(fq)
        if act is not None:
            # ``gelu(x)`` with transformers' module-level GELUActivation instance computes
            # exactly ``nn.functional.gelu(x)``: written as that function call
            return self.emit("torch.nn.functional.gelu" if act == "torch.nn.GELU" else act, e, st, dest)
        if fq.startswith("transformers.activations."):
            if last[:1].isupper():
                return [(st, _V(alias=("act", fq, ""), expr=e))]
            return self.emit(fq, e, st, dest)
        if last[:1].isupper() and not last.endswith(_OPAQUE_CLASS_SUFFIXES) and not last.isupper():
            if not fq.startswith("transformers.") or ".modeling_" in fq or fq.endswith("pytorch_utils.Conv1D"):
                return [(st, _V(alias=("act", fq, ""), expr=e))]
        if last == "apply" and fq.rsplit(".", 2)[-2][:1].isupper():  # autograd.Function.apply
            return self.emit(fq, e, st, dest)
        return self.opaque(e, st, True)

    def call_module(self, var: str, e: ast.Call, st: _St, dest) -> list:
        cls = self.cls
        types = cls.types_of(var) if cls is not None else []
        module = Var(var)
        if not types:
            return self.emit(UNKNOWN_TYPE, e, st, dest, module=module)
        if len(types) > 1:
            ck = "@" + var
            chosen = st.env.get(ck)
            if chosen is not None:
                choices = [(st, chosen.alias[1])]
            elif self.no_fork:
                choices = [(st, types[0])]
            else:
                choices = []
                for i, ty in enumerate(types):
                    s2 = st if i == len(types) - 1 else st.fork()
                    s2.env[ck] = _V(alias=("choice", ty), text=ty)
                    choices.append((s2, ty))
        else:
            choices = [(st, types[0])]
        out = []
        mod_prefix = self.fc.module + "."
        for s2, ty in choices:
            if ty.startswith(mod_prefix) and ty[len(mod_prefix):] in self.fc.functions:
                name = ty[len(mod_prefix):]
                out.extend(self.inline(self.fc.functions[name], name, None, e, s2, dest, bound_self=False))
            elif ty == "torch.nn.Sequential" and self.sequential_variants(var):
                out.extend(self.call_sequential(var, e, s2, dest))
            else:
                out.extend(self.emit(ty, e, s2, dest, module=module))
        return out

    def sequential_variants(self, var: str) -> list:
        for c in self.cls.mro():
            if var in c.seq_variants:
                return c.seq_variants[var]
        return []

    def call_sequential(self, var: str, e: ast.Call, st: _St, dest) -> list:
        """``self.seq(x)`` for an ``nn.Sequential`` built in ``__init__``: its elements in order."""
        variants = self.sequential_variants(var)
        if self.no_fork:
            variants = variants[:1]
        out = []
        for st1, pos, _kw in self.eval_args(e, st):
            start = pos[0].value() if pos else Const("None")
            for i, variant in enumerate(variants):
                st2 = st1 if i == len(variants) - 1 else st1.fork()
                flat = self.flatten_sequential(variant, 0)
                cur = start
                for j, (name, ty) in enumerate(flat):
                    var_out = dest if (j == len(flat) - 1 and dest is not None) else self.tmp(e, j)
                    st2.nodes = (Layer(ty, (Arg(cur),), var_out, Var(name), self.span(e)), st2.nodes)
                    cur = var_out
                out.append((st2, _V(var=cur, tensor=True)))
        return out

    def flatten_sequential(self, variant, depth: int) -> list:
        """Elements of a Sequential, nested Sequentials (first variant) expanded in place."""
        flat = []
        for name, ty in variant:
            inner = self.sequential_variants(name) if ty == "torch.nn.Sequential" and depth < 4 else []
            if inner:
                flat.extend(self.flatten_sequential(inner[0], depth + 1))
            else:
                flat.append((name, ty))
        return flat

    def eval_args(self, e: ast.Call, st: _St) -> list:
        """[(state, positional values, [(keyword, value)])] for the call's arguments."""
        res = [(st, [], [])]
        for a in e.args:
            if type(a) is ast.Starred:
                v = _V(text="*" + ast.unparse(a.value), tensor=True)
                for _s, pos, _kw in res:
                    pos.append(v)
                continue
            if type(a) is ast.Name or type(a) is ast.Constant:
                for s, pos, _kw in res:
                    pos.append(self.name(a.id, s) if type(a) is ast.Name else _V(expr=a))
                continue
            nres = []
            for s, pos, kw in res:
                for s2, v in self.ev(a, s):
                    nres.append((s2, pos + [v], list(kw)))
            res = nres
        for k in e.keywords:
            if k.arg is None:
                v = _V(text="**" + ast.unparse(k.value))
                for _s, _pos, kw in res:
                    kw.append((None, v))
                continue
            nres = []
            for s, pos, kw in res:
                for s2, v in self.ev(k.value, s):
                    nres.append((s2, list(pos), kw + [(k.arg, v)]))
            res = nres
        return res

    def emit(
        self, type_: str, e: ast.Call, st: _St, dest, module: Var | None = None, recv: _V | None = None, extra=()
    ) -> list:
        out = []
        for st2, pos, kw in self.eval_args(e, st):
            args = [Arg(v.value()) for v in pos]
            args += [Arg(v.value(), k) for k, v in kw]
            args += extra
            if recv is not None:
                args.insert(0, Arg(recv.value()))
            var = dest or self.tmp(e)
            node = Layer(type_, tuple(args), var, module, self.span(e))
            st2.nodes = (node, st2.nodes)
            out.append((st2, _V(var=var, tensor=True)))
        return out

    # -- inlining
    def inline(self, fdef, qual: str, owner, e: ast.Call, st: _St, dest, bound_self: bool, closure=False) -> list:
        if fdef is None or id(fdef) in self.stack or len(self.stack) > MAX_INLINE_DEPTH or self.no_fork:
            return self.opaque(e, st, True)
        out = []
        for st1, pos, kw in self.eval_args(e, st):
            caller_env = st1.env
            key = None
            if not closure:
                # Same callee, call site, arguments and ``self.*`` state -> same nodes: the
                # callee runs once per distinct input, its node deltas are replayed per path.
                key = (
                    id(e), self.ctx, id(fdef), dest,
                    tuple(_sig(v) for v in pos),
                    tuple((k, _sig(v)) for k, v in kw),
                    tuple((k, _sig(v)) for k, v in caller_env.items() if k[0] == "@" or k.startswith("self.")),
                )
                results = self.memo.get(key)
            else:
                results = None
            if results is None:
                results = self.run_callee(fdef, qual, owner, e, caller_env, pos, kw, bound_self, closure, dest)
                if key is not None:
                    self.memo[key] = results
            if not results:
                out.append((_St(st1.nodes, caller_env, DEAD), _NONE))
                continue
            if len(out) >= MAX_PATHS:
                self.capped = True
                break
            for delta, ret, updates in results:
                nodes = st1.nodes
                for n in delta:
                    nodes = (n, nodes)
                if updates:
                    cenv = dict(caller_env)
                    cenv.update(updates)
                else:
                    cenv = caller_env if len(results) == 1 else dict(caller_env)
                out.append((_St(nodes, cenv), ret))
        return out

    def run_callee(self, fdef, qual, owner, e, caller_env, pos, kw, bound_self, closure, dest) -> list:
        """Run an inlined body from an empty node list: [(added nodes, return value, self.* updates)]."""
        env = {}
        if closure:
            env.update(caller_env)
        else:
            for k, v in caller_env.items():
                if k[0] == "@" or k.startswith("self."):
                    env[k] = v
        a = fdef.args
        params = list(a.posonlyargs) + list(a.args)
        if bound_self and params:
            env[params[0].arg] = _SELF
            params = params[1:]
        star = any(v.text is not None and v.text.startswith("*") and v.var is None and v.alias is None for v in pos)
        ndef = len(a.defaults)
        first_default = len(params) - ndef
        kwmap = {k: v for k, v in kw if k is not None}
        for i, p in enumerate(params):
            if i < len(pos) and not (star and pos[i].text is not None and pos[i].text.startswith("*")):
                env[p.arg] = pos[i]
            elif p.arg in kwmap:
                env[p.arg] = kwmap.pop(p.arg)
            elif i >= first_default and not star:
                env[p.arg] = _V(expr=a.defaults[i - first_default], tensor=False)
            else:
                env[p.arg] = _V(var=Var(p.arg), tensor=_annotation_is_tensor(p.annotation))
        for p, d in zip(a.kwonlyargs, a.kw_defaults):
            if p.arg in kwmap:
                env[p.arg] = kwmap.pop(p.arg)
            elif d is not None:
                env[p.arg] = _V(expr=d, tensor=False)
            else:
                env[p.arg] = _V(var=Var(p.arg), tensor=True)
        if a.vararg is not None:
            env[a.vararg.arg] = _V(text=a.vararg.arg)
        if a.kwarg is not None:
            env[a.kwarg.arg] = _V(text=a.kwarg.arg)
        saved = (self.qual, self.ctx, self.inlined_at, self.stmt, self.cls, self.ret_dest, self.owner)
        self.ret_dest = dest
        if owner is not None:
            self.owner = owner
        self.qual = qual
        self.ctx = self.ctx + (id(e),)
        self.inlined_at = self.inlined_at + (e.lineno,)
        if owner is not None and self.cls is None:
            self.cls = owner
        self.stack.append(id(fdef))
        try:
            results = self.block(fdef.body, [_St(None, env)])
        finally:
            self.stack.pop()
            self.qual, self.ctx, self.inlined_at, self.stmt, self.cls, self.ret_dest, self.owner = saved
        rets = []
        for r in results:
            if r.flow == DEAD:
                continue
            upd = {k: v for k, v in r.env.items() if (k[0] == "@" or k.startswith("self.")) and caller_env.get(k) is not v}
            rets.append(_St(r.nodes, upd, RET, r.ret if r.flow == RET and r.ret is not None else _NONE))
        out = []
        for r in self.merge(rets, e):
            out.append((_cons_to_tuple(r.nodes), r.ret, r.env))
        return out


def _has_module(v: _V) -> bool:
    if v.alias is not None:
        return v.alias[0] == "mod"
    return v.elts is not None and any(_has_module(e) for e in v.elts)


def _sig(v: _V):
    """Hashable identity of an abstract value (equal signatures behave the same)."""
    if v.var is not None:
        return (v.var, v.tensor, None if v.elts is None else tuple(_sig(x) for x in v.elts))
    if v.alias is not None:
        return v.alias
    if v.elts is not None:
        return ("elts",) + tuple(_sig(x) for x in v.elts)
    return (v.text, id(v.expr), v.tensor)


# ---------------------------------------------------------------- driver


def _is_module(fc: _File, cls: _ClassCtx, seen=()) -> bool:
    for b in cls.node.bases:
        d = _dotted(b)
        if d is None:
            continue
        if d in fc.classes:
            base = fc.classes[d]
            if base is not cls and base.name not in seen and _is_module(fc, base, seen + (cls.name,)):
                return True
            continue
        fq = fc.fqn(d) or d
        if _is_module_base(fq):
            return True
    return False


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
    tree = ast.parse(text, filename=filename)
    _UNPARSED.clear()
    _TEST_NAMES.clear()
    try:
        return _extract_tree(tree, filename, text.splitlines())
    finally:
        _UNPARSED.clear()
        _TEST_NAMES.clear()


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
    return FileStructures(file=filename, classes=tuple(classes), functions=tuple(functions), imports=dict(fc.imports))


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


# ---------------------------------------------------------------- debug printer


def _fallback_format_node(node) -> str:
    args = ", ".join(str(a) for a in node.args)
    out = f" -> {node.output}" if node.output is not None else ""
    if isinstance(node, Layer):
        mod = f"@{node.module}" if node.module is not None else ""
        return f"{node.type}{mod}({args}){out}"
    if len(node.args) == 2:
        return f"{node.args[0]} {node.op} {node.args[1]}{out}"
    return f"{node.op} {args}{out}"


def format_structure(fs: FileStructures, *, lines: bool = True) -> str:
    """Human-readable dump of everything extracted from one file (debugging aid)."""
    try:
        from adopter.core.dsl_text import format_node as dsl_format_node
    except Exception:  # pragma: no cover - printer not available
        dsl_format_node = _fallback_format_node

    def format_node(node) -> str:
        try:
            return dsl_format_node(node)
        except ValueError:  # names the DSL text cannot spell (``self.layers[*]``)
            return _fallback_format_node(node)
    out = [f"# {fs.file}"]
    for c in fs.classes:
        out.append(f"class {c.name}({', '.join(c.bases)}){' [module]' if c.is_module else ''}")
        for b in c.init_bindings:
            flags = []
            if b.conditional:
                flags.append("conditional")
            if b.container:
                flags.append(f"container={b.container}")
            if b.activation:
                flags.append(f"activation={b.activation}")
            where = f"  # L{b.span.line}" if lines and b.span else ""
            out.append(f"  init {b.attr}: {format_node(b.layer)}{' [' + ', '.join(flags) + ']' if flags else ''}{where}")
    for f in fs.functions:
        qual = f"{f.class_name}.{f.function}" if f.class_name else f.function
        out.append(f"def {qual}: {len(f.paths)} path(s){' [capped]' if f.capped else ''}")
        for i, p in enumerate(f.paths):
            out.append(f"  path {i}:")
            for n in p.nodes:
                where = f"  # {n.span.function} L{n.span.line}:{n.span.col}" if lines and n.span else ""
                out.append(f"    {format_node(n)}{where}")
    return "\n".join(out)
