"""``FusedQKV``: one Linear for the query/key/value projections, saved/loaded as the three originals."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .ops.qkv import qkv_projection
from .state_dict_hooks import ParentKeyRemap, install_hooks


class ProjectionView(nn.Module):
    """One projection of a :class:`FusedQKV`, seen as the ``nn.Linear`` it replaced.

    Installed unregistered as ``<parent>.<name>`` so that loaders which resolve checkpoint keys by
    module path (transformers' ``from_pretrained``) find ``query.weight``: reading ``weight``/``bias``
    gives the slice of the fused tensor, assigning one copies into that slice, and calling it
    computes that projection alone.
    """

    def __init__(self, fused: FusedQKV, index: int) -> None:
        super().__init__()
        # plain attributes, not registrations: the fused module owns the parameters
        object.__setattr__(self, "_fused", fused)
        object.__setattr__(self, "_index", index)

    @property
    def weight(self) -> torch.Tensor:
        return self._fused.projection_slice("weight", self._index)

    @property
    def bias(self) -> torch.Tensor | None:
        return self._fused.projection_slice("bias", self._index)

    @property
    def in_features(self) -> int:
        return self._fused.in_features

    @property
    def out_features(self) -> int:
        return self._fused.sizes[self._index]

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight", "bias"):
            self._fused.load_projection(name, self._index, value)
        else:
            super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"view of {self._fused.names[self._index]!r} in FusedQKV"


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
        kv_out_features: int | None = None,
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv_projection(x, self.weight, self.bias, self.sizes)

    def extra_repr(self) -> str:
        kv = f", kv_out_features={self.kv_out_features}" if self.kv_out_features != self.q_out_features else ""
        return (
            f"in_features={self.in_features}, out_features={self.q_out_features}{kv}, "
            f"bias={self.bias is not None}, names={self.names}"
        )

    def projection_slice(self, param: str, index: int) -> torch.Tensor | None:
        fused = getattr(self, param)
        if fused is None:
            return None
        start = sum(self.sizes[:index])
        return fused[start:start + self.sizes[index]]

    def load_projection(self, param: str, index: int, value: torch.Tensor) -> None:
        """Copy one projection's ``weight``/``bias`` into the fused tensor (what assigning
        ``parent.<name>.weight`` does). A fused tensor still on the meta device (transformers builds
        models there before loading) is first materialized on the value's device and dtype."""
        fused = getattr(self, param)
        if fused is None:
            raise AttributeError(f"FusedQKV({self.names}) has no {param}")
        expected = self.projection_slice(param, index).shape
        if tuple(value.shape) != tuple(expected):
            raise ValueError(f"{self.names[index]}.{param}: shape {tuple(value.shape)} != {tuple(expected)}")
        loaded = self.__dict__.setdefault("_loaded_projections", {}).setdefault(param, set())
        with torch.no_grad():
            if fused.is_meta and not value.is_meta:
                fused = nn.Parameter(torch.empty(fused.shape, dtype=value.dtype, device=value.device),
                                     requires_grad=fused.requires_grad)
                setattr(self, param, fused)
                loaded.clear()
            self.projection_slice(param, index).copy_(value)
        loaded.add(index)
        if len(loaded) == len(self.names) and getattr(value, "_is_hf_initialized", False):
            fused._is_hf_initialized = True  # all slices loaded: transformers must not re-initialize it

    def _parent_views(self) -> dict[str, nn.Module]:
        return {name: ProjectionView(self, i) for i, name in enumerate(self.names)}

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
