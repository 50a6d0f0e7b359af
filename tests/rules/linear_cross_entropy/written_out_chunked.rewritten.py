# expect: linear_cross_entropy UnchunkedLoss.forward
# expect: linear_cross_entropy UnchunkedPositional.forward
# expect: linear_cross_entropy ChunkSizeFromTheModule.forward
# expect: linear_cross_entropy ChunkSizeFromTheConfig.forward
"""A same-file chunked cross-entropy helper (litgpt style): a list of logits concatenated, the
logits flattened, a plain ``F.cross_entropy`` when ``chunk_size == 0`` and a sum over chunks
divided by ``max(count, 1)`` otherwise. A call that settles ``chunk_size`` to 0 (a literal) is the
mean cross entropy and is matched; the chunked branch is not provably that mean (an all-ignored
batch gives 0, the mean gives nan), so a call settling it (a literal 16) is left alone. A chunk
size read off the module or its config (a name or attribute chain) is matched with a run-time
guard: the fused loss only when the value is 0 then, the helper's call otherwise; one the call
computes (a method call) is not a guard and is left alone. litgpt's ``if targets is None: return
logits`` before the loss returns the head's output on a path without a loss."""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from adopter.kernels import lm_head_cross_entropy


def chunked_cross_entropy(logits, targets, chunk_size=128, ignore_index=-100):
    if isinstance(logits, list):
        logits = torch.cat(logits, dim=1)
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    if chunk_size == 0:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    logit_chunks = logits.split(chunk_size)
    target_chunks = targets.split(chunk_size)
    loss_chunks = [F.cross_entropy(lc, tc, ignore_index=ignore_index, reduction="none")
                   for lc, tc in zip(logit_chunks, target_chunks)]
    non_masked_elems = (targets != ignore_index).sum()
    return torch.cat(loss_chunks).sum() / non_masked_elems.maximum(torch.ones_like(non_masked_elems))


class _GPT(nn.Module):
    def __init__(self, vocab_size=64, n_embd=32, loss_chunk_size=0):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.loss_chunk_size = loss_chunk_size


class UnchunkedLoss(_GPT):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head,
            self.ln_f(self.wte(idx)),
            F.cross_entropy,
            targets[..., 1:].reshape(-1),
            rows=(..., slice(None, -1), slice(None)),
            flatten="reshape",
            ignore_index=-100,
        )
        return logits, loss


class UnchunkedPositional(_GPT):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head,
            self.ln_f(self.wte(idx)),
            F.cross_entropy,
            targets[..., 1:].reshape(-1),
            rows=(..., slice(None, -1), slice(None)),
            flatten="reshape",
            ignore_index=-1,
        )
        return logits, loss


class ChunkedLoss(_GPT):
    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=16)
        return logits, loss


class ChunkSizeFromTheModule(_GPT):
    def forward(self, idx, targets):
        if self.loss_chunk_size == 0:  # adopter: only then is chunked_cross_entropy(...) the plain cross entropy
            # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
            logits, loss = lm_head_cross_entropy(
                self.lm_head,
                self.ln_f(self.wte(idx)),
                F.cross_entropy,
                targets[..., 1:].reshape(-1),
                rows=(..., slice(None, -1), slice(None)),
                flatten="reshape",
                ignore_index=-100,
            )
        else:
            logits = self.lm_head(self.ln_f(self.wte(idx)))
            loss = chunked_cross_entropy(
                logits[..., :-1, :], targets[..., 1:], chunk_size=self.loss_chunk_size
            )
        return logits, loss


@dataclass
class _Config:
    loss_chunk_size: int = 0


class ChunkSizeFromTheConfig(nn.Module):
    def __init__(self, vocab_size=64, n_embd=32, loss_chunk_size=0):
        super().__init__()
        self.config = _Config(loss_chunk_size)
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        x = self.ln_f(self.wte(idx))
        if targets is None:
            logits = self.lm_head(x)
            return logits
        if self.config.loss_chunk_size == 0:  # adopter: only then is chunked_cross_entropy(...) the plain cross entropy
            # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
            logits, loss = lm_head_cross_entropy(
                self.lm_head,
                x,
                F.cross_entropy,
                targets[..., 1:].reshape(-1),
                rows=(..., slice(None, -1), slice(None)),
                flatten="reshape",
                ignore_index=-100,
            )
        else:
            logits = self.lm_head(x)
            loss = chunked_cross_entropy(
                logits[..., :-1, :], targets[..., 1:], chunk_size=self.config.loss_chunk_size
            )
        return logits, loss


class ChunkSizeFromACall(_GPT):
    def chunk_size(self):
        return self.loss_chunk_size

    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=self.chunk_size())
        return logits, loss
