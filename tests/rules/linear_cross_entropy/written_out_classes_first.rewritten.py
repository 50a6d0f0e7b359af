# expect: linear_cross_entropy RearrangeLM.forward
# expect: linear_cross_entropy TransposeLM.forward
# expect: linear_cross_entropy PermuteLM.forward
"""Cross entropy with the classes at dim 1 (einops / x-transformers style): the (batch, tokens,
vocab) logits of an LM head moved to (batch, vocab, tokens) for a (batch, tokens) target, which is
the per-token cross entropy of the (tokens, vocab) rows. Not matched: a move that is not the
classes to dim 1 (``transpose(0, 2)``, a pattern that reorders the batch)."""
import torch.nn as nn
import torch.nn.functional as F
from adopter.kernels import lm_head_cross_entropy
from einops import rearrange


class _TinyLM(nn.Module):
    def __init__(self, num_tokens=48, dim=16, ignore_index=-100):
        super().__init__()
        self.ignore_index = ignore_index
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)


class RearrangeLM(_TinyLM):
    def forward(self, x, return_loss=False):
        if return_loss:
            x, target = x[:, :-1], x[:, 1:]
        h = self.norm(self.token_emb(x))
        if not return_loss:
            logits = self.to_logits(h)
            return logits
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.to_logits,
            h,
            F.cross_entropy,
            target,
            flatten=('rearrange', 'b n c -> b c n'),
            ignore_index=self.ignore_index,
        )
        return loss


class TransposeLM(_TinyLM):
    def forward(self, idx, targets=None):
        if targets is None:
            logits = self.to_logits(self.norm(self.token_emb(idx)))
            return logits, None
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.to_logits,
            self.norm(self.token_emb(idx)),
            F.cross_entropy,
            targets,
            flatten=('transpose', 1, 2),
            reduction="sum",
        )
        return None, loss


class PermuteLM(_TinyLM):
    def __init__(self):
        super().__init__(ignore_index=0)
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=0)

    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.to_logits,
            self.norm(self.token_emb(idx)),
            self.loss_fn,
            targets,
            flatten=('permute', 0, 2, 1),
            upcast=True,
        )
        return loss


class TransposeBatchLM(_TinyLM):
    def forward(self, idx, targets):
        logits = self.to_logits(self.norm(self.token_emb(idx)))
        loss = F.cross_entropy(logits.transpose(0, 2), targets)
        return loss


class RearrangeOtherLM(_TinyLM):
    def forward(self, idx, targets):
        logits = self.to_logits(self.norm(self.token_emb(idx)))
        loss = F.cross_entropy(rearrange(logits, "b n c -> n c b"), targets)
        return loss
