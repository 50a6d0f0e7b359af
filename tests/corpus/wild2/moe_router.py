"""Mixture-of-experts code as research repositories write it: a Mixtral-like top-k router (softmax
over the experts in float32, ``topk``, renormalised weights, experts indexed with
``torch.where``), a Switch-like top-1 router with a load-balancing loss, a Mixtral-style
softmax over the top-k logits, Soft-MoE slots (dispatch normalised over tokens, combine over
slots), an expert-choice router, SwiGLU experts, and a small MoE language model with a loss."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEArgs:
    dim: int = 32
    hidden_dim: int = 48
    num_experts: int = 4
    top_k: int = 2
    vocab_size: int = 128
    n_layers: int = 2
    n_heads: int = 4


class Expert(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TopKMoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(args.dim, args.hidden_dim) for _ in range(args.num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_shape = x.shape
        x = x.view(-1, x.shape[-1])
        router_logits = self.gate(x)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token_idx, nth = torch.where(selected_experts == i)
            if token_idx.numel() == 0:
                continue
            out[token_idx] += routing_weights[token_idx, nth, None] * expert(x[token_idx])
        return out.view(orig_shape)


class TopKThenSoftmaxMoE(nn.Module):
    """mistral-inference's order: top-k of the logits first, softmax over the k chosen ones."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(args.dim, args.hidden_dim) for _ in range(args.num_experts)])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        flat = inputs.reshape(-1, inputs.shape[-1])
        gate_logits = self.gate(flat)
        weights, selected = torch.topk(gate_logits, self.top_k)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(flat[batch_idx])
        return results.view_as(inputs)


class SwitchRouter(nn.Module):
    """Top-1 routing with capacity-free dispatch and the Switch load-balancing loss."""

    def __init__(self, args: MoEArgs, jitter: float = 0.0):
        super().__init__()
        self.num_experts = args.num_experts
        self.jitter = jitter
        self.classifier = nn.Linear(args.dim, args.num_experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(args.dim, args.hidden_dim), nn.GELU(),
                                                    nn.Linear(args.hidden_dim, args.dim))
                                      for _ in range(args.num_experts)])
        self.aux_loss = torch.tensor(0.0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        router_logits = self.classifier(hidden_states)
        router_probs = torch.softmax(router_logits, dim=-1)
        expert_index = torch.argmax(router_probs, dim=-1)
        expert_mask = F.one_hot(expert_index, num_classes=self.num_experts)
        tokens_per_expert = expert_mask.float().mean(dim=(0, 1))
        router_prob_per_expert = router_probs.mean(dim=(0, 1))
        self.aux_loss = self.num_experts * torch.sum(tokens_per_expert * router_prob_per_expert)
        router_top = router_probs.max(dim=-1, keepdim=True).values
        out = hidden_states.clone()
        for idx, expert in enumerate(self.experts):
            token_indices = expert_mask[:, :, idx].bool()
            out[token_indices] = expert(hidden_states[token_indices]).to(out.dtype)
        return router_top * out


class SoftMoE(nn.Module):
    """Soft-MoE: every slot is a convex mix of tokens, every token a convex mix of slots."""

    def __init__(self, args: MoEArgs, slots_per_expert: int = 2):
        super().__init__()
        self.num_experts = args.num_experts
        self.slot_embeds = nn.Parameter(torch.randn(args.num_experts, slots_per_expert, args.dim) * 0.02)
        self.experts = nn.ModuleList([Expert(args.dim, args.hidden_dim) for _ in range(args.num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.einsum("bnd,esd->bnes", x, self.slot_embeds)
        dispatch_weights = logits.softmax(dim=1)
        combine_weights = logits.flatten(2).softmax(dim=-1)
        slots = torch.einsum("bnd,bnes->besd", x, dispatch_weights)
        out = torch.stack([expert(slots[:, i]) for i, expert in enumerate(self.experts)], dim=1)
        out = out.flatten(1, 2)
        return torch.einsum("bsd,bns->bnd", out, combine_weights)


class ExpertChoiceRouter(nn.Module):
    """Experts pick their top tokens: the token-to-expert affinity normalised over experts."""

    def __init__(self, args: MoEArgs, capacity: int = 4):
        super().__init__()
        self.capacity = capacity
        self.wg = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = nn.ModuleList([Expert(args.dim, args.hidden_dim) for _ in range(args.num_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        tokens = x.reshape(b * n, d)
        affinity = self.wg(tokens).softmax(dim=-1)
        gates, index = torch.topk(affinity.t(), min(self.capacity, b * n), dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            chosen = index[e]
            out.index_add_(0, chosen, gates[e, :, None] * expert(tokens[chosen]))
        return out.view(b, n, d)


class MoEBlock(nn.Module):
    def __init__(self, args: MoEArgs, moe: nn.Module):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attn = nn.MultiheadAttention(args.dim, args.n_heads, batch_first=True)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = moe

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        h = self.attention_norm(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, args: Optional[MoEArgs] = None):
        super().__init__()
        self.args = args = args or MoEArgs()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([MoEBlock(args, TopKMoE(args)), MoEBlock(args, TopKThenSoftmaxMoE(args)),
                                     MoEBlock(args, SwitchRouter(args)), MoEBlock(args, SoftMoE(args)),
                                     MoEBlock(args, ExpertChoiceRouter(args))][: max(args.n_layers, 5)])
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        seqlen = tokens.shape[1]
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=tokens.device), diagonal=1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask)
        h = self.norm(h)
        logits = self.output(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            aux = sum(layer.feed_forward.aux_loss for layer in self.layers if hasattr(layer.feed_forward, "aux_loss"))
            loss = loss + 0.01 * aux
        return logits, loss
