"""Build a model instance plus example inputs to trace: from a known model id (shipped config),
a local directory holding ``config.json`` (and weights, when present), or a user's model class.

No network: known ids are built from the configs in :mod:`adopter.configs` with random weights.
``device="meta"`` builds without allocating weights, so the structure of a 7B model can be traced
on a laptop.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adopter import configs as shipped_configs

from .build_sites import recording_build_sites


class TracingError(Exception):
    """A model that cannot be built, fed or traced; one line, shown to the user as is."""


@dataclass
class BuiltModel:
    model: nn.Module
    example_inputs: dict[str, Any]
    model_id: str
    config: Any  # a transformers PretrainedConfig, or None for a user class without one
    device: str
    source_files: list[str] = field(default_factory=list)
    forward_checked: bool = False  # an eager forward ran on example_inputs (not possible on meta)


def known_model_ids() -> list[str]:
    return shipped_configs.known_model_ids()


def _looks_like_path(ref: str) -> bool:
    if ref.startswith(("/", "./", "../", "~")) or ref.endswith(("/", os.sep)) or ref.endswith(".json"):
        return True
    parent = os.path.dirname(ref)
    return bool(parent) and os.path.isdir(os.path.expanduser(parent))


def check_model_ref(model: str) -> None:
    """Fail fast (before anything is built or printed) on a model reference that names
    nothing: an unknown model id (suggesting the nearest known one), or a path that does not
    exist. Raises :class:`TracingError` with one line."""
    if shipped_configs.has_config(model) or os.path.exists(model):
        return
    if _looks_like_path(model):
        raise TracingError(f"directory not found: {model} (a model directory must hold config.json)")
    import difflib

    known = known_model_ids()
    near = difflib.get_close_matches(model, known, n=1, cutoff=0.6)
    if not near:
        lowered = {k.lower(): k for k in known}
        near = [lowered[k] for k in difflib.get_close_matches(model.lower(), list(lowered), n=1, cutoff=0.6)]
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise TracingError(
        f"unknown model id {model!r}; {hint}known model ids: {', '.join(known)} (or a directory holding config.json)"
    )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------ config handling


def _transformers():
    from adopter.core.extras import require

    return require("transformers", "hf", "a model built from a HuggingFace config")


def _config_from_dict(data: dict):
    AutoConfig = _transformers().AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_adopter")}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise TracingError("config has no 'model_type'; cannot tell which transformers config class to use")
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise TracingError(f"unknown model_type {model_type!r} in config: {str(exc).splitlines()[0]}") from None


def _model_class_for(config):
    transformers = _transformers()

    archs = getattr(config, "architectures", None) or []
    for name in archs:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    from transformers import AutoModel

    try:
        return AutoModel._model_mapping[type(config)]
    except KeyError:
        raise TracingError(
            f"no model class for config {type(config).__name__} (architectures={archs})"
        ) from None


def _apply_overrides(config, attn_implementation, config_overrides, on_meta: bool):
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    # A KV cache in the outputs is not a pytree torch.export knows; tracing needs no cache.
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


# ------------------------------------------------------------------ inputs


_TEXT_INPUTS = ("input_ids",)
_KNOWN_INPUTS = {
    "input_ids", "attention_mask", "pixel_values", "input_features", "input_values", "decoder_input_ids", "decoder_attention_mask",
}  # fmt: skip


def forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def make_example_inputs(model: nn.Module, config, *, batch_size: int = 2, seq_len: int = 16, device="cpu") -> dict:
    """Inputs generated from the forward signature and the config: token ids with an attention
    mask that really pads (the last sample's tail is zeros), pixel values of the configured image
    size, decoder inputs for encoder-decoder models."""
    names = {p.name for p in forward_parameters(model)}
    inputs: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    vocab = int(getattr(config, "vocab_size", 0) or 1000)

    def ids(n):
        t = torch.randint(3, max(4, min(vocab, 1000)), (batch_size, n), generator=gen)
        return t.to(device)

    def mask(n):
        m = torch.ones(batch_size, n, dtype=torch.long)
        if n > 1:
            m[-1, max(1, (3 * n) // 4):] = 0
        return m.to(device)

    if "input_ids" in names:
        inputs["input_ids"] = ids(seq_len)
        if "attention_mask" in names:
            # On meta the mask has the shape but no values: torch.export traces it symbolically.
            inputs["attention_mask"] = mask(seq_len)
        if "labels" in names and _is_causal_lm(model):
            # A causal LM trains on its own loss: labels are the input ids, padding ignored
            # (-100, the loss's ignore_index), so the loss path of the model runs as in training.
            labels = inputs["input_ids"].clone()
            if "attention_mask" in inputs:
                labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
            inputs["labels"] = labels
    if "pixel_values" in names and "input_ids" not in names:
        size = getattr(config, "image_size", 224) if config is not None else 224
        size = size[0] if isinstance(size, (list, tuple)) else int(size)
        channels = int(getattr(config, "num_channels", 3) or 3) if config is not None else 3
        inputs["pixel_values"] = torch.randn(batch_size, channels, size, size, generator=gen).to(device)
    if "input_features" in names and "input_ids" not in names and config is not None:
        # Speech encoders (Whisper): log-mel frames; Whisper's encoder requires exactly
        # 2 * max_source_positions frames (two convolutions, the second with stride 2).
        bins = int(getattr(config, "num_mel_bins", 0) or getattr(config, "feature_size", 0) or 80)
        source_positions = getattr(config, "max_source_positions", None)
        frames = 2 * int(source_positions) if isinstance(source_positions, int) else 4 * seq_len
        inputs["input_features"] = torch.randn(batch_size, bins, frames, generator=gen).to(device)
    if "input_values" in names and "input_ids" not in names and config is not None:
        # Raw-audio encoders (Wav2Vec2 family): samples for about seq_len frames after the
        # strided convolutional feature extractor.
        strides = getattr(config, "conv_stride", None)
        stride = math.prod(int(s) for s in strides) if isinstance(strides, (list, tuple)) and strides else 320
        inputs["input_values"] = torch.randn(batch_size, stride * (seq_len + 1), generator=gen).to(device)
    if "decoder_input_ids" in names and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids(max(2, seq_len // 2))
    return inputs


def _is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal language model (``*ForCausalLM``: a next-token loss over its LM head)."""
    return any(c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)


def _missing_required_inputs(model: nn.Module, inputs: dict) -> list[str]:
    return [
        p.name for p in forward_parameters(model) if p.default is inspect.Parameter.empty and p.name not in inputs
    ]


# ------------------------------------------------------------------ source files


def model_source_files(model: nn.Module) -> list[str]:
    """Files defining the classes of the model's modules (torch's own excluded), in first-use order."""
    torch_dir = os.path.dirname(torch.__file__)
    files: list[str] = []
    seen_types = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen_types:
            continue
        seen_types.add(cls)
        try:
            path = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            continue
        if not path:
            continue
        path = os.path.realpath(path)
        if path.startswith(torch_dir + os.sep) or path in files:
            continue
        files.append(path)
    return files


# ------------------------------------------------------------------ building


# the end of a constructor failure where a dict was given (a config object expected, probably)
DICT_GIVEN_HINT = "(pass the config object it expects with init_args=... / init_kwargs=...)"


def _dicts_given(args, kwargs) -> str:
    """``; params was given as a dict (...)`` when some argument is a dict, else ""."""
    names = [f"argument {i + 1}" for i, a in enumerate(args) if isinstance(a, dict)]
    names += [k for k, v in kwargs.items() if isinstance(v, dict)]
    if not names:
        return ""
    return f"; {', '.join(names)} {'was' if len(names) == 1 else 'were'} given as a dict {DICT_GIVEN_HINT}"


def _instantiate(cls, args, kwargs, device: str):
    try:
        # Sequential build sites are what confirms pairs matched where a Sequential is built
        with recording_build_sites():
            if device == "meta":
                with torch.device("meta"):
                    return cls(*args, **kwargs)
            return cls(*args, **kwargs)
    except TypeError as exc:
        msg = str(exc).splitlines()[0]
        if "argument" in msg:
            raise TracingError(f"{cls.__name__}(...) needs constructor arguments not given: {msg}") from None
        raise TracingError(f"{cls.__name__}(...) failed: {type(exc).__name__}: {msg}{_dicts_given(args, kwargs)}") from None
    except Exception as exc:  # a model's own validation (ValueError etc.): one line for the user
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TracingError(f"{cls.__name__}(...) failed: {type(exc).__name__}: {msg}{_dicts_given(args, kwargs)}") from None


def _check_constructor_args(cls, args, kwargs):
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return
    params = [p for p in sig.parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = {p.name for p in positional[: len(args)]} | set(kwargs)
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name not in given
    ]
    if missing:
        raise TracingError(
            f"{cls.__name__}(...) needs constructor arguments not given: {', '.join(missing)} "
            f"(pass them with init_args=... / init_kwargs=...)"
        )


def _run_forward_check(model: nn.Module, inputs: dict, name: str, *, generated: bool = True) -> None:
    """Run the forward once on ``inputs``; a failure is one line that says whose inputs they were
    (``generated``: adopter's, from the forward's signature; else the caller's example inputs)."""
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        given = ", ".join(f"{k}{list(v.shape) if hasattr(v, 'shape') else ''}" for k, v in inputs.items())
        missing = _missing_required_inputs(model, inputs)
        other = [p.name for p in forward_parameters(model) if p.name not in inputs and p.name not in missing]
        also = f" (it also accepts: {', '.join(other[:8])})" if other else ""
        if not generated:
            hint = (f"the example inputs lack {', '.join(missing)}" if missing
                    else "check the example inputs' names, shapes and dtypes against the forward" + also)
            raise TracingError(
                f"forward of {name} failed on the example inputs given ({given or 'none'}): "
                f"{type(exc).__name__}: {first}; {hint}"
            ) from None
        hint = (
            f"pass {', '.join(missing)} with example_inputs"
            if missing
            else "pass the inputs it needs with example_inputs" + also
        )
        raise TracingError(
            f"forward of {name} failed on the generated inputs ({given or 'none'}): "
            f"{type(exc).__name__}: {first}; {hint}"
        ) from None


def build_model(
    model,
    *,
    device: str | None = None,
    attn_implementation: str | None = None,
    config_overrides: dict | None = None,
    batch_size: int = 2,
    seq_len: int = 16,
    init_args: tuple = (),
    init_kwargs: dict | None = None,
    example_inputs: dict | None = None,
    check_forward: bool = True,
) -> BuiltModel:
    """Build ``model`` — a known model id, a directory/JSON file with a Hugging Face config, an
    ``nn.Module`` class (constructed with ``init_args``/``init_kwargs``) or instance — in eval mode
    on ``device`` (CUDA when available, else CPU; ``"meta"`` allocates no weights), with example
    inputs. Raises :class:`TracingError` with a one-line message on any problem."""
    device = str(device or default_device())
    if device not in ("cpu", "meta") and not device.startswith("cuda"):
        raise TracingError(f"unknown device {device!r}: use cpu, cuda or meta")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TracingError("device 'cuda' asked for but CUDA is not available here; use --device cpu or meta")
    on_meta = device == "meta"
    init_kwargs = dict(init_kwargs or {})
    config = None
    weights_dir = None

    if isinstance(model, str):
        model_id = model
        if shipped_configs.has_config(model):
            # overrides go in before construction so derived values follow
            # (T5's feed_forward_proj -> dense_act_fn/is_gated_act)
            config = _config_from_dict({**shipped_configs.load_config_dict(model), **(config_overrides or {})})
        elif os.path.isdir(model):
            cfg_path = os.path.join(model, "config.json")
            if not os.path.isfile(cfg_path):
                raise TracingError(f"directory {model} has no config.json")
            config = _config_from_file(cfg_path, config_overrides)
            if any(os.path.isfile(os.path.join(model, w)) for w in ("model.safetensors", "pytorch_model.bin")):
                weights_dir = model
        elif os.path.isfile(model) and model.endswith(".json"):
            config = _config_from_file(model, config_overrides)
        else:
            check_model_ref(model)  # the one-line error, with the nearest known id
            raise TracingError(f"cannot build a model from {model!r}: not a directory or a config .json file")
        config = _apply_overrides(config, attn_implementation, config_overrides, on_meta)
        cls = _model_class_for(config)
        if weights_dir and not on_meta:
            try:
                instance = cls.from_pretrained(weights_dir, config=config)
            except Exception as exc:
                raise TracingError(
                    f"cannot load weights from {weights_dir}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                ) from None
        else:
            instance = _instantiate(cls, (config,), {}, device)
    elif isinstance(model, type) and issubclass(model, nn.Module):
        cls = model
        model_id = f"{cls.__module__}.{cls.__qualname__}"
        args = tuple(init_args)
        # a transformers-style class taking a config: build one when none is given
        if not args and not init_kwargs and hasattr(cls, "config_class") and cls.config_class is not None:
            config = cls.config_class(**(config_overrides or {}))
            config = _apply_overrides(config, attn_implementation, None, on_meta)
            args = (config,)
        else:
            _check_constructor_args(cls, args, init_kwargs)
            config = next((a for a in args if hasattr(a, "to_dict")), None)
        instance = _instantiate(cls, args, init_kwargs, device)
    elif isinstance(model, nn.Module):
        instance = model
        model_id = type(model).__name__
        config = getattr(model, "config", None)
    else:
        raise TracingError(f"cannot build a model from {type(model).__name__}: give a model id, directory or nn.Module class")

    if not on_meta:
        instance = instance.to(device)
    instance.eval()
    generated = example_inputs is None
    if generated:
        example_inputs = make_example_inputs(instance, config, batch_size=batch_size, seq_len=seq_len, device=device)
        missing = _missing_required_inputs(instance, example_inputs)
        if missing:
            raise TracingError(
                f"forward of {type(instance).__name__} needs inputs adopter cannot generate: "
                f"{', '.join(missing)}; pass them with example_inputs"
            )
    forward_checked = False
    if check_forward and not on_meta:
        _run_forward_check(instance, example_inputs, type(instance).__name__, generated=generated)
        forward_checked = True
    return BuiltModel(
        model=instance,
        example_inputs=example_inputs,
        model_id=model_id,
        config=config,
        device=device,
        source_files=model_source_files(instance),
        forward_checked=forward_checked,
    )


def _config_from_file(path: str, overrides: dict | None = None):
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TracingError(f"cannot read {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise TracingError(f"{path} does not hold a JSON object")
    return _config_from_dict({**data, **(overrides or {})})
