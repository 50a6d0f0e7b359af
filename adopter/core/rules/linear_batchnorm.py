"""Linear_BatchNorm: ``BatchNorm1d(Linear(x))`` becomes ``adopter.kernels.linear_bn(linear, bn, x)`` (BN folded in eval)."""

from __future__ import annotations

from adopter.core.rule import Rule
from adopter.core.rules._batchnorm_codemod import LinearBatchNorm
from adopter.core.rules._common import (
    BATCH_NORM_1D,
    LINEAR,
    const_text,
    distinct_modules,
    intermediates_unused,
    kwarg,
    layer_pair_runtime,
)

DSL = """
rule Linear_BatchNorm
init:
    torch.nn.Linear($in, $out_features) -> $lin; torch.nn.BatchNorm1d($nf) -> $bn
forward:
    torch.nn.Linear@$lin($x) -> $h; torch.nn.BatchNorm1d@$bn($h) -> $out

# LeViT MLPLayerWithBN: BatchNorm1d over the flattened leading dims
rule Linear_BatchNorm
init:
    torch.nn.Linear($in, $out_features) -> $lin; torch.nn.BatchNorm1d($nf) -> $bn
forward:
    torch.nn.Linear@$lin($x) -> $h; torch.Tensor.flatten($h) -> $flat; torch.nn.BatchNorm1d@$bn($flat) -> $out
"""

DOC = """\
Fuses a linear layer and the 1-D batch norm applied to its output. A match is a
``torch.nn.Linear`` module call whose output is the input of a ``torch.nn.BatchNorm1d``
module call on the same control-flow path — directly, or through a ``.flatten(start,
end)`` of the leading dimensions that keeps the feature dimension last (LeViT's
``batch_norm(x.flatten(0, 1)).reshape_as(x)``) — both modules bound in ``__init__``
(``nn.Sequential`` members count). Not a match: any other op between them (activation,
transpose, reshape); a flatten that merges the feature dimension (``flatten()``,
``end_dim=-1``); other norms; a linear output whose data is also read elsewhere (reading
only its shape, as ``reshape_as(x)`` does, is fine)."""

def _flatten_keeps_features(ctx) -> str | None:
    flat = next((mn.node for mn in ctx.match.nodes if mn.pattern_index == 1 and len(ctx.match.nodes) == 3), None)
    if flat is None:
        return None
    end = kwarg(flat, "end_dim", 2)
    text = const_text(end) if end is not None else None
    if text is None or text in ("-1",):
        return "flatten merges the feature dimension"
    return None


RUNTIME = layer_pair_runtime(LINEAR, BATCH_NORM_1D, "out_features")

RULE = Rule(
    name="Linear_BatchNorm",
    chain=True,
    kernel="adopter.kernels.linear_bn",
    doc=DOC,
    dsl=DSL,
    codemod=LinearBatchNorm(),
    runtime=RUNTIME,
    fixtures="Linear_BatchNorm",
    preconditions=(intermediates_unused("$h", "$flat"), distinct_modules("$lin", "$bn"), _flatten_keeps_features),
    # Sequential entries (``nn.Sequential(conv, bn, ...)``): rewritten to GuardedSequential where built.
    in_sequential=True,
)
