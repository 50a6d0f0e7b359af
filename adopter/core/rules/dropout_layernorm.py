"""Dropout_LayerNorm: fuse ``LayerNorm(Dropout(x) + residual)`` (EPOI ``FusedDropoutAddLayerNorm``).

Rewrite (the codemod below), forward only — ``__init__`` and the modules stay:
    h = self.dropout(h); h = self.LayerNorm(h + r)
 => h = dropout_add_layer_norm(self.dropout, self.LayerNorm, h, r)
    h = F.dropout(h, p=self.p, training=self.training); h = self.norm(h + r)
 => h = dropout_add_layer_norm(F.dropout, self.norm, h, r, p=self.p, training=self.training)
    x = x + self.drop1(y); ...; z = self.norm2(x)            (pre-norm: the sum is kept)
 => x, norm2_out = dropout_add_layer_norm(self.drop1, self.norm2, y, x, prenorm=True); ...; z = norm2_out

``adopter.kernels.dropout_add_layer_norm`` runs the fused kernel when, at run time, the dropout is
a plain ``nn.Dropout`` (or ``F.dropout`` with a probability and a bool ``training``), the norm a
plain ``nn.LayerNorm`` and the shapes agree, and the original ``norm(dropout(h, ...) + r)``
otherwise.
"""

from __future__ import annotations

import ast
from dataclasses import replace

from adopter.core.codemod.base import (
    ChainPlan,
    Codemod,
    arg_text,
    fresh_local,
    kernel_name,
    match_function,
    matched_exprs,
    module_handle,
    pos,
    separate_calls,
)
from adopter.core.codemod.context import FileContext, Skip, has_call, is_self_attr, loads, stores
from adopter.core.codemod.edits import Edit, ExprEdit, ForwardEdit, MethodEdit
from adopter.core.dsl import Layer, TensorOp
from adopter.core.match import MatchContext
from adopter.core.match.source import function_ast
from adopter.core.rule import Rule, Runtime, RuntimeSite, RuntimeStep
from adopter.core.rules._common import DROPOUT, LAYER_NORM, first_of, intermediates_unused
from adopter.core.structures import Match
from adopter.core.syntax import walk

DSL = """
rule Dropout_LayerNorm
init:
    torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln
forward:
    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out

# functional dropout (Bart, Whisper, research code): F.dropout(y, p=..., training=...)
rule Dropout_LayerNorm
init:
    torch.nn.LayerNorm($shape, eps=$eps) -> $ln
forward:
    torch.nn.functional.dropout($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
"""

DOC = """\
Fuses a dropout, a residual add and a layer norm into one kernel. A match is a call of
a ``torch.nn.Dropout`` module bound in ``__init__``, or of the functional
``torch.nn.functional.dropout`` (``F.dropout``/``nn.functional.dropout``, any spelling of its
``p``/``training`` arguments), whose output is added (``+``, either operand order, nested or
through assignments) to another tensor, the sum being the input of a ``torch.nn.LayerNorm``
module call, all on one control-flow path of a ``forward`` (or a helper it calls), with the
modules bound in ``__init__`` of the class (or a base class in the same file). The sum may also
be kept (pre-norm blocks: ``x = x + self.drop1(y)`` then ``self.norm2(x)`` while ``x`` is also
the next residual) when it is assigned to a name (``s = a + b``) and the LayerNorm call reads
that name in a later statement of the same block, with only plain assignments without calls
that do not rebind it in between, and nothing in its statement that runs before it or makes it
conditional; the rewrite then takes both the sum and its normalization from the kernel
(``prenorm=True``). Not a match: ``torch.dropout``/``x.dropout`` and other dropout functions;
LayerNorm before Dropout (embeddings); other norm classes (RMSNorm, custom LayerNorm); Dropout
and LayerNorm that are not connected through the add; a dropout output that is also read by
another node (fusion would drop it); a kept sum whose LayerNorm call lies in another block
(``if``), behind code with calls, or after the sum's name is rebound; the same module used as
both layers."""


def _dropout_is_not_layernorm(ctx: MatchContext) -> str | None:
    drop, ln = ctx.binding("$drop"), ctx.binding("$ln")
    if drop is not None and drop == ln:
        return "Dropout and LayerNorm are the same module"
    return None


