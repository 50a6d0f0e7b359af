"""Capture what a model executes as a ``torch.fx.GraphModule``.

First ``torch.fx.symbolic_trace`` semantics (a :class:`LayerTracer` that keeps the layers the rules
talk about as leaf ``call_module`` nodes and records stack traces); where it fails — it does on
transformers 5 models, whose forwards branch on tensor values and assign into proxies — fall back
to non-strict ``torch.export``, whose graph nodes carry ``nn_module_stack`` and ``stack_trace``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch import nn

from adopter.core.rules import all_rules

from .source_map import MODULE_FRAMES

CaptureMethod = Literal["symbolic_trace", "export"]

def leaf_modules_of(rules: Iterable) -> tuple[str, ...]:
    """The module classes the rules' runtime parts need whole in a symbolic trace."""
    out: dict[str, None] = {}
    for rule in rules:
        for name in getattr(getattr(rule, "runtime", None), "leaf_modules", ()):
            out[name] = None
    return tuple(out)


def leaf_predicate(leaf_modules: Iterable[str]) -> Callable[[nn.Module], bool]:
    """``module -> keep it whole`` for the rules' leaf declarations: qualified class names
    (subclasses included) and ``package.`` prefixes (every class defined under the package)."""
    classes: list[type] = []
    prefixes: list[str] = []
    for name in leaf_modules:
        if name.endswith("."):
            prefixes.append(name[:-1])
            continue
        module_name, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # a layer class from a package that is not installed: nothing to keep whole
        if isinstance(cls, type):
            classes.append(cls)
    class_tuple = tuple(classes)
    prefix_tuple = tuple(prefixes)

    def is_leaf(m: nn.Module) -> bool:
        return isinstance(m, class_tuple) or (bool(prefix_tuple) and type(m).__module__.startswith(prefix_tuple))

    return is_leaf


class LayerTracer(torch.fx.Tracer):
    """``symbolic_trace`` with the rules' layers as leaves and stack traces recorded."""

    def __init__(self, leaf_modules: Iterable[str] = ()):
        super().__init__()
        self.record_stack_traces = True
        self._is_rule_leaf = leaf_predicate(leaf_modules)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._is_rule_leaf(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)


@dataclass
class Capture:
    method: CaptureMethod
    graph_module: torch.fx.GraphModule
    seconds: float
    root: nn.Module  # the module traced (symbolic_trace's call_module targets resolve against it)
    errors: dict[str, str] = field(default_factory=dict)  # method tried -> first error line


class CaptureError(Exception):
    """Neither symbolic_trace nor torch.export could capture the model."""

    def __init__(self, message: str, errors: dict[str, str]):
        super().__init__(message)
        self.errors = errors


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def _symbolic_trace(
    model: nn.Module, example_inputs: dict[str, Any], leaf_modules: Iterable[str] = ()
) -> torch.fx.GraphModule:
    # Parameters not given keep their defaults as constants, as HF's own fx tracer does.
    concrete = {}
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name not in example_inputs:
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"forward needs {name!r}, not in the example inputs")
            concrete[name] = p.default
    tracer = LayerTracer(leaf_modules)
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    # A symbolic trace can "succeed" yet not run (a value baked in, a missing branch): run it.
    with torch.no_grad():
        if not any(_is_meta(v) for v in example_inputs.values()):
            gm(**{k: v for k, v in example_inputs.items() if k in params})
    return gm


def _is_meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _model_code_objects(model: nn.Module) -> set[tuple[str, str]]:
    """``(co_filename, co_name)`` of every function and method defined in the modules that define
    the model's classes (``eager_attention_forward``, ``feed_forward_chunk``...) and of the
    functions nested in them."""
    torch_dir = os.path.dirname(torch.__file__)
    module_names = {type(m).__module__ for m in model.modules()}
    anchors: set[tuple[str, str]] = set()

    def add_code(code):
        anchors.add((code.co_filename, code.co_name))
        for const in code.co_consts:  # functions nested in it (``def stem(x)`` inside ``forward``)
            if inspect.iscode(const) and not const.co_name.startswith("<"):
                add_code(const)

    def add(obj):
        obj = inspect.unwrap(obj) if callable(obj) else obj
        code = getattr(obj, "__code__", None)
        if code is not None and not code.co_filename.startswith(torch_dir):
            add_code(code)

    for name in module_names:
        module = sys.modules.get(name)
        if module is None or name.startswith("torch."):
            continue
        for value in list(vars(module).values()):
            if inspect.isfunction(value):
                add(value)
            elif inspect.isclass(value) and value.__module__ == name:
                for attr in vars(value).values():
                    if isinstance(attr, (staticmethod, classmethod)):
                        attr = attr.__func__
                    if inspect.isfunction(attr):
                        add(attr)
    return anchors


