# expect: linear_cross_entropy Llama2cLastLoss.forward
# expect: linear_cross_entropy LastLossAfterBranches.forward
# expect: linear_cross_entropy LocalLossReturnsLogitsOnly.forward refused:logits-read
# expect: linear_cross_entropy LastLossLogitsReadAgain.forward refused:logits-read
"""Issue 24 forms of the written-out LM loss: the loss kept on the module (``self.last_loss``, the
logits returned alone: the convention of a returned ``(logits, loss)``), and heads that are no LM
head — a classifier over a pooled vector (one row per example) is not listed."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from adopter.kernels import lm_head_cross_entropy


class _Trunk(nn.Module):
    def __init__(self, vocab_size=64, dim=32, num_labels=3):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight
        self.pooler = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.0)
        self.classifier = nn.Linear(dim, num_labels)
        self.num_labels = num_labels
        self.last_loss = None

    def trunk(self, tokens):
        return self.norm(self.tok_embeddings(tokens))


class Llama2cLastLoss(_Trunk):
    """llama2.c: the loss on self.last_loss, the inference branch runs the head on the last position."""

    def forward(self, tokens, targets=None):
        h = self.trunk(tokens)
        if targets is not None:
            # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
            logits, self.last_loss = lm_head_cross_entropy(
                self.output, h, F.cross_entropy, targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.output(h[:, [-1], :])
            self.last_loss = None
        return logits


class LastLossAfterBranches(_Trunk):
    def forward(self, tokens, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, self.last_loss = lm_head_cross_entropy(
            self.output, self.trunk(tokens), F.cross_entropy, targets.reshape(-1), flatten="reshape"
        )
        return logits


class LocalLossReturnsLogitsOnly(_Trunk):
    """The loss is a local nobody reads: returning the logits alone would return None in training."""

    def forward(self, tokens, targets):
        logits = self.output(self.trunk(tokens))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))  # noqa: F841
        return logits


class LastLossLogitsReadAgain(_Trunk):
    def forward(self, tokens, targets):
        logits = self.output(self.trunk(tokens))
        self.last_loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits.argmax(-1)  # a read of the logits (no other rule's site)


class FirstTokenClassifier(_Trunk):
    """A sequence classifier: the first token's state, pooled, into num_labels classes."""

    def forward(self, tokens, labels):
        hidden = self.trunk(tokens)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        logits = self.classifier(self.dropout(pooled))
        loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return loss, logits


class MeanPooledClassifier(_Trunk):
    def __init__(self):
        super().__init__()
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(self, tokens, labels):
        pooled = self.trunk(tokens).mean(dim=1)
        logits = self.classifier(pooled)
        loss = self.loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
        return loss, logits


class LastTokenClassifier(_Trunk):
    def forward(self, tokens, labels):
        hidden = self.trunk(tokens)
        logits = self.classifier(hidden[:, -1, :])
        loss = F.cross_entropy(logits.reshape(-1, self.num_labels), labels.reshape(-1))
        return logits, loss