# ---------------------------------------------------------------- the kept sum (pre-norm)

# Inside the LayerNorm's statement these make it run conditionally or repeatedly.
_CONDITIONAL = (
    ast.IfExp, ast.BoolOp, ast.Compare, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
    ast.Lambda, ast.Await,
)
_NORM_STATEMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)
_EFFECTS = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)


def _plain_names(target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return True
    return isinstance(target, (ast.Tuple, ast.List)) and all(_plain_names(t) for t in target.elts)


def _between_obstacle(stmt: ast.stmt, name: str, handle_names: set[str]) -> str | None:
    """Why ``stmt`` (between the add and the LayerNorm call) keeps the LayerNorm from running
    at the add instead: it is not a plain assignment without calls, or it rebinds the sum or
    what the LayerNorm reference reads."""
    if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
        return None
    if isinstance(stmt, ast.Assign):
        plain = all(_plain_names(t) for t in stmt.targets)
    elif isinstance(stmt, ast.AnnAssign):
        plain = isinstance(stmt.target, ast.Name)
    else:
        plain = False
    if not plain or has_call(stmt):
        return "is not a plain assignment to names without calls"
    clash = stores(stmt) & ({name} | handle_names)
    if clash:
        return f"rebinds {', '.join(sorted(clash))}"
    return None


def prenorm_obstacle(fn: ast.AST, add: ast.BinOp, norm: ast.Call) -> str | None:
    """Why the LayerNorm call ``norm`` cannot run at the add ``add`` (in function ``fn``) with the
    sum kept under its name (the pre-norm rewrite), or None. Plain ``ast``: the scan's
    precondition and the codemod ask the same question."""
    parents = {child: node for node in walk(fn) for child in ast.iter_child_nodes(node)}

    def statement(node: ast.AST) -> ast.AST | None:
        while node is not None and not isinstance(node, ast.stmt):
            node = parents.get(node)
        return node

    add_stmt, norm_stmt = statement(add), statement(norm)
    if not (
        isinstance(add_stmt, ast.Assign)
        and add_stmt.value is add
        and len(add_stmt.targets) == 1
        and isinstance(add_stmt.targets[0], ast.Name)
    ):
        return "the sum is not assigned to a name of its own (`s = a + b`)"
    name = add_stmt.targets[0].id
    if not (len(norm.args) == 1 and not norm.keywords and isinstance(norm.args[0], ast.Name) and norm.args[0].id == name):
        return f"the LayerNorm does not read {name!r} itself"
    owner = parents.get(add_stmt)
    block = next(
        (b for b in (getattr(owner, f, None) for f in ("body", "orelse", "finalbody")) if isinstance(b, list) and add_stmt in b),
        [],
    )
    if norm_stmt not in block or block.index(norm_stmt) <= block.index(add_stmt):
        return (
            f"the LayerNorm call (line {norm.lineno}) is not in a later statement of the add's block "
            f"(line {add.lineno}): the code between is not straight-line"
        )
    handle_names = loads(norm.func)
    if has_call(norm.func):
        return "the LayerNorm is not a module reference"
    for stmt in block[block.index(add_stmt) + 1:block.index(norm_stmt)]:
        why = _between_obstacle(stmt, name, handle_names)
        if why:
            return f"line {stmt.lineno} between the add and the LayerNorm {why}"
    if not isinstance(norm_stmt, _NORM_STATEMENTS):
        return f"the LayerNorm call is part of a {type(norm_stmt).__name__.lower()} statement"
    ancestors = set()
    node = parents.get(norm)
    while node is not None and node is not norm_stmt:
        if isinstance(node, _CONDITIONAL) or isinstance(node, ast.comprehension):
            return "the LayerNorm call runs conditionally or repeatedly within its statement"
        ancestors.add(node)
        node = parents.get(node)
    inside = set(walk(norm))
    for sub in walk(norm_stmt):
        if (
            isinstance(sub, _EFFECTS)
            and sub not in ancestors
            and sub not in inside
            and (sub.lineno, sub.col_offset) < (norm.lineno, norm.col_offset)
        ):
            return "code with calls runs before the LayerNorm call in its statement"
    return None


def _exact(fn: ast.AST, span, kind: type) -> ast.AST | None:
    key = (span.line, span.col, span.end_line, span.end_col)
    return next(
        (n for n in walk(fn) if isinstance(n, kind)
         and (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) == key),
        None,
    )


_SUM_UNUSED = intermediates_unused("$sum")


def _sum_unused_or_kept(ctx: MatchContext) -> str | None:
    """The sum is read only by the LayerNorm (post-norm), or it is kept in a form the pre-norm
    rewrite takes over (:func:`prenorm_obstacle`)."""
    reason = _SUM_UNUSED(ctx)
    if reason is None:
        return None
    add = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, TensorOp)), None)
    norm = next((mn.node for mn in ctx.match.nodes if isinstance(mn.node, Layer) and mn.node.type.endswith("LayerNorm")), None)
    if ctx.source is None or add is None or norm is None or add.span is None or norm.span is None:
        return reason
    if (add.span.function, add.span.inlined_at) != (norm.span.function, norm.span.inlined_at) or not add.span.function:
        return f"{reason}, and the add and the LayerNorm lie in different functions"
    fn = function_ast(ctx.source, add.span.function, add.span.line)
    add_node = _exact(fn, add.span, ast.BinOp) if fn is not None else None
    norm_node = _exact(fn, norm.span, ast.Call) if fn is not None else None
    if add_node is None or norm_node is None:
        return reason
    why = prenorm_obstacle(fn, add_node, norm_node)
    return f"{reason}, and {why}" if why else None


