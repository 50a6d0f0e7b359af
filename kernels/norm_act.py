"""Norm+act modules at run time: a ``BatchNorm2d`` subclass whose ``forward`` applies its own
submodules (an activation, a drop) to its batch norm and computes nothing else (timm's
``BatchNormAct2d``). :func:`norm_act_parts` reads the class's ``forward`` *as it is now* (its source,
through :func:`adopter.catalogue.norm_act_form`, the same reader the static analysis uses) and says
which submodules it applies, so ``conv_bn`` can fold the batch norm into the conv and call those
submodules after it. Nothing of the analysed source is trusted: a class whose forward, ``super``
chain or the names its forward reads differ from what the reader accepted is no norm+act module."""
from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import weakref
from typing import Any

import torch.nn.functional as F
from torch import nn

from adopter.catalogue import norm_act_form

__all__ = ["norm_act_parts"]

# objects the reader may meet, by the name it knows them under
_KNOWN = {"torch.nn.functional.batch_norm": F.batch_norm, "torch.nn.BatchNorm2d": nn.BatchNorm2d}
_BN_FORWARD = nn.BatchNorm2d.forward

# forward function -> (its code object, (submodule names or None, ((dotted name, object) read)))
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _resolve(dotted: str, namespace: dict) -> Any:
    head, *rest = dotted.split(".")
    obj = namespace[head] if head in namespace else getattr(builtins, head, None)
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def _read(forward) -> tuple[tuple[str, ...] | None, tuple]:
    try:
        source = textwrap.dedent(inspect.getsource(forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None, ()
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef):
        return None, ()
    namespace = getattr(forward, "__globals__", {})
    read: list[tuple[str, Any]] = []

    def fqn(dotted: str) -> str | None:
        obj = _resolve(dotted, namespace)
        for name, known in _KNOWN.items():
            if obj is known:
                read.append((dotted, known))
                return name
        return None

    return norm_act_form(fdef, fqn), tuple(read)


def norm_act_parts(bn: Any) -> tuple[str, ...] | None:
    """The names of the submodules ``bn``'s class applies after its batch norm (``("drop",
    "act")``), when ``bn`` is a ``BatchNorm2d`` whose class's ``forward`` is such a norm+act forward
    over ``BatchNorm2d``'s own; None otherwise (a plain ``BatchNorm2d`` too). Read once per forward
    function (and its code object); the globals it reads are checked again on every call."""
    cls = type(bn)
    if not isinstance(bn, nn.BatchNorm2d):
        return None
    mro = cls.__mro__
    owner = next((c for c in mro if "forward" in c.__dict__), None)
    if owner is None or owner.__dict__["forward"] is _BN_FORWARD or owner in (nn.BatchNorm2d, nn.modules.batchnorm._BatchNorm):
        return None
    above = next((c for c in mro[mro.index(owner) + 1:] if "forward" in c.__dict__), None)
    if above is None or above.__dict__["forward"] is not _BN_FORWARD:
        return None  # ``super().forward`` is not BatchNorm2d's
    if cls._check_input_dim is not nn.BatchNorm2d._check_input_dim or cls.__call__ is not nn.Module.__call__:
        return None
    forward = owner.__dict__["forward"]
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    hit = _FORMS.get(forward)
    if hit is None or hit[0] is not code:
        hit = (code, _read(forward))
        _FORMS[forward] = hit
    form, read = hit[1]
    if form is None:
        return None
    namespace = forward.__globals__
    if any(_resolve(dotted, namespace) is not obj for dotted, obj in read):
        return None  # (a name the forward reads was bound to something else since)
    return form
