"""The codemod of linear_cross_entropy: the site the analysis found (carried on the match, see
:mod:`.site`) becomes one kernel call, forward only (``__init__``, the head module and the state dict
stay).

transformers' form (``adopter.kernels.linear_cross_entropy``)::

    logits = self.lm_head(hidden_states)          (or hidden_states[:, slice_indices, :], ...)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
 => logits, loss = linear_cross_entropy(  # adopter: logits is None when training with labels ...
        self.lm_head, hidden_states, self.loss_function if labels is not None else None, labels=labels,
        vocab_size=self.config.vocab_size, **kwargs
    )

The written-out form (``adopter.kernels.lm_head_cross_entropy``): the head statement (and the
shift's) go, the cross entropy's statement becomes one call that gets the head, its input, the cross
entropy and the logits' layout; under the run-time guards of an inlined helper when it has some.

The site's positions are found again in this file's tree (``FileContext.expr_at``); what is checked
here is only what the rewrite itself needs (the statements it replaces, their shape), never whether
the site is one: that is the analysis', done once.
"""

from __future__ import annotations

import ast

from adopter.core.codemod.base import Codemod, arg_text, kernel_name, matched_exprs, module_handle, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.rules.linear_cross_entropy.analysis import analyse
from adopter.core.rules.linear_cross_entropy.loss_function import labels_argument
from adopter.core.rules.linear_cross_entropy.site import CrossEntropySite, ExprRef, LossFunctionSite
from adopter.core.rules.linear_cross_entropy.written_out import loss_target
from adopter.core.structures import Match
from adopter.core.syntax import walk

KERNEL = "linear_cross_entropy"
CE_KERNEL = "lm_head_cross_entropy"
# What the rewritten call says in the diff (the one observable difference of the fused path).
NOTE = "adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them"
# the kernel's own keywords for the layout: a cross entropy called with one of them cannot be handed over
LAYOUT_KEYWORDS = ("rows", "contiguous", "flatten", "vocab", "upcast")


class LinearCrossEntropy(Codemod):
    rule = "linear_cross_entropy"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        (_, head_call), = exprs
        fn = ctx.enclosing_function(head_call)
        if fn is None or not isinstance(head_call, ast.Call) or len(head_call.args) != 1 or head_call.keywords:
            raise Skip("the head must be a module called with one tensor inside a function")
        site = match.site
        if not isinstance(site, (LossFunctionSite, CrossEntropySite)):
            # a match the scan's precondition did not analyse (built elsewhere): analysed here, as there
            found = analyse(ctx.text, match.nodes[0].node.span, match.class_name)
            if isinstance(found, str):
                raise Skip(str(found))
            site = found
        if isinstance(site, LossFunctionSite):
            return loss_function_edit(ctx, head_call, site)
        return cross_entropy_edit(ctx, fn, head_call, site)


# ---------------------------------------------------------------- transformers' form


def _is_not_none_test(test: ast.expr, name: str) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _block(ctx: FileContext, stmt: ast.stmt) -> list[ast.stmt]:
    owner = ctx.parent(stmt)
    for name in ("body", "orelse", "finalbody"):
        block = getattr(owner, name, None)
        if isinstance(block, list) and stmt in block:
            return block
    for handler in getattr(owner, "handlers", ()):
        if stmt in handler.body:
            return handler.body
    return [stmt]


