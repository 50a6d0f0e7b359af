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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from torch import nn

from adopter.core.source_file import SourceReadError, read_source
from adopter.core.structures import Match

from .confirm import _class_file, confirm_matches


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


def runtime_reach(
    model: nn.Module,
    example_inputs,
    matches: Sequence[Match],
    confirmed: Sequence[Match],
    files: Iterable[str],
    rules: Sequence,
    *,
    texts: dict[str, str] | None = None,
    confirm: Callable[..., list[Match]] | None = None,
) -> list[Match]:
    """``confirmed`` plus the matches the source alone could not type, found with the submodule
    classes of ``model`` (:func:`runtime_type_hints`) and confirmed against the trace like the
    others; the ``runtime-only`` reports those matches cover are dropped.

    ``matches``: the static matches already confirmed (not looked for again); ``texts``: the
    files' decoded text by real path when the caller has it (else read as UTF-8); ``confirm``:
    ``(model, inputs, matches, rules) -> matches`` (default :func:`confirm_matches`)."""
    from adopter.core.scan import scan_source

    files = [os.path.realpath(str(f)) for f in files]
    hints = runtime_type_hints(model, files)
    if not hints:
        return list(confirmed)
    def key(m: Match) -> tuple:  # the same match whichever spelling of its file's path
        return (m.rule, os.path.realpath(m.file), *m.key()[2:])

    known = {key(m) for m in matches}
    extra: list[Match] = []
    for path in files:
        file_hints = hints.get(path)
        if not file_hints:
            continue
        try:
            text = (texts or {}).get(path)
            if text is None:
                text = read_source(path).text
            found = scan_source(text, path, rules, type_hints=file_hints)
        except (SourceReadError, SyntaxError, ValueError):
            continue
        extra += [m for m in found if key(m) not in known and m.status in ("static", "conditional")]
    if not extra:
        return list(confirmed)
    if confirm is None:
        checked = confirm_matches(model, example_inputs, extra, rules=rules, runtime_only=False)
    else:
        checked = [m for m in confirm(model, example_inputs, extra, rules) if m.status != "runtime-only"]
    new = [replace(m, reason=f"{m.reason}; layer types from the trace" if m.reason else "layer types from the trace")
           for m in checked]
    lines = {(m.rule, os.path.realpath(m.file), line) for m in new if m.status == "confirmed" for line in m.lines}
    kept = [
        m for m in confirmed
        if not (m.status == "runtime-only" and any((m.rule, os.path.realpath(m.file), ln) in lines for ln in m.lines))
    ]
    return kept + new
