# expect: linear_cross_entropy NanoGPT.forward
# expect: linear_cross_entropy ReshapeConfigVocab.forward
# expect: linear_cross_entropy FlattenImportedFunction.forward
# expect: linear_cross_entropy LossModuleInInit.forward
# expect: linear_cross_entropy InlineLossModule.forward
# expect: linear_cross_entropy GPT2Shifted.forward
# expect: linear_cross_entropy InlineShiftSum.forward
# expect: linear_cross_entropy UpcastBeforeView.forward
# expect: linear_cross_entropy TorchtitanHelper.forward
# expect: linear_cross_entropy StraightLineHelper.forward
# expect: linear_cross_entropy ModuleLevelLoss.forward
"""An LM head whose output reaches torch's cross entropy as research code writes it out (no
transformers ``self.loss_function``): every spelling the rule recognises, by what it computes."""
import torch
import torch.nn as nn
from adopter.kernels import lm_head_cross_entropy
from torch.nn import CrossEntropyLoss
from torch.nn import functional as F
from torch.nn.functional import cross_entropy

LOSS = nn.CrossEntropyLoss(ignore_index=-1)


def cross_entropy_loss(pred, labels):
    """torchtitan's: the loss of every token, in fp32."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def token_cross_entropy(logits, targets, ignore_index=-100):
    logits = logits.reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)


class _Trunk(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def trunk(self, idx):
        return self.ln_f(self.wte(idx))


class NanoGPT(_Trunk):
    """nanoGPT: the head in the training branch, the inference branch (last position only) untouched,
    tied weights."""

    def __init__(self, config):
        super().__init__(config)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.trunk(idx)
        if targets is not None:
            # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
            logits, loss = lm_head_cross_entropy(
                self.lm_head, x, F.cross_entropy, targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class ReshapeConfigVocab(_Trunk):
    def forward(self, idx, targets):
        x = self.trunk(idx)
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head,
            x,
            torch.nn.functional.cross_entropy,
            targets.reshape(-1),
            flatten="reshape",
            vocab=self.config.vocab_size,
            reduction="mean",
        )
        return logits, loss


class FlattenImportedFunction(_Trunk):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head, self.trunk(idx), cross_entropy, targets.flatten(0, 1), flatten=(0, 1)
        )
        return {"logits": logits, "loss": loss}


class LossModuleInInit(_Trunk):
    def __init__(self, config):
        super().__init__(config)
        self.criterion = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head, self.trunk(idx), self.criterion, targets.view(-1), vocab=self.config.vocab_size
        )
        return logits, loss


class InlineLossModule(_Trunk):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head, self.trunk(idx), nn.CrossEntropyLoss(ignore_index=0), targets.view(-1)
        )
        return logits, loss


class GPT2Shifted(_Trunk):
    """GPT-2 style: shifted targets, the loss module built as a local, under ``if labels is not None``."""

    def forward(self, idx, labels=None):
        hidden_states = self.trunk(idx)
        if labels is not None:
            loss = None
            shift_labels = labels[..., 1:].contiguous()
            loss_fct = CrossEntropyLoss()
            # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
            lm_logits, loss = lm_head_cross_entropy(
                self.lm_head,
                hidden_states,
                loss_fct,
                shift_labels.view(-1),
                rows=(..., slice(None, -1), slice(None)),
                contiguous=True,
            )
        else:
            lm_logits = self.lm_head(hidden_states)
            loss = None
        return (loss, lm_logits)


class InlineShiftSum(_Trunk):
    def forward(self, idx):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head,
            self.trunk(idx),
            F.cross_entropy,
            idx[:, 1:].reshape(-1),
            rows=(slice(None), slice(None, -1)),
            contiguous=True,
            reduction="sum",
        )
        return logits, loss


class UpcastBeforeView(_Trunk):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head, self.trunk(idx), F.cross_entropy, targets.view(-1), upcast=True
        )
        return logits, loss


class TorchtitanHelper(_Trunk):
    def forward(self, idx, labels):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        pred, loss = lm_head_cross_entropy(
            self.lm_head,
            self.trunk(idx),
            torch.nn.functional.cross_entropy,
            labels.flatten(0, 1),
            flatten=(0, 1),
            upcast=True,
        )
        return pred, loss


class StraightLineHelper(_Trunk):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head,
            self.trunk(idx),
            F.cross_entropy,
            targets.reshape(-1),
            flatten="reshape",
            ignore_index=-1,
        )
        return logits, loss


class ModuleLevelLoss(_Trunk):
    def forward(self, idx, targets):
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = lm_head_cross_entropy(
            self.lm_head, self.trunk(idx), LOSS, targets.view(-1)
        )
        return logits, loss


class ClassificationOverTokens(nn.Module):
    """A token classification head written like an LM head: not matched. Its output size
    (num_labels) is no size the file embeds, so it is a classifier over a few labels: the kernel
    would compute it exactly, but there is nothing to save and training would lose the logits."""

    def __init__(self, hidden, num_labels):
        super().__init__()
        self.num_labels = num_labels
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, sequence_output, labels):
        logits = self.classifier(sequence_output)
        loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return logits, loss