@contextlib.contextmanager
def _keep_model_frames(model: nn.Module):
    """torch.export keeps only frames of functions named ``forward`` in ``stack_trace``; the model
    code's other functions (``eager_attention_forward``) are registered as anchors while exporting
    so nodes map to the line that produced them."""
    anchors_set = getattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS", None)
    if anchors_set is None:
        yield
        return
    added = _model_code_objects(model) - anchors_set
    anchors_set.update(added)
    try:
        yield
    finally:
        anchors_set.difference_update(added)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _frame_modules(frame, modules: dict[int, tuple[str, nn.Module]], owners: frozenset[str]):
    """``(path, class)`` of the model's module instances whose methods are running on the stack
    from ``frame`` outwards, outermost first: a frame counts when its function is a method of a
    class in its first argument's MRO (``Block.forward``, a base's ``forward`` reached through
    ``super()``, ``nn.Module.forward(self.ffn, x)``) and that argument is a module of the model."""
    chain: list[tuple[str, str]] = []
    while frame is not None:
        code = frame.f_code
        owner = code.co_qualname.rpartition(".")[0]
        if code.co_argcount and owner in owners:
            obj = frame.f_locals.get(code.co_varnames[0])
            hit = modules.get(id(obj))
            if hit is not None and hit[1] is obj and any(k.__qualname__ == owner for k in type(obj).__mro__):
                entry = (hit[0], _class_name(type(obj)))
                if not chain or chain[-1] != entry:
                    chain.append(entry)
        frame = frame.f_back
    chain.reverse()
    return tuple(chain)


@contextlib.contextmanager
def _module_frames_recorded(model: nn.Module):
    """Record on every graph node created while capturing the module instances whose methods were
    running (``source_map.MODULE_FRAMES``): the tracers' module stacks see only ``__call__``, so
    the nodes of a submodule whose ``forward`` the model calls directly would be filed under the
    caller (one capture at a time: ``fx.Graph.create_node`` is wrapped while it runs)."""
    modules = {id(m): (path, m) for path, m in model.named_modules()}
    owners = frozenset(k.__qualname__ for _, m in modules.values() for k in type(m).__mro__)
    original = torch.fx.Graph.create_node

    def create_node(graph, *args, **kwargs):
        node = original(graph, *args, **kwargs)
        chain = _frame_modules(sys._getframe(1), modules, owners)
        if chain:
            node.meta[MODULE_FRAMES] = chain
        return node

    torch.fx.Graph.create_node = create_node
    try:
        yield
    finally:
        torch.fx.Graph.create_node = original


def _export(model: nn.Module, example_inputs: dict[str, Any]) -> torch.fx.GraphModule:
    with torch.no_grad(), _keep_model_frames(model):
        exported = torch.export.export(model, (), dict(example_inputs), strict=False)
    return exported.graph_module


@contextlib.contextmanager
def _attributes_restored(model: nn.Module):
    """Put every module's attributes back as they were after a capture attempt: a forward that
    assigns to ``self`` (Meta llama's ``self.freqs_cis = self.freqs_cis.to(h.device)``) leaves an
    fx Proxy or a fake tensor in the analysed instance, which breaks the next method and the
    equivalence check that runs the same instance afterwards."""
    saved = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in model.modules()]
    try:
        yield
    finally:
        for m, attrs, params, buffers, modules in saved:
            for name in set(vars(m)) - set(attrs):
                del m.__dict__[name]
            m.__dict__.update(attrs)
            for store, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                store.clear()
                store.update(old)


def capture_model(
    model: nn.Module,
    example_inputs: dict[str, Any],
    *,
    methods: tuple[CaptureMethod, ...] = ("symbolic_trace", "export"),
    leaf_modules: Iterable[str] | None = None,
) -> Capture:
    """Capture ``model`` on ``example_inputs``; raises :class:`CaptureError` when no method works.

    ``leaf_modules``: layer classes a symbolic trace keeps as one node (the rules' declarations,
    see ``adopter.core.rule.Runtime.leaf_modules``; default: those of every registered rule)."""
    if leaf_modules is None:
        leaf_modules = leaf_modules_of(all_rules())
    errors: dict[str, str] = {}
    for method in methods:
        start = time.perf_counter()
        try:
            with _attributes_restored(model), _module_frames_recorded(model):
                if method == "symbolic_trace":
                    gm = _symbolic_trace(model, example_inputs, leaf_modules)
                elif method == "export":
                    gm = _export(model, example_inputs)
                else:
                    raise ValueError(f"unknown capture method {method!r}")
        except Exception as exc:  # any failure of one method means: try the next
            errors[method] = first_line(exc)
            continue
        return Capture(method, gm, time.perf_counter() - start, model, errors)
    detail = "; ".join(f"{m}: {e}" for m, e in errors.items())
    raise CaptureError(f"could not capture {type(model).__name__} ({detail})", errors)
