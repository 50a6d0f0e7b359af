"""Launch helpers shared by the triton kernels (imports triton: load lazily)."""
from __future__ import annotations

import functools

import torch
import triton  # noqa: F401  (this module is only imported on the triton path)

from .common import row_block  # noqa: F401  (re-exported for the kernels)


def row_num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


@torch.compiler.assume_constant_result  # torch.compile: queried once while tracing, not traced into
def _sm_count(index: int) -> int:
    return _sm_count_cached(index)


@functools.cache
def _sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(device: torch.device, n_rows: int) -> int:
    """Programs for a backward that accumulates per-column partial sums (dweight/dbias) per program."""
    if device.type == "cuda":
        return max(1, min(n_rows, 2 * _sm_count(device.index if device.index is not None else 0)))
    return max(1, min(n_rows, 4))  # interpreter: few programs, it is slow anyway


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(..., n_cols) -> contiguous (rows, n_cols) view or copy."""
    return t.reshape(-1, n_cols).contiguous()
