"""The linear_cross_entropy rule: its pattern, what counts as a match (DOC), its precondition and
codemod, and its run-time check.

The LM head followed by the model's causal-LM loss, fused and chunked so the ``(tokens x vocab)``
logits never exist in training. ``adopter.kernels.linear_cross_entropy`` decides at run time (see
``kernels/guarded_linear_cross_entropy.py``): training with labels, a plain ``nn.Linear`` head and
transformers' ``ForCausalLMLoss`` run fused and return ``(None, loss)``; anything else (eval, no
labels, another loss function, ``ADOPTER_KEEP_LOGITS=1``) runs the original statements. Statically,
a site is only rewritten when nothing but the loss and the returned output reads the logits.
"""

from __future__ import annotations

import linecache

from adopter.core.rule import Rule, Runtime, RuntimeSite
from adopter.core.rules._common import LINEAR
from adopter.core.rules.linear_cross_entropy.analysis import head_feeds_loss
from adopter.core.rules.linear_cross_entropy.codemod import LinearCrossEntropy
from adopter.core.rules.linear_cross_entropy.site import CrossEntropySite, ExprRef, LossFunctionSite

DSL = """
rule linear_cross_entropy
init:
    torch.nn.Linear($hidden, $vocab) -> $head
forward:
    torch.nn.Linear@$head($h) -> $logits
"""


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
(``F.cross_entropy``, an ``nn.CrossEntropyLoss``, a shift ``logits[..., :-1, :]``, the classes moved
to dim 1 for a ``(batch, tokens)`` target — ``rearrange(logits, "b n c -> b c n")``,
``logits.transpose(1, 2)``, ``logits.permute(0, 2, 1)``: the same per-token loss, fused only when
the logits are 3-D and the target has their leading shape, else the source's op runs —, a same-file
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


# ---------------------------------------------------------------- runtime


def _source_text(file: str, ref: ExprRef) -> str:
    """The text of an expression the site refers to: its own, or the file's at its position
    (one line; ast's UTF-8 byte columns)."""
    if ref.text or ref.at is None:
        return ref.text
    at = ref.at
    if at.line != at.end_line:
        return ""
    line = linecache.getline(file, at.line).encode("utf-8")
    return line[at.col:at.end_col].decode("utf-8", "replace").strip()


def _loss_condition(match) -> str:
    """When the kernel runs fused, in the words of what this site calls (its ``Match.site``)."""
    site = getattr(match, "site", None)
    if isinstance(site, LossFunctionSite):
        return "when training with labels and self.loss_function is transformers' ForCausalLMLoss"
    if isinstance(site, CrossEntropySite):
        called = _source_text(match.file, site.loss_fn) or "the cross entropy"
        where = f" (inlined from {site.helper})" if site.helper else ""
        return (f"when training with targets and {called}{where} is torch's cross entropy the chunked sum "
                "computes (class-index targets, mean or sum, no weight nor label smoothing)")
    return "when training with targets and a loss the kernel computes"


def _runtime_check(site: RuntimeSite) -> tuple[str | None, str]:
    from torch import nn

    head = site.modules[0] if site.modules else None
    if not isinstance(head, nn.Linear):
        return f"the head that runs is {type(head).__name__}, not an nn.Linear", ""
    return None, (f"head Linear {head.in_features}->{head.out_features} bias={head.bias is not None}; fused only "
                  f"{_loss_condition(site.match)} (checked per call)")


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
