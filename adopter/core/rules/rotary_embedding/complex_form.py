"""The complex form, ``torch.view_as_real(xq_ * freqs_cis)`` with ``xq_`` (or ``freqs_cis``) a
``torch.view_as_complex`` of the pairs of a real tensor's last dimension (Meta-llama, torchtitan,
mistral-inference). Read into :class:`ComplexParts`, the operands the codemod passes
``rotary_complex``; not a candidate when the other factor reads a learned parameter of the class (a
complex spectral mix, not unit-modulus angles built from the positions)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from adopter.core.match import NotACandidate
from adopter.core.match.source import same_file_lineage
from adopter.core.rules.rotary_embedding.literals import called_name, int_const, unflattens_last
from adopter.core.rules.rotary_embedding.scope import class_def
from adopter.core.rules.rotary_embedding.site import Site, unsafe_operand
from adopter.core.syntax import walk


@dataclass(frozen=True)
class ComplexParts:
    """``torch.view_as_real(z * freqs_cis)`` with ``z`` (or ``freqs_cis``) a ``view_as_complex``
    of the pairs of a real tensor's last dimension; the operands in source order."""

    call: ast.Call
    left: ast.expr
    right: ast.expr


def _complex_of_pairs(e: ast.expr, site: Site) -> bool:
    """``e`` is (a name assigned once to) ``torch.view_as_complex(t.reshape(..., -1, 2))``
    (``.view``, ``.reshape(t.shape[:-1] + (-1, 2))``, ``.unflatten(-1, (-1, 2))``)."""
    assigned = site.facts.assigned_value(e)
    if assigned is not None:
        e = assigned[1]
    if not (isinstance(e, ast.Call) and site.names.is_(e.func, "view_as_complex") and len(e.args) == 1):
        return False
    inner = e.args[0]
    if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute) or inner.keywords:
        return False
    args = list(inner.args)
    if inner.func.attr in ("reshape", "view"):
        if len(args) == 1 and isinstance(args[0], ast.BinOp) and isinstance(args[0].op, ast.Add) \
                and isinstance(args[0].right, ast.Tuple):
            args = list(args[0].right.elts)
        return len(args) >= 2 and int_const(args[-2]) == -1 and int_const(args[-1]) == 2
    if inner.func.attr == "unflatten":
        return unflattens_last(args, [-1, 2])
    return False


def _parameter_attrs(tree: ast.Module, cls: ast.ClassDef | None) -> set[str]:
    """``self.<attr>`` names the class (or a same-file base) binds to an ``nn.Parameter(...)`` or
    registers with ``self.register_parameter("<attr>", ...)``."""
    out: set[str] = set()
    # (a base is looked up as the rule's scope finds classes: in module-level blocks too)
    for c in same_file_lineage(tree, cls, lambda name: class_def(tree, name)):
        for node in walk(c):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_parameter(node.value.func):
                out |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "register_parameter" and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _is_parameter(func: ast.expr) -> bool:
    """``nn.Parameter``, ``torch.nn.Parameter``, ``Parameter`` (torch's class by its API name)."""
    return called_name(func) == "Parameter"


def _learned_parameter(e: ast.expr, site: Site, depth: int = 0) -> str | None:
    """The attribute of a learned parameter the factor ``e`` reads (following names assigned once
    in the function), else None. A rotation multiplies by unit-modulus factors built from the
    positions (a buffer, an argument, ``torch.polar(ones, angles)``); a factor read off a parameter
    is a learned complex weight, whatever the product looks like."""
    this = site.first_param
    if this is None or site.cls is None or depth > 8:
        return None
    params = _parameter_attrs(site.tree, site.cls)
    for node in walk(e):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == this \
                and node.attr in params:
            return node.attr
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in site.facts.single:
            found = _learned_parameter(site.facts.single[node.id][1], site, depth + 1)
            if found:
                return found
    return None


def complex_parts(call: ast.Call, site: Site) -> ComplexParts | str:
    """Read ``call`` as the complex rotation: the parts, why not (a :class:`NotACandidate` when it
    is no rotation at all)."""
    if not (site.names.is_(call.func, "view_as_real") and len(call.args) == 1 and not call.keywords):
        return NotACandidate("not torch.view_as_real(a * b)")
    prod = call.args[0]
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        return NotACandidate("not torch.view_as_real(a * b)")
    pairs = [_complex_of_pairs(e, site) for e in (prod.left, prod.right)]
    if not any(pairs):
        return NotACandidate("neither factor is a view_as_complex of pairs of the last dimension")
    for factor, is_pairs in zip((prod.left, prod.right), pairs):
        learned = None if is_pairs else _learned_parameter(factor, site)
        if learned:
            return NotACandidate(f"the factor {ast.unparse(factor)} reads the learned parameter self.{learned}: a "
                                 "complex (spectral) mix, not a rotation by angles built from the positions")
    if unsafe_operand(prod):
        return "an operand assigns or yields"
    return ComplexParts(call, prod.left, prod.right)
