"""What the trace knows that the source may not: the class of every submodule.

``self.bn = norm_layer(c)`` with ``norm_layer`` passed in by a caller, ``self.conv =
create_conv2d(...)`` from another package: the static pass cannot type these attributes (and
does not guess). The built model can: :func:`runtime_type_hints` lists, per class of the scanned
files, the ``torch.nn`` class of each direct child attribute in every instance. Extraction uses
them only for attributes it left unresolved (``extract_source(type_hints=...)``); the matches
they allow are then confirmed against the trace like any other.
"""
from __future__ import annotations

import os
from collections import defaultdict

from torch import nn

from .confirm import _class_file


def _torch_name(cls: type) -> str | None:
    """``torch.nn.BatchNorm2d`` for torch's own layer classes; None for anything else."""
    name = cls.__name__
    return f"torch.nn.{name}" if getattr(nn, name, None) is cls else None


def runtime_type_hints(model: nn.Module, files) -> dict[str, dict[tuple[str, str], tuple[str, ...]]]:
    """``{real path: {(class name, "self.<attr>"): (torch layer types seen, ...)}}`` for the
    classes defined in ``files`` that have instances in ``model``."""
    wanted = {os.path.realpath(str(f)) for f in files}
    seen: dict[str, dict[tuple[str, str], list[str]]] = defaultdict(lambda: defaultdict(list))
    for module in model.modules():
        cls = type(module)
        file = _class_file(cls)
        if file not in wanted:
            continue
        for name, child in module.named_children():
            if not name.isidentifier():
                continue
            t = _torch_name(type(child))
            if t is None:
                continue
            types = seen[file][(cls.__name__, f"self.{name}")]
            if t not in types:
                types.append(t)
    return {f: {k: tuple(v) for k, v in d.items()} for f, d in seen.items()}
