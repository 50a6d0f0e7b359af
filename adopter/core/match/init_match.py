"""Init matching: the init pattern against the ``__init__`` bindings of a class (any order)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from adopter.core.dsl import Pattern
from adopter.core.match.core import Bindings, match_node
from adopter.core.structures import ClassInfo, FileStructures, InitBinding


def class_and_bases(structures: FileStructures, cls: ClassInfo) -> Iterator[ClassInfo]:
    """``cls``, then its bases defined in the same file, nearest first (breadth first, each once)."""
    by_name = {c.name: c for c in structures.classes}
    seen: set[str] = set()
    todo = [cls]
    while todo:
        c = todo.pop(0)
        if c.name in seen:
            continue
        seen.add(c.name)
        yield c
        todo.extend(by_name[b.rsplit(".", 1)[-1]] for b in c.bases if b.rsplit(".", 1)[-1] in by_name)


def class_init_bindings(structures: FileStructures, cls: ClassInfo | None) -> tuple[InitBinding, ...]:
    """``__init__`` bindings of ``cls`` followed by those of its bases defined in the same file
    (a subclass that does not rebind an attribute inherits the base's binding)."""
    if cls is None:
        return ()
    out: list[InitBinding] = []
    seen_attrs: set[str] = set()
    for c in class_and_bases(structures, cls):
        attrs_here = set()
        for ib in c.init_bindings:
            if ib.attr not in seen_attrs:
                out.append(ib)
                attrs_here.add(ib.attr)
        seen_attrs |= attrs_here
    return tuple(out)


def match_init(
    pattern: Pattern, bindings_list: Sequence[InitBinding], b: Bindings, aliases: dict[str, str] | None = None
) -> tuple[tuple[InitBinding, ...], Bindings] | None:
    """Match every init pattern node against a distinct ``__init__`` binding (any order)."""
    pnodes = pattern.nodes

    def rec(pi: int, used: tuple[int, ...], b: Bindings):
        if pi == len(pnodes):
            return used, b
        pn = pnodes[pi]
        for j, ib in enumerate(bindings_list):
            if j in used:
                continue
            nb = match_node(pn, ib.layer, b, aliases)
            if nb is not None:
                r = rec(pi + 1, used + (j,), nb)
                if r is not None:
                    return r
        return None

    r = rec(0, (), b)
    if r is None:
        return None
    used, nb = r
    return tuple(bindings_list[j] for j in used), nb
