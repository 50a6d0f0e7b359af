"""Linear_BatchNorm: fuse ``BatchNorm1d(Linear(x))`` into ``adopter.kernels.FusedLinearBatchNorm1d``."""

from __future__ import annotations

from adopter.rules import Rule
from adopter.rules._common import distinct_modules, intermediates_unused

DSL = """
rule Linear_BatchNorm
init:
    torch.nn.Linear($in, $out_features) -> $lin; torch.nn.BatchNorm1d($nf) -> $bn
    => adopter.kernels.FusedLinearBatchNorm1d($in, $out_features) -> $lin
forward:
    torch.nn.Linear@$lin($x) -> $h; torch.nn.BatchNorm1d@$bn($h) -> $out
    => adopter.kernels.FusedLinearBatchNorm1d@$lin($x) -> $out
"""

DOC = """\
Fuses a linear layer and the 1-D batch norm applied to its output. A match is a
``torch.nn.Linear`` module call whose output is directly the input of a
``torch.nn.BatchNorm1d`` module call on the same control-flow path, both modules bound in
``__init__``. Not a match: an op between them (activation, transpose, reshape); other
norms; a linear output also read elsewhere."""

RULE = Rule(
    name="Linear_BatchNorm",
    kernel="adopter.kernels.FusedLinearBatchNorm1d",
    doc=DOC,
    dsl=DSL,
    preconditions=(intermediates_unused("$h"), distinct_modules("$lin", "$bn")),
)
