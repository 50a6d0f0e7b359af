"""softmax: drop-in replacement of torch softmax calls by the triton kernel ``adopter.kernels.softmax``.

Rewrite (the codemod below):
    forward:  F.softmax(x, dim=-1, dtype=torch.float32)  =>  softmax(x, dim=-1, dtype=torch.float32)
              x.softmax(-1)                              =>  softmax(x, dim=-1)
    partial:  self.attn_fn = partial(F.softmax, dim=-1)  =>  self.attn_fn = partial(softmax, dim=-1)
    __init__: self.softmax = nn.Softmax(dim=-1)          =>  self.softmax = Softmax(dim=-1)
"""

from __future__ import annotations

import ast
import re

from adopter.core.codemod.base import (
    Codemod,
    arg_text,
    init_statement,
    kernel_name,
    matched_exprs,
    pos,
)
from adopter.core.codemod.context import FileContext, Skip, call_arguments, is_self_attr
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, InitEdit
from adopter.core.dsl import Const, Layer, TensorOp, Value, Var
from adopter.core.match import MatchContext, NotACandidate, Refusal
from adopter.core.match.scalars import local_is_number, self_attr_is_number
from adopter.core.match.source import function_ast, parse_file
from adopter.core.rule import Rule, Runtime
from adopter.core.rules._common import kwarg
from adopter.core.structures import Match
from adopter.core.syntax import dotted_name, statements, walk

DSL = """
rule softmax
forward:
    torch.nn.functional.softmax|torch.softmax|torch.Tensor.softmax|torch.special.softmax($x) -> $y

rule softmax
init:
    torch.nn.Softmax() -> $m
forward:
    torch.nn.Softmax@$m($x) -> $y

# nn.Softmax(dim=-1)(x): the module is constructed and called in one expression
rule softmax
forward:
    torch.nn.Softmax() -> $m
"""

DOC = """\
Replaces softmax with the triton softmax kernel (same signature: ``input, dim, dtype``).
A match is every call of ``torch.nn.functional.softmax`` (however imported: ``F.softmax``,
``nn.functional.softmax``), ``torch.softmax``, ``torch.special.softmax``, the tensor method
``x.softmax(...)``, a ``torch.nn.Softmax`` module bound in ``__init__`` and called in
``forward``, or one constructed and called inline (``nn.Softmax(dim=-1)(x)``); one match per
call site. A call through a ``functools.partial`` of one of these functions counts with the bound
arguments merged (``self.attn_fn = partial(F.softmax, dim=-1)`` in ``__init__``, nested partials,
a module-level partial, a parameter's default, one made in a lambda): the rewrite makes the
function the partial binds the kernel where the partial is made (``partial(softmax, dim=-1)``). Not a match: ``log_softmax``, ``gumbel_softmax``,
sparse/masked softmax variants, user functions named ``softmax``, and calls in code that
extraction does not reach (nested lambdas). Refused (``dim-not-last``: the kernel normalises
rows): a softmax whose ``dim`` is not provably the last dimension — only ``dim=-1`` is, or
``dim=n`` when the input's rank is statically ``n + 1`` (it comes from a ``view``/``reshape``/
``permute`` with explicit sizes, an ``einsum`` with explicit output subscripts, a matmul, a
Linear..., traced back through rank-keeping ops: elementwise ops, activations, casts, a Linear
— also a module handed to the constructor (``self.gate = gate``) when every construction of the
class in the file passes one rank-keeping layer (``gate=nn.Linear(...)``) — and the values of
``values, indices = torch.topk(t, k)``/``torch.sort``), or a ``dim`` parameter that every call
site in the file (and the default, where one omits it) sets to ``-1``; a softmax without ``dim``
is refused too. A ``dtype=`` argument is fine (the kernel takes it).
Sampling is left alone, by decision: a softmax in ``generate()`` (a method calling the model
itself is no analysis entry) or whose probabilities go to ``torch.multinomial`` (directly or
through a cast/reshape; not a candidate) normalizes one (batch, vocab) row per generated token at
inference — torch's softmax is already one kernel there, and without a backward there is no
memory to save, so a kernel would change nothing measurable. (A top-p sampler that sorts the
probabilities first, Llama's ``sample_top_p``, still matches: the sort's unpacked output is not
followed.)"""


