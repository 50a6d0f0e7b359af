"""linear_cross_entropy: the LM head followed by the model's causal-LM loss, fused and chunked so the
``(tokens x vocab)`` logits never exist in training (the rule: :mod:`.rule`, ``RULE`` here).

The package, by what each part is:

    rule           pattern, DOC, run-time check, ``RULE``
    analysis       one head call as a site, both forms, once per site: the precondition
    site           the site model: what the analysis finds, in positions and names (no tree
                   node), carried to the codemod on the match (``Match.site``)
    loss_function  transformers' form: the logits of ``self.loss_function(...)``
    written_out    the written-out form: torch's cross entropy of the logits laid out as
                   ``(tokens, vocab)``, through the modules below
      layout       the chain from the logits to the cross entropy's input, and its order
      inline       a same-file helper inlined (its ``if``s settled by the call or run-time guards)
      heads        LM head or classifier (a pooled input, an output size nothing embeds)
      file_facts   what a whole file says (its functions, cross-entropy names, embeddings)
      names        imports, dotted names, the one assignment of a name
    flow           blocks and paths in one function, and the one check of what changes the
                   logits between the head and the loss (both forms)
    codemod        the site becomes the kernel call
"""

from __future__ import annotations

from adopter.core.rules.linear_cross_entropy.analysis import analyse, head_feeds_loss
from adopter.core.rules.linear_cross_entropy.codemod import (
    CE_KERNEL,
    KERNEL,
    LAYOUT_KEYWORDS,
    NOTE,
    LinearCrossEntropy,
)
from adopter.core.rules.linear_cross_entropy.inline import inline_helper
from adopter.core.rules.linear_cross_entropy.loss_function import LOSS_METHOD
from adopter.core.rules.linear_cross_entropy.rule import DOC, DSL, RULE
from adopter.core.rules.linear_cross_entropy.site import (
    CrossEntropySite,
    ExprRef,
    Layout,
    LossFunctionSite,
    NotAMatch,
    Site,
)
from adopter.core.rules.linear_cross_entropy.written_out import CE_FUNCTION, CE_MODULES

__all__ = [
    "CE_FUNCTION", "CE_KERNEL", "CE_MODULES", "DOC", "DSL", "KERNEL", "LAYOUT_KEYWORDS", "LOSS_METHOD", "NOTE",
    "RULE", "CrossEntropySite", "ExprRef", "Layout", "LinearCrossEntropy", "LossFunctionSite", "NotAMatch",
    "Site", "analyse", "head_feeds_loss", "inline_helper",
]  # fmt: skip
