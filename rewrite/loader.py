"""Import rewritten source in memory, in the original module's package context.

``load_rewritten_module(transformers.models.bert.modeling_bert, new_text)`` executes the
text as module ``transformers.models.bert._adopter_rewritten_modeling_bert_<hash>``
with ``__package__`` set, so ``from ...utils import x`` and ``from .configuration_bert
import BertConfig`` resolve exactly as in the original. The source is registered with
:mod:`linecache` so tracebacks and ``inspect.getsource`` show the rewritten code.

``load_rewritten_modules({module name: (file, new text), ...})`` loads several rewritten
modules of one package together (``optimize()``): while they execute, an import of one of the
original modules resolves to its rewritten version.

A class defined by a rewritten module is a new class object: ``isinstance`` checks against
the original class are False for its instances. Making it a subclass of the original (extra
base, or a changed ``__bases__``) would put the original's methods into its MRO and change
what ``super()`` calls, i.e. its behaviour, so the loader does not; ``optimize()`` records the
original as ``Optimized.adopter_original`` instead.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.abc
import importlib.util
import linecache
import sys
import types
from typing import Any

__all__ = ["RewrittenSourceLoader", "load_rewritten_module", "load_rewritten_modules", "rewritten_module_name"]


class RewrittenSourceLoader(importlib.abc.InspectLoader):
    """Executes source text as a module (no file behind it); ``get_source`` returns the text,
    and the code is compiled under ``code_filename`` (whose lines are in :mod:`linecache`)."""

    def __init__(self, text: str, code_filename: str):
        self.text = text
        self.code_filename = code_filename

    def create_module(self, spec):
        return None

    def get_source(self, fullname: str) -> str:
        return self.text

    def get_code(self, fullname: str):
        return compile(self.text, self.code_filename, "exec", dont_inherit=True)

    def is_package(self, fullname: str) -> bool:
        return False

    def exec_module(self, module) -> None:
        exec(self.get_code(module.__name__), module.__dict__)  # noqa: S102 - executing the rewrite is the point


def _new_module(name: str, text: str, code_filename: str, package: str, file: str) -> types.ModuleType:
    loader = RewrittenSourceLoader(text, code_filename)
    spec = importlib.util.spec_from_loader(name, loader, origin=file)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = file
    module.__package__ = package
    linecache.cache[code_filename] = (len(text), None, text.splitlines(keepends=True), code_filename)
    return module


def rewritten_module_name(original: types.ModuleType, new_text: str) -> str:
    package = original.__package__ or ""
    base = original.__name__.rsplit(".", 1)[-1]
    digest = hashlib.sha1(new_text.encode("utf-8")).hexdigest()[:10]
    name = f"_adopter_rewritten_{base}_{digest}"
    return f"{package}.{name}" if package else name


def load_rewritten_module(original: types.ModuleType, new_text: str, *, register: bool = True) -> types.ModuleType:
    """Execute ``new_text`` as a sibling of ``original`` and return the new module.

    The module is put in ``sys.modules`` (``register``) because transformers and
    dataclasses look classes' modules up there. Loading the same text twice returns the
    module already loaded. Raises what executing the module raises (``SyntaxError``,
    ``ImportError``...)."""
    name = rewritten_module_name(original, new_text)
    if register and name in sys.modules:
        return sys.modules[name]
    origin = getattr(original, "__file__", None) or original.__name__
    filename = f"{origin}<adopter-rewritten {name.rsplit('.', 1)[-1]}>"
    module = _new_module(name, new_text, filename, original.__package__, filename)
    code = module.__spec__.loader.get_code(name)  # a SyntaxError surfaces before registering
    if register:
        sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module


# ---------------------------------------------------------------- several modules of one package


def _imported_modules(text: str, package: str) -> set[str]:
    """Absolute names of the modules a source imports (relative imports resolved)."""
    names: set[str] = set()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _dependency_order(sources: dict[str, tuple[str, str]]) -> list[str]:
    """Rewritten modules ordered so that a module comes after the rewritten ones it imports."""
    deps = {}
    for name, (_, text) in sources.items():
        package = name.rpartition(".")[0]
        imported = _imported_modules(text, package)
        deps[name] = {other for other in sources if other != name and other in imported}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order or name in visiting:
            return  # a cycle: plain import semantics (partially initialized module) apply
        visiting.add(name)
        for dep in sorted(deps[name]):
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in sources:
        visit(name)
    return order


@contextlib.contextmanager
def _imports_resolve_to(replacements: dict[str, Any]):
    """While active, importing one of the original module names (absolutely, relatively or as
    ``from package import module``) gives its rewritten module."""
    saved_modules = {}
    saved_attrs = []
    missing = object()
    try:
        for name, module in replacements.items():
            saved_modules[name] = sys.modules.get(name, missing)
            sys.modules[name] = module
            parent_name, _, child = name.rpartition(".")
            parent = sys.modules.get(parent_name)
            if parent is not None:
                saved_attrs.append((parent, child, getattr(parent, child, missing)))
                setattr(parent, child, module)
        yield
    finally:
        for parent, child, value in reversed(saved_attrs):
            if value is missing:
                with contextlib.suppress(AttributeError):
                    delattr(parent, child)
            else:
                setattr(parent, child, value)
        for name, value in saved_modules.items():
            if value is missing:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value


def load_rewritten_modules(sources: dict[str, tuple[str, str]]) -> dict[str, types.ModuleType]:
    """Load rewritten sources of one package in memory. ``sources`` maps an original module
    name to ``(original file, new source text)``; returns original module name -> new module.

    Each new module is named ``<package>.<module>__adopter_<hash>`` (hash of all the new
    texts, so identical rewrites share modules), has ``__package__`` of the original (relative
    imports work) and ``__file__`` of the original (files next to it are found), and is
    registered in ``sys.modules``. Its code is compiled under a pseudo file name whose lines
    are in ``linecache`` so tracebacks show the rewritten source. While the modules execute,
    imports of the other original modules resolve to their rewritten versions; the original
    modules are left as they were. Raises what executing a module raises, registering nothing.
    """
    digest = hashlib.sha1()
    for name in sorted(sources):
        digest.update(name.encode())
        digest.update(sources[name][1].encode())
    tag = digest.hexdigest()[:12]
    generated = {name: f"{name}__adopter_{tag}" for name in sources}
    if all(g in sys.modules for g in generated.values()):
        return {name: sys.modules[g] for name, g in generated.items()}

    modules = {}
    for name, (original_file, text) in sources.items():
        code_filename = f"<adopter rewrite of {original_file} [{tag}]>"
        modules[name] = _new_module(generated[name], text, code_filename, name.rpartition(".")[0], original_file)

    for name, module in modules.items():
        sys.modules[generated[name]] = module
    try:
        with _imports_resolve_to(modules):
            for name in _dependency_order(sources):
                modules[name].__spec__.loader.exec_module(modules[name])
    except BaseException:
        for name in modules:
            sys.modules.pop(generated[name], None)
        raise
    return modules
