"""Symbol tables of one source file: imports and their aliases, module-level functions,
dicts and name aliases (:class:`_File`), and the class table (:class:`_ClassCtx`: methods,
same-file bases, ``__init__`` bindings, whether a class is a module). Also the small AST
helpers every step uses: dotted names (:func:`adopter.core.symbolic.dotted`, which the rules'
evaluator reads names with too), spans, activation keys."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Callable, Iterable

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
        # Sequentials built in the files read for a factory (by id of the call there, and of the
        # call of the factory here), shared with those files: never rewritten from this one
        self.read_seq_builds: dict[int, object] = {}
        # (module, function name) -> (its _File, FunctionDef) or None: package factories read so far
        self.package_cache: dict[tuple[str, str], object] = {}
        # modules of ``from <module> import *`` (as the file names them), in order
        self.star_modules: list[str] = []
        # types of layer classes defined in other files (read, never imported) that derive from a
        # torch layer: type -> (that torch layer, None when the class only fixes ``__init__``, or the
        # submodules a norm+act class applies after its batch norm); shared with the files read
        self.foreign_layers: dict[str, tuple[str, tuple[str, ...] | None]] = {}
        self._name_cache: dict[str, _V] = {}
        # the file this one was read for (a factory or class it defines), None for the scanned file
        self.read_for: _File | None = None
        self.tree = tree
        self._constructions: dict[str, list[ast.Call]] | None = None
        self._collect(tree.body)

    def constructions(self, class_name: str) -> list[tuple[ast.Call, ast.AST | None, str | None]]:
        """The calls ``Name(...)`` / ``mod.Name(...)`` of this file naming the class ``class_name``,
        each with the function it is in (None at module level) and that function's class (indexed
        once per file, on the first question)."""
        if self._constructions is None:
            index: dict[str, list] = {}

            def visit(node: ast.AST, fn: ast.AST | None, owner: str | None, cls: str | None) -> None:
                for child in ast.iter_child_nodes(node):
                    t = type(child)
                    if t is ast.ClassDef:
                        visit(child, fn, owner, child.name)
                        continue
                    if t in (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda):
                        visit(child, child, cls, cls)
                        continue
                    if t is ast.Call:
                        f = child.func
                        name = f.id if type(f) is ast.Name else f.attr if type(f) is ast.Attribute else None
                        if name in self.classes:
                            index.setdefault(name, []).append((child, fn, owner))
                    visit(child, fn, owner, cls)

            visit(self.tree, None, None, None)
            self._constructions = index
        return self._constructions.get(class_name, [])

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
                    elif base:
                        self.star_modules.append(base)
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
        found = _package_definition(self, fq, 3)
        return found if found is not None and not isinstance(found[1], ast.ClassDef) else None

    def package_definition(self, fq: str):
        """``(defining _File, FunctionDef or ClassDef)`` of ``fq`` (a function or class of another
        module of the file's package or of an installed package, read and parsed, never imported;
        re-exports and ``import *`` followed a few levels), or None."""
        return _package_definition(self, fq, 3)

    def bound_partial(self, name: str):
        """What the module-level ``name = partial(...)`` binds
        (:class:`~adopter.core.extract.partials.Bound`), or None."""
        return partials.unwrap(self.partials[name], self.fqn, self.partials.get)

    def fqn(self, dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        base = self.imports.get(head)
        if base is None:
            base = self.star_name(head)
            if base is None:
                return None
        return f"{base}.{rest}" if rest else base

    def star_name(self, name: str) -> str | None:
        """``module.name`` for a name one of the file's ``from module import *`` brings (the module
        read, never imported: a definition or re-export it has, within its ``__all__``), or None."""
        if not self.star_modules or name in self.classes or name in self.functions:
            return None
        cache = self.package_cache
        key = ("*", name)
        if key in cache:
            return cache[key]
        cache[key] = None  # (cycles)
        found = None
        for module in self.star_modules:
            if _is_torch(module):
                continue
            path = _module_path(self, module)
            tree = _package_module_tree(path) if path is not None else None
            if tree is None:
                continue
            other = _read_file(tree, path, self)
            exported = _exported(tree)
            if (name not in exported) if exported is not None else name.startswith("_"):
                continue  # (``import *`` brings ``__all__``, else the names without a leading underscore)
            if name in other.classes or name in other.functions or name in other.imports:
                found = _join(module, name)
                break
            if other.star_name(name) is not None:
                found = _join(module, name)
                break
        cache[key] = found
        return found

    def layer_type(self, fq: str) -> str:
        """The type a layer of class ``fq`` gets: for a class defined in another file that derives
        from a torch layer, the name of its defining module (``pkg.layers.norm_act.BatchNormAct2d``,
        however it was imported or re-exported), noted in :attr:`foreign_layers`; ``fq`` otherwise."""
        last = fq.rsplit(".", 1)[-1]
        # (torch's classes are named as torch names them; transformers' layer classes keep the names
        # the rules and the catalogue use, and their modules are not read for it: scan speed)
        if not last[:1].isupper() or fq.startswith(("torch.", "transformers.")) or "." not in fq:
            return fq
        found = self.package_definition(fq)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return fq
        home, node = found
        if _foreign_layer(home, node, 4) is None or _dotted_module(home.filename) is None:
            return fq
        return self.foreign_type(node, home)

    def class_type(self, name: str) -> str:
        if self.read_for is not None:
            # a class of a module read for a factory: named as any file importing it names it
            return self.foreign_type(self.classes[name].node, self)
        return f"{self.module}.{name}"

    def foreign_type(self, node: ast.ClassDef, home: "_File") -> str:
        """The type of a layer of class ``node`` defined in ``home`` (another file), noted in
        :attr:`foreign_layers` when it derives from a torch layer."""
        info = _foreign_layer(home, node, 4)
        module = _dotted_module(home.filename)
        if module is None:
            return f"{home.module}.{node.name}"
        canonical = f"{module}.{node.name}"
        if info is not None and info != "own":
            self.foreign_layers[canonical] = info
        return canonical


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
                return _installed_module_path(parts)
            base = parent
        else:
            return _installed_module_path(parts)
        if os.path.basename(base) != parts[0]:
            return _installed_module_path(parts)
        parts = parts[1:]
    return _module_file(os.path.join(base, *parts))


def _module_file(target: str) -> str | None:
    for candidate in (target + ".py", os.path.join(target, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


# (sys.path as it was, module) -> its file or None: an installed package's modules looked up once
_INSTALLED: dict[tuple[tuple[str, ...], str], str | None] = {}
_INSTALLED_KEPT = 512


def _installed_module_path(parts: list[str]) -> str | None:
    """The file of an absolute module outside the scanned file's package: found as Python's path
    finder would find it in a regular package on ``sys.path`` (each level a directory with an
    ``__init__.py``), by file lookups only — never imported (``importlib.util.find_spec`` would
    import its parent packages). torch's own modules are never read."""
    import sys

    if not parts or parts[0] in ("torch", "builtins", "typing", "functools", "collections") or \
            parts[0] in sys.builtin_module_names:
        return None
    paths = tuple(p for p in sys.path if isinstance(p, str))
    key = (paths, ".".join(parts))
    if key in _INSTALLED:
        return _INSTALLED[key]
    found = None
    for entry in paths:
        root = os.path.abspath(entry or os.curdir)
        base = os.path.join(root, parts[0])
        if len(parts) == 1:
            found = _module_file(base)
        elif os.path.isfile(os.path.join(base, "__init__.py")):
            pkg = base
            for p in parts[1:-1]:
                pkg = os.path.join(pkg, p)
                if not os.path.isfile(os.path.join(pkg, "__init__.py")):
                    pkg = None
                    break
            found = _module_file(os.path.join(pkg, parts[-1])) if pkg is not None else None
        elif os.path.isfile(base + ".py"):
            break  # a module of that name comes first: no package of it is imported
        if found is not None or os.path.isfile(os.path.join(base, "__init__.py")):
            break  # the first regular package of that name on the path is the one Python imports
    if len(_INSTALLED) >= _INSTALLED_KEPT:
        _INSTALLED.clear()
    _INSTALLED[key] = found
    return found


