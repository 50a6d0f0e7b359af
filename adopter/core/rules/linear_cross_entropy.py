"""linear_cross_entropy: the LM head followed by the model's causal-LM loss, fused and chunked so the
``(tokens x vocab)`` logits never exist in training.

Rewrite (the codemod below), forward only — ``__init__``, the head module and the state dict stay:

    logits = self.lm_head(hidden_states)          (or hidden_states[:, slice_indices, :], ...)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
 => logits, loss = linear_cross_entropy(  # adopter: logits is None when training with labels ...
        self.lm_head, hidden_states, self.loss_function if labels is not None else None, labels=labels,
        vocab_size=self.config.vocab_size, **kwargs
    )

The loss call's arguments other than the logits are handed over verbatim; the loss function is read
only when the labels are not None, where the source read it. ``adopter.kernels.linear_cross_entropy``
decides at run time (see ``kernels/guarded_linear_cross_entropy.py``): training with labels, a plain
``nn.Linear`` head and transformers' ``ForCausalLMLoss`` run fused and return ``(None, loss)``;
anything else (eval, no labels, another loss function, ``ADOPTER_KEEP_LOGITS=1``) runs the original
statements. Statically, a site is only rewritten when nothing but the loss and the returned output
reads the logits.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from adopter.core.codemod.base import Codemod, arg_text, kernel_name, matched_exprs, module_handle, pos
from adopter.core.codemod.context import FileContext, Skip
from adopter.core.codemod.edits import Edit, ForwardEdit, StatementEdit
from adopter.core.match import MatchContext, NotACandidate, Refusal
from adopter.core.match.source import function_ast, parse_file, same_file_lineage, source_lines
from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules._common import LINEAR
from adopter.core.structures import Match
from adopter.core.syntax import per_node, walk

DSL = """
rule linear_cross_entropy
init:
    torch.nn.Linear($hidden, $vocab) -> $head
forward:
    torch.nn.Linear@$head($h) -> $logits
"""

KERNEL = "linear_cross_entropy"
LOSS_METHOD = "loss_function"
# What the rewritten call says in the diff (the one observable difference of the fused path).
NOTE = "adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them"

DOC = """\
Fuses a causal language model's head with its loss: in training with labels the loss is computed
chunk by chunk over the tokens, with the gradients of the hidden states and of the head's weight
(and bias) produced per chunk, so the ``(tokens x vocab)`` logits never exist. A match is a
``torch.nn.Linear`` head module call ``<logits> = self.<head>(<hidden>)`` (any hidden-state
expression: ``hidden_states[:, slice_indices, :]``, ``slice_logits_to_keep(...)``'s result) whose
output is the logits argument (first positional or ``logits=``) of ``self.loss_function(...)`` in
the same function: transformers' causal-LM spelling ``loss = self.loss_function(logits=logits,
labels=labels, vocab_size=self.config.vocab_size, **kwargs)`` (about 110 modeling files) and its
positional form ``self.loss_function(logits, labels, self.vocab_size, **kwargs)``. The rewrite
needs ``loss = None`` / ``if <labels> is not None: loss = self.loss_function(...)`` right after the
head (otherwise the codemod says why it skips). At run time the fused path runs only when training
with labels (grad on, head in training mode), with a plain ``nn.Linear`` head and transformers'
``ForCausalLMLoss`` (same loss: labels shifted by one and padded with ``ignore_index``, or
``shift_labels``; ``ignore_index``; fp32 log-softmax; ``sum / num_items_in_batch`` or the mean) and
returns **no logits** (None) — eval, inference without labels, any other loss function or loss
keyword, and ``ADOPTER_KEEP_LOGITS=1`` / ``keep_logits()`` run the original code and return them.
Refused: ``logits-transformed`` — the logits are rebound or changed in place between the head
and the loss (Gemma2/3 ``final_logit_softcapping``, Cohere ``logit_scale``, a division by a
temperature); ``logits-read`` — the logits are read anywhere else than the loss call's logits
argument and the output the function packs them into (``CausalLMOutput(..., logits=logits)``,
a tuple), e.g. ``vocab_size=logits.shape[-1]`` or a second loss on them. Not a match: a head whose
output reaches no ``self.loss_function`` nor a written-out cross entropy, a Linear output not
assigned to a plain name.

