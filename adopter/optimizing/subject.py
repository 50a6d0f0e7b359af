"""The instance ``optimize()`` analyses: built from the user's config or, for transformers
classes, from the class's default config shrunk for speed, with example inputs; and the
source files that define its classes.

A model built from a config the user did not give (the shrunk default, or the full-size default
when the shrunk one fails) is first counted on the ``meta`` device (no memory): above
:data:`MAX_DEFAULT_PARAMETERS` parameters ``optimize()`` refuses with an ``OptimizeError`` naming
the count, instead of allocating billions of parameters the user never asked for; a full-size
default below it is used with an ``AdopterWarning`` saying so. A config or constructor arguments
the user passes are built as given, whatever their size.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adopter.errors import OptimizeError
from adopter.optimizing.shrink import shrink_config

__all__ = ["MAX_DEFAULT_PARAMETERS", "Subject", "build_subject", "is_transformers_class", "package_files",
           "shrink_config"]

# The most parameters a model built from a config the user did not pass may have (a few seconds
# and ~1 GB to build and check on a CPU); a shrunk config is far below (< 5M).
MAX_DEFAULT_PARAMETERS = 200_000_000

def _module_file(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    return os.path.realpath(path)


def package_files(model, model_cls: type) -> dict[str, str]:
    """module name -> file for the model class's module and every module (of the same top-level
    package) that defines the class of one of the model's submodules."""
    top = model_cls.__module__.split(".")[0]
    found: dict[str, str] = {}
    root_file = _module_file(model_cls.__module__)
    if root_file is None:
        raise OptimizeError(
            f"cannot find the source file of {model_cls.__qualname__} (module {model_cls.__module__})"
        )
    found[model_cls.__module__] = root_file
    for module in model.modules():
        name = type(module).__module__
        if name in found or name.split(".")[0] != top or "__adopter_" in name:
            continue
        path = _module_file(name)
        if path:
            found[name] = path
    return found


def is_transformers_class(model_cls: type) -> bool:
    return getattr(model_cls, "config_class", None) is not None and any(
        c.__module__.startswith("transformers.") for c in model_cls.__mro__
    )


@dataclass
class Subject:
    """The instance optimize() analyses, and how to build the same thing from a new class."""

    model: Any
    example_inputs: Any
    make: Callable[[type], Any]
    config: Any = None  # the transformers config it was built from, if any
    # The configuration to flip for the second equivalence check (a config object or the
    # constructor keywords) and how to build a class with flipped values ({field: value}).
    settings: Any = None
    make_with: Callable[[type, dict], Any] | None = None


def _as_keyword_inputs(model_cls: type, example_inputs):
    """Positional example inputs (a tensor or a tuple) as forward keyword arguments: the
    tracing API takes a dict."""
    if example_inputs is None or isinstance(example_inputs, dict):
        return example_inputs
    import inspect

    values = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    try:
        params = [
            p for p in inspect.signature(model_cls.forward).parameters.values()
            if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]  # fmt: skip
    except (TypeError, ValueError):
        params = []
    if len(params) < len(values):
        raise OptimizeError(
            f"{model_cls.__name__}.forward takes {len(params)} positional inputs, example_inputs has {len(values)}; "
            "pass a dict of keyword arguments"
        )
    return {p.name: v for p, v in zip(params, values)}


def _build_with(build_model, model_cls, device, args: tuple, kwargs: dict, example_inputs):
    """(constructor args actually used, BuiltModel)."""
    if args and hasattr(args[0], "to_dict") and hasattr(args[0], "use_cache"):
        args = (copy.deepcopy(args[0]),) + args[1:]
        args[0].use_cache = False  # caches in outputs are not compared and not traced
    built = build_model(model_cls, device=device, init_args=args, init_kwargs=kwargs, example_inputs=example_inputs)
    return args, built


def parameter_count(model_cls, args: tuple, kwargs: dict) -> int | None:
    """Parameters of ``model_cls(*args, **kwargs)``, counted on the ``meta`` device (nothing is
    allocated); None when the class cannot be built there (the build itself then says why)."""
    import torch

    try:
        with torch.device("meta"):
            model = model_cls(*args, **kwargs)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - any failure of the model's own constructor
        return None


