"""Conv_BatchNorm: ``BatchNorm2d(Conv2d(x))`` becomes ``adopter.kernels.conv_bn(conv, bn, x)`` (BN folded in eval)."""

from __future__ import annotations

from adopter.core.rule import Rule
from adopter.core.rules._batchnorm_codemod import ConvBatchNorm
from adopter.core.rules._common import (
    BATCH_NORM_2D,
    CONV2D,
    distinct_modules,
    intermediates_unused,
    layer_pair_runtime,
)

DSL = """
rule Conv_BatchNorm
init:
    torch.nn.Conv2d($cin, $cout) -> $conv; torch.nn.BatchNorm2d($nf) -> $bn
forward:
    torch.nn.Conv2d@$conv($x) -> $c; torch.nn.BatchNorm2d@$bn($c) -> $out
"""

DOC = """\
Fuses a 2-D convolution and the batch norm applied to its output (folded in eval). A
match is a ``torch.nn.Conv2d`` module call whose output is directly the input of a
``torch.nn.BatchNorm2d`` module call on the same control-flow path — including when the
batch norm sits in a branch the convolution does not (paper Fig. 3/5: DPT
``if self.use_batch_norm``) — with both modules bound in ``__init__``. The convolution
may be a subclass of ``nn.Conv2d`` defined in the same file that defines no method but
``__init__`` (directly or through same-file bases), so its forward is Conv2d's
(EfficientNet's depthwise ``EfficientNetDepthwiseConv2d``); the rewrite hands both modules
to the kernel, which folds only when, at run time, the conv keeps Conv2d's ``forward`` and the
batch norm is in eval mode with running statistics. An activation applied to the batch norm's
output alone, as the very next step (``self.act(h)`` of a module, or ``F.relu``/``torch.relu``),
is handed to the kernel too: a plain ``nn.ReLU`` (or functional ReLU) runs in the conv's
epilogue, anything else is called on the result as before. Not a match: functional
``F.conv2d``/``F.batch_norm``; Conv2d subclasses that override ``forward`` or any other
method, or are defined in another file; Conv1d/Conv3d/ConvTranspose2d; BatchNorm1d/3d,
SyncBatchNorm or other norms; any op (activation, padding, reshape) between the two; a
convolution output that is also read elsewhere; layers inside ``nn.Sequential``
containers (not extracted as separate calls)."""


RUNTIME = layer_pair_runtime(CONV2D, BATCH_NORM_2D, "out_channels")

RULE = Rule(
    name="Conv_BatchNorm",
    chain=True,
    kernel="adopter.kernels.conv_bn",
    doc=DOC,
    dsl=DSL,
    codemod=ConvBatchNorm(),
    runtime=RUNTIME,
    fixtures="Conv_BatchNorm",
    preconditions=(intermediates_unused("$c"), distinct_modules("$conv", "$bn")),
    # Same-file Conv2d subclasses (EfficientNetDepthwiseConv2d): conv_bn checks at run time that
    # the subclass keeps Conv2d's forward.
    match_subclasses=True,
    # BatchNorm2d subclasses applying their own activation (timm's BatchNormAct2d): conv_bn folds the
    # batch norm and applies the module's activation after, once it has checked what the class computes
    match_norm_act=True,
    # Sequential entries (``nn.Sequential(conv, bn, ...)``): rewritten to GuardedSequential where built.
    in_sequential=True,
)
