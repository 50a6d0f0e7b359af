"""Dropout_LayerNorm: fuse ``LayerNorm(Dropout(x) + residual)`` (EPOI ``FusedDropoutAddLayerNorm``)."""

from __future__ import annotations

from adopter.core.match import MatchContext
from adopter.core.rules import Rule
from adopter.core.rules._common import intermediates_unused

DSL = """
rule Dropout_LayerNorm
init:
    torch.nn.Dropout($p) -> $drop; torch.nn.LayerNorm($shape, eps=$eps) -> $ln
    => adopter.kernels.FusedDropoutAddLayerNorm($shape, p=$p, eps=$eps) -> $ln
forward:
    torch.nn.Dropout@$drop($x) -> $y; $y + $res -> $sum; torch.nn.LayerNorm@$ln($sum) -> $out
    => adopter.kernels.FusedDropoutAddLayerNorm@$ln($x, $res) -> $out
"""

DOC = """\
Fuses a dropout, a residual add and a layer norm into one kernel. A match is a call of
a ``torch.nn.Dropout`` module whose output is added (``+``, either operand order, nested
or through assignments) to another tensor, the sum being the input of a
``torch.nn.LayerNorm`` module call, all on one control-flow path of a ``forward`` (or a
helper it calls), with both modules bound in ``__init__`` of the class (or a base class
in the same file). Not a match: functional ``nn.functional.dropout``; LayerNorm before
Dropout (embeddings); other norm classes (RMSNorm, custom LayerNorm); Dropout and
LayerNorm that are not connected through the add; a dropout output or sum that is also
read by another node outside the three matched ones (fusion would drop it); the same
module used as both layers."""


def _dropout_is_not_layernorm(ctx: MatchContext) -> str | None:
    drop, ln = ctx.binding("$drop"), ctx.binding("$ln")
    if drop is not None and drop == ln:
        return "Dropout and LayerNorm are the same module"
    return None


RULE = Rule(
    name="Dropout_LayerNorm",
    kernel="adopter.kernels.FusedDropoutAddLayerNorm",
    doc=DOC,
    dsl=DSL,
    preconditions=(intermediates_unused("$y", "$sum"), _dropout_is_not_layernorm),
)
