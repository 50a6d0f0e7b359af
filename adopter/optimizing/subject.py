"""The instance ``optimize()`` analyses: built from the user's config or, for transformers
classes, from the class's default config shrunk for speed, with example inputs; and the
source files that define its classes."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adopter.errors import OptimizeError

__all__ = ["Subject", "build_subject", "is_transformers_class", "package_files", "shrink_config"]

# Sizes small enough that building, tracing and checking a model takes well under a second,
# while keeping every code path (layers, heads, heads dividing the hidden size).
_SHRINK_SCALARS = {
    "num_hidden_layers": 2, "num_layers": 2, "num_decoder_layers": 2, "n_layer": 2,
    "encoder_layers": 2, "decoder_layers": 2, "n_layers": 2,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "d_ff": 128, "hidden_dim": 128, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "ffn_dim": 128,
    "num_attention_heads": 4, "num_heads": 4, "n_head": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 4,
    "d_kv": 16, "head_dim": 16, "embedding_size": 32,
}  # fmt: skip
# Keys that a stage-based config (list ``depths`` / ``hidden_sizes``) derives from its stages.
_STAGE_DERIVED = frozenset({
    "num_hidden_layers", "num_layers", "n_layers", "hidden_size", "embed_dim", "dim",
    "num_attention_heads", "num_heads",
})  # fmt: skip


def shrink_config(config):
    """A copy of a transformers config with small sizes (never larger than the original)."""
    small = copy.deepcopy(config)
    depths = getattr(small, "depths", None)
    sizes = getattr(small, "hidden_sizes", None)
    staged = any(isinstance(v, (list, tuple)) and v for v in (depths, sizes))
    for key, value in _SHRINK_SCALARS.items():
        if staged and key in _STAGE_DERIVED:
            # In stage-based models (Swin, ConvNext) these are the stage count or derived from
            # the per-stage lists (ConvNext's num_hidden_layers is num_stages; Swin's hidden_size
            # is embed_dim * 2**(stages-1), its per-stage heads must divide embed_dim * 2**i):
            # shrinking them alone breaks the model. Depths and widths are shrunk below instead.
            continue
        if key == "hidden_dim" and isinstance(getattr(small, "num_block_repeats", None), (list, tuple)):
            # EfficientNet-style configs: hidden_dim is the final width, derived from the
            # per-block channels and the width coefficient, not an FFN size.
            continue
        current = getattr(small, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(small, key, value)
    embedding = getattr(config, "embedding_size", None)
    if isinstance(embedding, int) and embedding == getattr(config, "hidden_size", None):
        # Models that require embedding_size == hidden_size (SqueezeBERT) keep them equal;
        # factorised embeddings (ALBERT: 128 vs 768) shrink independently.
        with contextlib.suppress(AttributeError, TypeError, ValueError):
            small.embedding_size = small.hidden_size
    if getattr(small, "n_inner", None):
        small.n_inner = 128
    if isinstance(depths, (list, tuple)) and depths:
        small.depths = [1] * len(depths)
    if isinstance(sizes, (list, tuple)) and sizes:
        small.hidden_sizes = [min(int(s), 32 * 2**i) for i, s in enumerate(sizes)]
    image_size = getattr(small, "image_size", None)
    patch = getattr(small, "patch_size", None)
    if isinstance(image_size, int) and isinstance(patch, int) and image_size > 4 * patch:
        target = 4 * patch
        if staged:
            # Every stage halves the resolution; windowed attention (Swin) needs each stage's
            # resolution to hold a whole window: keep the last stage at least one window wide.
            window = getattr(small, "window_size", None)
            if isinstance(window, int) and not isinstance(window, bool) and window > 2:
                with contextlib.suppress(AttributeError, TypeError, ValueError):
                    small.window_size = 2
            window = getattr(small, "window_size", 1)
            window = window if isinstance(window, int) and not isinstance(window, bool) else 1
            stages = len(depths if isinstance(depths, (list, tuple)) and depths else sizes)
            target = max(target, patch * window * 2 ** (stages - 1))
        small.image_size = min(image_size, target)
    elif isinstance(image_size, int) and patch is None and isinstance(getattr(small, "num_block_repeats", None), (list, tuple)):
        # EfficientNet: 600 px by default; its strides reduce by 32, so 64 px keeps every stage.
        small.image_size = min(image_size, 64)
    return small


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


def build_subject(model_cls, config, example_inputs, device, init_args, init_kwargs) -> Subject:
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
    example_inputs = _as_keyword_inputs(model_cls, example_inputs)
    try:
        args, built = _build_with(build_model, model_cls, device, args, kwargs, example_inputs)
    except TracingError as exc:
        if full_size_config is None:
            raise OptimizeError(str(exc)) from None
        # Shrinking is a heuristic over config fields; some architectures derive sizes the
        # heuristic does not know (EfficientNet's hidden_dim): then use the default config.
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
