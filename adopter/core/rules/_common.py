"""Precondition helpers shared by the rule modules."""

from __future__ import annotations

from collections.abc import Callable

from adopter.core.dsl import Const, Layer, Node, TensorOp, Value, Var
from adopter.core.match import MatchContext, reads, same_value, uses_outside
from adopter.core.match.context import Producers
from adopter.core.match.source_uses import escaping_read
from adopter.core.rule import Runtime, RuntimeStep

Precondition = Callable[[MatchContext], "str | None"]


def _show(v: Value | None) -> str:
    return str(v) if v is not None else "?"


def intermediates_unused(*names: str) -> Precondition:
    """The values bound to ``names`` (outputs inside the matched span) are read by no
    node outside the match: fusing would otherwise remove a value still needed."""

    def check(ctx: MatchContext) -> str | None:
        matched = [mn.node for mn in ctx.match.nodes]
        for name in names:
            v = ctx.binding(name)
            if v is None:
                continue
            others = uses_outside(ctx, v)
            if others:
                line = others[0].span.line if others[0].span is not None else "?"
                return f"intermediate {_show(v)} ({name}) is also used at line {line}"
            prod = next((n for n in matched if getattr(n, "output", None) == v), None)
            if prod is not None:
                line = escaping_read(ctx.source, prod, v, matched)
                if line is not None:
                    return f"intermediate {_show(v)} ({name}) is also read at line {line}"
        return None

    check.__name__ = f"intermediates_unused({', '.join(names)})"
    return check


def distinct_modules(*names: str) -> Precondition:
    def check(ctx: MatchContext) -> str | None:
        seen = []
        for name in names:
            v = ctx.binding(name)
            if any(same_value(v, s) for s in seen):
                return f"{name} is the same module as another matched layer"
            seen.append(v)
        return None

    check.__name__ = f"distinct_modules({', '.join(names)})"
    return check


def const_text(v: Value | None) -> str | None:
    if isinstance(v, Const):
        return v.text
    if isinstance(v, Var) and not v.is_abstract:
        return v.name
    return None


def kwarg(node: Node, name: str, position: int | None = None) -> Value | None:
    """Argument ``name`` of a call (by keyword, or at ``position`` when passed positionally)."""
    args = getattr(node, "args", ())
    for a in args:
        if a.keyword == name:
            return a.value
    if position is not None:
        pos = [a for a in args if a.keyword is None]
        if position < len(pos):
            return pos[position].value
    return None


def producer(nodes, v: Value) -> Node | None:
    """The node whose output is ``v`` (SSA: at most one per path). ``nodes`` is a path's
    node list or its producer map (:meth:`MatchContext.producers`)."""
    if not isinstance(v, Var):
        return None
    if isinstance(nodes, (dict, Producers)):
        return nodes.get((v.name, v.version))
    for n in nodes:
        out = getattr(n, "output", None)
        if out is not None and same_value(out, v):
            return n
    return None


def derives(
    nodes: list[Node],
    src: Value,
    dst: Value,
    allowed: Callable[[Node], bool],
    max_steps: int = 12,
) -> list[Node] | None:
    """Chain of nodes (each allowed by ``allowed``) carrying ``src`` to ``dst`` along the path,
    or None. ``src == dst`` gives ``[]``."""
    if not isinstance(src, Var) or not isinstance(dst, Var):
        return None
    if same_value(src, dst):
        return []
    # walk backwards from dst through producers
    chain: list[Node] = []
    current = dst
    for _ in range(max_steps):
        n = producer(nodes, current)
        if n is None or not allowed(n):
            return None
        chain.append(n)
        if reads(n, src):
            return list(reversed(chain))
        # follow the first variable argument that is itself produced on the path
        nxt = None
        for a in getattr(n, "args", ()):
            if isinstance(a.value, Var) and producer(nodes, a.value) is not None:
                nxt = a.value
                break
        if nxt is None:
            return None
        current = nxt
    return None


def is_layer(node: Node, *types: str) -> bool:
    return isinstance(node, Layer) and node.type in types


def is_op(node: Node, *ops: str) -> bool:
    return isinstance(node, TensorOp) and node.op in ops


# ---------------------------------------------------------------- runtime (trace) helpers

# Qualified names of the torch layer classes the rules' runtime parts talk about.
DROPOUT = "torch.nn.modules.dropout.Dropout"
LAYER_NORM = "torch.nn.modules.normalization.LayerNorm"
LINEAR = "torch.nn.modules.linear.Linear"
CONV2D = "torch.nn.modules.conv.Conv2d"
BATCH_NORM_1D = "torch.nn.modules.batchnorm.BatchNorm1d"
BATCH_NORM_2D = "torch.nn.modules.batchnorm.BatchNorm2d"


def self_attr_path(var) -> str | None:
    """``self.encoder.layers[2]`` -> ``encoder.layers.2``; None if not an attribute of self."""
    name = getattr(var, "name", None)
    if not isinstance(name, str) or not name.startswith("self."):
        return None
    return name[len("self."):].replace("[", ".").replace("]", "")


def first_of(modules, cls):
    return next((m for m in modules if isinstance(m, cls)), None)


def layer_pair_runtime(first: str, second: str, features: str):
    """Runtime part of a ``second(first(x))`` layer-pair rule (Conv2d+BatchNorm2d,
    Linear+BatchNorm1d), from the two layers' qualified class names: both layers that run are
    of those classes and the norm's ``num_features`` equals ``first.<features>``; the pair is the
    runtime sequence; both layers stay whole in a symbolic trace."""
    first_name, second_name = first.rsplit(".", 1)[-1], second.rsplit(".", 1)[-1]

    def check(site):
        from torch import nn

        first_mod = first_of(site.modules, getattr(nn, first_name))
        second_mod = first_of(site.modules, getattr(nn, second_name))
        if first_mod is None or second_mod is None:
            return f"the layers that run are not nn.{first_name} and nn.{second_name}", ""
        width = getattr(first_mod, features)
        in_width = getattr(first_mod, "in_" + features.split("_", 1)[1])
        if second_mod.num_features != width:
            return f"{second_name}({second_mod.num_features}) does not fit {first_name} {features}={width}", ""
        return None, f"{first_name}({in_width}->{width}) + {second_name}({second_mod.num_features})"

    return Runtime(
        check=check,
        sequence=(
            RuntimeStep(f"torch.nn.{first_name}", module_types=(first,)),
            RuntimeStep(f"torch.nn.{second_name}", module_types=(second,)),
        ),
        leaf_modules=(first, second),
    )