# ---------------------------------------------------------------- codemod

KERNEL = "dropout_add_layer_norm"
F_DROPOUT = "torch.nn.functional.dropout"
F_DROPOUT_PARAMETERS = ("input", "p", "training", "inplace")


def _plain_call(kernel: str, args: list[str]):
    """The kernel call's text, with ``prenorm=True`` when asked."""
    return lambda prenorm: f"{kernel}({', '.join(args + ['prenorm=True'] if prenorm else args)})"


# A subclass that overrides the split helper gets its own helper's output handed to the kernel
# with no dropout: the kernel never fuses for this callable, it runs ``norm(h + residual)``, the
# original computation.
_NO_DROPOUT = "(lambda h: h)"


class _HelperSplit:
    """A dropout that is the return value of a same-class helper method called in the add
    (``norm1(x + self._sa_block(x, mask))``, ``def _sa_block(self, x, mask): ...; return
    self.dropout1(x)``). The helper stays as it is (other callers, subclasses); a new method
    right below it returns the value before the dropout, and the caller hands that and the
    dropout module to the kernel while ``type(self)._sa_block`` is the helper split:
    ``(kernel(self.dropout1, norm, self._sa_block_before_dropout(x, mask), r) if type(self)._sa_block
    is Owner._sa_block else kernel(<no dropout>, norm, self._sa_block(x, mask), r))``."""

    def __init__(self, call: ast.Call, name: str, owner: str, dropout: str, new_name: str,
                 method_edit: MethodEdit | None, ctx: FileContext):
        self.call, self.name, self.owner, self.dropout = call, name, owner, dropout
        self.new_name, self.method_edit, self.ctx = new_name, method_edit, ctx

    @classmethod
    def of(cls, match: Match, ctx: FileContext, drop_node, drop: ast.Call, add: ast.BinOp,
           norm: ast.Call) -> _HelperSplit:
        functions = sorted({mn.node.span.function or match.function for mn in match.nodes if mn.node.span})
        several = Skip(f"matched nodes lie in several functions ({', '.join(functions)})")
        fn, method = ctx.enclosing_function(add), ctx.enclosing_function(drop)
        inlined = drop_node.span.inlined_at if drop_node.span is not None else ()
        if fn is None or method is None or ctx.enclosing_function(norm) is not fn or len(inlined) != 1:
            raise several
        if drop_node.type == F_DROPOUT:
            raise Skip(f"{several}: the helper ends in a functional dropout, whose arguments are the helper's")
        call = next((o for o in (add.left, add.right) if isinstance(o, ast.Call) and is_self_attr(o.func) == method.name
                     and o.lineno <= inlined[0] <= o.end_lineno), None)
        if call is None:
            raise Skip(f"{several}: the add does not read the call of {method.name} itself")
        if match.class_name is None or ctx.enclosing_class_name(fn) is None:
            raise several
        found = ctx.method_in_class_family(match.class_name, method.name)
        if found is None or found[1] is not method:
            raise Skip(f"{several}: self.{method.name} is not the helper that the scan followed")
        owner = found[0]
        if not any(isinstance(st, ast.ClassDef) and st.name == owner for st in ctx.tree.body):
            raise Skip(f"{several}: {owner} is not a module-level class (the guard names it)")
        why = _split_obstacle(ctx, fn, method, drop)
        if why:
            raise Skip(f"{several}: the helper {owner}.{method.name} cannot be split: {why}")
        family = [match.class_name, owner, *ctx.subclasses(owner)]
        if any(ctx.class_attr_stores(c, method.name) for c in family):
            raise Skip(f"{several}: an instance attribute {method.name!r} shadows the helper")
        if owner in stores(fn) or owner in {a.arg for a in walk(fn.args) if isinstance(a, ast.arg)}:
            raise Skip(f"{several}: {owner} names something else in {fn.name}, where the guard reads the class")
        dropout = module_handle(ctx, drop, "Dropout")
        # the same name each time, so a later pass finds the method an earlier one added
        new_name, text = _split_method(ctx, method, drop)
        existing = ctx.method_in_class_family(owner, new_name)
        taken = {m for c in family for m in _method_names(ctx, c)} | _self_attrs(ctx, family)
        if existing is not None:
            if existing[0] != owner or _normalized(ctx, existing[1]) != _normalized_text(text):
                raise Skip(f"{several}: {owner}.{new_name} exists and is not {method.name} without its dropout")
            edit = None
        elif new_name in taken:
            raise Skip(f"{several}: the name {new_name} is taken in the class family")
        else:
            edit = MethodEdit(pos(ctx, method), text)
        return cls(call, method.name, owner, dropout, new_name, edit, ctx)

    def kernel_call(self, kernel: str, norm: str, residual: str):
        ctx, call = self.ctx, self.call
        text = arg_text(ctx, call)
        head = ctx.segment(call.func) if "\n" not in ctx.segment(call) else ast.unparse(call.func)
        if not text.startswith(head):
            raise Skip(f"cannot rename the call {text!r}")
        split = f"self.{self.new_name}{text[len(head):]}"
        guard = f"type(self).{self.name} is {self.owner}.{self.name}"

        def render(prenorm: bool) -> str:
            tail = ", prenorm=True" if prenorm else ""
            fused = f"{kernel}({self.dropout}, {norm}, {split}, {residual}{tail})"
            original = f"{kernel}({_NO_DROPOUT}, {norm}, {text}, {residual}{tail})"
            return f"({fused} if {guard} else {original})"

        return render