Written out (issue 24): torch's cross entropy of the logits laid out as ``(tokens, vocab)``
(``F.cross_entropy``, an ``nn.CrossEntropyLoss``, a shift ``logits[..., :-1, :]``, a same-file
helper inlined when straight-line once the call settles its ``if``s: ``isinstance(<the head's
tensor>, list)`` is False, ``chunk_size == 0`` with a constant argument or default picks the plain
cross entropy; a call that settles litgpt's chunked sum over ``max(count, 1)`` (0, not nan, for an
all-ignored batch) leaves the site alone; a chunk size the call reads off the model or its config
(a name or attribute chain: ``chunk_size=self.config.loss_chunk_size``) becomes a run-time guard,
``if self.config.loss_chunk_size == 0:`` the fused kernel, else the head and the helper's call as
written — the analysed value is never written into the source). A ``return`` of the logits before
the loss (litgpt's ``if targets is None: return logits``, in ``if``s below the head) gets the head
call on its path.
The loss may go to ``self.<attr>`` with the logits returned alone (llama2.c's ``self.last_loss``):
the convention of a returned ``(logits, loss)`` applies (no logits in training, the kernel's
``LogitsNotComputedWarning``); a local loss with ``return logits`` is refused ``logits-read``.
LM head or classifier is decided from what the head reads: a vector per example — a token picked
by an int index before the last dimension (``h[:, 0]``, ``h[:, -1, :]``) or a reduction over a
dimension (``h.mean(1)``), seen through names, ``self.<module>(...)`` calls, activations and casts
— is a sequence classifier (not a match). A head over every token position is an LM head when
it predicts what the model embeds: its weight is tied to another module's, or its output size is
the size an embedding of the file is built with (``nn.Linear(d, cfg.vocab_size)`` beside
``nn.Embedding(cfg.vocab_size, d)``). A head over a size no embedding of the file has
(``nn.Linear(d, cfg.num_labels)``: a token classifier, transformers' ``*ForTokenClassification``)
is not a match: the kernel would compute it exactly, but its logits are small, so nothing is
saved, and training would lose them. Where the file embeds nothing or the head is built
elsewhere, it is matched; the run-time guard checks the layout and shapes. An input the source
does not settle (an argument, another module's output) is matched likewise."""


# ---------------------------------------------------------------- the site, read from the function's ast


@dataclass
class HeadLossSite:
    """The head statement, the loss call reading its output and what surrounds them."""

    head_stmt: ast.Assign
    head_call: ast.Call
    logits: str  # name the head's output is bound to
    loss_call: ast.Call
    # filled by :func:`site_structure` (what the rewrite needs)
    loss_stmt: ast.Assign | None = None
    guard: ast.If | None = None
    labels: str = ""
    loss_none: list[ast.stmt] = field(default_factory=list)


class NotAMatch(Exception):
    """The Linear is not an LM head feeding ``self.loss_function``."""


@per_node(64)  # (every Linear of a function asks for the same map: a file's dozens walked it again)
def _parents(fn: ast.AST) -> dict[ast.AST, ast.AST]:
    out = {}
    for node in walk(fn):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _statement(node: ast.AST, parents: dict) -> ast.stmt:
    while not isinstance(node, ast.stmt):
        node = parents[node]
    return node


def _at(node: ast.AST) -> tuple[int, int]:
    return node.lineno, node.col_offset


def _end(node: ast.AST) -> tuple[int, int]:
    return node.end_lineno, node.end_col_offset


def _is_loss_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == LOSS_METHOD
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")


def _logits_argument(call: ast.Call) -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == "logits"), None)


def _labels_argument(call: ast.Call) -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[1] if len(call.args) > 1 and not isinstance(call.args[1], ast.Starred) else None
    return next((k.value for k in call.keywords if k.arg == "labels"), None)


def _passes_vocab_size(call: ast.Call) -> bool:
    """A language-model loss call: ``vocab_size=...`` or a third positional argument naming a vocab
    size (``self.vocab_size``, ``self.config.text_config.vocab_size``); classification losses take
    ``(logits, labels, self.config)``."""
    if any(k.arg == "vocab_size" for k in call.keywords):
        return True
    third = call.args[2] if len(call.args) > 2 else None
    return third is not None and "vocab_size" in ast.unparse(third)


def find_site(fn: ast.AST, head_call: ast.Call) -> HeadLossSite:
    """The LM head site of ``head_call`` in ``fn``; raises :class:`NotAMatch` when the head's output
    reaches no ``self.loss_function`` as its logits."""
    parents = _parents(fn)
    head_stmt = _statement(head_call, parents)
    if not (isinstance(head_stmt, ast.Assign) and head_stmt.value is head_call and len(head_stmt.targets) == 1
            and isinstance(head_stmt.targets[0], ast.Name)):
        raise NotAMatch("the Linear's output is not assigned to a plain name")
    logits = head_stmt.targets[0].id
    calls = [n for n in walk(fn) if _is_loss_call(n) and _at(n) > _at(head_stmt)
             and isinstance(_logits_argument(n), ast.Name) and _logits_argument(n).id == logits]
    if not calls:
        raise NotAMatch(f"{logits} reaches no self.{LOSS_METHOD}(...) as its logits")
    if len(calls) > 1:
        raise NotAMatch(f"{logits} reaches {len(calls)} self.{LOSS_METHOD} calls")
    if not _passes_vocab_size(calls[0]):
        raise NotAMatch(f"self.{LOSS_METHOD} gets no vocab_size: not a language-model loss")
    return HeadLossSite(head_stmt=head_stmt, head_call=head_call, logits=logits, loss_call=calls[0])


def _packed(name: ast.Name, parents: dict) -> bool:
    """``name`` is packed into a returned structure: an element of a tuple/list/dict display or an
    argument of a ``...Output...(...)`` constructor (transformers' ModelOutput classes)."""
    parent = parents.get(name)
    if isinstance(parent, ast.keyword):
        parent = parents.get(parent)
        if not isinstance(parent, ast.Call):
            return False
    if isinstance(parent, (ast.Tuple, ast.List)) or (isinstance(parent, ast.Dict) and name in parent.values):
        return True
    if isinstance(parent, ast.Call) and parent.func is not name:
        func = parent.func
        callee = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return "Output" in callee
    return False


def logits_refusal(fn: ast.AST, site: HeadLossSite, source_line) -> Refusal | None:
    """``logits-transformed`` when the logits change between the head and the loss; ``logits-read``
    when they are read elsewhere than the loss call's logits argument and a packed output."""
    parents = _parents(fn)
    name = site.logits
    loss_stmt = _statement(site.loss_call, parents)
    logits_arg = _logits_argument(site.loss_call)
    uses = sorted((n for n in walk(fn) if isinstance(n, ast.Name) and n.id == name and n is not logits_arg
                   and _at(n) > _end(site.head_stmt)), key=_at)
    # first whatever changes the logits before the loss, then any other read
    for node in uses:
        stmt = _statement(node, parents)
        if _at(node) >= _at(loss_stmt):
            break
        parent = parents.get(node)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            return Refusal("logits-transformed", f"line {stmt.lineno} rebinds {name} between the head and the "
                                                 f"loss ({source_line(stmt.lineno)}): the fused loss would take "
                                                 "the head's output")
        in_place = isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
        if in_place or (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)):
            return Refusal("logits-transformed", f"line {stmt.lineno} changes {name} in place between the head "
                                                 f"and the loss ({source_line(stmt.lineno)})")
    for node in uses:
        stmt = _statement(node, parents)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            break  # rebound after the loss: later reads see another value
        if _inside(node, site.loss_call):
            return Refusal("logits-read", f"the loss call reads {name} beside its logits argument "
                                          f"({source_line(stmt.lineno)})")
        if _at(node) > _end(loss_stmt) and _packed(node, parents):
            continue
        return Refusal("logits-read", f"line {stmt.lineno} reads {name} ({source_line(stmt.lineno)}): in training "
                                      "the fused path never computes the logits")
    return None


def _inside(node: ast.AST, container: ast.AST) -> bool:
    return _at(container) <= _at(node) and _end(node) <= _end(container)


def site_structure(fn: ast.AST, site: HeadLossSite) -> HeadLossSite:
    """Fill in the statements the rewrite replaces; raises :class:`Skip` when the shape is not
    ``head; [loss = None]; if <labels> is not None: loss = self.loss_function(...)``."""
    parents = _parents(fn)
    loss_stmt = _statement(site.loss_call, parents)
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is site.loss_call and len(loss_stmt.targets) == 1
            and isinstance(loss_stmt.targets[0], ast.Name)):
        raise Skip(f"line {loss_stmt.lineno}: the loss call is not assigned to a plain name")
    loss = loss_stmt.targets[0].id
    guard = parents.get(loss_stmt)
    labels = _labels_argument(site.loss_call)
    if not isinstance(labels, ast.Name):
        raise Skip("the loss call's labels are not a plain name")
    if not (isinstance(guard, ast.If) and guard.body == [loss_stmt] and not guard.orelse
            and _is_not_none_test(guard.test, labels.id)):
        raise Skip(f"line {loss_stmt.lineno}: the loss is not computed alone under `if {labels.id} is not None:` "
                   "(the kernel returns no loss exactly when the labels are None)")
    block = _block(site.head_stmt, parents)
    if guard not in block:
        raise Skip(f"the head (line {site.head_stmt.lineno}) and the loss's `if` (line {guard.lineno}) are in "
                   "different blocks")
    between = block[block.index(site.head_stmt) + 1:block.index(guard)]
    for stmt in between:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id == loss and isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
            raise Skip(f"line {stmt.lineno} lies between the head and the loss (the fused call replaces both)")
    call = site.loss_call
    if any(isinstance(a, ast.Starred) for a in call.args):
        raise Skip("the loss call unpacks positional arguments")
    if call.args and (len(call.args) < 2 or any(k.arg in ("logits", "labels") for k in call.keywords)):
        raise Skip("the loss call passes the logits positionally but not the labels")
    if not call.args and call.keywords and call.keywords[0].arg is None and "logits" not in [
            k.arg for k in call.keywords]:
        raise Skip("the loss call passes no logits argument")
    site.loss_stmt, site.guard, site.labels, site.loss_none = loss_stmt, guard, labels.id, between
    return site


def _is_not_none_test(test: ast.expr, name: str) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _block(stmt: ast.stmt, parents: dict) -> list[ast.stmt]:
    owner = parents[stmt]
    for name in ("body", "orelse", "finalbody"):
        block = getattr(owner, name, None)
        if isinstance(block, list) and stmt in block:
            return block
    for handler in getattr(owner, "handlers", ()):
        if stmt in handler.body:
            return handler.body
    return [stmt]


# ---------------------------------------------------------------- issue 24: a written-out cross entropy
#
# The head's output reaching torch's cross entropy as the source writes it out (nanoGPT, minGPT, GPT-2
# style, torchtitan/litgpt-style helpers): ``F.cross_entropy(logits.view(-1, logits.size(-1)), ...)``,
# an ``nn.CrossEntropyLoss`` (bound in ``__init__``, a local, or built inline), a shift
# ``logits[..., :-1, :].contiguous()`` on the way, or a module-level helper of the same file that is
# provably that expression. What the code computes decides, never a name.

CE_KERNEL = "lm_head_cross_entropy"
CE_FUNCTION = "torch.nn.functional.cross_entropy"
CE_MODULES = ("torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss")
_FLOAT32 = ("torch.float32", "torch.float")


@dataclass
class Layout:
    """How the source turns the logits into the cross entropy's ``(tokens, vocab)`` input, in this
    order: ``logits[rows]``, ``.contiguous()``, ``.view/.reshape(-1, vocab)`` or ``.flatten(a, b)``,
    ``.float()``."""

    rows: ast.Subscript | None = None
    contiguous: bool = False
    flatten: str | tuple[int, int] = "view"
    vocab: ast.expr | None = None  # None: the logits' own last size (``logits.size(-1)``)
    upcast: bool = False


@dataclass
class CrossEntropySite:
    """The head statement, the cross entropy reading its output and how."""

    head_stmt: ast.Assign
    head_call: ast.Call
    logits: str
    loss_call: ast.Call  # the call in the function: the cross entropy, or the helper's call
    kind: str  # "function" (F.cross_entropy), "module" (an nn.CrossEntropyLoss), "helper"
    loss_fn: ast.expr  # what the kernel gets as the cross entropy
    args: list[ast.expr]  # the cross entropy's positional arguments after its input
    keywords: list[ast.keyword]  # ... and its keywords other than ``input``
    layout: Layout
    reads: set = field(default_factory=set)  # the Name nodes of the function the layout reads (allowed)
    shift_stmt: ast.Assign | None = None  # ``shift_logits = logits[..., :-1, :].contiguous()``
    shift: str = ""
    helper: ast.FunctionDef | None = None
    # tests (of the helper call's arguments) under which the inlined helper is that cross entropy:
    # the rewrite fuses only when they hold at run time and keeps the helper's call otherwise
    guards: list[ast.expr] = field(default_factory=list)

    @property
    def synthesized(self) -> bool:
        """Arguments come from an inlined helper (texts are unparsed, not source segments)."""
        return self.helper is not None


def _import_map(tree: ast.Module, fn: ast.AST | None = None) -> dict[str, str]:
    """Local name -> fully qualified name of the imports at module level (under ``if``/``try`` too)
    and inside ``fn``."""
    out: dict[str, str] = {}
    scopes: list[ast.AST] = [tree] + ([fn] if fn is not None else [])
    for scope in scopes:
        stack = list(scope.body)
        while stack:
            node = stack.pop(0)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        out[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.If, ast.Try)):
                stack += list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    stack += handler.body
    return out


