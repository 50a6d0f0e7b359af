"""The user's own model class on the command line: ``--model package.module:Name``.

``Name`` (dotted for a nested class) is looked up in the imported module, with the working
directory first on ``sys.path`` (as ``python -m`` has it), and is either

* an ``nn.Module`` class, built as ``Name(*args, **kwargs)``, or
* a factory function, called as ``Name(*args, **kwargs)``, returning the model or
  ``(model, example_inputs)``; the arguments the factory gave the model class's constructor
  are recorded while it runs, so the optimized class is built the same way.

``--model-args FILE.json`` (optional) holds ``{"args": [...], "kwargs": {...}, "inputs": {...}}``
(every key optional): ``args``/``kwargs`` for the class or factory; ``inputs`` the forward's
keyword arguments, each ``{"shape": [2, 3, 32, 32], "dtype": "float32"}`` (a seeded random
tensor: normal for floating dtypes, integers in ``[low, high)`` — default ``[0, 2)`` — for
integer ones, ``{"value": ...}`` for a given tensor) or a plain JSON value passed as is.
``inputs`` given there win over a factory's. Without inputs, they are generated from the
forward signature where adopter knows the names (``input_ids``, ``pixel_values``...).
A JSON object given for a parameter annotated with a dataclass (``params: ModelArgs``,
``Optional[ModelArgs]``; string annotations resolved in the class's module) becomes an instance
of it, field by field (a field typed by a dataclass likewise); an unknown field is an error.
Any other config object needs a factory.

Every problem is a :class:`UserModelError` (a :class:`TracingError`) with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import sys
import traceback
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .models import DICT_GIVEN_HINT, TracingError, default_device

# what a constructor that failed on a dict argument is told on the command line
DICT_GIVEN_CLI_HINT = (
    "(a JSON object in --model-args becomes a config object only for a parameter annotated with a dataclass; "
    "otherwise give a factory function that builds the model: --model package.module:make_model)"
)

__all__ = [
    "UserModel", "UserModelError", "build_user_model", "cli_wording",
    "is_user_model_ref", "load_user_model", "make_inputs",
]  # fmt: skip

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip
_ARGS_KEYS = ("args", "kwargs", "inputs")
_INPUT_KEYS = {"shape", "dtype", "low", "high", "value"}


class UserModelError(TracingError):
    """A ``--model package.module:Name`` that cannot be imported, found, built or fed (one line)."""


@dataclass
class UserModel:
    """What ``--model package.module:Name`` (and ``--model-args``) resolved to."""

    ref: str
    model_cls: type
    init_args: tuple = ()
    init_kwargs: dict = field(default_factory=dict)
    example_inputs: dict | None = None  # forward keyword arguments (CPU tensors); None: generated
    factory: str = ""  # the factory's qualified name, when one built the model

    @property
    def label(self) -> str:
        return f"{self.model_cls.__module__}.{self.model_cls.__qualname__}"

    def inputs_on(self, device: str | None) -> dict | None:
        """The example inputs moved to ``device`` (None: left where they are)."""
        if self.example_inputs is None or not device or device == "meta":
            return self.example_inputs
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.example_inputs.items()}

    def build_kwargs(self, device: str | None = None) -> dict:
        """Keyword arguments of :func:`adopter.tracing.build_model` for this model (with the class)."""
        return {"init_args": self.init_args, "init_kwargs": dict(self.init_kwargs),
                "example_inputs": self.inputs_on(device)}


def is_user_model_ref(ref: str | None) -> bool:
    """``package.module:Name`` (not an existing path, not a shipped id)."""
    if not ref or ":" not in ref or os.path.exists(ref):
        return False
    module, _, name = ref.partition(":")
    return bool(module) and all(p.isidentifier() for p in module.split(".")) and all(
        p.isidentifier() for p in name.split(".")
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


def _import(module_name: str, ref: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UserModelError(
                f"--model {ref}: cannot import module {module_name!r}: no module named {exc.name!r} "
                f"(imported with {cwd} first on sys.path; set PYTHONPATH for another root)"
            ) from None
        raise UserModelError(f"--model {ref}: importing {module_name} failed: {_first_line(exc)}") from None
    except BaseException as exc:  # the user's module raised while importing (SystemExit included)
        if isinstance(exc, KeyboardInterrupt):
            raise
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {os.path.relpath(where[0].filename)}:{where[0].lineno}" if where else ""
        raise UserModelError(f"--model {ref}: importing {module_name} failed{at}: {_first_line(exc)}") from None


def _lookup(module, name: str, ref: str):
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            candidates = sorted(
                k for k, v in vars(module).items()
                if not k.startswith("_") and ((isinstance(v, type) and issubclass(v, nn.Module)) or inspect.isfunction(v))
                and getattr(v, "__module__", None) == module.__name__
            )  # fmt: skip
            import difflib

            near = difflib.get_close_matches(part, candidates, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            listed = ", ".join(candidates[:12]) or "none"
            raise UserModelError(
                f"--model {ref}: module {module.__name__} has no {part!r}; {hint}"
                f"its model classes and functions: {listed}"
            )
        obj = getattr(obj, part)
    return obj


def _read_args_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise UserModelError(f"--model-args {path}: no such file") from None
    except OSError as exc:
        raise UserModelError(f"--model-args {path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserModelError(f"--model-args {path}: not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise UserModelError(f"--model-args {path}: not UTF-8 text: {exc.reason}") from None
    if not isinstance(data, dict):
        raise UserModelError(f'--model-args {path}: expected a JSON object {{"args": [...], "kwargs": {{...}}, '
                             f'"inputs": {{...}}}}, got {type(data).__name__}')
    unknown = sorted(set(data) - set(_ARGS_KEYS))
    if unknown:
        raise UserModelError(f"--model-args {path}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"expected {', '.join(_ARGS_KEYS)}")
    for key, kind in (("args", list), ("kwargs", dict), ("inputs", dict)):
        if key in data and not isinstance(data[key], kind):
            raise UserModelError(f"--model-args {path}: {key!r} must be a JSON {'array' if kind is list else 'object'}")
    return data


def make_input(name: str, spec: Any, generator: torch.Generator, where: str = "inputs") -> Any:
    """One example input from its JSON spec (see the module docstring)."""
    if not isinstance(spec, dict):
        return torch.tensor(spec) if isinstance(spec, list) else spec
    unknown = sorted(set(spec) - _INPUT_KEYS)
    if unknown:
        raise UserModelError(f"{where}: input {name!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"expected shape, dtype, low, high or value")
    dtype_name = spec.get("dtype", "float32")
    dtype = _DTYPES.get(str(dtype_name).removeprefix("torch."))
    if dtype is None:
        raise UserModelError(f"{where}: input {name!r}: unknown dtype {dtype_name!r}; one of {', '.join(_DTYPES)}")
    if "value" in spec:
        try:
            return torch.tensor(spec["value"], dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UserModelError(f"{where}: input {name!r}: bad value: {_first_line(exc)}") from None
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise UserModelError(f"{where}: input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}")
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    low, high = spec.get("low", 0), spec.get("high", 2)
    if not (isinstance(low, int) and isinstance(high, int) and high > low):
        raise UserModelError(f"{where}: input {name!r}: need integers low < high, got low={low!r} high={high!r}")
    return torch.randint(low, high, shape, generator=generator, dtype=dtype)


def make_inputs(specs: dict, where: str = "inputs") -> dict:
    generator = torch.Generator().manual_seed(0)
    return {name: make_input(name, spec, generator, where) for name, spec in specs.items()}


@contextlib.contextmanager
def _recording_constructions():
    """``{id(module): (module, args, kwargs)}``: the arguments of the first ``__init__`` that ran
    for each ``nn.Module`` constructed inside (the class's own, called by ``type.__call__`` with
    the constructor's arguments), seen by a profile hook as each call starts."""
    records: dict[int, tuple[nn.Module, tuple, dict]] = {}

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name != "__init__" or not frame.f_code.co_argcount:
            return
        code = frame.f_code
        values = frame.f_locals
        module = values.get(code.co_varnames[0])
        if not isinstance(module, nn.Module) or id(module) in records:
            return
        names = code.co_varnames
        positional = code.co_argcount
        keyword_only = code.co_kwonlyargcount
        args = [values[n] for n in names[1:positional]]
        kwargs = {n: values[n] for n in names[positional:positional + keyword_only]}
        extra = positional + keyword_only
        if code.co_flags & inspect.CO_VARARGS:
            args += list(values[names[extra]])
            extra += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            kwargs.update(values[names[extra]])
        records[id(module)] = (module, tuple(args), kwargs)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield records
    finally:
        sys.setprofile(previous)


def _as_keyword_inputs(model_cls: type, value, where: str) -> dict:
    """A factory's example inputs (a dict, a tensor, or a tuple/list of them) as forward keywords."""
    if isinstance(value, dict):
        return dict(value)
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    params = [p for p in forward_parameters_of(model_cls) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) < len(values):
        raise UserModelError(f"{where}: {model_cls.__name__}.forward takes {len(params)} positional input(s), "
                             f"the example inputs have {len(values)}; return a dict of keyword arguments")
    return {p.name: v for p, v in zip(params, values)}


def forward_parameters_of(model_cls: type) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(model_cls.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _call_factory(factory, args: list, kwargs: dict, ref: str):
    with _recording_constructions() as records:
        try:
            result = factory(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise UserModelError(f"--model {ref}: the factory failed: {_first_line(exc)}") from None
    inputs = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, inputs = result
    if not isinstance(result, nn.Module):
        raise UserModelError(f"--model {ref}: the factory returned {type(result).__name__}, "
                             "expected an nn.Module or (nn.Module, example_inputs)")
    record = records.get(id(result))
    if record is None or record[0] is not result or type(result) is not type(record[0]):
        raise UserModelError(
            f"--model {ref}: cannot tell how the factory constructed {type(result).__name__} (it returned a copy or "
            "a module it did not construct); name the class and give its arguments in --model-args instead"
        )
    return type(result), record[1], dict(record[2]), inputs


def _annotation_dataclass(annotation) -> type | None:
    """The dataclass an annotation names (``ModelArgs``, ``Optional[ModelArgs]``, ``ModelArgs | None``)."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation
    options = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(options) == 1 and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _annotation_dataclass(options[0])
    return None


def _type_hints(obj) -> dict:
    """Resolved annotations of a function or dataclass (string annotations evaluated in their
    module); {} where they cannot be resolved."""
    try:
        return typing.get_type_hints(obj)
    except Exception:  # noqa: BLE001 - a name the annotations use is not importable: no hints
        return {}


def _as_dataclass(cls: type, value: dict, where: str):
    """``cls(**value)`` with a JSON object for each field typed by a dataclass built the same way."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise UserModelError(f"{where}: {cls.__name__} has no field(s) {', '.join(map(repr, unknown))}; its fields: "
                             f"{', '.join(fields) or 'none'}")
    hints = _type_hints(cls)
    kwargs = {}
    for name, item in value.items():
        inner = _annotation_dataclass(hints.get(name))
        kwargs[name] = _as_dataclass(inner, item, f"{where}.{name}") if inner and isinstance(item, dict) else item
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the dataclass's own checks (__post_init__, missing fields)
        raise UserModelError(f"{where}: {cls.__name__}(...) failed: {_first_line(exc)}") from None


def _dataclass_arguments(target, args: list, kwargs: dict, where: str) -> tuple[list, dict]:
    """The JSON objects given for parameters of ``target`` (a class's ``__init__`` or a factory)
    annotated with a dataclass (``config: ModelArgs``), as instances of it."""
    function = target.__init__ if isinstance(target, type) else target
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return args, kwargs
    if isinstance(target, type) and params:
        params = params[1:]  # self
    hints = _type_hints(function)

    def convert(param, value, label):
        cls = _annotation_dataclass(hints.get(param.name)) if param is not None else None
        return _as_dataclass(cls, value, f"{where}: {label}") if cls is not None and isinstance(value, dict) else value

    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    args = [convert(positional[i] if i < len(positional) else None, v, f"args[{i}]") for i, v in enumerate(args)]
    kwargs = {k: convert(by_name.get(k), v, f"kwargs.{k}") for k, v in kwargs.items()}
    return args, kwargs


def load_user_model(ref: str, args_file: str | None = None) -> UserModel:
    """Resolve ``package.module:Name`` (see the module docstring); imports the user's module."""
    if not is_user_model_ref(ref):
        raise UserModelError(f"--model {ref!r}: expected package.module:Name (a module path, a colon, a class "
                             "or function name)")
    module_name, _, name = ref.partition(":")
    data = _read_args_file(args_file) if args_file else {}
    module = _import(module_name, ref)
    obj = _lookup(module, name, ref)
    args, kwargs = list(data.get("args", [])), dict(data.get("kwargs", {}))
    where = f"--model-args {args_file}" if args_file else f"--model {ref}"
    inputs = make_inputs(data["inputs"], where) if "inputs" in data else None
    if isinstance(obj, type) and not issubclass(obj, nn.Module):
        raise UserModelError(f"--model {ref}: {name} is a class but not an nn.Module")
    if not callable(obj):
        raise UserModelError(f"--model {ref}: {name} is not an nn.Module class or a factory function (it is {type(obj).__name__})")
    # a JSON object for a parameter annotated with a dataclass (``config: ModelArgs``) builds one
    args, kwargs = _dataclass_arguments(obj, args, kwargs, where)
    if isinstance(obj, type):
        return UserModel(ref, obj, tuple(args), kwargs, inputs)
    model_cls, init_args, init_kwargs, returned = _call_factory(obj, args, kwargs, ref)
    if inputs is None and returned is not None:
        inputs = _as_keyword_inputs(model_cls, returned, f"--model {ref}")
    return UserModel(ref, model_cls, tuple(init_args), init_kwargs, inputs, factory=f"{module_name}.{name}")


def cli_wording(message: str) -> str:
    """A build/optimize message naming the Python API's arguments, in the CLI's words."""
    return (message.replace("with example_inputs", 'in --model-args {"inputs": {...}}')
            .replace("(pass them with init_args=... / init_kwargs=...)", '(give them in --model-args {"kwargs": {...}})')
            .replace(DICT_GIVEN_HINT, DICT_GIVEN_CLI_HINT))


def build_user_model(user: UserModel, device: str | None = None, **kwargs):
    """:func:`adopter.tracing.build_model` of the user's class, with its arguments and inputs;
    :class:`UserModelError` in the CLI's words when it cannot be built or fed."""
    from .models import build_model

    device = device or default_device()
    try:
        return build_model(user.model_cls, device=device, **user.build_kwargs(device), **kwargs)
    except TracingError as exc:
        raise UserModelError(f"--model {user.ref}: {cli_wording(str(exc))}") from None
