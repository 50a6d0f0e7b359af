"""The second configuration ``optimize()`` checks a rewritten class under.

A rewrite must be right for every configuration its source can build, not only the analysed
one. So besides the analysed instance, optimize builds original and optimized classes with a
*flipped* configuration — every config value a rewritten site reads (activation, eps, bias
flags, attention implementation, dropout probabilities) changed — and compares them. Which
values a site reads is found statically: ``config.<name>`` / ``self.config.<name>`` /
``getattr(config, "<name>", ...)`` in the ``__init__`` of the class owning the rewritten
function (and its same-file bases), in the arguments of the calls that build that class
(``LayerNorm(config.n_embd, bias=config.bias)``), and in the rewritten function itself; a dict
config is read as ``config["<name>"]`` / ``config.get("<name>")``.

Where the configuration lives, and how a flipped one is built:

* a transformers config (the first constructor argument): copied, the fields set;
* a plain configuration object — a dataclass instance, a ``types.SimpleNamespace`` or a dict —
  passed positionally or by keyword (nanoGPT's ``GPT(GPTConfig(...))``), or, when the model was
  built without one, the one the instance stores (``self.config``) passed back under the
  constructor parameter of that name: rebuilt the way such an object is
  (``dataclasses.replace`` / copy + setattr / dict copy) and put where the original was;
* constructor keywords (``Model(hidden=32, bias=True)``): the keywords themselves.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import os
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from adopter.core.structures import Match
from adopter.errors import one_line
from adopter.kernels.telemetry import count_kernel_calls
from adopter.optimizing.subject import Subject

__all__ = ["ConfigFlip", "FlipCheck", "PlainConfig", "config_fields_read", "constructor_arguments", "flips_for",
           "with_values"]

_CONFIG_NAMES = ("config", "cfg")
# transformers stores the attention implementation in a private field with a public meaning
_ATTN_IMPL = {"eager": "sdpa", "sdpa": "eager"}


@dataclass(frozen=True)
class ConfigFlip:
    field: str
    original: Any
    flipped: Any

    def __str__(self) -> str:
        return f"{self.field}={self.flipped!r} (was {self.original!r})"

    def to_json(self) -> dict:
        return {"field": self.field, "original": self.original, "flipped": self.flipped}


def _is_config(node: ast.expr, names: Iterable[str] = _CONFIG_NAMES) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names or node.id.endswith("_config")
    return isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _reads(node: ast.AST, names: Iterable[str] = _CONFIG_NAMES) -> set[str]:
    names = tuple(names)
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and _is_config(sub.value, names):
            out.add(sub.attr)
        elif isinstance(sub, ast.Subscript) and _is_config(sub.value, names) and _string(sub.slice) is not None:
            out.add(_string(sub.slice))  # a dict config: config["bias"]
        elif isinstance(sub, ast.Call) and sub.args:
            func, key = sub.func, None
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_config(func.value, names):
                key = _string(sub.args[0])  # a dict config: config.get("bias", True)
            elif (isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(sub.args) >= 2
                  and _is_config(sub.args[0], names)):
                key = _string(sub.args[1])
            if key is not None:
                out.add(key)
    return out


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _construction_reads(tree: ast.Module, class_name: str, names: Iterable[str]) -> set[str]:
    """Config values passed to the constructor of ``class_name`` where the file builds it: a class
    that takes plain arguments (``LayerNorm(ndim, bias)``) reads its config through its builder's."""
    out: set[str] = set()
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Call):
            callee = sub.func.id if isinstance(sub.func, ast.Name) else getattr(sub.func, "attr", None)
            if callee == class_name:
                for arg in [*sub.args, *(k.value for k in sub.keywords)]:
                    out |= _reads(arg, names)
    return out