# ---------------------------------------------------------------- codemod

SIGNATURES = {
    "torch.nn.functional.softmax": ("input", "dim", "_stacklevel", "dtype"),
    "torch.softmax": ("input", "dim", "dtype"),
    "torch.special.softmax": ("input", "dim", "dtype"),
    "torch.Tensor.softmax": ("dim", "dtype"),
}


class SoftmaxCodemod(Codemod):
    rule = "softmax"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        if len(exprs) != 1 or not isinstance(exprs[0][1], ast.Call) or not isinstance(exprs[0][0], Layer):
            raise Skip("expected one softmax call")
        node, call = exprs[0]
        if node.bound is not None:
            return self._bound(ctx, node)
        if isinstance(call.func, ast.Call):
            return self._inline_module(ctx, call)
        if node.type == "torch.nn.Softmax" or is_self_attr(call.func):
            return self._module(match, ctx, call)
        signature = SIGNATURES.get(node.type)
        if signature is None:
            raise Skip(f"{node.type} is not a softmax this codemod knows")
        args = call_arguments(call, signature)
        if node.type == "torch.Tensor.softmax":
            if not isinstance(call.func, ast.Attribute):
                raise Skip("tensor method call without a receiver")
            args["input"] = call.func.value
        if "input" not in args:
            raise Skip("softmax without input")
        if "dim" not in args:
            raise Skip("softmax without dim= (implicit dim is deprecated and ambiguous)")
        spec, local = kernel_name(ctx, "softmax")
        keywords = [f"dim={arg_text(ctx, args['dim'])}"]
        if "dtype" in args:
            keywords.append(f"dtype={arg_text(ctx, args['dtype'])}")
        text = f"{local}({arg_text(ctx, args['input'])}, {', '.join(keywords)})"
        stmt = ctx.statement_of(call)
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(call), text),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    def _bound(self, ctx: FileContext, node: Layer) -> Edit:
        """A softmax called through a ``functools.partial`` (``self.attn_fn = partial(F.softmax,
        dim=-1)``, a module-level ``softmax = partial(...)``, a parameter's default): the function
        the partial binds becomes the kernel, where the partial is made
        (``partial(softmax, dim=-1)``). Every call of that partial then runs the kernel — a
        drop-in for ``input, dim, dtype`` whatever the dim —, what the caller stores or passes
        instead still runs as it did."""
        if node.type not in ("torch.nn.functional.softmax", "torch.softmax", "torch.special.softmax"):
            raise Skip(f"a partial of {node.type} is not a softmax this codemod knows")
        if sum(1 for a in node.args if a.keyword is None) > 2 or any(
                a.keyword not in (None, "input", "dim", "dtype") for a in node.args):
            raise Skip("the partial binds arguments the kernel does not take (input, dim, dtype)")
        func = ctx.expr_at(node.bound)
        stmt = ctx.statement_of(func)
        spec, local = kernel_name(ctx, "softmax")
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(func), local),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    def _inline_module(self, ctx: FileContext, call: ast.Call) -> Edit:
        """``nn.Softmax(dim=-1)(x)`` -> ``softmax(x, dim=-1)``."""
        ctor = call.func
        name = ctor.func.attr if isinstance(ctor.func, ast.Attribute) else getattr(ctor.func, "id", "")
        if name != "Softmax" or len(call.args) != 1 or call.keywords:
            raise Skip("inline module call is not nn.Softmax(dim)(x)")
        args = call_arguments(ctor, ("dim",))
        if "dim" not in args:
            raise Skip("nn.Softmax() without dim (implicit dim is deprecated and ambiguous)")
        spec, local = kernel_name(ctx, "softmax")
        text = f"{local}({arg_text(ctx, call.args[0])}, dim={arg_text(ctx, args['dim'])})"
        stmt = ctx.statement_of(call)
        forward = ForwardEdit(
            statements=(pos(ctx, stmt),), anchor=pos(ctx, stmt), expr_edits=(ExprEdit(ctx.char_span(call), text),)
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))

    def _module(self, match: Match, ctx: FileContext, call: ast.Call) -> Edit:
        attr = is_self_attr(call.func)
        if attr is None:
            raise Skip("Softmax module must be called as self.<name>(x)")
        stmt, ctor, _ = init_statement(ctx, match, attr)
        args = call_arguments(ctor, ("dim",))
        spec, local = kernel_name(ctx, "Softmax")
        dim = f"dim={arg_text(ctx, args['dim'])}" if "dim" in args else ""
        if not dim:
            raise Skip("nn.Softmax() without dim (implicit dim is deprecated and ambiguous)")
        construct = f"self.{attr} = {local}({dim})"
        return Edit(rule=self.rule, forward=None, init=(InitEdit(replace=pos(ctx, stmt), construct=construct),), imports=(spec,))