def loss_function_edit(ctx: FileContext, head_call: ast.Call, site: LossFunctionSite) -> Edit:
    """The rewrite of transformers' form; raises :class:`Skip` when the statements are not
    ``head; [loss = None]; if <labels> is not None: loss = self.loss_function(...)``."""
    head_stmt = ctx.statement_of(head_call)
    call = ctx.expr_at(site.loss_call)
    loss_stmt = ctx.statement_of(call)
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is call and len(loss_stmt.targets) == 1
            and isinstance(loss_stmt.targets[0], ast.Name)):
        raise Skip(f"line {loss_stmt.lineno}: the loss call is not assigned to a plain name")
    loss = loss_stmt.targets[0].id
    guard = ctx.parent(loss_stmt)
    labels = labels_argument(call)
    if not isinstance(labels, ast.Name):
        raise Skip("the loss call's labels are not a plain name")
    if not (isinstance(guard, ast.If) and guard.body == [loss_stmt] and not guard.orelse
            and _is_not_none_test(guard.test, labels.id)):
        raise Skip(f"line {loss_stmt.lineno}: the loss is not computed alone under `if {labels.id} is not None:` "
                   "(the kernel returns no loss exactly when the labels are None)")
    block = _block(ctx, head_stmt)
    if guard not in block:
        raise Skip(f"the head (line {head_stmt.lineno}) and the loss's `if` (line {guard.lineno}) are in "
                   "different blocks")
    loss_none = block[block.index(head_stmt) + 1:block.index(guard)]
    for stmt in loss_none:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == loss and isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
            raise Skip(f"line {stmt.lineno} lies between the head and the loss (the fused call replaces both)")
    if any(isinstance(a, ast.Starred) for a in call.args):
        raise Skip("the loss call unpacks positional arguments")
    if call.args and (len(call.args) < 2 or any(k.arg in ("logits", "labels") for k in call.keywords)):
        raise Skip("the loss call passes the logits positionally but not the labels")
    if not call.args and call.keywords and call.keywords[0].arg is None and "logits" not in [
            k.arg for k in call.keywords]:
        raise Skip("the loss call passes no logits argument")
    head = module_handle(ctx, head_call, "head")
    hidden = arg_text(ctx, head_call.args[0])
    if call.args:  # (logits, labels, rest...): the kernel gets (labels, rest...)
        rest = [arg_text(ctx, a) for a in call.args[1:]]
    else:
        rest = []
    rest += [f"{k.arg}={arg_text(ctx, k.value)}" if k.arg else f"**{arg_text(ctx, k.value)}"
             for k in call.keywords if k.arg != "logits"]
    spec, kernel = kernel_name(ctx, KERNEL)
    # the source reads ``self.loss_function`` under ``if labels is not None`` only (transformers'
    # property logs a warning per read where the model has no loss_type, and torch.compile breaks
    # the graph on that logging): read exactly then, the kernel never calls it without labels
    loss_function = f"{arg_text(ctx, call.func)} if {labels.id} is not None else None"
    args = ", ".join([head, hidden, loss_function] + rest)
    text = f"{site.logits}, {loss} = {kernel}(  # {NOTE}\n    {args}\n)"
    statements = [head_stmt, *loss_none, guard]
    forward = ForwardEdit(
        statements=tuple(pos(ctx, s) for s in statements),
        anchor=pos(ctx, guard),
        statement_edits=(StatementEdit(pos(ctx, guard), text),),
        delete=tuple(pos(ctx, s) for s in statements[:-1]),
    )
    return Edit(rule=LinearCrossEntropy.rule, forward=forward, imports=(spec,))


# ---------------------------------------------------------------- the written-out form


def _text(ctx: FileContext, ref: ExprRef) -> str:
    """The text the rewrite writes for ``ref``: its source (unparsed when it spans lines), or the
    text the analysis gave an expression that is in no place of the file."""
    return ref.text if ref.at is None else arg_text(ctx, ctx.expr_at(ref.at))


def _rows_text(ctx: FileContext, rows: tuple) -> str:
    parts = []
    for bounds in rows:
        if bounds is None:
            parts.append("...")
            continue
        texts = [_text(ctx, b) if b is not None else "None" for b in bounds]
        while len(texts) > 1 and texts[-1] == "None":
            texts.pop()  # slice(None, -1), slice(None): what t[:-1], t[:] mean
        parts.append(f"slice({', '.join(texts)})")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _check_head_inputs_kept(fn: ast.AST, head_call: ast.Call, head_stmt: ast.stmt, moved: list[ast.stmt],
                            loss_stmt: ast.stmt) -> None:
    """The head's call moves down to the loss statement: nothing it reads may change on the way."""
    head_names = {n.id for n in walk(head_call) if isinstance(n, ast.Name)}
    head_text = ast.unparse(head_call)
    moved_ids = {id(s) for s in moved}
    for node in walk(fn):
        if not (isinstance(node, ast.stmt) and id(node) not in moved_ids
                and (head_stmt.end_lineno, head_stmt.end_col_offset) <= (node.lineno, node.col_offset)
                and (node.lineno, node.col_offset) < (loss_stmt.lineno, loss_stmt.col_offset)):
            continue
        if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)):
            continue  # their statements are visited themselves
        for sub in walk(node):
            written = None
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)) and sub.id in head_names:
                written = sub.id
            elif isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)) \
                    and ast.unparse(sub) in head_text:
                written = ast.unparse(sub)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr.endswith("_") \
                    and not sub.func.attr.startswith("_") and ast.unparse(sub.func.value) in head_text:
                written = ast.unparse(sub.func.value)
            if written:
                raise Skip(f"line {node.lineno} changes {written}, which the head reads, between the head and "
                           "the loss (the fused call runs the head at the loss)")