def config_fields_read(texts: dict[str, str], applied: Iterable[Match], names: Iterable[str] = ()) -> set[str]:
    """Config attribute names read by the rewritten functions and their classes' ``__init__``, and
    passed to those classes' constructors.

    ``texts``: file path -> source text of the files the matches lie in; ``names``: parameter
    names that also hold the config (besides ``config``, ``cfg`` and ``*_config``)."""
    names = (*_CONFIG_NAMES, *names)
    trees: dict[str, ast.Module] = {}
    fields: set[str] = set()
    for m in applied:
        path = os.path.realpath(m.file)
        if path not in trees:
            if path not in texts:
                continue
            try:
                trees[path] = ast.parse(texts[path])
            except SyntaxError:
                continue
        tree = trees[path]
        classes = _classes(tree)
        function = m.function.partition(".")[0]  # a nested function's (``forward.stem``) method
        if m.class_name and m.class_name.split(".")[-1] in classes:
            todo, seen = [m.class_name.split(".")[-1]], set()
            while todo:  # the class and its same-file bases: their __init__ builds the modules
                name = todo.pop()
                if name in seen or name not in classes:
                    continue
                seen.add(name)
                init = _method(classes[name], "__init__")
                if init is not None:
                    fields |= _reads(init, names)
                fields |= _construction_reads(tree, name, names)
                todo += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in classes[name].bases]
            fn = _method(classes[m.class_name.split(".")[-1]], function)
        else:
            fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), None)
        if fn is not None:
            fields |= _reads(fn, names)
    return fields


def _activation_names() -> set[str]:
    try:
        from transformers.activations import ACT2FN
    except Exception:  # noqa: BLE001 - transformers absent or broken: torch names only
        return {"gelu", "relu", "silu", "swish", "tanh", "sigmoid"}
    return set(ACT2FN)


def flip_value(field: str, value: Any, activations: set[str]) -> Any:
    """A different value of the same kind, or None when the field is not flipped (sizes, counts
    and free-form strings change shapes or are not ours to guess)."""
    if isinstance(value, bool):
        return not value
    if field == "_attn_implementation" and value in _ATTN_IMPL:
        return _ATTN_IMPL[value]
    if isinstance(value, str) and value in activations and ("act" in field.lower() or value.startswith("gelu")):
        return "relu" if value.startswith("gelu") else "gelu"
    if isinstance(value, float):
        lowered = field.lower()
        if "drop" in lowered or "prob" in lowered:
            return 0.0 if value > 0 else 0.1
        if "eps" in lowered or "epsilon" in lowered:
            return value * 10 if value > 0 else 1e-5
    return None


def flips_for(settings: Any, fields: Iterable[str]) -> list[ConfigFlip]:
    """The flips of ``fields`` that ``settings`` (a config object or constructor keyword dict) holds."""
    activations = _activation_names()
    out = []
    for name in sorted(fields):
        try:
            value = settings[name] if isinstance(settings, dict) else getattr(settings, name)
        except (KeyError, AttributeError):
            continue
        flipped = flip_value(name, value, activations)
        if flipped is not None and flipped != value:
            out.append(ConfigFlip(name, value, flipped))
    return out


def _is_plain_config(value: Any, allow_dict: bool) -> bool:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return True
    if isinstance(value, types.SimpleNamespace):
        return True
    return allow_dict and isinstance(value, dict) and bool(value) and all(isinstance(k, str) for k in value)


def _config_like(name: str) -> bool:
    return name in _CONFIG_NAMES or name.endswith("_config") or name.endswith("config")


def with_values(config: Any, values: dict) -> Any:
    """A new configuration like ``config`` with ``values`` set, built the way such an object is:
    a dict copy, ``dataclasses.replace`` (its ``__post_init__`` runs again, as when a user writes
    the flipped config), or a copy with the attributes set (a namespace, or a dataclass field
    ``replace`` cannot take: ``init=False``). ``config`` itself is never changed."""
    if isinstance(config, dict):
        return {**config, **values}
    if dataclasses.is_dataclass(config):
        init_fields = {f.name for f in dataclasses.fields(config) if f.init}
        if set(values) <= init_fields:
            return dataclasses.replace(config, **values)
    new = copy.copy(config)
    for name, value in values.items():
        object.__setattr__(new, name, value)  # also through a frozen dataclass's __setattr__
    return new