# ---------------------------------------------------------------- dim-not-last

# ops whose output has the rank of their first tensor input
_SAME_RANK = {
    "torch.nn.Linear", "torch.nn.Dropout", "torch.nn.LayerNorm", "torch.nn.GELU", "torch.nn.ReLU", "torch.nn.SiLU",
    "torch.nn.Tanh", "torch.nn.Sigmoid", "torch.nn.Identity", "torch.nn.Softmax",
    "torch.nn.functional.linear", "torch.nn.functional.dropout", "torch.nn.functional.gelu",
    "torch.nn.functional.relu", "torch.nn.functional.silu", "torch.nn.functional.softmax",
    "torch.nn.functional.layer_norm", "torch.tanh", "torch.sigmoid", "torch.exp", "torch.relu", "torch.softmax",
    "torch.clamp", "torch.where", "torch.masked_fill", "torch.transpose", "torch.Tensor.transpose",
    "torch.Tensor.swapaxes", "torch.Tensor.float", "torch.Tensor.half", "torch.Tensor.bfloat16", "torch.Tensor.double",
    "torch.Tensor.to", "torch.Tensor.type", "torch.Tensor.type_as", "torch.Tensor.contiguous",
    "torch.Tensor.masked_fill", "torch.Tensor.masked_fill_", "torch.Tensor.clone", "torch.Tensor.detach",
    "torch.Tensor.softmax", "torch.Tensor.mul", "torch.Tensor.div", "torch.Tensor.add", "torch.Tensor.sub",
    "torch.Tensor.clamp", "torch.Tensor.exp", "torch.Tensor.tanh", "torch.Tensor.sigmoid", "torch.Tensor.neg",
    "torch.Tensor.abs", "torch.Tensor.view_as", "torch.Tensor.reshape_as",
}
_SIZES = {"torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape", "torch.Tensor.permute", "torch.permute",
          "torch.Tensor.expand", "torch.Tensor.repeat"}


def _int(v: Value | None) -> int | None:
    if isinstance(v, Const):
        try:
            out = ast.literal_eval(v.text)
        except (ValueError, SyntaxError):
            return None
        return out if type(out) is int else None
    return None


def _sizes_rank(args: list) -> int | None:
    """Rank given by the size arguments of ``view``/``reshape``/``permute``."""
    if not args or any(a.keyword for a in args):
        return None
    if len(args) == 1 and isinstance(args[0].value, Const):
        try:
            e = ast.parse(re.sub(r"#\d+", "", args[0].value.text), mode="eval").body
        except SyntaxError:
            return None
        if isinstance(e, (ast.Tuple, ast.List)):
            return None if any(isinstance(x, ast.Starred) for x in e.elts) else len(e.elts)
        return 1 if _int(args[0].value) is not None else None
    if any(isinstance(a.value, Const) and a.value.text.startswith("*") for a in args):
        return None
    return len(args)


