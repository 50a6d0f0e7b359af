"""Conv2d+BatchNorm2d and Linear+BatchNorm1d: separate math in training, BN folded in eval."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from .frozen import frozen_tensors, release_if_training
from .guarded import _fold_pays_per_call, _fold_range, fold_output_bound
from .ops.batch_norm_fold import fold_batch_norm
from .ops.common import is_proxy
from .ops.conv_prepacked import conv_prepacked, pack_conv_weight, prepack_layout
from .policy import mode_reason
from .state_dict_hooks import ParentKeyRemap, install_hooks, move_keys

_BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_BN_CHILD = "bn"
# module -> (key, oneDNN-packed folded weight) of FusedConv2dBatchNorm2d on CPU; kept outside the
# module so that copying or pickling a module never meets an opaque oneDNN tensor
_PACK_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _FoldsBatchNorm(ParentKeyRemap):
    """Shared eval-mode folding (kept between calls under ``freeze``) and BN key mapping; the BN lives in child ``bn`` and its
    keys appear in the parent's state dict as ``<bn_name>.<key>``, like the original sibling BN."""

    bn: nn.modules.batchnorm._BatchNorm
    bn_name: str
    _fold_key: tuple | None
    _fold_cache: tuple[torch.Tensor, torch.Tensor] | None

    def _attach_batch_norm(self, bn: nn.modules.batchnorm._BatchNorm, bn_name: str) -> None:
        """Register the BN child, the parent-key name its state maps to, and the hooks."""
        self.bn_name = _bn_name_ok(bn_name)
        self.bn = bn
        self._fold_key = None
        self._fold_cache = None
        install_hooks(self)

    def _can_fold(self) -> bool:
        bn = self.bn
        # BN uses batch statistics in training, and in eval when it tracks none
        return (not bn.training and bn.running_mean is not None and bn.running_var is not None
                # autocast runs the layer in low precision and the BatchNorm in float32: a fold would
                # round the BN scale into the low-precision weight
                and not torch.is_autocast_enabled(bn.running_mean.device.type))

    def _fold_inputs(self):
        bn = self.bn
        return (self.weight, self.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)

    def _fold_route(self, x: torch.Tensor) -> tuple[int, ...] | None:
        """How this call may fold: the freeze tokens to keep the fold between calls under (under
        :func:`adopter.kernels.freeze`'s promise), ``()`` to fold on this call (where that pays:
        ``guarded._fold_pays_per_call``), None to run the two layers."""
        if torch.compiler.is_compiling():
            return None  # (the range guard reads the input's magnitude; the compiler fuses the BatchNorm)
        tokens = frozen_tensors((self, self.bn), self._fold_inputs())
        if tokens:
            return tokens
        return () if _fold_pays_per_call(self.weight, x) else None

    def _folded(self, keep: tuple[int, ...]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple | None]:
        """The folded weight and bias, and the key they are kept under: kept between calls only
        under :func:`adopter.kernels.freeze`'s promise (no version counter tells that a fused
        optimizer step, a ``.data`` write or a train-mode BatchNorm changed a tensor:
        ``kernels/frozen.py``); otherwise computed from the live tensors (key None), recorded by
        autograd when a gradient can flow."""
        tensors = self._fold_inputs()
        key = self._fold_state_key(tensors, keep) if keep else None
        if key is None:
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
                return fold_batch_norm(*tensors, self.bn.eps), None
            with torch.no_grad():
                return fold_batch_norm(*tensors, self.bn.eps), None
        if key != self._fold_key or self._fold_cache is None:
            # (inference_mode(False) first: it switches grad mode on, no_grad then off again)
            with torch.inference_mode(False), torch.no_grad():  # (usable outside inference mode too)
                self._fold_cache = fold_batch_norm(*tensors, self.bn.eps)
            self._fold_key = key
        return self._fold_cache, key

    def _fold_state_key(self, tensors, freeze_tokens: tuple[int, ...]) -> tuple | None:
        """The freeze promise the fold is kept under (a later ``freeze`` refolds), identity,
        version and place of each tensor the fold reads, and ``eps`` (a change of any of them
        refolds even under the promise); None for inference tensors, which have no version
        counter."""
        try:
            return (freeze_tokens,) + tuple(
                None if t is None else (id(t), t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape))
                for t in tensors
            ) + (self.bn.eps,)
        except RuntimeError:
            return None

    def _parent_views(self) -> dict[str, nn.Module]:
        # the BN itself, unregistered, as <parent>.<bn_name> (for loaders that resolve key paths)
        return {self.bn_name: self.bn}

    def _export_to_parent(self, state_dict, prefix, parent_prefix) -> None:
        move_keys(state_dict, f"{prefix}{_BN_CHILD}.", f"{parent_prefix}{self.bn_name}.", _BN_KEYS)

    def _import_from_parent(self, state_dict, prefix, parent_prefix, missing_keys) -> None:
        move_keys(state_dict, f"{parent_prefix}{self.bn_name}.", f"{prefix}{_BN_CHILD}.", _BN_KEYS)