def _dotted_name(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _qualified(node: ast.AST, imports: dict[str, str], local: set[str]) -> str | None:
    """``F.cross_entropy`` -> ``torch.nn.functional.cross_entropy`` through the imports; None when
    the first name is bound in the function (``local``) or not a dotted name."""
    name = _dotted_name(node)
    if name is None:
        return None
    head, _, rest = name.partition(".")
    if head in local:
        return None
    full = imports.get(head, head)
    return f"{full}.{rest}" if rest else full


def _stored_names(fn: ast.AST) -> set[str]:
    out = {a.arg for a in walk(fn.args) if isinstance(a, ast.arg)} if hasattr(fn, "args") else set()
    for node in walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add((node.asname or node.name).split(".")[0])
    return out


def _int_literal(node: ast.AST | None) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def _names_in(node: ast.AST, names: set[str]) -> list[ast.Name]:
    return [n for n in walk(node) if isinstance(n, ast.Name) and n.id in names]


def _last_size_of(node: ast.AST, names: set[str]) -> ast.Name | None:
    """The Name of ``<n>.size(-1)`` / ``<n>.shape[-1]`` (``n`` in ``names``), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names and not node.keywords \
            and len(node.args) == 1 and _int_literal(node.args[0]) == -1:
        return node.func.value
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape" \
            and isinstance(node.value.value, ast.Name) and node.value.value.id in names \
            and _int_literal(node.slice) == -1:
        return node.value.value
    return None


def _own_last_size(vocab: ast.AST, receiver: ast.AST) -> ast.AST | None:
    """``receiver`` itself when ``vocab`` is ``<receiver>.size(-1)`` / ``<receiver>.shape[-1]`` for
    a receiver that is not a plain name (handled by :func:`_last_size_of`), else None."""
    if isinstance(receiver, ast.Name):
        return None
    if isinstance(vocab, ast.Call) and isinstance(vocab.func, ast.Attribute) and vocab.func.attr == "size" \
            and not vocab.keywords and len(vocab.args) == 1 and _int_literal(vocab.args[0]) == -1:
        inner = vocab.func.value
    elif isinstance(vocab, ast.Subscript) and isinstance(vocab.value, ast.Attribute) \
            and vocab.value.attr == "shape" and _int_literal(vocab.slice) == -1:
        inner = vocab.value.value
    else:
        return None
    return inner if ast.dump(inner) == ast.dump(receiver) else None


def _rows_subscript(node: ast.Subscript) -> bool:
    """A subscript of slices with literal int bounds and at most one ``...``."""
    elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    dots = 0
    for e in elements:
        if isinstance(e, ast.Constant) and e.value is Ellipsis:
            dots += 1
        elif isinstance(e, ast.Slice):
            if any(b is not None and _int_literal(b) is None for b in (e.lower, e.upper, e.step)):
                return False
        else:
            return False
    return dots <= 1


def _chain(expr: ast.expr, names: set[str], imports: dict[str, str], local: set[str]) -> tuple[str, list, list]:
    """``(base name, ops in application order, Name nodes read)`` of an expression that lays out
    the logits: a name of ``names`` followed by subscripts of rows, ``.contiguous()``, ``.float()``
    (``.to(torch.float32)``), ``.view/.reshape(-1, V)``, ``.flatten(a, b)``; raises NotAMatch."""
    ops: list = []
    reads: list = []
    node = expr
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            if method in ("view", "reshape") and len(node.args) == 2 and not node.keywords \
                    and _int_literal(node.args[0]) == -1:
                vocab = node.args[1]
                last = _last_size_of(vocab, names)
                own = _own_last_size(vocab, receiver)
                if own is not None:
                    # t.reshape(-1, t.size(-1)) with t an expression (an inlined helper's parameter)
                    reads += _names_in(own, names)
                    ops.append((method, None))
                elif last is not None:
                    reads.append(last)
                    ops.append((method, None))
                elif _names_in(vocab, names):
                    raise NotAMatch(f"the logits' .{method} reads them in {ast.unparse(vocab)}")
                else:
                    ops.append((method, vocab))
            elif method == "flatten" and len(node.args) <= 2 and all(k.arg in ("start_dim", "end_dim")
                                                                     for k in node.keywords):
                dims = dict(zip(("start_dim", "end_dim"), node.args))
                dims.update({k.arg: k.value for k in node.keywords})
                start = _int_literal(dims.get("start_dim")) if "start_dim" in dims else 0
                end = _int_literal(dims.get("end_dim")) if "end_dim" in dims else -1
                if start is None or end is None:
                    raise NotAMatch("the logits are flattened over dimensions that are not int literals")
                ops.append(("flatten", (start, end)))
            elif method == "contiguous" and not node.args and not node.keywords:
                ops.append(("contiguous", None))
            elif (method == "float" and not node.args and not node.keywords) or (
                    method == "to" and len(node.args) == 1 and not node.keywords
                    and _qualified(node.args[0], imports, local) in _FLOAT32):
                ops.append(("float", None))
            else:
                raise NotAMatch(f"the logits reach the cross entropy through .{method}(...)")
            node = receiver
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if not _rows_subscript(node):
                raise NotAMatch(f"the logits are indexed by {ast.unparse(node.slice)} (not slices of rows)")
            ops.append(("rows", node))
            node = node.value
        elif isinstance(node, ast.Name) and node.id in names:
            reads.append(node)
            return node.id, list(reversed(ops)), reads
        else:
            raise NotAMatch("the cross entropy's input is not the logits laid out as (tokens, vocab)")


def _layout(ops: list) -> Layout:
    """The :class:`Layout` of ``ops`` (application order); raises NotAMatch for an order the kernel
    does not replay exactly."""
    kinds = [k for k, _ in ops]
    flat = [i for i, k in enumerate(kinds) if k in ("view", "reshape", "flatten")]
    if len(flat) != 1:
        raise NotAMatch("the logits are not flattened to (tokens, vocab) once" if not flat else
                        "the logits are flattened more than once")
    at = flat[0]
    before, after = kinds[:at], kinds[at + 1:]
    if any(kinds.count(k) > 1 for k in ("rows", "contiguous", "float")) or "rows" in after:
        raise NotAMatch("the logits' layout is not rows, contiguous, flatten, float")
    if "rows" in before and before.index("rows") != 0:
        raise NotAMatch("the logits are sliced after being changed")
    if "float" in before and "rows" in before:
        raise NotAMatch("the sliced logits are cast before being flattened")
    kind, value = ops[at]
    layout = Layout(contiguous="contiguous" in before, upcast="float" in kinds)
    if "rows" in before:
        layout.rows = ops[0][1]
    if kind == "flatten":
        layout.flatten = value
    else:
        layout.flatten, layout.vocab = kind, value
    return layout


def _ce_input(call: ast.Call) -> tuple[ast.expr | None, list[ast.expr], list[ast.keyword]]:
    """``(input, other positional arguments, other keywords)`` of a cross entropy call."""
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0], list(call.args[1:]), list(call.keywords)
    for k in call.keywords:
        if k.arg == "input":
            return k.value, list(call.args), [o for o in call.keywords if o is not k]
    return None, [], []


def _module_construction(node: ast.AST | None, imports: dict[str, str], local: set[str]) -> bool:
    return isinstance(node, ast.Call) and _qualified(node.func, imports, local) in CE_MODULES


def _class_of(tree: ast.Module, fn: ast.AST) -> ast.ClassDef | None:
    for node in walk(tree):
        if isinstance(node, ast.ClassDef) and fn in node.body:
            return node
    return None


def _self_attr_is_ce(tree: ast.Module, cls: ast.ClassDef | None, attr: str, imports: dict[str, str]) -> bool:
    """``self.<attr>`` is assigned once in the class (or a same-file base class): an
    ``nn.CrossEntropyLoss(...)``."""
    stores, assigns = [], []
    for c in same_file_lineage(tree, cls):
        for node in walk(c):
            if isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                stores.append(node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                assigns.append(node)  # (the statement of the one store, found without a parents map)
    if len(stores) != 1:
        return False
    stmt = next((a for a in assigns if a.targets[0] is stores[0]), None)
    return stmt is not None and _module_construction(stmt.value, imports, set())


def _self_attr_values(tree: ast.Module, cls: ast.ClassDef | None, attr: str) -> list[ast.expr]:
    """Every value assigned to ``self.<attr>`` in the class and its same-file base classes."""
    values = []
    for c in same_file_lineage(tree, cls):
        for node in walk(c):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr == attr \
                            and isinstance(target.value, ast.Name) and target.value.id == "self":
                        values.append(node.value)
    return values


def _size_key(expr: ast.expr | None, scope: ast.AST | None) -> object:
    """What a size argument names, comparable across constructions: an int literal's value, else the
    last name of the expression (``config.padded_vocab_size`` -> ``padded_vocab_size``), a local
    name of the constructing function resolved through its one assignment first."""
    for _ in range(3):
        if isinstance(expr, ast.Name) and scope is not None:
            bound = _single_assign(scope, expr.id)
            if bound is None:
                break
            expr = bound.value
        else:
            break
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Name):
        return expr.id
    return None


def _callee_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _argument(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[index] if len(call.args) > index and not isinstance(call.args[index], ast.Starred) else None


class _FileFacts:
    """What the vocabulary-head check reads from a whole file, computed once per parsed tree and
    each part only when first asked for (most files never reach the embedding part)."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self._functions: list | None = None
        self._embedding: tuple | None = None
        self._ce_names: set[str] | None = None
        self.no_cross_entropy: dict[int, bool] = {}  # id(function of the tree) -> _calls_no_cross_entropy

    @property
    def functions(self) -> list:
        """(lineno, end_lineno, function) of every function."""
        if self._functions is None:
            self._functions = [(f.lineno, f.end_lineno, f) for f in walk(self.tree)
                               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return self._functions

    def _embedding_facts(self) -> tuple:
        if self._embedding is None:
            scope_of_call: dict[int, ast.AST] = {}
            for _, _, f in self.functions:
                for c in walk(f):
                    if isinstance(c, ast.Call):
                        scope_of_call[id(c)] = f  # the innermost function wins: walked after its parent
            embedded, tied = set(), set()
            for node in walk(self.tree):
                if isinstance(node, ast.Call) and _callee_name(node).endswith("Embedding"):
                    key = _size_key(_argument(node, 0, "num_embeddings"), scope_of_call.get(id(node)))
                    if key is not None:  # (relative-position tables sized by arithmetic: not a vocabulary)
                        embedded.add(key)
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "weight"
                                                          for t in node.targets):
                    tied |= {n.attr for n in walk(node) if isinstance(n, ast.Attribute)}
            self._embedding = (scope_of_call, embedded, tied)
        return self._embedding

    @property
    def ce_names(self) -> set[str]:
        """Every name through which code of this file can reach torch's cross entropy: its own
        names, import aliases of them, names assigned a value that mentions one (``self.loss_fct
        = CrossEntropyLoss()``, ``LOSS = ...``, ``loss_fn = F.cross_entropy``) and module-level
        functions that call one — a fixpoint, so helpers of helpers count. A function calling
        none of them reaches no cross entropy: the cheap test before the exact one."""
        if self._ce_names is None:
            names = {"cross_entropy", "CrossEntropyLoss"}
            bindings: list[tuple[set[str], set[str]]] = []  # (names bound, names read by the value)
            for node in walk(self.tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for alias in node.names:
                        if alias.asname and alias.name.rsplit(".", 1)[-1] in names:
                            names.add(alias.asname)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    bound = {t.id if isinstance(t, ast.Name) else t.attr for target in targets
                             for t in walk(target) if isinstance(t, (ast.Name, ast.Attribute))}
                    bindings.append((bound, _names_read(node.value)))
            for node in self.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    bindings.append(({node.name}, _names_read(node)))
            changed = True
            while changed:
                changed = False
                for bound, read in bindings:
                    if read & names and not bound <= names:
                        names |= bound
                        changed = True
            self._ce_names = names
        return self._ce_names

    @property
    def scope_of_call(self) -> dict[int, ast.AST]:
        """id(call) -> the function it is in."""
        return self._embedding_facts()[0]

    @property
    def embedded(self) -> set:
        """The size keys embeddings are built with."""
        return self._embedding_facts()[1]

    @property
    def tied(self) -> set[str]:
        """Attribute names in ``<...>.weight = <...>`` assignments."""
        return self._embedding_facts()[2]


def _names_read(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _calls_no_cross_entropy(tree: ast.Module, fn: ast.AST) -> bool:
    """No call of ``fn`` names anything that can reach torch's cross entropy (``_FileFacts.ce_names``);
    once per function."""
    facts = _file_facts(tree)
    known = facts.no_cross_entropy.get(id(fn))
    if known is None:
        names = facts.ce_names
        known = not any(isinstance(n, ast.Call) and _names_read(n.func) & names for n in walk(fn))
        facts.no_cross_entropy[id(fn)] = known  # (the facts keep the tree, so fn's id stays its own)
    return known


@per_node(32)
def _file_facts(tree: ast.Module) -> _FileFacts:
    return _FileFacts(tree)


def _classifier_head(tree: ast.Module, fn: ast.AST, head_call: ast.Call) -> str:
    """Why the head is provably a classifier over a few labels rather than a vocabulary ("" when
    it is a vocabulary head or cannot be told). A language-model head predicts the tokens the model
    embeds: its weight is tied to an embedding's, or its output size is the size some embedding of
    the file is built with (``nn.Linear(d, config.vocab_size)`` beside ``nn.Embedding(
    config.vocab_size, d)``). A token or sequence classifier (``nn.Linear(d, config.num_labels)``)
    gains nothing from the fused loss (its logits are small) and would lose them in training."""
    head = head_call.func
    if not (isinstance(head, ast.Attribute) and isinstance(head.value, ast.Name) and head.value.id == "self"):
        return ""
    values = _self_attr_values(tree, _class_of(tree, fn), head.attr)
    if len(values) != 1 or not isinstance(values[0], ast.Call) or not _callee_name(values[0]).endswith("Linear"):
        return ""  # built elsewhere, or not a Linear constructor: cannot be told
    construction = values[0]
    facts = _file_facts(tree)
    out = _argument(construction, 1, "out_features")
    out_key = _size_key(out, facts.scope_of_call.get(id(construction)))
    if out_key is None or head.attr in facts.tied:
        return ""  # a size we cannot name, or tied to another module's weight (an embedding's)
    if not facts.embedded or out_key in facts.embedded:
        return ""  # the file embeds nothing (a head module on its own): cannot be told
    shown = out_key if isinstance(out_key, int) else ast.unparse(out)
    return (f"self.{head.attr} = {_callee_name(construction)}(..., {shown}) predicts no embedded vocabulary "
            "(a classifier: its logits are small, the fused loss saves nothing and would drop them)")


_BINDINGS: dict[int, tuple[ast.AST, dict[str, list], dict[int, ast.Assign]]] = {}


def _binding_index(scope: ast.AST) -> tuple[dict[str, list], dict[int, ast.Assign]]:
    """(name -> the nodes binding it in ``scope``, id(target) -> its one-target ``Assign``): one
    walk per scope (the checks ask about many names of the same function or file)."""
    cached = _BINDINGS.get(id(scope))
    if cached is not None and cached[0] is scope:
        return cached[1], cached[2]
    binds: dict[str, list] = {}
    assigns: dict[int, ast.Assign] = {}
    for sub in walk(scope):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            binds.setdefault(sub.id, []).append(sub)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not scope:
            binds.setdefault(sub.name, []).append(sub)
        elif isinstance(sub, ast.alias):
            binds.setdefault((sub.asname or sub.name).split(".")[0], []).append(sub)
        elif isinstance(sub, ast.Assign) and len(sub.targets) == 1:
            assigns[id(sub.targets[0])] = sub
    if len(_BINDINGS) > 256:
        _BINDINGS.clear()
    _BINDINGS[id(scope)] = (scope, binds, assigns)
    return binds, assigns


def _single_assign(scope: ast.AST, name: str) -> ast.Assign | None:
    """The one ``name = ...`` of ``scope`` (its body for a module) when it binds ``name`` once."""
    binds, assigns = _binding_index(scope)
    found = binds.get(name, [])
    if len(found) != 1 or not isinstance(found[0], ast.Name):
        return None
    return assigns.get(id(found[0]))


def _module_function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    """The module-level ``def name`` when nothing else at module level binds ``name``."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(defs) != 1:
        return None
    for node in tree.body:
        if node is defs[0]:
            continue
        for sub in walk(node):
            if isinstance(sub, ast.Name) and sub.id == name and isinstance(sub.ctx, ast.Store):
                return None
            if isinstance(sub, ast.alias) and (sub.asname or sub.name).split(".")[0] == name:
                return None
    return defs[0]


class _Substitute(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.expr]):
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            return self.env[node.id]
        return node


def _static_test(test: ast.expr, env: dict[str, ast.expr], tensors: set[str]) -> bool | None:
    """The value of an ``if`` test of the helper that the call settles, else None: a parameter bound
    to an int/str/bool/None constant compared with a constant (``chunk_size == 0``), or
    ``isinstance(<p>, list|tuple)`` of a parameter the call binds to the head's tensor (False)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _static_test(test.operand, env, tensors)
        return None if inner is None else not inner
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance" \
            and len(test.args) == 2 and not test.keywords and isinstance(test.args[0], ast.Name) \
            and test.args[0].id in tensors:
        kinds = test.args[1].elts if isinstance(test.args[1], ast.Tuple) else [test.args[1]]
        if all(isinstance(k, ast.Name) and k.id in ("list", "tuple") for k in kinds):
            return False
        return None
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name):
        bound, other = env.get(test.left.id), test.comparators[0]
        if not (isinstance(bound, ast.Constant) and isinstance(other, ast.Constant)):
            return None
        a, b = bound.value, other.value
        if not all(x is None or type(x) in (int, bool, str) for x in (a, b)):
            return None
        op = test.ops[0]
        table = {ast.Eq: a == b, ast.NotEq: a != b, ast.Is: a is b, ast.IsNot: a is not b}
        if type(op) in table:
            return table[type(op)]
        if type(a) is int and type(b) is int:
            return {ast.Lt: a < b, ast.LtE: a <= b, ast.Gt: a > b, ast.GtE: a >= b}.get(type(op))
    return None


def _pure(expr: ast.expr) -> bool:
    """A name, a constant or an attribute chain on one (``self.config.loss_chunk_size``): evaluating
    it again at the same place gives the same value, so a guard may read it before the call does."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, (ast.Name, ast.Constant))


def _guardable(test: ast.expr, env: dict[str, ast.expr], from_call: set[str]) -> bool:
    """A test the call does not settle but that the rewritten source can evaluate at run time in
    the call's place: a parameter the call binds to a pure expression (:func:`_pure`) compared with
    a constant (``chunk_size == 0`` with ``chunk_size=self.config.loss_chunk_size``), or its ``not``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _guardable(test.operand, env, from_call)
    return isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
        and test.left.id in from_call and _pure(env[test.left.id]) \
        and isinstance(test.comparators[0], ast.Constant) \
        and (test.comparators[0].value is None or type(test.comparators[0].value) in (int, bool, str)) \
        and type(test.ops[0]) in (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _settle_branches(body: list[ast.stmt], env: dict[str, ast.expr], tensors: set[str],
                     assume: dict | None = None, open_tests: list | None = None,
                     from_call: set[str] = frozenset()) -> list[ast.stmt]:
    """``body`` with each ``if`` whose test the call settles (:func:`_static_test`, read before any
    statement rebinds what it tests), or whose value ``assume`` fixes (``id(test) -> bool``: a
    run-time guard of the rewrite, see :func:`inline_helper`), replaced by the branch that runs; a
    branch ending in ``return`` ends the body there. Any other ``if`` stays (the helper is then not
    straight-line); those a guard could decide are appended to ``open_tests``."""
    assume = {} if assume is None else assume
    out: list[ast.stmt] = []
    rebound: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.If):
            tested = {n.id for n in walk(stmt.test) if isinstance(n, ast.Name)}
            value = None if tested & rebound else _static_test(stmt.test, env, tensors)
            if value is None and not tested & rebound:
                if id(stmt.test) in assume:
                    value = assume[id(stmt.test)]
                elif open_tests is not None and _guardable(stmt.test, env, from_call):
                    open_tests.append(stmt.test)
            if value is not None:
                taken = _settle_branches(list(stmt.body if value else stmt.orelse), env, tensors, assume,
                                         open_tests, from_call)
                out += taken
                if taken and isinstance(taken[-1], ast.Return):
                    return out
                continue
        out.append(stmt)
        rebound |= {n.id for n in walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        if isinstance(stmt, ast.Return):
            return out
    return out


def inline_helper(helper: ast.FunctionDef, call: ast.Call, tensors: set[str] = frozenset(),
                  accept=None) -> tuple[ast.expr, list[ast.expr]]:
    """``(expr, guards)``: the expression ``helper(<call's arguments>)`` computes, the helper's
    parameters replaced by the call's argument expressions (the call's own nodes) and its locals by
    their values, when every test in ``guards`` (expressions of the call's arguments) is true at run
    time; raises NotAMatch unless the helper is straight-line once its ``if``s are settled: a
    docstring, single-name assignments each read later, one ``return``.

    ``guards`` is empty when the call settles every ``if`` (constants). Otherwise the tests the call
    leaves open but the rewrite can evaluate in its place (:func:`_guardable`: litgpt's ``if
    chunk_size == 0`` with the chunk size read off the config) are assumed true or false, at most
    three, until one assumption makes the helper straight-line and ``accept(expr)`` holds (the
    caller: torch's cross entropy); the rewrite then runs the fused kernel only under those guards
    and the original call otherwise."""
    import copy

    a = helper.args
    if a.vararg or a.kwarg or helper.decorator_list:
        raise NotAMatch(f"helper {helper.name} takes *args/**kwargs or is decorated")
    params = [p.arg for p in a.posonlyargs + a.args]
    defaults = dict(zip(params[len(params) - len(a.defaults):], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    if any(isinstance(x, ast.Starred) for x in call.args) or any(k.arg is None for k in call.keywords) \
            or len(call.args) > len(params):
        raise NotAMatch(f"the call of {helper.name} unpacks arguments")
    env: dict[str, ast.expr] = dict(zip(params, call.args))
    for k in call.keywords:
        if k.arg in env or k.arg not in params + [p.arg for p in a.kwonlyargs]:
            raise NotAMatch(f"the call of {helper.name} does not bind")
        env[k.arg] = k.value
    from_call = set(env)  # a default is evaluated where the helper is defined: never a guard
    for name in params + [p.arg for p in a.kwonlyargs]:
        if name not in env:
            if name not in defaults:
                raise NotAMatch(f"the call of {helper.name} misses {name}")
            env[name] = copy.deepcopy(defaults[name])
    body = list(helper.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]

    def straight(settled: list[ast.stmt]) -> ast.expr:
        if not settled or not isinstance(settled[-1], ast.Return) or settled[-1].value is None:
            raise NotAMatch(f"helper {helper.name} does not end in one return")
        assigned: list[str] = []
        for stmt in settled[:-1]:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)):
                raise NotAMatch(f"helper {helper.name} is not straight-line (line {stmt.lineno}: "
                                f"{type(stmt).__name__.lower()})")
            assigned.append(stmt.targets[0].id)
        for i, name in enumerate(assigned):
            later = settled[i + 1:]
            if not any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
                       for s in later for n in walk(s)):
                raise NotAMatch(f"helper {helper.name} assigns {name} and never reads it")
        local_env = dict(env)
        for stmt in settled[:-1]:
            local_env[stmt.targets[0].id] = _Substitute(local_env).visit(copy.deepcopy(stmt.value))
        return _Substitute(local_env).visit(copy.deepcopy(settled[-1].value))

    def attempt(assume: dict[int, tuple[ast.expr, bool]]) -> tuple[ast.expr, list[ast.expr]]:
        open_tests: list[ast.expr] = []
        settled = _settle_branches(body, env, tensors, {k: v for k, (_, v) in assume.items()}, open_tests,
                                   from_call)
        try:
            expr = straight(settled)
            if assume and accept is not None and not accept(expr):
                raise NotAMatch(f"helper {helper.name} does not return torch's cross entropy under "
                                "any run-time guard")
        except NotAMatch:
            if not open_tests or len(assume) >= 3:
                raise
            test = open_tests[0]
            for value in (True, False):
                try:
                    return attempt({**assume, id(test): (test, value)})
                except NotAMatch:
                    pass
            raise
        guards = []
        for test, value in assume.values():
            guard = _Substitute({p: env[p] for p in from_call}).visit(copy.deepcopy(test))
            guards.append(guard if value else ast.UnaryOp(op=ast.Not(), operand=guard))
        return expr, guards

    return attempt({})


def _tensor_params(helper: ast.FunctionDef, call: ast.Call, logits: set[str]) -> set[str]:
    """The helper's parameters the call binds to the head's output (a tensor, never a list)."""
    a = helper.args
    params = [p.arg for p in a.posonlyargs + a.args]
    bound = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
    out = set()
    for name, value in bound:
        try:
            base, _, _ = _chain(value, logits, {}, set())
        except NotAMatch:
            continue
        out.add(name) if base in logits else None
    return out


def _classify(call: ast.Call, fn: ast.AST, tree: ast.Module, imports: dict[str, str], local: set[str]
              ) -> tuple[str, ast.expr] | None:
    """``(kind, loss_fn expression)`` when ``call`` calls torch's cross entropy (``"function"``,
    ``"module"``) or a module-level helper of the file (``"helper"``), else None."""
    func = call.func
    if _qualified(func, imports, local) == CE_FUNCTION:
        return "function", func
    if _module_construction(func, imports, local):
        return "module", func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
        if _self_attr_is_ce(tree, _class_of(tree, fn), func.attr, imports):
            return "module", func
        return None
    if isinstance(func, ast.Name):
        if func.id in local:
            bound = _single_assign(fn, func.id)
            if bound is not None and _module_construction(bound.value, imports, local):
                return "module", func
            return None
        bound = _single_assign(tree, func.id)
        if bound is not None and _module_construction(bound.value, imports, set()):
            return "module", func
        if _module_function(tree, func.id) is not None:
            return "helper", func
    return None


def _block_path(stmt: ast.stmt, parents: dict) -> list[tuple[ast.AST, str, int]]:
    """``[(owner, field, index), ...]`` from the function body down to ``stmt``."""
    out = []
    node = stmt
    while node in parents:
        owner = parents[node]
        for name in ("body", "orelse", "finalbody"):
            block = getattr(owner, name, None)
            if isinstance(block, list) and node in block:
                out.append((owner, name, block.index(node)))
                break
        else:
            for handler in getattr(owner, "handlers", ()):
                if node is handler:
                    out.append((owner, "handlers", 0))
                    break
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            break
        node = owner
    return list(reversed(out))


def _exclusive(a: ast.stmt, b: ast.stmt, parents: dict) -> bool:
    """``a`` and ``b`` lie in different branches of one ``if`` (and no loop repeats it): no run
    executes both."""
    pa, pb = _block_path(a, parents), _block_path(b, parents)
    for (oa, fa, _), (ob, fb, _) in zip(pa, pb):
        if oa is not ob:
            return False
        if fa != fb:
            if not isinstance(oa, ast.If):
                return False
            node = oa
            while node in parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                node = parents[node]
                if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
                    return False
            return True
    return False


def _dominated(head: ast.stmt, stmt: ast.stmt, parents: dict) -> str:
    """"" when ``stmt`` runs after ``head`` on every path that reaches it from there: in ``head``'s
    block after it, or inside ``if`` statements that follow it there; else why not."""
    ph, ps = _block_path(head, parents), _block_path(stmt, parents)
    depth = len(ph) - 1
    if len(ps) <= depth or any(x[:2] != y[:2] or x[2] != y[2] for x, y in zip(ph[:depth], ps[:depth])):
        return f"line {stmt.lineno} is not in the block of the head (line {head.lineno}) or nested below it"
    if ps[depth][:2] != ph[depth][:2] or ps[depth][2] <= ph[depth][2]:
        return f"line {stmt.lineno} does not follow the head (line {head.lineno}) in its block"
    for owner, _, _ in ps[depth + 1:]:
        if not isinstance(owner, ast.If):
            return f"line {stmt.lineno} is inside a {type(owner).__name__.lower()} statement"
    return ""


def _killed(read: ast.AST, head: ast.stmt, name: str, fn: ast.AST, parents: dict) -> bool:
    """A store of ``name`` after the head definitely runs between the head and ``read``."""
    r_stmt = _statement(read, parents)
    for node in walk(fn):
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store)):
            continue
        s_stmt = _statement(node, parents)
        if _at(s_stmt) <= _at(head) or _at(s_stmt) >= _at(r_stmt) or _inside(r_stmt, s_stmt):
            continue
        if _exclusive(s_stmt, head, parents):
            continue
        # the store's block holds the read (at the store's level or below) after the store
        ps, pr = _block_path(s_stmt, parents), _block_path(r_stmt, parents)
        d = len(ps) - 1
        if len(pr) > d and all(x == y for x, y in zip(ps[:d], pr[:d])) and pr[d][:2] == ps[d][:2] \
                and pr[d][2] > ps[d][2]:
            return True
    return False