def constructor_arguments(model_cls: type, config: Any, init_args: tuple, init_kwargs: dict | None) -> tuple:
    """(args, kwargs) the analysed instance was built with, from ``optimize``'s arguments.

    The same mapping as :func:`adopter.optimizing.subject.build_subject` (which does not keep
    them): ``init_args`` / ``init_kwargs`` when given, else a dict ``config`` is the keywords of a
    plain module, a tuple or list the positional arguments, anything else the one positional
    argument. (A transformers config is not flipped from here: the Subject carries it.)"""
    from adopter.optimizing.subject import is_transformers_class

    args: tuple = tuple(init_args or ())
    kwargs: dict = dict(init_kwargs or {})
    if config is not None and not args and not kwargs:
        if isinstance(config, dict) and not is_transformers_class(model_cls):
            kwargs = dict(config)
        elif isinstance(config, (tuple, list)):
            args = tuple(config)
        else:
            args = (config,)
    return args, kwargs


@dataclass
class PlainConfig:
    """A plain configuration object (dataclass, namespace, dict) and where the constructor takes it."""

    value: Any
    args: tuple
    kwargs: dict
    index: int | None = None  # its position in args, or
    keyword: str | None = None  # its keyword (added to kwargs when the model was built without it)
    parameter: str | None = None  # the constructor parameter that receives it, when known

    def arguments(self, values: dict) -> tuple[tuple, dict]:
        flipped = with_values(self.value, values)
        args, kwargs = list(self.args), dict(self.kwargs)
        if self.index is not None:
            args[self.index] = flipped
        else:
            kwargs[self.keyword] = flipped
        return tuple(args), kwargs


def _parameters(model_cls: type):
    try:
        return inspect.signature(model_cls).parameters
    except (TypeError, ValueError):
        return {}


def find_plain_config(model_cls: type, model: Any, args: tuple, kwargs: dict) -> PlainConfig | None:
    """The plain configuration object of the constructor call ``model_cls(*args, **kwargs)``.

    A dataclass instance or namespace anywhere among the arguments; a dict only as the first
    positional argument or under a config-like keyword (``config=``, ``cfg=``, ``*_config=``):
    other dicts are too often not configurations. When the call holds none, the one the built
    instance stores under a config-like name (``self.config = config or GPTConfig()``), if the
    constructor has a free parameter of that name to pass it back through."""
    params = _parameters(model_cls)
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        if _is_plain_config(value, allow_dict=i == 0):
            name = positional[i] if i < len(positional) else None
            return PlainConfig(value, args, kwargs, index=i, parameter=name)
    for key, value in kwargs.items():
        if _is_plain_config(value, allow_dict=_config_like(key)):
            return PlainConfig(value, args, kwargs, keyword=key, parameter=key)
    for key in params:
        value = getattr(model, key, None) if _config_like(key) else None
        if value is None or not _is_plain_config(value, allow_dict=True) or key in kwargs:
            continue
        try:
            bound = inspect.signature(model_cls).bind_partial(*args, **kwargs)
        except TypeError:
            continue
        if key not in bound.arguments and params[key].kind in (params[key].POSITIONAL_OR_KEYWORD,
                                                                params[key].KEYWORD_ONLY):
            return PlainConfig(value, args, kwargs, keyword=key, parameter=key)
    return None


