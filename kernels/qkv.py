"""``FusedQKV``: one Linear for the query/key/value projections, saved/loaded as the three originals."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from .ops.qkv import qkv_projection
from .state_dict_hooks import ParentKeyRemap, install_hooks


class FusedQKV(ParentKeyRemap, nn.Linear):
    """``q, k, v = m(x)`` equals ``query(x), key(x), value(x)`` of three ``nn.Linear`` siblings.

    The weight is ``cat([Wq, Wk, Wv])``; in the parent's state dict it appears as
    ``<names[i]>.weight`` / ``<names[i]>.bias`` (no key of its own), so checkpoints of the original
    class load strictly and what it saves loads into the original class strictly.
    ``kv_out_features`` gives key/value a different width (GQA/MQA); default ``out_features``.
    Parameters are initialized slice by slice in the order three ``nn.Linear`` would be, so the
    same RNG state gives the same weights as the original layers.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        names: Sequence[str] = ("query", "key", "value"),
        kv_out_features: Optional[int] = None,
        device=None,
        dtype=None,
    ) -> None:
        names = tuple(names)
        if len(names) != 3 or len(set(names)) != 3:
            raise ValueError(f"FusedQKV needs three distinct names, got {names}")
        kv = out_features if kv_out_features is None else kv_out_features
        self.names = names
        self.sizes = (out_features, kv, kv)
        self.q_out_features = out_features
        self.kv_out_features = kv
        super().__init__(in_features, sum(self.sizes), bias=bias, device=device, dtype=dtype)
        install_hooks(self)

    def reset_parameters(self) -> None:
        # the same draws, in the same order, as nn.Linear(query), nn.Linear(key), nn.Linear(value)
        with torch.no_grad():
            weights = self.weight.split(self.sizes, 0)
            biases = self.bias.split(self.sizes, 0) if self.bias is not None else (None,) * 3
            for w, b in zip(weights, biases):
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))
                if b is not None:
                    fan_in = w.shape[1]
                    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
                    nn.init.uniform_(b, -bound, bound)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv_projection(x, self.weight, self.bias, self.sizes)

    def extra_repr(self) -> str:
        kv = f", kv_out_features={self.kv_out_features}" if self.kv_out_features != self.q_out_features else ""
        return (
            f"in_features={self.in_features}, out_features={self.q_out_features}{kv}, "
            f"bias={self.bias is not None}, names={self.names}"
        )

    def _export_to_parent(self, state_dict, prefix, parent_prefix) -> None:
        for param in ("weight", "bias"):
            fused = state_dict.pop(prefix + param, None)
            if fused is None:
                continue
            # copies, not views of one storage: safetensors refuses tensors that share memory
            for name, part in zip(self.names, fused.split(self.sizes, 0)):
                state_dict[f"{parent_prefix}{name}.{param}"] = part.detach().clone()

    def _import_from_parent(self, state_dict, prefix, parent_prefix, missing_keys) -> None:
        for param in ("weight", "bias"):
            keys = [f"{parent_prefix}{name}.{param}" for name in self.names]
            present = [k in state_dict for k in keys]
            if prefix + param in state_dict or not any(present):
                continue  # already fused, or not in this checkpoint (reported as our own key)
            if not all(present):
                # name the original keys that are absent; the present ones stay (reported unexpected)
                missing_keys.extend(k for k, ok in zip(keys, present) if not ok)
                continue
            state_dict[prefix + param] = torch.cat([state_dict.pop(k) for k in keys], 0)
