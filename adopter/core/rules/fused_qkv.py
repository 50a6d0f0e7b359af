"""fused_QKV: three Linear projections of the same input (q, k, v) run as one matmul.

Rewrite (the codemod below), forward only — ``__init__`` and the three modules stay:
    q = self.query(x); k = self.key(x); v = self.value(x)
 => q, k, v = qkv(self.query, self.key, self.value, x)
  or, when the projections are used inside larger expressions
    (``self.query(x).view(...).transpose(1, 2)``):
    query_output, key_output, value_output = qkv(self.query, self.key, self.value, x)   # inserted before
    ... query_output.view(...).transpose(1, 2) ...

``adopter.kernels.qkv`` concatenates the three weights at run time (cached while no gradient
flows) when they are plain ``nn.Linear`` with one input size and matching biases, and calls the
three modules otherwise; parameters and state-dict keys are the original ones.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache

from adopter.core.codemod.base import (
    Codemod,
    arg_text,
    fresh_local,
    kernel_name,
    match_function,
    matched_exprs,
    module_handle,
    pos,
)
from adopter.core.codemod.context import (
    FileContext,
    Skip,
    is_self_attr,
    loads,
    simple_assign_target,
    stores,
)
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, StatementEdit
from adopter.core.dsl import Var
from adopter.core.match import MatchContext
from adopter.core.match.source import parse_file, source_lines
from adopter.core.match.source_uses import attribute_uses_in_class_family
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules._common import LINEAR, const_text, distinct_modules, kwarg
from adopter.core.structures import Match
from adopter.core.syntax import per_file, walk

DSL = """
rule fused_QKV
init:
    torch.nn.Linear($in, $dq) -> $a; torch.nn.Linear($in, $db) -> $b; torch.nn.Linear($in, $dc) -> $c
