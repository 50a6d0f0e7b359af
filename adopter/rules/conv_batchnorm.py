"""Conv_BatchNorm: fuse ``BatchNorm2d(Conv2d(x))`` into ``adopter.kernels.FusedConv2dBatchNorm2d``."""

from __future__ import annotations

from adopter.rules import Rule
from adopter.rules._common import distinct_modules, intermediates_unused

DSL = """
rule Conv_BatchNorm
init:
    torch.nn.Conv2d($cin, $cout) -> $conv; torch.nn.BatchNorm2d($nf) -> $bn
    => adopter.kernels.FusedConv2dBatchNorm2d($cin, $cout) -> $conv
forward:
    torch.nn.Conv2d@$conv($x) -> $c; torch.nn.BatchNorm2d@$bn($c) -> $out
    => adopter.kernels.FusedConv2dBatchNorm2d@$conv($x) -> $out
"""

DOC = """\
Fuses a 2-D convolution and the batch norm applied to its output (folded in eval). A
match is a ``torch.nn.Conv2d`` module call whose output is directly the input of a
``torch.nn.BatchNorm2d`` module call on the same control-flow path — including when the
batch norm sits in a branch the convolution does not (paper Fig. 3/5: DPT
``if self.use_batch_norm``) — with both modules bound in ``__init__``. Not a match:
functional ``F.conv2d``/``F.batch_norm``; Conv2d subclasses (EfficientNet's depthwise
``EfficientNetDepthwiseConv2d``: its constructor is not Conv2d's); Conv1d/Conv3d/
ConvTranspose2d; BatchNorm1d/3d, SyncBatchNorm or other norms; any op (activation, padding, reshape) between the two; a
convolution output that is also read elsewhere; layers inside ``nn.Sequential``
containers (not extracted as separate calls)."""

RULE = Rule(
    name="Conv_BatchNorm",
    kernel="adopter.kernels.FusedConv2dBatchNorm2d",
    doc=DOC,
    dsl=DSL,
    preconditions=(intermediates_unused("$c"), distinct_modules("$conv", "$bn")),
    # Off: same-file Conv2d subclasses (EfficientNetDepthwiseConv2d) would be matched, but the
    # rewrite builds FusedConv2dBatchNorm2d from the subclass's own constructor arguments
    # (no out_channels/groups there) and produces a model that fails to build. Turn on once
    # rewrite/codemod_batchnorm.py skips or maps constructors other than torch.nn.Conv2d.
    match_subclasses=True,
)