def _method_names(ctx: FileContext, class_name: str) -> set[str]:
    cls = ctx.classes.get(class_name)
    return {st.name for st in cls.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))} \
        if cls is not None else set()


def _self_attrs(ctx: FileContext, classes: list[str]) -> set[str]:
    out = set()
    for name in classes:
        for node in walk(ctx.classes[name]) if name in ctx.classes else ():
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
    return out


def _split_obstacle(ctx: FileContext, caller: ast.AST, method: ast.AST, drop: ast.Call) -> str | None:
    """Why ``method`` cannot be split into the value before its final dropout ``drop``, or None."""
    if not isinstance(method, ast.FunctionDef) or method.decorator_list:
        return "it is async or decorated"
    params = method.args.posonlyargs + method.args.args
    caller_params = caller.args.posonlyargs + caller.args.args
    if not params or params[0].arg != "self" or not caller_params or caller_params[0].arg != "self":
        return "its instance parameter (or the caller's) is not named self"
    last = method.body[-1]
    if not (isinstance(last, ast.Return) and last.value is drop):
        return "its dropout is not its final `return self.<dropout>(...)`"
    for node in walk(method):
        if node is not last and isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.FunctionDef,
                                                  ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)) \
                and node is not method:
            return f"it has a {type(node).__name__.lower()} besides its final return (line {node.lineno})"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "it declares global or nonlocal names"
    if len(drop.args) != 1 or drop.keywords or isinstance(drop.args[0], ast.Starred):
        return "its Dropout call does not take exactly one tensor"
    if is_self_attr(drop.func) is None:
        return "its Dropout is not an attribute of self"
    if "self" in stores(method):
        return "it rebinds self"
    lines = ctx.lines[method.lineno - 1:method.end_lineno]
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    if any(line.strip() and not line.startswith(indent) for line in lines):
        return "its text is not indented as a block (a multi-line string)"
    # the new method goes right below the helper; comments there belong to what follows, and
    # the rewrite's tree keeps them inside the helper's block (the insertion would misindent)
    for number, line in enumerate(ctx.lines[method.end_lineno:], method.end_lineno + 1):
        if line.strip():
            if line.lstrip().startswith("#"):
                return f"a comment follows it (line {number})"
            break
    return None