# one value per example, whatever the tensor's rank: reductions over a dimension other than the last
_REDUCTIONS = ("mean", "sum", "amax", "amin", "max", "min", "logsumexp")
# calls that keep each row a row: the head's input seen through them is the tensor they were given
_ROW_KEEPING = ("float", "to", "contiguous", "type_as", "half", "bfloat16")


def _pooled(expr: ast.expr, fn: ast.AST, depth: int = 0) -> str:
    """Why ``expr`` (the head's input) is provably one vector per example — a token picked by an int
    index on a dimension before the last (``h[:, 0]``, ``h[:, -1, :]``) or a reduction over one
    (``h.mean(1)``, ``torch.max(h, dim=1)[0]``), seen through names assigned once, ``self.<module>(y)``
    calls (dropout, a pooler's dense layer, an activation: they map each row) and casts — else "".
    A head over a pooled vector is a sequence classifier, not a language-model head over every
    token."""
    if depth > 12:
        return ""
    if isinstance(expr, ast.Name):
        bound = _single_assign(fn, expr.id)
        return _pooled(bound.value, fn, depth + 1) if bound is not None else ""
    if isinstance(expr, ast.Subscript):
        parts = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        dots = any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts)
        if not dots and len(parts) >= 2 and any(_int_literal(p) is not None for p in parts[1:]):
            return f"{ast.unparse(expr)} picks one token per example"
        if isinstance(expr.value, ast.Call) and _int_literal(expr.slice) == 0:
            return _pooled(expr.value, fn, depth + 1)  # torch.max(h, dim=1)[0]: the values
        return _pooled(expr.value, fn, depth + 1) if all(isinstance(p, ast.Slice) for p in parts) else ""
    if not isinstance(expr, ast.Call):
        return ""
    func = expr.func
    method = func.attr if isinstance(func, ast.Attribute) else ""
    if method in _REDUCTIONS:
        dim = expr.args[0] if expr.args and not (isinstance(func.value, ast.Name) and func.value.id == "torch") \
            else expr.args[1] if len(expr.args) > 1 else None
        dim = next((k.value for k in expr.keywords if k.arg == "dim"), dim)
        value = _int_literal(dim)
        if value is not None and value != -1:
            return f"{ast.unparse(expr)} reduces over dimension {value}: one vector per example"
        return ""
    if method in _ROW_KEEPING and isinstance(func, ast.Attribute):
        return _pooled(func.value, fn, depth + 1)
    args = [a for a in expr.args if not isinstance(a, ast.Starred)]
    if len(args) >= 1 and isinstance(func, ast.Attribute) and (
            (isinstance(func.value, ast.Name) and func.value.id == "self" and len(args) == 1)
            or _dotted_name(func) in ("torch.tanh", "torch.relu", "F.dropout", "F.gelu", "F.relu", "F.tanh")):
        return _pooled(args[0], fn, depth + 1)
    return ""


