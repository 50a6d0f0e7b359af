"""Shared analysis for the three attention rules (BertSelfAttention, T5Attention, GPT2Attention).

The forward pattern is the eager attention core — ``scores = q @ kᵀ``, ``softmax``,
``probs @ v`` — in its ``torch.matmul``/``@`` spellings; the rest is data flow checked here:

* scores reach the softmax input only through element-wise score ops (scale ``*``/``/``,
  mask ``+``/``-``, ``torch.where``/``masked_fill``, dtype casts);
* the softmax output reaches the second matmul only through dropout, casts or a head-mask
  multiply;
* the key operand is a transpose of a key tensor;
* q, k and v are traced back (through view/reshape/transpose/permute/contiguous/casts,
  cache concatenation, and helper functions inlined by extraction) to their projection.

The result (:class:`AttentionFacts`) says how q/k/v were produced (separate Linears, one
fused projection split in three, or something else such as rotary embeddings or
``repeat_kv``) and whether a position bias is added to the scores: each rule accepts one
combination, so the three rules never claim the same computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adopter.core.dsl import Layer, Node, TensorOp, Value, Var
from adopter.core.match import MatchContext, same_value
from adopter.core.match.context import NotACandidate
from adopter.core.rules._common import producer

MATMULS = ("torch.matmul", "torch.Tensor.matmul")
SOFTMAXES = ("torch.nn.functional.softmax", "torch.softmax", "torch.Tensor.softmax", "torch.nn.Softmax")


def attention_dsl(name: str) -> str:
    """Forward-only variants of the attention core for rule ``name`` (matmul spelled as a call or ``@``)."""
    mm = "|".join(MATMULS)
    sm = "|".join(SOFTMAXES)
    first = (f"{mm}($q, $kt) -> $scores", "$q @ $kt -> $scores")
    second = (f"{mm}($probs, $v) -> $out", "$probs @ $v -> $out")
    blocks = []
    for a in first:
        for b in second:
            blocks.append(
                f"rule {name}\nforward:\n    {a};\n    {sm}($logits) -> $weights;\n    {b}\n"
            )
    return "\n".join(blocks)


# Ops a tensor may pass through between a projection and the attention core.
RESHAPE_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "to", "float", "half", "bfloat16", "type",
    "type_as", "clone", "view_as", "reshape_as", "unflatten", "squeeze", "unsqueeze", "flatten",
    "expand", "detach",
}
SPLIT_METHODS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
CONCAT = {"torch.cat", "torch.concat", "torch.concatenate"}
PROJECTIONS = {"torch.nn.Linear", "transformers.pytorch_utils.Conv1D", "transformers.modeling_utils.Conv1D"}

# Ops allowed between the score matmul and the softmax input.
SCORE_METHODS = {"to", "float", "half", "type", "type_as", "masked_fill", "masked_fill_", "clamp", "clamp_min",
                 "contiguous", "view", "reshape", "mul", "div", "add", "mul_", "div_", "add_", "double"}
SCORE_FUNCS = {"torch.where", "torch.masked_fill", "torch.clamp", "torch.mul", "torch.div", "torch.add"}
SCORE_OPS = {"+", "-", "*", "/"}
# Ops allowed between softmax output and the second matmul.
PROB_METHODS = {"to", "float", "half", "type", "type_as", "contiguous", "masked_fill", "view", "reshape"}
PROB_FUNCS = {"torch.nn.functional.dropout", "torch.dropout", "torch.nn.Dropout"}


def _method(n: Node) -> str | None:
    if isinstance(n, Layer) and n.type.startswith("torch.Tensor."):
        return n.type[len("torch.Tensor."):]
    return None


def _var_args(n: Node) -> list[Var]:
    return [a.value for a in getattr(n, "args", ()) if isinstance(a.value, Var)]


@dataclass
class Source:
    """Where an attention operand comes from."""

    kind: str  # "linear" | "split" | "rotary" | "repeat_kv" | "input" | "other"
    projection: Node | None = None
    via: list[Node] = field(default_factory=list)

    @property
    def module(self) -> Value | None:
        return getattr(self.projection, "module", None)


def producer_or_phi(nodes, v: Value) -> Node | None:
    """Producer of ``v``; for a version no node on the path produces (an SSA merge of
    branches without DL nodes, e.g. a KV-cache update), the producer of the latest lower
    version of the same name that is produced on the path."""
    n = producer(nodes, v)
    if n is not None or not isinstance(v, Var) or v.version == 0:
        return n
    for version in range(v.version - 1, 0, -1):
        n = producer(nodes, Var(v.name, version))
        if n is not None:
            return n
    return None


def is_projection(n: Node) -> bool:
    return (
        isinstance(n, Layer)
        and n.module is not None
        and (n.type in PROJECTIONS or n.type.rsplit(".", 1)[-1] == "Conv1D")
    )


def namesake(ctx: MatchContext, rule_name: str) -> str | None:
    """The attention rules target the class they are named after (and classes whose
    name ends with it), as the kernel policies they come from do. Any other attention is no
    candidate of theirs (not reported as rejected: the sdpa_attention rule covers written-out
    attention in every other class); a namesake class that differs stays a rejected match."""
    cls = ctx.match.class_name or ""
    if not cls.endswith(rule_name):
        return NotACandidate(f"class {cls or '(none)'} is not a {rule_name} class")
    return None


def trace_operand(nodes, v: Value, max_steps: int = 24) -> Source:
    via: list[Node] = []
    split = False
    current = v
    for _ in range(max_steps):
        n = producer_or_phi(nodes, current)
        if n is None:
            return Source("input", None, via)
        if isinstance(n, Layer):
            if is_projection(n):
                return Source("split" if split else "linear", n, via)
            low = n.type.lower()
            if "rotary" in low or "rope" in low:
                return Source("rotary", n, via)
            if low.endswith("repeat_kv") or "repeat_kv" in low:
                return Source("repeat_kv", n, via)
            m = _method(n)
            if m in SPLIT_METHODS or n.type in ("torch.split", "torch.chunk", "torch.unbind"):
                split = True
            elif m in RESHAPE_METHODS or n.type in CONCAT or n.type in ("operator.getitem", "getitem"):
                pass
            else:
                return Source("other", n, via)
        elif isinstance(n, TensorOp):
            return Source("other", n, via)
        via.append(n)
        args = [a for a in _var_args(n) if producer_or_phi(nodes, a) is not None]
        if n.type in CONCAT and len(args) > 1:  # type: ignore[union-attr]
            args = args[-1:]  # torch.cat([past, new]): follow the new part
        if not args:
            return Source("input", None, via)
        current = args[0]
    return Source("other", None, via)


def _chain(nodes, src: Value, dst: Value, ok, max_steps: int = 16) -> list[Node] | None:
    """Nodes carrying ``src`` to ``dst`` (walking producers back from ``dst``), each accepted by ``ok``."""
    if not isinstance(src, Var) or not isinstance(dst, Var):
        return None
    chain: list[Node] = []
    frontier = [dst]
    seen = set()
    steps = 0
    while frontier and steps < max_steps * 4:
        steps += 1
        cur = frontier.pop()
        if same_value(cur, src):
            return list(reversed(chain))
        if (cur.name, cur.version) in seen:
            continue
        seen.add((cur.name, cur.version))
        n = producer(nodes, cur)
        if n is None or not ok(n):
            continue
        chain.append(n)
        frontier.extend(_var_args(n))
    return None


def _score_op_ok(n: Node) -> bool:
    if isinstance(n, TensorOp):
        return n.op in SCORE_OPS
    if isinstance(n, Layer):
        return _method(n) in SCORE_METHODS or n.type in SCORE_FUNCS
    return False


def _prob_op_ok(n: Node) -> bool:
    if isinstance(n, TensorOp):
        return n.op == "*"  # head mask
    if isinstance(n, Layer):
        return _method(n) in PROB_METHODS or n.type in PROB_FUNCS
    return False


@dataclass
class AttentionFacts:
    q: Source
    k: Source
    v: Source
    score_ops: list[Node]
    prob_ops: list[Node]
    position_bias: bool  # on this path
    position_bias_in_function: bool  # on any path of the entry function (T5 skips it when None)
    rotary: str | None  # what rotary / repeat_kv code runs before the scores, if any

    def bias_adds(self) -> list[Node]:
        """The score ops of this path that add a position bias (``scores + position_bias``)."""
        return [n for n in self.score_ops if _is_bias_add(n)]

    def projections(self) -> list[Node]:
        out = []
        for s in (self.q, self.k, self.v):
            if s.projection is not None and s.projection not in out:
                out.append(s.projection)
        return out


def _is_bias_name(v: Value) -> bool:
    name = v.name if isinstance(v, Var) else getattr(v, "text", "")
    last = name.rsplit(".", 1)[-1].lower()
    return "position_bias" in last or last in ("pos_bias", "rel_pos_bias", "relative_position_bias")


def _is_bias_add(n: Node) -> bool:
    return isinstance(n, TensorOp) and n.op == "+" and any(_is_bias_name(a.value) for a in n.args)


_ROTARY_MARKERS = ("rotary", "rope", "repeat_kv", "rotate_half", "apply_rotary")


def _rotary_before(ctx: MatchContext, end: int) -> str | None:
    """Name of rotary-embedding / repeat_kv code among the path's nodes before ``end``."""
    for n in ctx.path.nodes[:end]:
        names = [getattr(n, "type", "")]
        if n.span is not None:
            names.append(n.span.function)
        for name in names:
            low = name.lower()
            if any(m in low for m in _ROTARY_MARKERS):
                return name
    return None