def _split_method(ctx: FileContext, method: ast.FunctionDef, drop: ast.Call) -> tuple[str, str]:
    """``(name, text at column 0)`` of ``method`` without its final dropout: its own text (comments
    kept), renamed, the returned dropout call replaced by the dropout's input."""
    name = f"{method.name}_before_dropout"
    first, last = method.lineno, method.end_lineno
    lines = [line.rstrip("\r\n") for line in ctx.lines[first - 1:last]]
    line, col, end_line, end_col = ctx.char_span(drop)
    if line != end_line:
        raise Skip("the helper's dropout call spans several lines")
    i = line - first
    lines[i] = lines[i][:col] + ctx.segment(drop.args[0]) + lines[i][end_col:]
    header = next(i for i, t in enumerate(lines) if f"def {method.name}" in t)
    lines[header] = lines[header].replace(f"def {method.name}", f"def {name}", 1)
    body = method.body[0].lineno - first
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    inner = lines[body][:len(lines[body]) - len(lines[body].lstrip())]
    note = f"{inner}# {method.name} before its final dropout, which the fused dropout+add+LayerNorm kernel applies"
    if isinstance(method.body[0], ast.Expr) and isinstance(method.body[0].value, ast.Constant) and len(method.body) > 1:
        # the helper's docstring describes the helper, not this
        lines[body:method.body[0].end_lineno - first + 1] = [note]
    else:
        lines.insert(body, note)
    return name, "".join(t[len(indent):] + "\n" if t.strip() else "\n" for t in lines)


def _normalized(ctx: FileContext, method: ast.AST) -> str:
    lines = ctx.lines[method.lineno - 1:method.end_lineno]
    indent = lines[0][:len(lines[0]) - len(lines[0].lstrip())]
    return _normalized_text("".join(t.rstrip("\r\n")[len(indent):] + "\n" for t in lines))


def _normalized_text(text: str) -> str:
    return ast.dump(ast.parse(text))