def _const_rank(ctx: MatchContext, text: str, depth: int, where=None) -> int | None:
    """Rank of an expression kept as text: a number (0), or ``x[:, a:b, :]`` of a variable ``x``
    of known rank (slices keep a dimension, an index drops one, ``None`` adds one). ``where``: the
    span of the node reading it, whose function settles local names (``int(c) ** -0.5``)."""
    try:
        e = ast.parse(re.sub(r"#\d+", "", text), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(e, ast.Constant) and type(e.value) in (int, float):
        return 0
    if where is not None and where.function and ctx.source is not None and not isinstance(e, ast.Subscript) \
            and local_is_number(ctx, text, function_ast(ctx.source, where.function, where.line), where.line):
        return 0  # the LDM/VAE attention's ``w_ * (int(c) ** (-0.5))``, ``/ math.sqrt(c)``
    if isinstance(e, ast.Attribute) and self_attr_is_number(ctx, ast.unparse(e)):
        return 0  # ``self.scale = dim ** -0.5``: a number broadcasts to the other operand's rank
    if not (isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name)):
        return None
    parts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
    if any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts):
        return None
    versions = [ver for (name, ver) in ctx.producers() if name == e.value.id]
    if len(versions) != 1:
        return None  # which version the text reads is not known
    base = _rank(ctx, Var(e.value.id, versions[0]), depth + 1)
    if base is None:
        return None
    delta = 0
    for p in parts:
        if isinstance(p, ast.Slice):
            continue
        if isinstance(p, ast.Constant) and p.value is None:
            delta += 1
        elif isinstance(p, (ast.Constant, ast.Name, ast.BinOp, ast.UnaryOp)):
            delta -= 1  # an integer index (a tensor index would be another story: names count as ints)
        else:
            return None
    return base + delta if len(parts) <= base else None


# ops returning ``(values, indices)`` of their input's rank (``dim`` defaults to the last, and
# these ops keep it: ``topk``'s k entries, ``sort``'s permutation)
_TUPLE_SAME_RANK = {"torch.topk", "torch.Tensor.topk", "torch.sort", "torch.Tensor.sort"}


def _fqn(imports: dict, node: ast.AST) -> str | None:
    """``nn.Linear`` -> ``torch.nn.Linear`` through the file's imports."""
    name = dotted_name(node)
    head, _, rest = (name or "").partition(".")
    resolved = imports.get(head) if name else None
    return ".".join(filter(None, (resolved, rest))) if resolved else None


def _class_def(tree: ast.AST, name: str) -> ast.ClassDef | None:
    found = [c for c in statements(tree) if isinstance(c, ast.ClassDef) and c.name == name]
    return found[0] if len(found) == 1 else None


def _injected_module_type(ctx: MatchContext, attr: str) -> str | None:
    """The layer type a ``self.<attr>`` holds when ``__init__`` stores a constructor parameter
    there (``self.gate = gate``, Mistral's MoE) and every construction of the class in this
    file passes that parameter a construction of one torch layer type (``gate=nn.Linear(...)``).
    None when anything is unclear: no construction here, ``*args``, a subclass sharing the
    ``__init__``, another store to the attribute."""
    if ctx.cls is None or ctx.source is None or not attr.startswith("self."):
        return None
    key = f"injected:{ctx.cls.name}.{attr}"
    if key in ctx.path_cache:
        return ctx.path_cache[key]
    ctx.path_cache[key] = None
    tree = parse_file(ctx.source)
    cls = _class_def(tree, ctx.cls.name) if tree is not None else None
    if cls is None or any(isinstance(c, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == cls.name or isinstance(b, ast.Attribute) and b.attr == cls.name
            for b in c.bases) for c in walk(tree)):
        return None
    name = attr[len("self."):]
    stores = [n for n in walk(cls) if isinstance(n, ast.Attribute) and n.attr == name
              and isinstance(n.value, ast.Name) and n.value.id == "self" and not isinstance(n.ctx, ast.Load)]
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None or len(stores) != 1:
        return None
    assign = next((st for st in walk(init) if isinstance(st, ast.Assign) and st.targets == [stores[0]]), None)
    if assign is None or not isinstance(assign.value, ast.Name):
        return None
    params = [a.arg for a in init.args.posonlyargs + init.args.args][1:]
    param = assign.value.id
    if param not in params + [a.arg for a in init.args.kwonlyargs]:
        return None
    if any(isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == param for t in walk(st) if isinstance(t, ast.Name)
            and not isinstance(t.ctx, ast.Load)) for st in walk(init)):
        return None  # the parameter is rebound before it is stored
    types = set()
    for call in walk(tree):
        if not (isinstance(call, ast.Call) and (isinstance(call.func, ast.Name) and call.func.id == cls.name
                                                or isinstance(call.func, ast.Attribute) and call.func.attr == cls.name)):
            continue
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return None
        given = next((k.value for k in call.keywords if k.arg == param), None)
        if given is None and param in params and params.index(param) < len(call.args):
            given = call.args[params.index(param)]
        if not isinstance(given, ast.Call):
            return None
        types.add(_fqn(ctx.structures.imports, given.func))
    if len(types) != 1 or None in types:
        return None
    ctx.path_cache[key] = types.pop()
    return ctx.path_cache[key]