def find_ce_site(tree: ast.Module, fn: ast.AST, head_call: ast.Call) -> CrossEntropySite:
    """The cross entropy the head's output reaches in ``fn``; raises :class:`NotAMatch` when none
    (or several) does, in a layout the kernel replays, or when the head reads a pooled vector."""
    parents = _parents(fn)
    head_stmt = _statement(head_call, parents)
    if head_call.args:
        pooled = _pooled(head_call.args[0], fn)
        if pooled:
            raise NotAMatch(f"a classifier over a pooled vector ({pooled}), not a language-model head over "
                            "every token")
    if not (isinstance(head_stmt, ast.Assign) and head_stmt.value is head_call and len(head_stmt.targets) == 1
            and isinstance(head_stmt.targets[0], ast.Name)):
        raise NotAMatch("the Linear's output is not assigned to a plain name")
    logits = head_stmt.targets[0].id
    imports = _import_map(tree, fn)
    local = _stored_names(fn)
    # shift_logits = logits[..., :-1, :].contiguous(): assigned once, after the head
    shifts: dict[str, tuple[ast.Assign, list, list]] = {}
    for node in walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and _at(node) > _at(head_stmt) and node.targets[0].id != logits and _names_in(node.value, {logits}):
            try:
                base, ops, reads = _chain(node.value, {logits}, imports, local)
            except NotAMatch:
                continue
            name = node.targets[0].id
            if ops and all(k in ("rows", "contiguous", "float") for k, _ in ops) \
                    and _single_assign(fn, name) is node and not _dominated(head_stmt, node, parents):
                shifts[name] = (node, ops, reads)
    found, why_not = [], []
    for call in sorted((n for n in walk(fn) if isinstance(n, ast.Call) and _at(n) > _end(head_stmt)), key=_at):
        if not _names_in(call, {logits, *shifts}):
            continue
        classified = _classify(call, fn, tree, imports, local)
        if classified is None:
            continue
        kind, loss_fn = classified
        helper = None
        guards: list[ast.expr] = []
        ce_call = call
        if kind == "helper":
            helper = _module_function(tree, call.func.id)

            def torch_cross_entropy(expr: ast.expr) -> bool:
                inner = _classify(expr, fn, tree, imports, local) if isinstance(expr, ast.Call) else None
                return inner is not None and inner[0] != "helper"

            try:
                expr, guards = inline_helper(helper, call, _tensor_params(helper, call, {logits, *shifts}),
                                             accept=torch_cross_entropy)
            except NotAMatch as exc:
                why_not.append(str(exc))
                continue
            if any(_names_in(g, {logits, *shifts}) for g in guards):
                # the guard runs before the head: it cannot read the logits
                why_not.append(f"the call of {helper.name} decides its branch from the logits")
                continue
            free = {n.id for n in walk(expr) if isinstance(n, ast.Name)} - {
                n.id for n in walk(call) if isinstance(n, ast.Name)}
            if not isinstance(expr, ast.Call) or free & local:
                why_not.append(f"helper {helper.name} does not return torch's cross entropy of its arguments")
                continue
            inner = _classify(expr, fn, tree, imports, local)
            if inner is None or inner[0] == "helper":
                why_not.append(f"helper {helper.name} does not return torch's cross entropy of its arguments")
                continue
            kind, loss_fn = inner
            ce_call = expr
        input_expr, args, keywords = _ce_input(ce_call)
        if input_expr is None or not _names_in(input_expr, {logits, *shifts}):
            continue
        try:
            base, ops, reads = _chain(input_expr, {logits, *shifts}, imports, local)
            shift_stmt = None
            if base in shifts:
                shift_stmt, shift_ops, shift_reads = shifts[base]
                if _at(shift_stmt) > _at(call):
                    raise NotAMatch(f"{base} is assigned after the cross entropy")
                ops, reads = shift_ops + ops, shift_reads + reads
            layout = _layout(ops)
        except NotAMatch as exc:
            why_not.append(str(exc))
            continue
        where = _dominated(head_stmt, _statement(call, parents), parents)
        if where:
            why_not.append(f"the cross entropy: {where}")
            continue
        found.append(CrossEntropySite(
            head_stmt=head_stmt, head_call=head_call, logits=logits, loss_call=call, kind=kind, loss_fn=loss_fn,
            args=args, keywords=keywords, layout=layout, reads=set(map(id, reads)), shift_stmt=shift_stmt,
            shift=base if shift_stmt is not None else "", helper=helper, guards=guards))
    if not found:
        raise NotAMatch(f"{logits} reaches no cross entropy it lays out as (tokens, vocab)"
                        + (f" ({why_not[0]})" if why_not else ""))
    if len(found) > 1:
        raise NotAMatch(f"{logits} reaches {len(found)} cross entropies")
    # last: it reads the whole file (cached per tree)
    classifier = _classifier_head(tree, fn, head_call)
    if classifier:
        raise NotAMatch(classifier)
    return found[0]


