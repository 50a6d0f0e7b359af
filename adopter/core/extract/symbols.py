"""Symbol tables of one source file: imports and their aliases, module-level functions,
dicts and name aliases (:class:`_File`), and the class table (:class:`_ClassCtx`: methods,
same-file bases, ``__init__`` bindings, whether a class is a module). Also the small AST
helpers every step uses: dotted names (:func:`adopter.core.symbolic.dotted`, which the rules'
evaluator reads names with too), spans, activation keys."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable

from adopter.core.dsl import Arg, Const, Span
from adopter.core.extract import partials
from adopter.core.extract import tables as T
from adopter.core.extract.values import _V, _unparse
from adopter.core.structures import InitBinding
from adopter.core.syntax import dotted_name as _dotted

_OPAQUE_CLASS_SUFFIXES = ("Output", "Config", "Cache", "Mixin", "Kwargs", "Dict")
# an element of a container: ``[0]``, or a child's name (``self.mlp[c_fc]`` of a ModuleDict or an
# OrderedDict Sequential): ``[*]`` stands for any of them
_INDEX = re.compile(r"\[(?:\d+|[A-Za-z_]\w*)\]")


# ---------------------------------------------------------------- names and imports


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


# ---------------------------------------------------------------- class and file tables


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
        # ``self.<attr> = <class>`` in ``__init__`` (``self._norm_layer = norm_layer``): attr -> refs
        self.class_attrs: dict[str, list[tuple]] = {}
        # ``self.<attr> = lambda x: ...`` in ``__init__``: attr -> (the lambda, its statement, the
        # function holding it, captured names -> "self" or the ``self.<attr>`` they alias)
        self.lambdas: dict[str, tuple] = {}
        # ``self.<attr> = partial(f, ...)`` in ``__init__``: attr -> what it binds
        # (:class:`~adopter.core.extract.partials.Bound`), None where the attribute is also
        # assigned something else
        self.partials: dict[str, object] = {}
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

    def find_lambda(self, name: str):
        """``(lambda, statement, function, captured)`` bound to ``self.<name>`` here or in a base."""
        for c in self.mro():
            if name in c.lambdas:
                return c.lambdas[name]
        return None

    def find_partial(self, name: str):
        """The :class:`~adopter.core.extract.partials.Bound` ``self.<name>`` holds (here or in a
        base), or None."""
        for c in self.mro():
            if name in c.partials:
                return c.partials[name]
        return None

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
        # module-level ``name = partial(Class, ...)``: the partial call
        self.partials: dict[str, ast.Call] = {}
        # ``nn.Sequential(...)`` constructions seen while resolving values, by id of the call
        self.seq_builds: dict[int, object] = {}
        # (module, function name) -> (its _File, FunctionDef) or None: package factories read so far
        self.package_cache: dict[tuple[str, str], object] = {}
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
                elif type(v) is ast.Call and v.args and (self.fqn(_dotted(v.func) or "") or "") == "functools.partial":
                    self.partials[name] = v
                else:
                    d = _dotted(v)
                    if d is not None:
                        if d in self.classes:
                            self.local_class_alias[name] = d
                        else:
                            fq = self.fqn(d)
                            if fq is not None:
                                self.imports[name] = fq

    def package_function(self, fq: str) -> tuple[_File, ast.FunctionDef] | None:
        """A function imported from the scanned file's own package (``from .create_conv2d import
        create_conv2d``, ``from timm.layers import create_conv2d`` inside ``timm/``): its
        defining file, read and parsed (never imported), and its definition; None otherwise.
        Re-exports through a package ``__init__`` are followed (two levels)."""
        return _package_function(self, fq, 2)

    def bound_partial(self, name: str):
        """What the module-level ``name = partial(...)`` binds
        (:class:`~adopter.core.extract.partials.Bound`), or None."""
        return partials.unwrap(self.partials[name], self.fqn, self.partials.get)

    def fqn(self, dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        base = self.imports.get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def class_type(self, name: str) -> str:
        return f"{self.module}.{name}"


# A module of the package larger than this is not read for a factory (modeling_utils-sized
# files hold no layer factories, and parsing them would dominate the scan).
_MAX_PACKAGE_MODULE_BYTES = 150_000


def _module_path(fc: _File, module: str) -> str | None:
    """The file of ``module`` (``.create_conv2d``, ``..layers``, ``timm.layers.mlp``) inside the
    scanned file's package, or None."""
    if fc.filename.startswith("<"):
        return None
    here = os.path.dirname(os.path.abspath(fc.filename))
    if module.startswith("."):
        level = len(module) - len(module.lstrip("."))
        base = here
        for _ in range(level - 1):
            base = os.path.dirname(base)
        parts = [p for p in module[level:].split(".") if p]
    else:
        parts = module.split(".")
        base = here
        for _ in range(8):  # the package root: an ancestor named like the import's first part
            if os.path.basename(base) == parts[0] and os.path.isfile(os.path.join(base, "__init__.py")):
                break
            parent = os.path.dirname(base)
            if parent == base:
                return None
            base = parent
        else:
            return None
        if os.path.basename(base) != parts[0]:
            return None
        parts = parts[1:]
    target = os.path.join(base, *parts)
    for candidate in (target + ".py", os.path.join(target, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


# path -> ((size, mtime), tree): a package module many scanned files import from (transformers'
# backbone_utils.py, one in 13 modeling files) is parsed once per process while it is unchanged
_PACKAGE_TREES: dict[str, tuple[tuple[int, int], ast.Module | None]] = {}
_PACKAGE_TREES_KEPT = 16


def _package_module_tree(path: str) -> ast.Module | None:
    """The parsed module at ``path``, None when it is too large or cannot be read or parsed."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    if stat.st_size > _MAX_PACKAGE_MODULE_BYTES:
        return None
    stamp = (stat.st_size, stat.st_mtime_ns)
    kept = _PACKAGE_TREES.get(path)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    try:
        with open(path, encoding="utf-8") as fh:
            tree: ast.Module | None = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        tree = None
    if len(_PACKAGE_TREES) >= _PACKAGE_TREES_KEPT:
        _PACKAGE_TREES.pop(next(iter(_PACKAGE_TREES)))
    _PACKAGE_TREES[path] = (stamp, tree)
    return tree


def _package_function(fc: _File, fq: str, depth: int):
    module, _, name = fq.rpartition(".")
    if not module or not name or not name[:1].islower():
        return None
    cache = fc.package_cache
    key = (module, name)
    if key in cache:
        return cache[key]
    cache[key] = None  # cycles
    path = _module_path(fc, module)
    tree = _package_module_tree(path) if path is not None else None
    if tree is None:
        return None
    other = _File(tree, path)
    other.package_cache = cache
    fdef = other.functions.get(name)
    found = (other, fdef) if fdef is not None else None
    if found is None and depth > 0 and name in other.imports:
        found = _package_function(other, other.imports[name], depth - 1)
    cache[key] = found
    return found


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


# ---------------------------------------------------------------- AST helpers


def _activation_type(key: ast.AST) -> tuple[str, tuple[Arg, ...], str]:
    """Type, constructor args and key text of ``ACT2FN[key]`` / ``get_activation(key)``."""
    text = _unparse(key)
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


def _span(node, function: str, stmt, inlined_at: tuple[int, ...] = ()) -> Span:
    return Span(
        node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, function,
        stmt.lineno if stmt is not None else node.lineno,
        stmt.end_lineno if stmt is not None else node.end_lineno,
        inlined_at,
    )