class DropoutLayerNorm(Codemod):
    rule = "Dropout_LayerNorm"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx, single_function=False)
        drop_node, drop = next(
            ((n, e) for n, e in exprs if isinstance(n, Layer) and (n.type.endswith("Dropout") or n.type == F_DROPOUT)),
            (None, None),
        )
        add = next((e for n, e in exprs if isinstance(n, TensorOp) and n.op == "+"), None)
        norm = next((e for n, e in exprs if isinstance(n, Layer) and n.type.endswith("LayerNorm")), None)
        if not (isinstance(drop, ast.Call) and isinstance(add, ast.BinOp) and isinstance(norm, ast.Call)):
            raise Skip("match does not have a dropout call, a `+` and a LayerNorm call")
        helper = None
        if ctx.enclosing_function(drop) is not ctx.enclosing_function(add):
            # the dropout ends a helper method whose call is added (TransformerEncoderLayer's
            # ``x + self._sa_block(x)``): split the helper, or refuse as before
            helper = _HelperSplit.of(match, ctx, drop_node, drop, add, norm)
        else:
            exprs = matched_exprs(match, ctx)
        fn = ctx.enclosing_function(add) if helper is not None else match_function(match, ctx, exprs)
        if fn is None:
            raise Skip("matched code is not inside a function")
        if len(norm.args) != 1 or norm.keywords:
            raise Skip("the LayerNorm call must take exactly one tensor")
        if helper is not None:
            x, extra, dropout = None, [], helper.dropout
        elif drop_node.type == F_DROPOUT:
            x, extra = self._functional_arguments(ctx, drop)
            dropout = module_handle(ctx, drop, "dropout function")
        else:
            if len(drop.args) != 1 or drop.keywords:
                raise Skip("the Dropout call must take exactly one tensor")
            x, extra = drop.args[0], []
            dropout = module_handle(ctx, drop, "Dropout")
        if helper is not None:
            drop = helper.call  # what the add reads, in the function rewritten
        separate_calls(drop, norm)
        norm_module = module_handle(ctx, norm, "LayerNorm")
        residual = self._residual(ctx, drop, add)
        if residual is add.left and self._inside(drop, add) and has_call(residual) and has_call(x if x else drop):
            raise Skip("the residual and the dropout input both have calls: the kernel call would swap their order")
        spec, kernel = kernel_name(ctx, KERNEL)
        if helper is not None:
            args = helper.kernel_call(kernel, norm_module, arg_text(ctx, residual))
            moved = [(drop, drop), (residual, add)]
        else:
            args = [dropout, norm_module, arg_text(ctx, x), arg_text(ctx, residual)]
            args += [arg_text(ctx, e) if k is None else f"{k}={arg_text(ctx, e)}" for k, e in extra]
            args = _plain_call(kernel, args)
            moved = [(drop.func, drop), (x, drop), *((e, drop) for _, e in extra), (residual, add)]
        nested = norm.args[0] is add
        if not nested:
            add_stmt = ctx.statement_of(add)
            arg = norm.args[0]
            if not (
                isinstance(arg, ast.Name)
                and isinstance(add_stmt, ast.Assign)
                and add_stmt.value is add
                and [t.id for t in add_stmt.targets if isinstance(t, ast.Name)] == [arg.id]
            ):
                raise Skip("the LayerNorm does not read the sum")
        if not nested and self._read_in_loop_before(ctx, fn, add):
            forward = self._prenorm(ctx, fn, drop, add, norm, args, moved, kernel)
        else:
            try:
                plan = ChainPlan(ctx, fn, [drop, add, norm])
                plan.anchor_text = args(False)
                plan.moved = moved
                forward = plan.build()
            except Skip as post_norm:
                if nested:
                    raise
                # the sum is read elsewhere too: keep it (pre-norm form)
                try:
                    forward = self._prenorm(ctx, fn, drop, add, norm, args, moved, kernel)
                except Skip as pre_norm:
                    if str(pre_norm) == str(post_norm):
                        raise post_norm from None
                    raise Skip(f"{post_norm}; keeping the sum: {pre_norm}") from None
        methods = (helper.method_edit,) if helper is not None and helper.method_edit is not None else ()
        return Edit(rule=self.rule, forward=forward, imports=(spec,), methods=methods)

    @staticmethod
    def _inside(node: ast.AST, container: ast.AST) -> bool:
        return (node.lineno, node.col_offset) >= (container.lineno, container.col_offset) and (
            node.end_lineno, node.end_col_offset) <= (container.end_lineno, container.end_col_offset)

    @staticmethod
    def _functional_arguments(ctx: FileContext, call: ast.Call) -> tuple[ast.expr, list[tuple[str | None, ast.expr]]]:
        """``F.dropout``'s input and its other arguments as written (``(keyword or None, expr)``)."""
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            raise Skip("the F.dropout call uses *args or **kwargs")
        if len(call.args) > len(F_DROPOUT_PARAMETERS):
            raise Skip("the F.dropout call has more arguments than F.dropout takes")
        unknown = [k.arg for k in call.keywords if k.arg not in F_DROPOUT_PARAMETERS]
        if unknown:
            raise Skip(f"the F.dropout call passes {', '.join(unknown)}, which F.dropout does not take")
        x = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "input"), None)
        if x is None:
            raise Skip("the F.dropout call has no input")
        extra: list[tuple[str | None, ast.expr]] = [(None, a) for a in call.args[1:]]
        extra += [(k.arg, k.value) for k in call.keywords if k.arg != "input"]
        if any(has_call(e) for _, e in extra):
            raise Skip("the F.dropout arguments have calls: they would run in another order")
        return x, extra

    @staticmethod
    def _residual(ctx: FileContext, drop: ast.Call, add: ast.BinOp) -> ast.expr:
        """The operand of the add that is not the dropout output (a nested call or its assigned name)."""
        drop_stmt = ctx.statement_of(drop)
        nested = drop_stmt is ctx.statement_of(add)
        for this, other in ((add.left, add.right), (add.right, add.left)):
            if this is drop or (
                not nested
                and isinstance(this, ast.Name)
                and isinstance(drop_stmt, ast.Assign)
                and len(drop_stmt.targets) == 1
                and isinstance(drop_stmt.targets[0], ast.Name)
                and drop_stmt.targets[0].id == this.id
            ):
                return other
        raise Skip("the `+` does not read the dropout output")

    @staticmethod
    def _read_in_loop_before(ctx: FileContext, fn: ast.AST, add: ast.BinOp) -> bool:
        """The sum's name is read earlier in a loop body holding the add (the next iteration reads
        this iteration's sum): the statement assigning it must stay."""
        add_stmt = ctx.statement_of(add)
        name = add_stmt.targets[0].id
        node = ctx.parent(add_stmt)
        while node is not None and node is not fn:
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                return any(
                    isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                    and (n.lineno, n.col_offset) < (add_stmt.lineno, add_stmt.col_offset)
                    for n in walk(node)
                )
            node = ctx.parent(node)
        return False

    def _prenorm(self, ctx: FileContext, fn: ast.AST, drop: ast.Call, add: ast.BinOp, norm: ast.Call,
                 args, moved: list, kernel: str) -> ForwardEdit:
        """``s = r + drop(y); ...; norm(s)`` -> ``s, <fresh> = kernel(..., prenorm=True); ...; <fresh>``."""
        why = prenorm_obstacle(fn, add, norm)
        if why:
            raise Skip(why)
        add_stmt, norm_stmt = ctx.statement_of(add), ctx.statement_of(norm)
        name = add_stmt.targets[0].id
        func = norm.func
        base = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "norm"
        out = fresh_local(ctx, fn, f"{base}_out", set())
        plan = ChainPlan(ctx, fn, [drop, add])
        plan.anchor_text = args(True)
        plan.moved = moved
        forward = plan.build()
        return replace(
            forward,
            statements=forward.statements + (pos(ctx, norm_stmt),),
            expr_edits=forward.expr_edits + (
                ExprEdit(ctx.char_span(add_stmt.targets[0]), f"{name}, {out}"),
                ExprEdit(ctx.char_span(norm), out),
            ),
        )

# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    drop = first_of(site.modules, nn.Dropout)
    ln = first_of(site.modules, nn.LayerNorm)
    if ln is None:
        return "the norm that runs is not an nn.LayerNorm", ""
    add_i = next((i for i, n in enumerate(site.nodes) if isinstance(n, TensorOp)), None)
    if add_i is not None:
        for op in site.ops[add_i]:
            shapes = op.input_shapes
            if len(shapes) == 2 and None not in shapes and shapes[0] != shapes[1]:
                return f"residual add broadcasts ({list(shapes[0])} + {list(shapes[1])})", ""
    dropout = f"Dropout(p={drop.p})" if drop is not None else "F.dropout"
    return None, f"{dropout} + LayerNorm{tuple(ln.normalized_shape)} eps={ln.eps}"


RUNTIME = Runtime(
    check=_runtime_check,
    sequence=(
        RuntimeStep("torch.nn.Dropout", module_types=(DROPOUT,)),
        RuntimeStep("+", ops=frozenset({"add", "add_"})),
        RuntimeStep("torch.nn.LayerNorm", module_types=(LAYER_NORM,)),
    ),
    leaf_modules=(DROPOUT, LAYER_NORM),
)

RULE = Rule(
    name="Dropout_LayerNorm",
    chain=True,
    kernel="adopter.kernels.dropout_add_layer_norm",
    doc=DOC,
    dsl=DSL,
    codemod=DropoutLayerNorm(),
    runtime=RUNTIME,
    fixtures="Dropout_LayerNorm",
    preconditions=(intermediates_unused("$y"), _sum_unused_or_kept, _dropout_is_not_layernorm),
)