_FN_BIAS: dict[int, tuple[object, bool]] = {}


def _function_has_position_bias(ctx: MatchContext) -> bool:
    hit = _FN_BIAS.get(id(ctx.function))
    if hit is not None and hit[0] is ctx.function:
        return hit[1]
    seen: set[int] = set()
    found = False
    for p in ctx.function.paths:
        for n in p.nodes:
            if id(n) in seen:
                continue
            seen.add(id(n))
            if _is_bias_add(n):
                found = True
                break
        if found:
            break
    if len(_FN_BIAS) > 4096:
        _FN_BIAS.clear()
    _FN_BIAS[id(ctx.function)] = (ctx.function, found)
    return found


def analyse(ctx: MatchContext) -> AttentionFacts | str:
    """Facts about the matched attention core, or a reason string when it is not one."""
    cached = ctx.extra.get("attention")
    if cached is not None:
        return cached
    nodes = ctx.producers()
    b = ctx.match.bindings
    result: AttentionFacts | str
    score_ops = _chain(nodes, b["$scores"], b["$logits"], _score_op_ok)
    prob_ops = _chain(nodes, b["$weights"], b["$probs"], _prob_op_ok)
    kt = producer_or_phi(nodes, b["$kt"])
    if score_ops is None:
        result = "the softmax input is not computed from the q·kᵀ scores by element-wise ops"
    elif prob_ops is None:
        result = "the softmax output does not reach the second matmul through dropout/casts only"
    elif not (isinstance(kt, Layer) and _method(kt) in ("transpose", "permute", "t")):
        result = "the key operand is not a transposed key tensor"
    else:
        k_var = next(iter(_var_args(kt)), None)
        position_bias = any(_is_bias_add(n) for n in score_ops)
        result = AttentionFacts(
            q=trace_operand(nodes, b["$q"]),
            k=trace_operand(nodes, k_var) if k_var is not None else Source("other"),
            v=trace_operand(nodes, b["$v"]),
            score_ops=score_ops,
            prob_ops=prob_ops,
            position_bias=position_bias,
            position_bias_in_function=position_bias or _function_has_position_bias(ctx),
            rotary=_rotary_before(ctx, ctx.node_indices[0]),
        )
    ctx.extra["attention"] = result
    return result


