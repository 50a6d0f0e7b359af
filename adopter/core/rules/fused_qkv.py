"""fused_QKV: three Linear projections of the same input (q, k, v) become one ``FusedQKV`` matmul."""

from __future__ import annotations

import re

from adopter.core.dsl import Var
from adopter.core.match import MatchContext
from adopter.core.rules import Rule
from adopter.core.rules._common import const_text, distinct_modules, kwarg
from adopter.core.rules._source import source_lines
from adopter.core.rules._source_uses import attribute_uses_in_class_family

DSL = """
rule fused_QKV
init:
    torch.nn.Linear($in, $dq) -> $a; torch.nn.Linear($in, $db) -> $b; torch.nn.Linear($in, $dc) -> $c
    => adopter.kernels.FusedQKV($in, $dq, kv_out_features=$db) -> $a
forward:
    torch.nn.Linear@$a($x) -> $ao; torch.nn.Linear@$b($x) -> $bo; torch.nn.Linear@$c($x) -> $co
    => adopter.kernels.FusedQKV@$a($x) -> $ao
"""

DOC = """\
Fuses the query, key and value projections of an attention layer into one matmul. A
match is three ``torch.nn.Linear`` module calls on one control-flow path that read the
very same tensor (same SSA value), whose modules are distinct attributes named as
query, key and value projections (one each; the attribute name contains a token
``q``/``query``/``wq``/``to_q`` etc., likewise for k and v), constructed in
``__init__`` with the same in-features expression and the same ``bias`` setting. The
calls may come in any order. Not a match: cross-attention (k/v read another tensor
than q); an already fused ``qkv``/``c_attn`` projection; Linears of other roles reading
the same input (gate/up projections); projections with different in-features text or
differing ``bias`` (Whisper's bias-free ``k_proj``); a projection module used anywhere else
in the class — another call in the same function (LongT5's side keys ``self.k(global_inputs)``),
the other branch of ``if is_cross_attention`` (k/v of ``encoder_hidden_states``: BROS,
ConvBERT), another method, a subclass in the same file — since ``FusedQKV`` replaces the
three modules."""

_ROLE_TOKENS = {
    "q": {"q", "query", "queries", "wq", "toq", "qproj", "qlin", "qs"},
    "k": {"k", "key", "keys", "wk", "tok", "kproj", "klin", "ks"},
    "v": {"v", "value", "values", "wv", "tov", "vproj", "vlin", "vs"},
}


def projection_role(attr: str) -> str | None:
    """'q', 'k' or 'v' from an attribute name (``self.q_proj`` -> 'q'), None if unclear."""
    last = attr.rsplit(".", 1)[-1].lower()
    tokens = [t for t in re.split(r"[_\d]+", last) if t]
    roles = {role for role, names in _ROLE_TOKENS.items() if any(t in names for t in tokens)}
    if len(roles) == 1:
        return roles.pop()
    return None


def _roles_are_qkv(ctx: MatchContext) -> str | None:
    roles = []
    for name in ("$a", "$b", "$c"):
        v = ctx.binding(name)
        role = projection_role(v.name) if isinstance(v, Var) else None
        if role is None:
            return f"{v} is not named as a query/key/value projection"
        roles.append(role)
    if sorted(roles) != ["k", "q", "v"]:
        return f"projection roles {roles} are not one query, one key and one value"
    return None


def _same_bias(ctx: MatchContext) -> str | None:
    texts = set()
    for ib in ctx.match.init_nodes:
        b = kwarg(ib.layer, "bias", 2)
        texts.add(const_text(b) if b is not None else "True")
    if len(texts) > 1:
        return f"projections differ in bias ({', '.join(sorted(texts))})"
    return None


def _binding_owner(ctx: MatchContext, attr: str) -> str:
    """The class whose ``__init__`` binds ``attr``: the matched class or its nearest in-file base."""
    by_name = {c.name: c for c in ctx.structures.classes}
    todo, seen = [ctx.cls.name], set()
    while todo:
        name = todo.pop(0)
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        if any(ib.attr == attr for ib in by_name[name].init_bindings):
            return name
        todo.extend(b.rsplit(".", 1)[-1] for b in by_name[name].bases)
    return ctx.cls.name


def _class_family(ctx: MatchContext, owner: str) -> list:
    """ClassInfo of ``owner``, its in-file bases (transitively) and its in-file subclasses."""
    by_name = {c.name: c for c in ctx.structures.classes}
    short_bases = {c.name: [b.rsplit(".", 1)[-1] for b in c.bases] for c in ctx.structures.classes}
    family, todo = set(), [owner]
    while todo:  # bases
        name = todo.pop()
        if name in by_name and name not in family:
            family.add(name)
            todo.extend(short_bases[name])
    subclasses, changed = {owner}, True
    while changed:
        changed = False
        for name, bases in short_bases.items():
            if name not in subclasses and any(b in subclasses for b in bases):
                subclasses.add(name)
                changed = True
    return [by_name[n] for n in sorted(family | subclasses) if n in by_name]


def _may_have_other_uses(ctx: MatchContext, attr: str, owner: str) -> bool:
    """Cheap screen with ``ClassInfo.attr_uses`` (lines reading ``self.<attr>``): False when every
    such line of the class family is a matched line holding no more mentions of the attribute
    than matched calls through it. Conservative (comments count, all base methods count); a
    True goes to the exact ``ast`` check."""
    per_line: dict[int, int] = {}
    for mn in ctx.match.nodes:
        module = getattr(mn.node, "module", None)
        if mn.node.span is not None and isinstance(module, Var) and module.name == attr:
            per_line[mn.node.span.line] = per_line.get(mn.node.span.line, 0) + 1
    lines = None
    mention = re.compile(r"\bself\." + re.escape(attr[len("self."):]) + r"(?![A-Za-z_0-9])")
    for cls in _class_family(ctx, owner):
        for line in cls.attr_uses.get(attr, ()):
            if line not in per_line:
                return True
            if lines is None:
                lines = source_lines(ctx.source)
            if line - 1 >= len(lines) or len(mention.findall(lines[line - 1])) > per_line[line]:
                return True
    return False


def _modules_used_only_here(ctx: MatchContext) -> str | None:
    """Each q/k/v module is used (called, read, rebound) only at the matched call sites in every
    class sharing its ``__init__`` binding (the binding class, its in-file subclasses, the
    in-file base methods they inherit): the fused module replaces all three, so any other use
    would lose its module."""
    if ctx.cls is None or ctx.source is None:
        return None
    matched = {(mn.node.span.line, mn.node.span.col) for mn in ctx.match.nodes if mn.node.span is not None}
    for name in ("$a", "$b", "$c"):
        v = ctx.binding(name)
        if not isinstance(v, Var) or not v.name.startswith("self."):
            continue
        owner = _binding_owner(ctx, v.name)
        if not _may_have_other_uses(ctx, v.name, owner):
            continue
        uses = attribute_uses_in_class_family(ctx.source, owner, v.name[len("self."):])
        if uses is None:
            return f"cannot read the uses of {v.name} in class {owner}"
        for line, col, where in uses:
            if (line, col) not in matched:
                return f"{v.name} is also used at line {line} ({where}): fusing would remove the module"
    return None


RULE = Rule(
    name="fused_QKV",
    kernel="adopter.kernels.FusedQKV",
    doc=DOC,
    dsl=DSL,
    preconditions=(distinct_modules("$a", "$b", "$c"), _roles_are_qkv, _same_bias, _modules_used_only_here),
)