class FlipCheck:
    """Equivalence under the flipped configuration (:mod:`adopter.optimizing.config_flip`): every config value
    the rewritten sites read, changed, for both the original class and the rewritten one.

    ``arguments``: the (args, kwargs) the analysed instance was built with
    (:func:`constructor_arguments`), when known: they locate a plain configuration object."""

    def __init__(self, model_cls: type, subject: Subject, files: dict[str, str], texts: dict[str, str],
                 arguments: tuple[tuple, dict] | None = None):
        self.model_cls, self.subject = model_cls, subject
        self.texts = {path: texts[name] for name, path in files.items()}
        self.arguments = arguments
        self.flips: list = []
        self.note = ""
        self.make_with: Callable[[type, dict], Any] | None = subject.make_with
        self.plain: PlainConfig | None = None  # the plain configuration flipped, if that is what is flipped

    @property
    def flips_text(self) -> str:
        return ", ".join(map(str, self.flips))

    @staticmethod
    def _values(flips) -> dict:
        return {f.field: f.flipped for f in flips}

    def _original_runs(self, flips) -> str:
        """Why the original class does not run with ``flips`` ("" when it does)."""
        from adopter.verification.equivalence import call_model

        try:
            call_model(self.make_with(self.model_cls, self._values(flips)), self.subject.example_inputs)
        except Exception as exc:  # noqa: BLE001 - a flip the original itself does not accept
            return one_line(exc)
        return ""

    def _plain_make_with(self, plain: PlainConfig) -> Callable[[type, dict], Any]:
        param = next(iter(self.subject.model.parameters()), None) if hasattr(self.subject.model, "parameters") else None
        device = param.device if param is not None else "cpu"

        def make_with(cls: type, values: dict):
            args, kwargs = plain.arguments(values)
            return cls(*args, **kwargs).to(device).eval()

        return make_with

    def choose(self, applied: list[Match]) -> None:
        """Pick the flips for the rewritten sites of ``applied`` (or say in ``note`` why none)."""
        settings = self.subject.settings
        if settings is not None and not isinstance(settings, dict) and self.subject.make_with is not None:
            # a transformers config: the Subject builds with it changed
            candidates = flips_for(settings, config_fields_read(self.texts, applied))
        else:
            args, kwargs = self.arguments if self.arguments is not None else ((), {})
            plain = find_plain_config(self.model_cls, self.subject.model, args, kwargs)
            candidates = []
            if plain is not None:
                names = [plain.parameter] if plain.parameter else []
                candidates = flips_for(plain.value, config_fields_read(self.texts, applied, names))
                if candidates:
                    self.plain, self.make_with = plain, self._plain_make_with(plain)
            if not candidates and isinstance(settings, dict) and self.subject.make_with is not None:
                candidates = flips_for(settings, set(settings))  # the constructor keywords themselves
            if plain is None and (settings is None or self.subject.make_with is None):
                self.note = ("no configuration to flip (the model takes no config object — transformers config, "
                             "dataclass, namespace or dict — nor keyword arguments)")
                return
        if not candidates:
            self.note = "the rewritten sites read no config value that can be flipped"
            return
        if not self._original_runs(candidates):
            self.flips = candidates
            return
        # All at once the original fails: keep each flip the original accepts on its own.
        self.flips = [f for f in candidates if not self._original_runs([f])]
        if self.flips and self._original_runs(self.flips):
            self.flips = self.flips[:1]
        left_out = [f.field for f in candidates if f not in self.flips]
        self.note = f"left out (the original does not run with them): {', '.join(left_out)}"

    def equivalent(self, new_cls: type) -> bool:
        return self._check(new_cls).equivalent

    def _check(self, new_cls: type):
        from adopter.verification.equivalence import EquivalenceResult, check_equivalence, tolerance_for

        values = self._values(self.flips)
        original = self.make_with(self.model_cls, values)
        try:
            candidate = self.make_with(new_cls, values)
        except Exception as exc:  # noqa: BLE001
            error = f"rewritten class cannot be built with the flipped config: {one_line(exc)}"
            param = next(iter(original.parameters()), None)
            tol = tolerance_for(param.dtype, param.device) if param is not None else tolerance_for(None, None)
            return EquivalenceResult(False, float("inf"), "", 0, tol, error=error)
        return check_equivalence(original, candidate, self.subject.example_inputs)

    def run(self, new_cls: type):
        """(EquivalenceResult, the kernel calls it made), or (None, None) when nothing is flipped."""
        if not self.flips:
            return None, None
        with count_kernel_calls() as calls:
            result = self._check(new_cls)
        return result, calls