forward:
    torch.nn.Linear@$a($x) -> $ao; torch.nn.Linear@$b($x) -> $bo; torch.nn.Linear@$c($x) -> $co
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
ConvBERT), another method, a subclass in the same file (kept out although the guarded kernel
would leave those uses intact: a projection with other uses is rarely a plain attention
projection) — unless that method calls the three projections once each on one input, another
attention over the same projections (a subclass's SDPA forward): that is a QKV site too. A use that only (re)initialises a projection's parameters does not count
(``nn.init.f(self.wq.weight)``, ``self.wq.bias.data.zero_()``, ``self.wq.reset_parameters()``, or
``for lin in (self.wq, self.wk, self.wv): nn.init.f(lin.weight)``): the kernel reads the current
weights at every call. Grouped-query projections (k/v narrower than q) match: the kernel splits
the fused output by each projection's own out-features. At run time the kernel fuses only three plain ``nn.Linear`` with one input size and
matching biases; anything else runs the three modules."""

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
    others: dict[str, list[tuple[str, int, int]]] = {}  # Class.method -> (attr, line, col) of its uses
    attrs = []
    for name in ("$a", "$b", "$c"):
        v = ctx.binding(name)
        if not isinstance(v, Var) or not v.name.startswith("self."):
            continue
        attrs.append(v.name[len("self."):])
        owner = _binding_owner(ctx, v.name)
        if not _may_have_other_uses(ctx, v.name, owner):
            continue
        uses = attribute_uses_in_class_family(ctx.source, owner, v.name[len("self."):])
        if uses is None:
            return f"cannot read the uses of {v.name} in class {owner}"
        for line, col, where in uses:
            if (line, col) not in matched and not _initialisation_use(ctx.source, line, col):
                others.setdefault(where, []).append((v.name, line, col))
    for where, uses in sorted(others.items(), key=lambda kv: kv[1][0][1:]):
        if not _projects_all_three(ctx.source, attrs, uses):
            name, line, _col = min(uses, key=lambda u: u[1:])
            return f"{name} is also used at line {line} ({where}): fusing would remove the module"
    return None


def _projects_all_three(source: str, attrs: list[str], uses: list[tuple[str, int, int]]) -> bool:
    """Whether a method's uses of the projections are the three called once each on one input
    (``self.query(h)``, ``self.key(h)``, ``self.value(h)``): another attention over the same
    projections (a subclass's SDPA forward), itself a QKV site, not a projection put to another use."""
    if len(attrs) != 3 or len(uses) != 3 or {u[0] for u in uses} != {f"self.{a}" for a in attrs}:
        return False
    calls = _self_calls_at(source)
    inputs = set()
    for _name, line, col in uses:
        call = calls.get((line, col))
        if call is None or len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
            return False
        inputs.add(ast.dump(call.args[0]))
    return len(inputs) == 1


@per_file
@lru_cache(maxsize=8)
def _self_calls_at(source: str) -> dict[tuple[int, int], ast.Call]:
    """(line, col) of ``self.<attr>`` -> the call ``self.<attr>(...)`` it is the callee of."""
    tree = parse_file(source)
    out: dict[tuple[int, int], ast.Call] = {}
    for node in walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            out[(node.func.lineno, node.func.col_offset)] = node
    return out


# ``torch.nn.init`` functions and in-place tensor methods that (re)initialise a parameter
_INIT_CALLEES = ("nn.init.", "torch.nn.init.", "init.")


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in walk(tree) for child in ast.iter_child_nodes(node)}


def _initialises_parameter(ref: ast.expr, parents: dict[int, ast.AST]) -> bool:
    """``ref`` (a module expression) is only read to initialise one of its parameters:
    ``nn.init.f(ref.weight, ...)``, ``ref.bias.data.zero_()``, ``ref.weight.normal_(...)`` as a
    statement, or ``ref.reset_parameters()``."""
    up = parents.get(id(ref))
    if isinstance(up, ast.Attribute) and up.attr == "reset_parameters":
        call = parents.get(id(up))
        return isinstance(call, ast.Call) and call.func is up and isinstance(parents.get(id(call)), ast.Expr)
    if not (isinstance(up, ast.Attribute) and up.value is ref and up.attr in ("weight", "bias")):
        return False
    tensor: ast.expr = up
    above = parents.get(id(tensor))
    if isinstance(above, ast.Attribute) and above.attr == "data":
        tensor, above = above, parents.get(id(above))
    if isinstance(above, ast.Call) and above.args and above.args[0] is tensor:
        return ast.unparse(above.func).startswith(_INIT_CALLEES) and isinstance(parents.get(id(above)), ast.Expr)
    if isinstance(above, ast.Attribute) and above.attr.endswith("_") and not above.attr.startswith("_"):
        call = parents.get(id(above))
        return isinstance(call, ast.Call) and call.func is above and isinstance(parents.get(id(call)), ast.Expr)
    return False


@per_file
@lru_cache(maxsize=64)
def _tree_and_parents(source: str) -> tuple[ast.AST, dict[int, ast.AST]] | None:
    tree = parse_file(source)
    return None if tree is None else (tree, _parents(tree))


def _initialisation_use(source: str, line: int, col: int) -> bool:
    """The ``self.<attr>`` at ``line:col`` only (re)initialises the module's parameters
    (torchtitan's ``init_weights``: ``for linear in (self.wq, self.wk, self.wv):
    nn.init.trunc_normal_(linear.weight, ...)``). The guarded kernel reads the three modules'
    current weights at every call, so such a use leaves the fused computation the original one;
    calls of the module (side keys, cross attention) and any other read still count."""
    found = _tree_and_parents(source)
    if found is None:
        return False
    tree, parents = found
    ref = next((n for n in walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.lineno == line and n.col_offset == col), None)
    if ref is None:
        return False
    if _initialises_parameter(ref, parents):
        return True
    # an element of the tuple/list a ``for`` loop runs over, the loop variable only initialising
    seq = parents.get(id(ref))
    loop = parents.get(id(seq))
    if not (isinstance(seq, (ast.Tuple, ast.List)) and isinstance(loop, ast.For) and loop.iter is seq
            and isinstance(loop.target, ast.Name) and not loop.orelse):
        return False
    name = loop.target.id
    reads = [n for stmt in loop.body for n in walk(stmt) if isinstance(n, ast.Name) and n.id == name]
    return bool(reads) and all(isinstance(n.ctx, ast.Load) and _initialises_parameter(n, parents) for n in reads)


# ---------------------------------------------------------------- codemod

KERNEL = "qkv"


def _role(attr: str) -> str | None:
    return projection_role(attr)


def _unpacked_targets(stmts: list[ast.stmt], calls: list[ast.Call]) -> list[str] | None:
    """The names ``a, b, c = <q call>, <k call>, <v call>`` (elements in any order) assigns the
    query's, key's and value's outputs to, in that order; None for any other shape."""
    stmt = stmts[0]
    if any(s is not stmt for s in stmts) or not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target, value = stmt.targets[0], stmt.value
    if not (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(value.elts) == 3
            and len(target.elts) == 3 and all(isinstance(t, ast.Name) for t in target.elts)):
        return None
    names = [t.id for t in target.elts]
    if len(set(names)) != 3:
        return None
    index = {id(e): i for i, e in enumerate(value.elts)}
    if any(id(c) not in index for c in calls):
        return None
    return [names[index[id(c)]] for c in calls]


class FusedQKVCodemod(Codemod):
    rule = "fused_QKV"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        fn = match_function(match, ctx, exprs)
        calls = [e for _, e in exprs]
        if len(calls) != 3 or not all(isinstance(c, ast.Call) for c in calls):
            raise Skip("expected three Linear calls")
        attrs = [is_self_attr(c.func) for c in calls]
        if not all(attrs) or len(set(attrs)) != 3:
            raise Skip("the projections must be three distinct modules self.<name>(x)")
        by_role = {}
        for attr, call in zip(attrs, calls):
            role = _role(attr)
            if role is None or role in by_role:
                raise Skip(f"cannot tell query/key/value apart ({', '.join(attrs)})")
            by_role[role] = (attr, call)
        if set(by_role) != {"q", "k", "v"}:
            raise Skip("projections are not one query, one key and one value")
        ordered = [by_role[r] for r in ("q", "k", "v")]
        inputs = set()
        for _, call in ordered:
            if len(call.args) != 1 or call.keywords:
                raise Skip("each projection must take exactly one tensor")
            inputs.add(ast.dump(call.args[0]))
        if len(inputs) != 1:
            raise Skip("the three projections read different inputs")
        source = ordered[0][1].args[0]
        if not isinstance(source, (ast.Name, ast.Attribute)):
            raise Skip("the projections' input must be a variable")
        spec, kernel = kernel_name(ctx, KERNEL)
        handles = [module_handle(ctx, call, "projection") for _, call in ordered]

        # ---- forward
        stmts = [ctx.statement_of(call) for _, call in ordered]
        if len({id(ctx.block_of(s)[2]) for s in stmts}) != 1:
            raise Skip("the projections are computed in different blocks")
        in_order = sorted(set(stmts), key=lambda s: (s.lineno, s.col_offset), reverse=False)
        first, final = in_order[0], in_order[-1]
        between = [
            s
            for s in ctx.block_of(first)[2]
            if (first.lineno, first.col_offset) <= (s.lineno, s.col_offset) <= (final.lineno, final.col_offset)
        ]
        source_text = arg_text(ctx, source)
        fused_call = f"{kernel}({', '.join(handles)}, {source_text})"
        targets = [simple_assign_target(s) for s in stmts]
        whole = all(
            t is not None and getattr(s, "value", None) is call for t, s, (_, call) in zip(targets, stmts, ordered)
        ) and len(set(targets)) == 3 and len(set(stmts)) == 3
        source_names = loads(source) | ({source.id} if isinstance(source, ast.Name) else set())
        for s in between[1:]:
            if stores(s) & source_names and s is not final:
                raise Skip(f"{source_text} changes between the projections (line {s.lineno})")
        unpacked = _unpacked_targets(stmts, [call for _, call in ordered])
        if unpacked is not None:
            # ``q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)``: the right side is the three
            # projections and nothing else, so the one statement becomes the kernel's call
            # (the two sides edited in place: a comment after the statement stays)
            forward = ForwardEdit(
                statements=(pos(ctx, first),),
                anchor=pos(ctx, first),
                expr_edits=(ExprEdit(ctx.char_span(first.targets[0]), ", ".join(unpacked)),
                            ExprEdit(ctx.char_span(first.value), fused_call)),
            )
        elif whole:
            others = [s for s in between if s not in stmts]
            for s in others:
                clash = (loads(s) | stores(s)) & set(targets)
                if clash:
                    raise Skip(f"{', '.join(sorted(clash))} is used between the projections (line {s.lineno})")
            if (stores(first) - {targets[stmts.index(first)]}) or any(source_names & {t} for t in targets[:-1]):
                raise Skip("a projection rebinds its own input")
            # the first statement's two sides edited in place (a comment after it stays)
            forward = ForwardEdit(
                statements=tuple(pos(ctx, s) for s in in_order),
                anchor=pos(ctx, first),
                expr_edits=(ExprEdit(ctx.char_span(first.targets[0]), ", ".join(targets)),
                            ExprEdit(ctx.char_span(first.value), fused_call)),
                delete=tuple(pos(ctx, s) for s in in_order[1:]),
            ) if isinstance(first, ast.Assign) and len(first.targets) == 1 else ForwardEdit(
                statements=tuple(pos(ctx, s) for s in in_order),
                anchor=pos(ctx, first),
                statement_edits=(StatementEdit(pos(ctx, first), f"{', '.join(targets)} = {fused_call}"),),
                delete=tuple(pos(ctx, s) for s in in_order[1:]),
            )
        else:
            taken: set[str] = set()
            names = [fresh_local(ctx, fn, f"{attr.split('.')[-1]}_output", taken) for attr, _ in ordered]
            forward = ForwardEdit(
                statements=tuple(pos(ctx, s) for s in in_order),
                anchor=pos(ctx, first),
                expr_edits=tuple(ExprEdit(ctx.char_span(call), name) for name, (_, call) in zip(names, ordered)),
                insert_before=(f"{', '.join(names)} = {fused_call}",),
            )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    mods = site.modules
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    if len(linears) != 3:
        return f"expected three nn.Linear projections, found {[type(m).__name__ for m in mods]}", ""
    ins = {m.in_features for m in linears}
    biases = {m.bias is not None for m in linears}
    if len(ins) != 1:
        return f"projections differ in in_features {sorted(ins)}", ""
    if len(biases) != 1:
        return "projections differ in bias (some have none)", ""
    outs = [m.out_features for m in linears]
    return None, f"3 x Linear in={ins.pop()} out={outs} bias={biases.pop()}"


RUNTIME = Runtime(check=_runtime_check, leaf_modules=(LINEAR,))

RULE = Rule(
    name="fused_QKV",
    kernel="adopter.kernels.qkv",
    doc=DOC,
    dsl=DSL,
    codemod=FusedQKVCodemod(),
    runtime=RUNTIME,
    fixtures="fused_QKV",
    preconditions=(distinct_modules("$a", "$b", "$c"), _roles_are_qkv, _same_bias, _modules_used_only_here),
)
