"""``--model`` / ``--model-args`` shared by scan, trace, verify and rewrite: a shipped id or a
config directory, or the user's own ``package.module:Name`` (:mod:`adopter.tracing.user_model`).
Not a command (``adopter.cli.COMMANDS`` lists those)."""

from __future__ import annotations

import re

# package.module:Name, told apart without importing torch (adopter scan stays light without --model)
_USER_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")

USER_MODEL_HELP = (
    "package.module:Name: your own model class (or a factory function returning the model, or (model, "
    "example_inputs)), imported with the working directory on sys.path, so this runs your code; see --model-args"
)
MODEL_HELP = "a shipped model id, a directory holding config.json, or " + USER_MODEL_HELP
MODEL_ARGS_HELP = (
    'with --model package.module:Name: a JSON file {"args": [...], "kwargs": {...}, "inputs": {"x": {"shape": '
    '[2, 3, 32, 32], "dtype": "float32"}}} (every key optional): the class\'s (or factory\'s) arguments and the '
    "forward's example inputs, random tensors of that shape and dtype (integer dtypes: values in [low, high), "
    'default [0, 2); {"value": [...]} gives a tensor\'s values); a factory\'s own inputs are used otherwise; a JSON '
    "object for a parameter annotated with a dataclass (config: ModelArgs) becomes one, field by field"
)

USER_MODEL_EPILOG = """\
your own model (--model package.module:Name):
  The module is imported with the working directory first on sys.path (PYTHONPATH adds others).
  Name is an nn.Module class, built as Name(*args, **kwargs) with --model-args's "args"/"kwargs", or
  a factory function called the same way that returns the model or (model, example_inputs); the
  arguments the factory passed the model class are recorded, and the optimized class is built with
  them. Example inputs: --model-args's "inputs", else the factory's, else generated from the forward
  signature where the names are known (input_ids, pixel_values, ...). A JSON object for a constructor
  parameter annotated with a dataclass (params: ModelArgs) becomes an instance of it; any other config
  object needs a factory. Example model-args file:
    {"kwargs": {"width": 64, "act": "gelu"}, "inputs": {"x": {"shape": [2, 3, 32, 32], "dtype": "float32"}}}
"""


def add_model_args(parser, *, default=None, help_prefix: str = "", user_only: bool = False) -> None:
    """``--model`` (``user_only``: only package.module:Name) and ``--model-args``."""
    text = USER_MODEL_HELP if user_only else MODEL_HELP
    parser.add_argument("--model", metavar="package.module:Name" if user_only else "MODEL", default=default,
                        help=help_prefix + text)
    parser.add_argument("--model-args", metavar="FILE.json", default=None, help=MODEL_ARGS_HELP)


def is_user_ref(ref: str | None) -> bool:
    """``package.module:Name`` (checked without importing anything)."""
    import os

    return bool(ref) and bool(_USER_REF.match(ref)) and not os.path.exists(ref)


def resolve_user_model(args, *, needed: bool = False):
    """The :class:`~adopter.tracing.user_model.UserModel` of ``--model package.module:Name`` (the
    user's module is imported), or None for a shipped id or directory. :class:`UserError` (one
    line, exit 2) for what cannot be imported, found, read or built; ``--model-args`` without a
    ``package.module:Name`` model is one too. ``needed``: a shipped id or directory is an error."""
    from adopter.errors import UserError

    ref = getattr(args, "model", None)
    model_args = getattr(args, "model_args", None)
    if not is_user_ref(ref):
        if model_args:
            raise UserError("--model-args applies only to --model package.module:Name (your own model class)")
        if needed:
            raise UserError(f"--model {ref!r}: expected package.module:Name, the class (or factory) of your own model")
        return None
    try:
        from adopter.tracing.user_model import UserModelError, load_user_model
    except ImportError as exc:
        raise UserError(f"--model needs the tracing extras: {exc}") from None
    try:
        return load_user_model(ref, model_args)
    except UserModelError as exc:
        raise UserError(str(exc)) from None