def ce_refusal(fn: ast.AST, site: CrossEntropySite, source_line) -> Refusal | None:
    """``logits-transformed`` when the logits (or the shift's name) change between the head and the
    cross entropy; ``logits-read`` when they are read elsewhere than the cross entropy's input
    layout and an output the function packs them into after it."""
    parents = _parents(fn)
    loss_stmt = _statement(site.loss_call, parents)
    names = {site.logits} | ({site.shift} if site.shift else set())
    early = _early_returns(fn, site, parents)
    for name in sorted(names):
        origin = site.head_stmt if name == site.logits else site.shift_stmt  # where the name gets its value
        uses = sorted((n for n in walk(fn) if isinstance(n, ast.Name) and n.id == name
                       and id(n) not in site.reads and _at(n) > _end(site.head_stmt)
                       and not (site.shift_stmt is not None and n is site.shift_stmt.targets[0])), key=_at)
        for node in uses:
            stmt = _statement(node, parents)
            if _exclusive(stmt, site.head_stmt, parents):
                continue
            if _at(stmt) < _at(loss_stmt) and name == site.logits and stmt in early:
                continue  # the rewrite runs the head on that path (see ce_edit)
            if _at(stmt) < _at(loss_stmt):
                parent = parents.get(node)
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    return Refusal("logits-transformed", f"line {stmt.lineno} rebinds {name} between the head and "
                                                         f"the loss ({source_line(stmt.lineno)}): the fused loss "
                                                         "would take the head's output")
                in_place = isinstance(parent, ast.Attribute) and parent.attr.endswith("_") \
                    and not parent.attr.startswith("_")
                if in_place or (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)):
                    return Refusal("logits-transformed", f"line {stmt.lineno} changes {name} in place between the "
                                                         f"head and the loss ({source_line(stmt.lineno)})")
                return Refusal("logits-read", f"line {stmt.lineno} reads {name} before the loss "
                                              f"({source_line(stmt.lineno)}): in training the fused path never "
                                              "computes the logits")
            if isinstance(node.ctx, (ast.Store, ast.Del)) or _killed(node, origin, name, fn, parents):
                continue
            if _inside(node, site.loss_call):
                return Refusal("logits-read", f"the cross entropy reads {name} beside its input "
                                              f"({source_line(stmt.lineno)})")
            if name == site.logits and _at(node) > _end(loss_stmt) and (
                    _packed(node, parents) or (_returned(node, parents) and _stored_on_self(loss_stmt))):
                continue
            return Refusal("logits-read", f"line {stmt.lineno} reads {name} ({source_line(stmt.lineno)}): in "
                                          "training the fused path never computes the logits")
    if site.synthesized:
        # the helper's body: its cross entropy must not read the logits beside the input
        inlined = [n for a in site.args + [k.value for k in site.keywords] for n in walk(a)
                   if isinstance(n, ast.Name) and n.id in names]
        if inlined:
            return Refusal("logits-read", f"helper {site.helper.name} reads the logits beside the cross "
                                          f"entropy's input ({source_line(site.loss_call.lineno)})")
    return None


