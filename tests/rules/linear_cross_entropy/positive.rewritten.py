# expect: linear_cross_entropy LlamaLikeForCausalLM.forward
# expect: linear_cross_entropy SliceIndicesForCausalLM.forward
# expect: linear_cross_entropy PositionalLossForCausalLM.forward
# expect: linear_cross_entropy TupleOutputForCausalLM.forward
"""LM heads feeding the causal-LM loss, in the spellings transformers uses."""
import torch
from adopter.kernels import linear_cross_entropy
from torch import nn

from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep


class LlamaLikeForCausalLM(nn.Module):
    """transformers 5.x: ``slice_logits_to_keep`` then the head, keyword loss call."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None, logits_to_keep=0, **kwargs):
        hidden_states = self.model(input_ids)
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)

        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = linear_cross_entropy(
            self.lm_head,
            hidden_states,
            self.loss_function if labels is not None else None,
            labels=labels,
            vocab_size=self.config.vocab_size,
            **kwargs,
        )

        return CausalLMOutputWithPast(loss=loss, logits=logits)


class SliceIndicesForCausalLM(nn.Module):
    """Older transformers: the head reads ``hidden_states[:, slice_indices, :]``."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None, logits_to_keep=0, **kwargs):
        hidden_states = self.model(input_ids)
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep

        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = linear_cross_entropy(
            self.lm_head,
            hidden_states[:, slice_indices, :],
            self.loss_function if labels is not None else None,
            labels=labels,
            vocab_size=self.config.vocab_size,
            **kwargs,
        )

        return CausalLMOutputWithPast(loss=loss, logits=logits)


class PositionalLossForCausalLM(nn.Module):
    """``self.loss_function(logits, labels, self.vocab_size, **kwargs)`` (the positional spelling)."""

    def __init__(self, config):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.model = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels=None, **kwargs):
        hidden_states = self.model(input_ids)
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = linear_cross_entropy(
            self.lm_head,
            hidden_states,
            self.loss_function if labels is not None else None,
            labels,
            self.vocab_size,
            **kwargs,
        )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class TupleOutputForCausalLM(nn.Module):
    """``return_dict=False``: the logits packed into a tuple are still only returned."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, labels=None, return_dict=True, **kwargs):
        hidden_states = self.model(input_ids)
        # adopter: logits None when training with labels (fused loss); ADOPTER_KEEP_LOGITS=1 keeps them
        logits, loss = linear_cross_entropy(
            self.lm_head,
            hidden_states,
            self.loss_function if labels is not None else None,
            labels=labels,
            vocab_size=self.config.vocab_size,
            **kwargs,
        )
        if not return_dict:
            output = (logits, hidden_states)
            return (loss,) + output if loss is not None else output
        return CausalLMOutputWithPast(loss=loss, logits=logits)