def _refuse_large_default(model_cls, args: tuple, what: str, why: str = "") -> int | None:
    """OptimizeError when the model ``optimize()`` would build from a config the user did not
    pass has more than MAX_DEFAULT_PARAMETERS parameters; -> the count."""
    count = parameter_count(model_cls, args, {})
    if count is not None and count > MAX_DEFAULT_PARAMETERS:
        raise OptimizeError(
            f"{model_cls.__name__} from {what} has {count / 1e6:,.0f}M parameters (more than "
            f"{MAX_DEFAULT_PARAMETERS / 1e6:,.0f}M): not built{why}; pass a small config "
            f"(optimize({model_cls.__name__}, config=...))"
        )
    return count


def build_subject(model_cls, config, example_inputs, device, init_args, init_kwargs, built=None) -> Subject:
    """The instance to analyse (``built``: a :class:`~adopter.tracing.BuiltModel` of ``model_cls``
    built already with ``init_args``/``init_kwargs``, analysed as it is: ``adopter verify`` hands
    over the model it built, which is not built a second time). With no config and no constructor arguments, a transformers class
    is built from its default config shrunk (``shrink_config``); when that does not build, from
    the shrunk default's first layers only (``layer_kinds=False``), then from the full-size
    default config, with an AdopterWarning, and only when it has at most
    MAX_DEFAULT_PARAMETERS parameters (else OptimizeError: pass a config). A model from a config
    the user did not pass is never built larger than that."""
    from adopter.tracing import TracingError, build_model

    device = device or "cpu"
    args: tuple = tuple(init_args or ())
    kwargs: dict = dict(init_kwargs or {})
    if config is not None and not args and not kwargs:
        if isinstance(config, dict) and not is_transformers_class(model_cls):
            kwargs = dict(config)
        elif isinstance(config, (tuple, list)):
            args = tuple(config)
        else:
            args = (config,)
    full_size_config = None
    if config is None and is_transformers_class(model_cls) and not args and not kwargs:
        full_size_config = model_cls.config_class()
        args = (shrink_config(full_size_config),)
        # a size the shrinking does not know would leave the "small" model large: say so
        _refuse_large_default(model_cls, args, f"its shrunk default config ({type(args[0]).__name__})")
    example_inputs = _as_keyword_inputs(model_cls, example_inputs)
    from adopter.errors import one_line

    try:
        if built is None:
            args, built = _build_with(build_model, model_cls, device, args, kwargs, example_inputs)
    except TracingError as exc:
        if full_size_config is None:
            raise OptimizeError(str(exc)) from None
        built, first_error = None, one_line(exc)[:200]
        with contextlib.suppress(TracingError):
            # a layer kind the default leaves unconfigured (Qwen4-Exp's indexer layers need a
            # token budget the default leaves None): the shrunk default's first layers only
            first_layers = (shrink_config(full_size_config, layer_kinds=False),)
            args, built = _build_with(build_model, model_cls, device, first_layers, kwargs, example_inputs)
    if full_size_config is not None and built is None:
        # Shrinking is a heuristic over config fields; some architectures derive sizes the
        # heuristic does not know (EfficientNet's hidden_dim): then use the default config,
        # unless it is LLM-sized (a DeepSeek default has hundreds of billions of parameters).
        count = _refuse_large_default(
            model_cls, (full_size_config,), f"its full-size default config {type(full_size_config).__name__}()",
            f" (the shrunk default config failed: {first_error})",
        )
        import warnings

        from adopter.errors import AdopterWarning

        size = f" ({count / 1e6:,.1f}M parameters)" if count is not None else ""
        warnings.warn(
            f"{model_cls.__name__}: the shrunk default config failed ({first_error}); "
            f"building the full-size default {type(full_size_config).__name__}(){size}",
            AdopterWarning, stacklevel=3,  # the user's optimize() call
        )
        try:
            args, built = _build_with(build_model, model_cls, device, (full_size_config,), kwargs, example_inputs)
        except TracingError as exc2:
            raise OptimizeError(str(exc2)) from None

    def make(cls):
        return make_with(cls, {})

    def make_with(cls, values: dict):
        fresh_args = tuple(copy.deepcopy(a) if hasattr(a, "to_dict") else a for a in args)
        fresh_kwargs = dict(kwargs)
        for name, value in values.items():
            if fresh_args and hasattr(fresh_args[0], "to_dict"):
                setattr(fresh_args[0], name, value)
            else:
                fresh_kwargs[name] = value
        instance = cls(*fresh_args, **fresh_kwargs)
        return instance.to(device).eval()

    settings = args[0] if args and hasattr(args[0], "to_dict") else (dict(kwargs) if kwargs else None)
    return Subject(built.model, built.example_inputs, make, built.config, settings, make_with)