def _returned(name: ast.Name, parents: dict) -> bool:
    """``return <name>``: the logits are the function's output as they are."""
    parent = parents.get(name)
    return isinstance(parent, ast.Return) and parent.value is name


def _loss_target(stmt: ast.stmt) -> ast.expr | None:
    """The one target of ``<loss> = <cross entropy>``: a plain name or ``self.<attr>``."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name) or (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                        and target.value.id == "self"):
        return target
    return None


def _stored_on_self(loss_stmt: ast.stmt) -> bool:
    """The loss goes to ``self.<attr>`` (llama2.c's ``self.last_loss``), the logits being returned
    alone: the output is the logits and the loss is read off the module. The convention of a
    returned ``(logits, loss)`` applies: in training the fused path returns the loss and no logits
    (the kernel's LogitsNotComputedWarning says so)."""
    target = _loss_target(loss_stmt)
    return isinstance(target, ast.Attribute) and isinstance(loss_stmt, ast.Assign) and isinstance(
        loss_stmt.value, ast.Call)


def _rows_text(sub: ast.Subscript, text_of) -> str:
    elements = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
    parts = []
    for e in elements:
        if isinstance(e, ast.Constant) and e.value is Ellipsis:
            parts.append("...")
            continue
        bounds = [text_of(b) if b is not None else "None" for b in (e.lower, e.upper, e.step)]
        while len(bounds) > 1 and bounds[-1] == "None":
            bounds.pop()  # slice(None, -1), slice(None): what t[:-1], t[:] mean
        parts.append(f"slice({', '.join(bounds)})")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


LAYOUT_KEYWORDS = ("rows", "contiguous", "flatten", "vocab", "upcast")


def ce_edit(ctx: FileContext, fn: ast.AST, head_call: ast.Call, site: CrossEntropySite) -> Edit:
    """The rewrite of a written-out cross entropy site: the head statement (and the shift's) go, the
    cross entropy's statement becomes one ``lm_head_cross_entropy`` call (see the kernel)."""
    refusal = ce_refusal(fn, site, lambda n: ctx.lines[n - 1].strip())
    if refusal is not None:
        raise Skip(str(refusal))
    parents = _parents(fn)
    loss_stmt = _statement(site.loss_call, parents)
    target = _loss_target(loss_stmt)
    if not (isinstance(loss_stmt, ast.Assign) and loss_stmt.value is site.loss_call and target is not None):
        raise Skip(f"line {loss_stmt.lineno}: the cross entropy is not assigned to a plain name or self.<attr>")
    loss = ast.unparse(target)
    if loss in (site.logits, site.shift):
        raise Skip(f"line {loss_stmt.lineno}: the loss is bound to the logits' name")
    # the head's call moves down to the loss statement: nothing it reads may change on the way
    head_names = {n.id for n in walk(head_call) if isinstance(n, ast.Name)}
    head_text = ast.unparse(head_call)
    moved = {id(site.head_stmt), id(site.shift_stmt), id(loss_stmt)}
    for node in walk(fn):
        if not (isinstance(node, ast.stmt) and id(node) not in moved and _end(site.head_stmt) <= _at(node)
                and _at(node) < _at(loss_stmt)):
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
    text_of = (lambda n: ast.unparse(n)) if site.synthesized else (lambda n: arg_text(ctx, n))
    head = module_handle(ctx, head_call, "head")
    hidden = arg_text(ctx, head_call.args[0])
    layout = site.layout
    named = []
    if layout.rows is not None:
        named.append(f"rows={_rows_text(layout.rows, text_of)}")
    if layout.contiguous:
        named.append("contiguous=True")
    if layout.flatten != "view":
        named.append(f'flatten="{layout.flatten}"' if isinstance(layout.flatten, str) else
                     f"flatten={layout.flatten!r}")
    if layout.vocab is not None:
        named.append(f"vocab={text_of(layout.vocab)}")
    if layout.upcast:
        named.append("upcast=True")
    if any(k.arg in LAYOUT_KEYWORDS for k in site.keywords):
        raise Skip("the cross entropy is called with a keyword the kernel's layout uses")
    keywords = [f"{k.arg}={text_of(k.value)}" if k.arg else f"**{text_of(k.value)}" for k in site.keywords]
    if any(isinstance(a, ast.Starred) for a in site.args):
        raise Skip("the cross entropy's arguments are unpacked")
    spec, kernel = kernel_name(ctx, CE_KERNEL)
    args = [head, hidden, text_of(site.loss_fn)] + [text_of(a) for a in site.args] + named + keywords
    indent = ctx.lines[loss_stmt.lineno - 1][:loss_stmt.col_offset] + ("    " if site.guards else "")
    one_line = ", ".join(args)
    if len(indent) + 4 + len(one_line) <= 110:
        text = f"{site.logits}, {loss} = {kernel}(  # {NOTE}\n    {one_line}\n)"
    else:
        text = f"{site.logits}, {loss} = {kernel}(  # {NOTE}\n" + "".join(f"    {a},\n" for a in args) + ")"
    statements = sorted([s for s in (site.head_stmt, site.shift_stmt, loss_stmt) if s is not None], key=_at)
    if site.guards:
        # the helper is that cross entropy only when the guards hold (litgpt's ``chunk_size == 0``
        # with the chunk size read off the config): they are evaluated at run time, in the call's
        # place, and any other value runs the user's statements (head, shift, helper call) as written
        test = " and ".join(ast.unparse(g) for g in site.guards)
        original = "\n".join(_statement_text(ctx, s) for s in statements)
        text = (f"if {test}:  # adopter: only then is {site.helper.name}(...) the plain cross entropy\n"
                f"{_indented(text)}\nelse:\n{_indented(original)}")
    # a ``return`` of the logits before the loss (litgpt's ``if targets is None: return logits``)
    # leaves the function on a path that never reaches the loss: the head moves there too
    head_text = _statement_text(ctx, site.head_stmt)
    early = tuple(StatementEdit(pos(ctx, r), f"{head_text}\n{_statement_text(ctx, r)}")
                  for r in _early_returns(fn, site, parents))
    forward = ForwardEdit(
        statements=tuple(pos(ctx, s) for s in statements),
        anchor=pos(ctx, loss_stmt),
        statement_edits=(StatementEdit(pos(ctx, loss_stmt), text),) + early,
        delete=tuple(pos(ctx, s) for s in statements if s is not loss_stmt),
    )
    return Edit(rule="linear_cross_entropy", forward=forward, imports=(spec,))


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


def _early_returns(fn: ast.AST, site: CrossEntropySite, parents: dict) -> list[ast.Return]:
    """The ``return`` statements between the head and the loss that read the logits, each after the
    head in its block or in ``if``s below it (:func:`_dominated`): such a path leaves the function
    with the head's output and never reaches the loss, so the rewrite runs the head there."""
    loss_stmt = _statement(site.loss_call, parents)
    out = []
    for node in walk(fn):
        if isinstance(node, ast.Return) and node.value is not None and _end(site.head_stmt) <= _at(node) \
                and _at(node) < _at(loss_stmt) and _names_in(node.value, {site.logits}) \
                and not _dominated(site.head_stmt, node, parents) \
                and not any(isinstance(n, (ast.Lambda, ast.NamedExpr)) for n in walk(node.value)):
            out.append(node)
    return sorted(out, key=_at)


# ---------------------------------------------------------------- preconditions


def _head_call(fn: ast.AST, span) -> ast.Call | None:
    return next((n for n in walk(fn) if isinstance(n, ast.Call) and (n.lineno, n.col_offset, n.end_lineno,
                 n.end_col_offset) == (span.line, span.col, span.end_line, span.end_col)), None)


def _function_at(tree: ast.Module, span) -> ast.AST | None:
    """The innermost function of ``tree`` holding ``span``."""
    best = None
    for lineno, end_lineno, node in _file_facts(tree).functions:
        if lineno <= span.line <= end_lineno and (best is None or lineno > best.lineno):
            best = node
    return best


def _might_be_cross_entropy(source: str) -> bool:
    """Cheap text test before parsing: the file names a cross entropy or defines a helper."""
    return "cross_entropy" in source or "CrossEntropyLoss" in source or "\ndef " in source


def head_feeds_loss(ctx: MatchContext) -> str | None:
    """The head's output is the logits of ``self.loss_function(...)``, or reaches torch's cross
    entropy laid out as ``(tokens, vocab)``; refused when the logits are changed before the loss or
    read elsewhere (see the DOC)."""
    node = ctx.match.nodes[0].node
    span = node.span
    if ctx.source is None or span is None:
        return NotACandidate("no source")
    lines = source_lines(ctx.source)
    hf_reason = f"no self.{LOSS_METHOD} call"
    call = None
    if LOSS_METHOD in ctx.source:
        if "ForMaskedLM" in (ctx.match.class_name or ""):
            return "a masked-LM head (transformers picks ForMaskedLMLoss by the class name)"
        fn = function_ast(ctx.source, span.function, span.line)
        if fn is None:
            return "the head call is not found in the source"
        # a function that does not write the loss method's name cannot call it: no site to look for
        # (every Linear of a file is asked; most are in functions without it)
        mentions = any(LOSS_METHOD in line for line in lines[fn.lineno - 1:fn.end_lineno])
        call = _head_call(fn, span) if mentions else None
        if mentions and call is None:
            return "the head call is not found in the source"
    if call is not None:
        try:
            site = find_site(fn, call)
        except NotAMatch as exc:
            hf_reason = str(exc)
        else:
            return logits_refusal(fn, site, lambda n: lines[n - 1].strip())
    if not _might_be_cross_entropy(ctx.source):
        return NotACandidate(hf_reason)
    tree = parse_file(ctx.source)
    fn = _function_at(tree, span) if tree is not None else None
    call = _head_call(fn, span) if fn is not None else None
    if call is None or _calls_no_cross_entropy(tree, fn):
        return NotACandidate(hf_reason)
    try:
        ce_site = find_ce_site(tree, fn, call)
    except NotAMatch as exc:
        # a Linear that is no LM head (every Linear fits the one-layer pattern): not listed
        return NotACandidate(f"{hf_reason}; {exc}")
    return ce_refusal(fn, ce_site, lambda n: lines[n - 1].strip())


# ---------------------------------------------------------------- codemod


class LinearCrossEntropy(Codemod):
    rule = "linear_cross_entropy"

    def analyze(self, match: Match, ctx: FileContext) -> Edit:
        exprs = matched_exprs(match, ctx)
        (_, head_call), = exprs
        fn = ctx.enclosing_function(head_call)
        if fn is None or not isinstance(head_call, ast.Call) or len(head_call.args) != 1 or head_call.keywords:
            raise Skip("the head must be a module called with one tensor inside a function")
        try:
            site = find_site(fn, head_call)
        except NotAMatch as exc:
            try:
                ce_site = find_ce_site(ctx.tree, fn, head_call)
            except NotAMatch as ce_exc:
                raise Skip(f"{exc}; {ce_exc}") from None
            return ce_edit(ctx, fn, head_call, ce_site)
        refusal = logits_refusal(fn, site, lambda n: ctx.lines[n - 1].strip())
        if refusal is not None:
            raise Skip(str(refusal))
        site = site_structure(fn, site)
        call = site.loss_call
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
        loss_function = f"{arg_text(ctx, call.func)} if {site.labels} is not None else None"
        args = ", ".join([head, hidden, loss_function] + rest)
        text = f"{site.logits}, {site.loss_stmt.targets[0].id} = {kernel}(  # {NOTE}\n    {args}\n)"
        statements = [site.head_stmt, *site.loss_none, site.guard]
        forward = ForwardEdit(
            statements=tuple(pos(ctx, s) for s in statements),
            anchor=pos(ctx, site.guard),
            statement_edits=(StatementEdit(pos(ctx, site.guard), text),),
            delete=tuple(pos(ctx, s) for s in statements[:-1]),
        )
        return Edit(rule=self.rule, forward=forward, imports=(spec,))


# ---------------------------------------------------------------- runtime


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    head = site.modules[0] if site.modules else None
    if not isinstance(head, nn.Linear):
        return f"the head that runs is {type(head).__name__}, not an nn.Linear", ""
    return None, (f"head Linear {head.in_features}->{head.out_features} bias={head.bias is not None}; fused only "
                  "when training with labels and transformers' ForCausalLMLoss (checked per call)")


RULE = Rule(
    name="linear_cross_entropy",
    kernel="adopter.kernels.linear_cross_entropy",
    doc=DOC,
    dsl=DSL,
    codemod=LinearCrossEntropy(),
    runtime=Runtime(check=_runtime_check, leaf_modules=(LINEAR,)),
    fixtures="linear_cross_entropy",
    preconditions=(head_feeds_loss,),
)
