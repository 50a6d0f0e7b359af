"""rotary_embedding positives outside HuggingFace's ``apply_rotary_pos_emb`` (issue 24): the rotation
interleaved (GPT-J, GLM, Cohere), as a method, written inline (litgpt), in complex numbers
(Meta-llama, mistral-inference) and in real numbers stacked or concatenated (llama2.c, Flux)."""
from typing import Tuple

import torch
import torch.nn as nn
from adopter.kernels import rotary, rotary_complex, rotary_interleaved, rotary_pairs


# ---------------------------------------------------------------- interleaved rotation functions


def rotate_every_two(x):
    # GPT-J / CodeGen: pairs at even/odd positions of a 4-d tensor
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


# expect: rotary_embedding apply_gptj
def apply_gptj(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return rotary_interleaved(tensor, cos, sin, rotate_every_two)


def rotate_half_glm(x):
    # GLM: named like the half split, computes the interleaved rotation
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# expect: rotary_embedding apply_glm
def apply_glm(q, cos, sin):
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return rotary_interleaved(q, cos, sin, rotate_half_glm)


def rotate_pairs(x):
    # the pairs by a reshape and unbind
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


# expect: rotary_embedding apply_unbind
def apply_unbind(q, cos, sin):
    return rotary_interleaved(q, cos, sin, rotate_pairs)


def rotate_chunks(x):
    # the half split by chunk
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# expect: rotary_embedding apply_chunks
def apply_chunks(q, cos, sin):
    return rotary(q, cos, sin, rotate_chunks)


# ---------------------------------------------------------------- methods


# expect: rotary_embedding NeoXAttention.forward
# expect: rotary_embedding NeoXAttention.forward
class NeoXAttention(nn.Module):
    """GPT-NeoX style: ``rotate_half`` a @staticmethod, called through self and through the class."""

    def __init__(self, rotary_ndims):
        super().__init__()
        self.rotary_ndims = rotary_ndims

    @staticmethod
    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k, cos, sin):
        q_rot, q_pass = q[..., : self.rotary_ndims], q[..., self.rotary_ndims:]
        q_embed = torch.cat([rotary(q_rot, cos, sin, self.rotate_half), q_pass], dim=-1)
        k_embed = rotary(k, cos, sin, NeoXAttention.rotate_half)
        return q_embed, k_embed


# expect: rotary_embedding MethodRotary.forward
class MethodRotary(nn.Module):
    """``rotate_half`` a plain method that leaves ``self`` alone; the interleaved one inherited."""

    def rotate_half(self, x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, q, cos, sin):
        return rotary(q, cos, sin, self.rotate_half)


class InterleavedBase(nn.Module):
    @staticmethod
    def rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)


# expect: rotary_embedding InterleavedChild.forward
class InterleavedChild(InterleavedBase):
    def forward(self, q, cos, sin):
        return rotary_interleaved(q, cos, sin, self.rotate_every_two)


# ---------------------------------------------------------------- the half rotation inline (litgpt)


# expect: rotary_embedding apply_rope
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    roped = rotary(x, cos, sin)
    return roped.to(dtype=x.dtype)


# expect: rotary_embedding apply_rope_batched
def apply_rope_batched(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # newer litgpt: cos/sin unsqueezed between the rotation and the sum: the rotation stays
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    if cos.dim() > 1:
        cos = cos.unsqueeze(-3)
        sin = sin.unsqueeze(-3)
    roped = rotary(x, cos, sin, rotated)
    return roped.to(dtype=x.dtype)


# expect: rotary_embedding apply_rope_in_product
def apply_rope_in_product(x, cos, sin):
    return rotary(x, cos, sin)


# ---------------------------------------------------------------- complex numbers (Meta-llama)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


# expect: rotary_embedding apply_rotary_emb
# expect: rotary_embedding apply_rotary_emb
def apply_rotary_emb(
    xq: torch.Tensor,
    xk: torch.Tensor,
    freqs_cis: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = rotary_complex(xq_, freqs_cis).flatten(3)
    xk_out = rotary_complex(xk_, freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# expect: rotary_embedding apply_rotary_emb_mistral
# expect: rotary_embedding apply_rotary_emb_mistral
def apply_rotary_emb_mistral(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = rotary_complex(freqs_cis, xq_).flatten(-2)
    xk_out = rotary_complex(xk_, freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# ---------------------------------------------------------------- real numbers, pairs stacked (llama2.c)


# expect: rotary_embedding apply_rotary_emb_real
# expect: rotary_embedding apply_rotary_emb_real
def apply_rotary_emb_real(xq, xk, freqs_cos, freqs_sin):
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)
    # flatten the last two dimensions
    xq_out = rotary_pairs(xq_r, xq_i, freqs_cos, freqs_sin).flatten(3)
    xk_out = rotary_pairs(xk_r, xk_i, freqs_cos, freqs_sin).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# expect: rotary_embedding apply_interleaved_inline
def apply_interleaved_inline(x, cos, sin):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return rotary_pairs(x1, x2, cos, sin).flatten(-2)


# expect: rotary_embedding apply_halves_written_out
def apply_halves_written_out(x, cos, sin):
    # the half split with one angle per pair, both parts written out (Flux / research code)
    x1, x2 = x.chunk(2, dim=-1)
    return rotary_pairs(x1, x2, cos, sin, join="cat")