def describe(src: Source) -> str:
    if src.kind in ("linear", "split"):
        return f"{src.kind} projection {src.module}"
    if src.projection is not None and isinstance(src.projection, Layer):
        return f"{src.kind} ({src.projection.type})"
    return src.kind


def namesake_facts(ctx: MatchContext, rule_name: str) -> AttentionFacts | str:
    """The checks every attention rule starts with: the class is the rule's namesake, the
    core analyses, and no rotary embedding / ``repeat_kv`` code runs before the scores.
    Returns the facts, or the reason the match is rejected."""
    reason = namesake(ctx, rule_name)
    if reason:
        return reason
    facts = analyse(ctx)
    if isinstance(facts, str):
        return facts
    if facts.rotary:
        return f"rotary embedding / repeat_kv code ({facts.rotary}) runs before the scores"
    return facts


def separate_projections_reason(facts: AttentionFacts) -> str | None:
    """q, k and v must each come from its own Linear projection (or straight from an input)."""
    for role, src in (("query", facts.q), ("key", facts.k), ("value", facts.v)):
        if src.kind not in ("linear", "input"):
            return f"{role} comes from {describe(src)}, not a Linear projection"
    mods = [s.module for s in (facts.q, facts.k, facts.v) if s.kind == "linear"]
    if any(same_value(a, b) for i, a in enumerate(mods) for b in mods[i + 1:]):
        return "q, k and v do not come from three distinct projections"
    return None