def _unpacked_rank(ctx: MatchContext, v: Var, depth: int) -> int | None:
    """``values, indices = torch.topk(t, k)``: the rank of ``t`` for ``values`` (extraction
    keeps the call's output, not the unpacked names). Only when that statement is the one store
    of the name before the softmax in the function holding it (``weights =
    F.softmax(weights, ...)`` may rebind it after), not a parameter, and no loop around the
    softmax stores the name (a later store could come round again)."""
    sp = ctx.match.nodes[0].node.span
    if ctx.source is None or sp is None or not sp.function:
        return None
    fn = function_ast(ctx.source, sp.function, sp.line)
    if fn is None or any(isinstance(a, ast.arg) and a.arg == v.name for a in walk(fn)):
        return None
    def stored(tree: ast.AST) -> list[ast.Name]:
        return [n for n in walk(tree) if isinstance(n, ast.Name) and n.id == v.name
                and not isinstance(n.ctx, ast.Load)]
    for loop in walk(fn):
        if isinstance(loop, (ast.For, ast.While, ast.AsyncFor)) and loop.lineno <= sp.stmt_line <= loop.end_lineno \
                and stored(loop):
            return None
    stores = [n for n in stored(fn) if n.lineno < sp.stmt_line]
    if len(stores) != 1:
        return None
    stmt = next((st for st in walk(fn) if isinstance(st, ast.Assign) and len(st.targets) == 1
                 and isinstance(st.targets[0], (ast.Tuple, ast.List))
                 and any(e is stores[0] for e in st.targets[0].elts)), None)
    if stmt is None or not isinstance(stmt.value, ast.Call) or len(stmt.targets[0].elts) != 2:
        return None
    call = stmt.value
    for n in ctx.path.nodes:
        if (isinstance(n, Layer) and n.type in _TUPLE_SAME_RANK and n.span is not None
                and (n.span.line, n.span.col) == (call.lineno, call.col_offset)):
            tensors = [a.value for a in n.args if a.keyword is None and isinstance(a.value, Var)]
            return _rank(ctx, tensors[0], depth + 1) if tensors else None
    return None


def _rank(ctx: MatchContext, v: Value | None, depth: int = 0) -> int | None:
    """The rank of ``v`` where the matched path makes it certain, else None."""
    if isinstance(v, Const):
        return _const_rank(ctx, v.text, depth) if depth <= 24 else None
    if not isinstance(v, Var) or depth > 24:
        return None
    n = ctx.producers().get((v.name, v.version))
    if n is None:
        joined = ctx.function.sources.get(v) if ctx.function.sources else None
        if not joined:
            return _unpacked_rank(ctx, v, depth)
        ranks = {_rank(ctx, s, depth + 1) for s in joined or ()}
        return ranks.pop() if len(ranks) == 1 else None
    args = [a for a in n.args]
    tensors = [a.value for a in args if isinstance(a.value, Var) and a.keyword is None]
    if isinstance(n, TensorOp):
        if n.op == "@":
            ranks = [_rank(ctx, a.value, depth + 1) for a in args]
            return max(ranks) if len(ranks) == 2 and None not in ranks and min(ranks) >= 2 else None
        ranks = [_const_rank(ctx, a.value.text, depth + 1, n.span) if isinstance(a.value, Const)
                 else _rank(ctx, a.value, depth + 1) for a in args]
        return max(ranks) if ranks and None not in ranks else None
    if not isinstance(n, Layer):
        return None
    if n.type in _SIZES:
        return _sizes_rank(args[1:])
    if n.type in ("torch.matmul", "torch.Tensor.matmul"):
        ranks = [_rank(ctx, t, depth + 1) for t in tensors[:2]]
        return max(ranks) if len(ranks) == 2 and None not in ranks and min(ranks) >= 2 else None
    if n.type in ("torch.bmm", "torch.baddbmm", "torch.Tensor.bmm"):
        return 3
    if n.type == "torch.einsum" and args and isinstance(args[0].value, Const):
        eq = args[0].value.text.strip("'\"")
        out = eq.split("->", 1)[1].strip() if "->" in eq else None
        return len(out) if out is not None and "." not in out and out.isalpha() else None
    if n.type in ("torch.flatten", "torch.Tensor.flatten") and tensors:
        start, end = _int(kwarg(n, "start_dim", 1)), _int(kwarg(n, "end_dim", 2))
        start = 0 if kwarg(n, "start_dim", 1) is None else start
        end = -1 if kwarg(n, "end_dim", 2) is None else end
        if start is None or end is None:
            return None
        if start >= 0 and end == -1:
            return start + 1
        r = _rank(ctx, tensors[0], depth + 1)
        if r is None:
            return None
        s_, e_ = start % r if r else 0, end % r if r else 0
        return r - (e_ - s_) if e_ >= s_ else None
    if n.type in ("torch.Tensor.unsqueeze", "torch.unsqueeze") and tensors:
        r = _rank(ctx, tensors[0], depth + 1)
        return r + 1 if r is not None else None
    if n.type in _SAME_RANK and tensors:
        return _rank(ctx, tensors[0], depth + 1)
    if n.type == "?" and isinstance(n.module, Var) and len(tensors) == 1 and len(args) == 1:
        # a module handed to the constructor: rank-keeping when every construction passes one
        if _injected_module_type(ctx, n.module.name) in _SAME_RANK:
            return _rank(ctx, tensors[0], depth + 1)
    return None