def _dotted_module(path: str) -> str | None:
    """The module name of the file at ``path`` within its regular package (the directories above
    it holding an ``__init__.py``): ``.../site-packages/pkg/layers/norm_act.py`` ->
    ``pkg.layers.norm_act``."""
    path = os.path.abspath(path)
    directory, file = os.path.split(path)
    stem = os.path.splitext(file)[0]
    parts = [] if stem == "__init__" else [stem]
    for _ in range(16):
        if not os.path.isfile(os.path.join(directory, "__init__.py")):
            break
        directory, name = os.path.split(directory)
        parts.append(name)
    parts.reverse()
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


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
    if tree is not None:
        # (another file's nodes: their positions are not in the text being extracted, so the
        # unparse shortcut that slices that text must not read them: values._unparse_by_source)
        for node in ast.walk(tree):
            node.other_file = True
    if len(_PACKAGE_TREES) >= _PACKAGE_TREES_KEPT:
        _PACKAGE_TREES.pop(next(iter(_PACKAGE_TREES)))
    _PACKAGE_TREES[path] = (stamp, tree)
    return tree


def _is_torch(module: str) -> bool:
    """torch itself (never read: its layers are the ones the rules name), not ``torchvision``."""
    return module == "torch" or module.startswith("torch.")


def _read_file(tree: ast.Module, path: str, reader: _File) -> _File:
    """Another module's symbol table, sharing the reader's caches (keys carry the directory)."""
    other = _File(tree, path)
    other.package_cache = reader.package_cache
    other.foreign_layers = reader.foreign_layers
    other.read_for = reader
    other.seq_builds = other.read_seq_builds = reader.read_seq_builds
    return other