def _bn_name_ok(bn_name: str) -> str:
    if not bn_name or "." in bn_name:
        raise ValueError(f"bn_name must be a plain attribute name, got {bn_name!r}")
    return bn_name


class FusedConv2dBatchNorm2d(_FoldsBatchNorm, nn.Conv2d):
    """``BatchNorm2d(Conv2d(x))``. Keeps the conv's attribute name and parameters; the BN's
    parameters and buffers save/load as the parent's ``<bn_name>.*``. Training runs the two layers
    (identical running-stat updates); eval runs one conv with the BN folded into the weights (folded
    on each call, or kept between calls under :func:`adopter.kernels.freeze`)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        bn_eps: float = 1e-5,
        bn_momentum: float | None = 0.1,
        bn_affine: bool = True,
        bn_track_running_stats: bool = True,
        bn_name: str = "batch_norm",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device=device, dtype=dtype)
        self._attach_batch_norm(nn.BatchNorm2d(out_channels, eps=bn_eps, momentum=bn_momentum, affine=bn_affine,
                                               track_running_stats=bn_track_running_stats, device=device,
                                               dtype=dtype), bn_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (fx records the two layers: the graph then follows gm.train()/gm.eval() as the original's)
        route = None if is_proxy(x) or x.dim() != 4 or not self._can_fold() or mode_reason() else self._fold_route(x)
        if route is None:
            release_if_training(self, self.bn)
            return self.bn(self._conv_forward(x, self.weight, self.bias))
        (weight, bias), key = self._folded(route)
        if fold_output_bound(x, _fold_range(self, key, self._fold_inputs(), self.bn.eps)) is None:
            # (NaN/inf in, or values that could overflow: they would land elsewhere than the original's)
            return self.bn(self._conv_forward(x, self.weight, self.bias))
        if key is not None:
            out = self._packed_forward(x, weight, bias, key)
            if out is not None:
                return out
        return self._conv_forward(x, weight, bias)

    def _packed_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, fold_key: tuple
                        ) -> torch.Tensor | None:
        """The folded conv on a oneDNN weight packed once per fold state (CPU, float32, no
        gradient: ``kernels/ops/conv_prepacked.py``), or None where aten's conv runs."""
        tensors = self._fold_inputs()
        geometry = (self.padding, self.stride, self.dilation, self.groups)
        layout = prepack_layout(x, weight, bias, *geometry, self.padding_mode, *tensors)
        if not layout:
            return None
        if layout == "onednn_contiguous":  # (a light NCHW conv: oneDNN on the folded weight itself)
            return conv_prepacked(x, weight, bias, *geometry, layout)
        key = (fold_key, tuple(x.shape[1:]), *(tuple(g) if isinstance(g, tuple) else g for g in geometry))
        hit = _PACK_CACHE.get(self)
        if hit is None or hit[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                hit = _PACK_CACHE[self] = (key, pack_conv_weight(weight, *geometry, x.shape))
        return conv_prepacked(x, hit[1], bias, *geometry, layout)


class FusedLinearBatchNorm1d(_FoldsBatchNorm, nn.Linear):
    """``BatchNorm1d(Linear(x))`` for ``(batch, features)`` inputs, folded in eval like
    :class:`FusedConv2dBatchNorm2d` (other input ranks run the two layers)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        bn_eps: float = 1e-5,
        bn_momentum: float | None = 0.1,
        bn_affine: bool = True,
        bn_track_running_stats: bool = True,
        bn_name: str = "batch_norm",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._attach_batch_norm(nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum, affine=bn_affine,
                                               track_running_stats=bn_track_running_stats, device=device,
                                               dtype=dtype), bn_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = (None if is_proxy(x) or x.dim() != 2 or not self._can_fold() or mode_reason()  # (rank unknown while fx traces)
                 else self._fold_route(x))
        if route is None:
            release_if_training(self, self.bn)
            return self.bn(nn.functional.linear(x, self.weight, self.bias))
        (weight, bias), key = self._folded(route)
        if fold_output_bound(x, _fold_range(self, key, self._fold_inputs(), self.bn.eps)) is None:
            return self.bn(nn.functional.linear(x, self.weight, self.bias))
        return nn.functional.linear(x, weight, bias)
