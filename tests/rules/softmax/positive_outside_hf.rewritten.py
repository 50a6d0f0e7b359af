# Mixture-of-experts routers written outside HuggingFace: the router's logits come from a gate
# module handed to the constructor (``self.gate = gate``; every construction here passes an
# nn.Linear), the tokens flattened to 2-D by a view, the top-k scores unpacked from torch.topk
# and normalised over dim=1 — the last dimension of a 2-D tensor.
# expect: softmax TopKRouter.forward
# expect: softmax SortedRouter.forward
# expect: softmax KeywordGateRouter.forward
from typing import List

import torch
import torch.nn.functional as F
from adopter.kernels import softmax
from torch import nn


class TopKRouter(nn.Module):
    def __init__(self, experts: List[nn.Module], gate: nn.Module, top_k: int):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.view(-1, hidden.shape[-1])
        router_logits = self.gate(tokens)
        weights, chosen = torch.topk(router_logits, self.top_k)
        weights = softmax(weights, dim=1, dtype=torch.float).to(hidden.dtype)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == i)
            out[rows] += weights[rows, slot, None] * expert(tokens[rows])
        return out.view_as(hidden)


class SortedRouter(nn.Module):
    """All experts weighted, in score order (``sort`` keeps the rank too)."""

    def __init__(self, scorer, n_experts):
        super().__init__()
        self.scorer = scorer
        self.n_experts = n_experts

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        ordered, order = self.scorer(flat).sort(descending=True)
        return softmax(ordered, dim=1), order


class KeywordGateRouter(nn.Module):
    def __init__(self, dim, n_experts, *, gate):
        super().__init__()
        self.router = gate
        self.n_experts = n_experts

    def forward(self, x):
        logits = self.router(x.view(-1, x.shape[-1]))
        top, idx = logits.topk(2)
        return softmax(top, dim=1), idx


class Block(nn.Module):
    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.moe = TopKRouter([nn.Linear(dim, dim) for _ in range(n_experts)],
                              gate=nn.Linear(dim, n_experts, bias=False), top_k=2)
        self.sorted = SortedRouter(nn.Linear(dim, n_experts), n_experts)
        self.keyword = KeywordGateRouter(dim, n_experts, gate=torch.nn.Linear(dim, n_experts))

    def forward(self, x):
        return self.moe(x), self.sorted(x), self.keyword(x)
