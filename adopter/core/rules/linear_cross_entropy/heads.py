"""LM head or classifier, for the written-out form, decided from what the head reads and what it
predicts: a head over one vector per example (:func:`pooled`) is a sequence classifier; a head over
every token whose output size no embedding of the file is built with (:func:`classifier_head`) is
a token classifier. Neither gains from the fused loss (their logits are small), and training would
lose their logits.
"""

from __future__ import annotations

import ast

from adopter.core.match.source import same_file_lineage
from adopter.core.rules.linear_cross_entropy.file_facts import file_facts, size_key
from adopter.core.rules.linear_cross_entropy.names import (
    argument,
    callee_name,
    class_of,
    dotted_name,
    int_literal,
    single_assign,
)
from adopter.core.syntax import walk

# one value per example, whatever the tensor's rank: reductions over a dimension other than the last
_REDUCTIONS = ("mean", "sum", "amax", "amin", "max", "min", "logsumexp")
# calls that keep each row a row: the head's input seen through them is the tensor they were given
_ROW_KEEPING = ("float", "to", "contiguous", "type_as", "half", "bfloat16")


def pooled(expr: ast.expr, fn: ast.AST, depth: int = 0) -> str:
    """Why ``expr`` (the head's input) is provably one vector per example — a token picked by an int
    index on a dimension before the last (``h[:, 0]``, ``h[:, -1, :]``) or a reduction over one
    (``h.mean(1)``, ``torch.max(h, dim=1)[0]``), seen through names assigned once, ``self.<module>(y)``
    calls (dropout, a pooler's dense layer, an activation: they map each row) and casts — else "".
    A head over a pooled vector is a sequence classifier, not a language-model head over every
    token."""
    if depth > 12:
        return ""
    if isinstance(expr, ast.Name):
        bound = single_assign(fn, expr.id)
        return pooled(bound.value, fn, depth + 1) if bound is not None else ""
    if isinstance(expr, ast.Subscript):
        parts = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
        dots = any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts)
        if not dots and len(parts) >= 2 and any(int_literal(p) is not None for p in parts[1:]):
            return f"{ast.unparse(expr)} picks one token per example"
        if isinstance(expr.value, ast.Call) and int_literal(expr.slice) == 0:
            return pooled(expr.value, fn, depth + 1)  # torch.max(h, dim=1)[0]: the values
        return pooled(expr.value, fn, depth + 1) if all(isinstance(p, ast.Slice) for p in parts) else ""
    if not isinstance(expr, ast.Call):
        return ""
    func = expr.func
    method = func.attr if isinstance(func, ast.Attribute) else ""
    if method in _REDUCTIONS:
        dim = expr.args[0] if expr.args and not (isinstance(func.value, ast.Name) and func.value.id == "torch") \
            else expr.args[1] if len(expr.args) > 1 else None
        dim = next((k.value for k in expr.keywords if k.arg == "dim"), dim)
        value = int_literal(dim)
        if value is not None and value != -1:
            return f"{ast.unparse(expr)} reduces over dimension {value}: one vector per example"
        return ""
    if method in _ROW_KEEPING and isinstance(func, ast.Attribute):
        return pooled(func.value, fn, depth + 1)
    args = [a for a in expr.args if not isinstance(a, ast.Starred)]
    if len(args) >= 1 and isinstance(func, ast.Attribute) and (
            (isinstance(func.value, ast.Name) and func.value.id == "self" and len(args) == 1)
            or dotted_name(func) in ("torch.tanh", "torch.relu", "F.dropout", "F.gelu", "F.relu", "F.tanh")):
        return pooled(args[0], fn, depth + 1)
    return ""



def classifier_head(tree: ast.Module, fn: ast.AST, head_call: ast.Call) -> str:
    """Why the head is provably a classifier over a few labels rather than a vocabulary ("" when
    it is a vocabulary head or cannot be told). A language-model head predicts the tokens the model
    embeds: its weight is tied to an embedding's, or its output size is the size some embedding of
    the file is built with (``nn.Linear(d, config.vocab_size)`` beside ``nn.Embedding(
    config.vocab_size, d)``). A token or sequence classifier (``nn.Linear(d, config.num_labels)``)
    gains nothing from the fused loss (its logits are small) and would lose them in training."""
    head = head_call.func
    if not (isinstance(head, ast.Attribute) and isinstance(head.value, ast.Name) and head.value.id == "self"):
        return ""
    values = _self_attr_values(tree, class_of(tree, fn), head.attr)
    if len(values) != 1 or not isinstance(values[0], ast.Call) or not callee_name(values[0]).endswith("Linear"):
        return ""  # built elsewhere, or not a Linear constructor: cannot be told
    construction = values[0]
    facts = file_facts(tree)
    out = argument(construction, 1, "out_features")
    out_key = size_key(out, facts.scope_of_call.get(id(construction)))
    if out_key is None or head.attr in facts.tied:
        return ""  # a size we cannot name, or tied to another module's weight (an embedding's)
    if not facts.embedded or out_key in facts.embedded:
        return ""  # the file embeds nothing (a head module on its own): cannot be told
    shown = out_key if isinstance(out_key, int) else ast.unparse(out)
    return (f"self.{head.attr} = {callee_name(construction)}(..., {shown}) predicts no embedded vocabulary "
            "(a classifier: its logits are small, the fused loss saves nothing and would drop them)")


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