def _inline_dim(ctx: MatchContext, node: Layer) -> tuple[bool, Value | None]:
    """``nn.Softmax(dim)(x)``: (found, the ``dim`` argument of the construction)."""
    sp = node.span
    if ctx.source is None or sp is None:
        return False, None
    fn = function_ast(ctx.source, sp.function, sp.line) if sp.function else parse_file(ctx.source)
    for e in walk(fn) if fn is not None else ():
        if isinstance(e, ast.Call) and (e.lineno, e.col_offset) == (sp.line, sp.col) and isinstance(e.func, ast.Call):
            ctor = e.func
            for k in ctor.keywords:
                if k.arg == "dim":
                    return True, Const(ast.unparse(k.value))
            return True, Const(ast.unparse(ctor.args[0])) if ctor.args else None
    return False, None


def _parameter_values(ctx: MatchContext, node: Layer, name: str) -> tuple[list[str], str]:
    """Values a parameter ``name`` of the function holding ``node`` takes at the file's call
    sites of that function (the default where a call omits it); ``[]`` when unknown."""
    sp = node.span
    if ctx.source is None or sp is None or not sp.function:
        return [], "the source is not at hand"
    fn = function_ast(ctx.source, sp.function, sp.line)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [], f"{sp.function} not found"
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if name not in positional + [p.arg for p in a.kwonlyargs]:
        return [], f"{name} is not a parameter of {sp.function}"
    defaults = dict(zip(positional[len(positional) - len(a.defaults):], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    is_method = "." in sp.function and positional[:1] in (["self"], ["cls"])
    index = positional.index(name) - (1 if is_method else 0) if name in positional else None
    tree = parse_file(ctx.source)
    values: list[str] = []
    for call in walk(tree) if tree is not None else ():
        if not isinstance(call, ast.Call):
            continue
        f = call.func
        if is_method:  # self.f(...), cls.f(...), Owner.f(...)
            owner = sp.function.rsplit(".", 2)[-2]
            if not (isinstance(f, ast.Attribute) and f.attr == fn.name and isinstance(f.value, ast.Name)
                    and f.value.id in ("self", "cls", owner)):
                continue
        elif not (isinstance(f, ast.Name) and f.id == fn.name):
            continue
        if any(isinstance(x, ast.Starred) for x in call.args) or any(k.arg is None for k in call.keywords):
            return [], f"a call at line {call.lineno} passes *args/**kwargs"
        given = next((k.value for k in call.keywords if k.arg == name), None)
        if given is None and index is not None and index < len(call.args):
            given = call.args[index]
        if given is None:
            given = defaults.get(name)
        if given is None:
            return [], f"the call at line {call.lineno} leaves {name} unknown"
        values.append(ast.unparse(given))
    if not values:
        return [], f"no call of {fn.name} in this file sets {name}"
    return values, ""


def _dim_is_last(ctx: MatchContext) -> str | None:
    """``dim-not-last``: refuse a softmax whose ``dim`` is not provably the input's last dimension."""
    node = ctx.match.nodes[0].node
    if not isinstance(node, Layer):
        return None
    x = node.args[0].value if node.args else None
    if node.type == "torch.nn.Softmax" and node.module is not None:
        ib = ctx.match.init_nodes[0] if ctx.match.init_nodes else ctx.init_binding_for(node.module)
        dim = kwarg(ib.layer, "dim", 0) if ib is not None else None
        if ib is None:
            return Refusal("dim-not-last", f"the construction of {node.module} is not known: its dim is unknown")
    elif node.type == "torch.nn.Softmax":
        found, dim = _inline_dim(ctx, node)
        if not found:
            return Refusal("dim-not-last", "the nn.Softmax(...) construction is not found: its dim is unknown")
    else:
        dim = kwarg(node, "dim", 1)
    if dim is None:
        return Refusal("dim-not-last", "softmax without dim (the implicit dim depends on the input's rank)")
    if isinstance(dim, Var) and dim.version == 0 and not dim.name.startswith("self."):
        values, why = _parameter_values(ctx, node, dim.name)
        bad = [v for v in values if v != "-1"]
        if not values or bad:
            detail = why or f"a call site passes {bad[0]}"
            return Refusal("dim-not-last", f"dim={dim.name} is not provably -1 ({detail})")
        return None
    d = _int(dim)
    if d == -1:
        return None
    shown = dim.text if isinstance(dim, Const) else str(dim)
    if d is None:
        return Refusal("dim-not-last", f"dim={shown} is not a constant")
    if d < 0:
        return Refusal("dim-not-last", f"dim={d} is not the last dimension")
    rank = _rank(ctx, x)
    if rank is None:
        return Refusal("dim-not-last", f"dim={d}: the input's rank is not known statically, so the dimension is "
                                       "not provably the last")
    if d != rank - 1:
        return Refusal("dim-not-last", f"dim={d} of a {rank}-D input is not the last dimension")
    return None


_SAMPLERS = {"torch.multinomial", "torch.Tensor.multinomial"}
_PASS_THROUGH = {"torch.Tensor.to", "torch.Tensor.float", "torch.Tensor.double", "torch.Tensor.type_as",
                 "torch.Tensor.squeeze", "torch.Tensor.view", "torch.Tensor.reshape", "torch.squeeze",
                 "torch.reshape"}


def _not_sampled(ctx: MatchContext) -> str | None:
    """A softmax whose probabilities are drawn from (``torch.multinomial``, directly or through a
    cast/reshape) is a sampling step: one (batch, vocab) row per generated token at inference,
    already a single torch kernel, with no backward to save memory for. Not what the rule is
    about (see DOC), so not a candidate."""
    node = ctx.match.nodes[0].node
    todo, seen = [getattr(node, "output", None)], set()
    while todo:
        v = todo.pop()
        if not isinstance(v, Var) or (v.name, v.version) in seen or len(seen) > 8:
            continue
        seen.add((v.name, v.version))
        for i in ctx.readers().get((v.name, v.version), ()):
            reader = ctx.path.nodes[i]
            if isinstance(reader, Layer) and reader.type in _SAMPLERS:
                return NotACandidate(f"the probabilities are sampled (line {reader.span.line if reader.span else '?'}): "
                                     "a per-token sampling softmax")
            if isinstance(reader, Layer) and reader.type in _PASS_THROUGH:
                todo.append(reader.output)
    return None


RULE = Rule(
    name="softmax",
    kernel="adopter.kernels.softmax",
    doc=DOC,
    dsl=DSL,
    codemod=SoftmaxCodemod(),
    # nn.Softmax stays one node in a symbolic trace so its call site maps to the source line.
    runtime=Runtime(leaf_modules=("torch.nn.modules.activation.Softmax",)),
    fixtures="softmax",
    preconditions=(_not_sampled, _dim_is_last),
)