def cross_entropy_edit(ctx: FileContext, fn: ast.AST, head_call: ast.Call, site: CrossEntropySite) -> Edit:
    """The rewrite of a written-out cross entropy site: the head statement (and the shift's) go, the
    cross entropy's statement becomes one ``lm_head_cross_entropy`` call (see the kernel)."""
    head_stmt = ctx.statement_of(head_call)
    shift_stmt = ctx.statement_of(ctx.expr_at(site.shift_value)) if site.shift_value is not None else None
    loss_call = ctx.expr_at(site.loss_call)
    loss_stmt = ctx.statement_of(loss_call)
    target = loss_target(loss_stmt)
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is loss_call and target is not None):
        raise Skip(f"line {loss_stmt.lineno}: the cross entropy is not assigned to a plain name or self.<attr>")
    loss = ast.unparse(target)
    if loss in (site.logits, site.shift):
        raise Skip(f"line {loss_stmt.lineno}: the loss is bound to the logits' name")
    _check_head_inputs_kept(fn, head_call, head_stmt, [s for s in (head_stmt, shift_stmt, loss_stmt) if s], loss_stmt)
    head = module_handle(ctx, head_call, "head")
    hidden = arg_text(ctx, head_call.args[0])
    layout = site.layout
    named = []
    if layout.rows is not None:
        named.append(f"rows={_rows_text(ctx, layout.rows)}")
    if layout.contiguous:
        named.append("contiguous=True")
    if layout.flatten != "view":
        named.append(f'flatten="{layout.flatten}"' if isinstance(layout.flatten, str) else
                     f"flatten={layout.flatten!r}")
    if layout.vocab is not None:
        named.append(f"vocab={_text(ctx, layout.vocab)}")
    if layout.upcast:
        named.append("upcast=True")
    if any(name in LAYOUT_KEYWORDS for name, _ in site.keywords):
        raise Skip("the cross entropy is called with a keyword the kernel's layout uses")
    keywords = [f"{name}={_text(ctx, value)}" if name else f"**{_text(ctx, value)}" for name, value in site.keywords]
    if site.unpacks_args:
        raise Skip("the cross entropy's arguments are unpacked")
    spec, kernel = kernel_name(ctx, CE_KERNEL)
    args = [head, hidden, _text(ctx, site.loss_fn)] + [_text(ctx, a) for a in site.args] + named + keywords
    indent = ctx.lines[loss_stmt.lineno - 1][:loss_stmt.col_offset] + ("    " if site.guards else "")
    one_line = ", ".join(args)
    if len(indent) + 4 + len(one_line) <= 110:
        text = f"{site.logits}, {loss} = {kernel}(  # {NOTE}\n    {one_line}\n)"
    else:
        text = f"{site.logits}, {loss} = {kernel}(  # {NOTE}\n" + "".join(f"    {a},\n" for a in args) + ")"
    statements = sorted([s for s in (head_stmt, shift_stmt, loss_stmt) if s is not None],
                        key=lambda s: (s.lineno, s.col_offset))
    if site.guards:
        # the helper is that cross entropy only when the guards hold (litgpt's ``chunk_size == 0``
        # with the chunk size read off the config): they are evaluated at run time, in the call's
        # place, and any other value runs the user's statements (head, shift, helper call) as written
        test = " and ".join(site.guards)
        original = "\n".join(_statement_text(ctx, s) for s in statements)
        text = (f"if {test}:  # adopter: only then is {site.helper}(...) the plain cross entropy\n"
                f"{_indented(text)}\nelse:\n{_indented(original)}")
    # a ``return`` of the logits before the loss (litgpt's ``if targets is None: return logits``)
    # leaves the function on a path that never reaches the loss: the head moves there too
    head_text = _statement_text(ctx, head_stmt)
    returns = [ctx.statement_of(ctx.expr_at(value)) for value in site.early_returns]
    early = tuple(StatementEdit(pos(ctx, r), f"{head_text}\n{_statement_text(ctx, r)}") for r in returns)
    forward = ForwardEdit(
        statements=tuple(pos(ctx, s) for s in statements),
        anchor=pos(ctx, loss_stmt),
        statement_edits=(StatementEdit(pos(ctx, loss_stmt), text),) + early,
        delete=tuple(pos(ctx, s) for s in statements if s is not loss_stmt),
    )
    return Edit(rule=LinearCrossEntropy.rule, forward=forward, imports=(spec,))


def _indented(text: str) -> str:
    return "\n".join("    " + line if line.strip() else line for line in text.split("\n"))


def _statement_text(ctx: FileContext, stmt: ast.stmt) -> str:
    """The source of ``stmt`` (a simple statement alone on its lines), its continuation lines
    dedented by the statement's indentation; Skip when it shares a line or holds a multi-line string
    (re-indenting would change it)."""
    first = ctx.lines[stmt.lineno - 1].encode()
    last = ctx.lines[stmt.end_lineno - 1].encode()
    after = last[stmt.end_col_offset:].decode().strip()
    if first[:stmt.col_offset].strip() or (after and not after.startswith("#")):
        raise Skip(f"line {stmt.lineno} shares its line with another statement")
    if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "\n" in n.value for n in walk(stmt)) \
            or isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef, ast.ClassDef)):
        raise Skip(f"line {stmt.lineno} cannot be copied into the guarded rewrite")
    prefix = first[:stmt.col_offset].decode()
    lines = ctx.segment(stmt).split("\n")
    return "\n".join([lines[0]] + [line[len(prefix):] if line.startswith(prefix) else line.lstrip()
                                    for line in lines[1:]])