def _exported(tree: ast.Module) -> set[str] | None:
    """The names of a module's ``__all__`` when it is a literal list/tuple, else None."""
    for st in tree.body:
        if type(st) is ast.Assign and len(st.targets) == 1 and type(st.targets[0]) is ast.Name \
                and st.targets[0].id == "__all__" and type(st.value) in (ast.List, ast.Tuple):
            return {e.value for e in st.value.elts if type(e) is ast.Constant and isinstance(e.value, str)}
    return None


def _package_definition(fc: _File, fq: str, depth: int):
    module, _, name = fq.rpartition(".")
    if not module or not name or _is_torch(module):
        return None
    cache = fc.package_cache
    key = (os.path.dirname(fc.filename), module, name)
    if key in cache:
        return cache[key]
    cache[key] = None  # cycles
    path = _module_path(fc, module)
    tree = _package_module_tree(path) if path is not None else None
    if tree is None:
        return None
    other = _read_file(tree, path, fc)
    found = None
    if name in other.functions:
        found = (other, other.functions[name])
    elif name in other.classes:
        found = (other, other.classes[name].node)
    elif depth > 0:
        target = other.imports.get(name) or other.star_name(name)
        if target is not None:
            found = _package_definition(other, target, depth - 1)
    cache[key] = found
    return found


def _foreign_layer(home: _File, node: ast.ClassDef, depth: int):
    """What a class of another file is as a layer: ``(torch layer, None)`` when it and its bases
    up to a ``torch.nn`` layer define nothing but ``__init__`` (its forward is the torch layer's),
    ``("torch.nn.BatchNorm2d", submodules)`` for a BatchNorm2d whose ``forward`` applies those
    submodules to its batch norm and computes nothing else (:func:`adopter.catalogue.norm_act_form`),
    ``"own"`` for a torch layer subclass computing something else, None when it derives from no
    torch layer (as far as the files read tell)."""
    from adopter.catalogue import norm_act_form

    forward = None
    for _ in range(depth):
        methods = {st.name: st for st in node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if len(node.bases) != 1 or node.keywords:
            return None
        if set(methods) - {"__init__", "forward", "extra_repr"}:
            return "own"
        if "forward" in methods:
            if forward is not None:
                return "own"
            forward = (methods["forward"], home)
        base = next_base(home, node, _is_torch_nn)
        if base is None:
            return None
        if type(base) is tuple:
            home, node = base
            continue
        last = base.rsplit(".", 1)[-1]  # (the walk reached torch.nn)
        if not last[:1].isupper() or last in ("Module", "Sequential", "ModuleList", "ModuleDict"):
            return None
        fq = "torch.nn." + last  # ``torch.nn.modules.batchnorm.BatchNorm2d`` is nn.BatchNorm2d
        if forward is None:
            return (fq, None)
        fdef, where = forward
        if fq != "torch.nn.BatchNorm2d":
            return "own"
        form = norm_act_form(fdef, lambda dotted, where=where: where.fqn(dotted))
        return "own" if form is None else (fq, form)
    return None


def _is_torch_nn(fq: str) -> bool:
    return fq.startswith("torch.nn.")


def next_base(home: _File, node: ast.ClassDef, ends: Callable[[str], bool]) -> tuple[_File, ast.ClassDef] | str | None:
    """The one base of ``node`` (a class of ``home`` with exactly one base and no keywords): its
    ``(file, ClassDef)`` when ``home`` defines it or another module of the package or an installed
    package does (read, never imported); its qualified name when ``ends(name)`` says a walk up the
    classes stops there (a torch class, never read); None when it is found neither way."""
    d = _dotted(node.bases[0])
    if d is None:
        return None
    if d in home.classes:
        return home, home.classes[d].node
    fq = home.fqn(d)
    if fq is None:
        return None
    if ends(fq):
        return fq
    found = _package_definition(home, fq, 3)
    if found is None or not isinstance(found[1], ast.ClassDef):
        return None
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

