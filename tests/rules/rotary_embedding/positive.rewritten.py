"""rotary_embedding positives: the half-split rotate_half, every way transformers writes the sum."""
import torch
from adopter.kernels import rotary
from torch import cat


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_by_cat(x):
    # another name, torch.cat imported as cat, a list, dim positional, the half in a local
    half = x.size(-1) // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return cat([-x2, x1], -1)


# expect: rotary_embedding apply_rotary_pos_emb
# expect: rotary_embedding apply_rotary_pos_emb
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = rotary(q, cos, sin, rotate_half)
    k_embed = rotary(k, cos, sin, rotate_half)
    return q_embed, k_embed


# partial rotary (Phi, GPT-NeoX, StableLM): the rotated slice is x, cos/sin have rotary_dim
# expect: rotary_embedding apply_partial_rotary
# expect: rotary_embedding apply_partial_rotary
def apply_partial_rotary(q, k, cos, sin):
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([rotary(q_rot, cos, sin, rotate_half), q_pass], dim=-1)
    k_embed = rotary(k_rot, cos, sin, rotate_half)
    return q_embed, torch.cat([k_embed, k_pass], dim=-1)


# the rotated product first, the factors swapped, a cast of x
# expect: rotary_embedding apply_other_orders
# expect: rotary_embedding apply_other_orders
def apply_other_orders(q, k, cos, sin):
    q_embed = rotary(q, cos, sin, rotate_by_cat)
    k_embed = rotary(k.float(), cos, sin, rotate_half)
    return q_embed, k_embed


# cos/sin of a cache longer than the query, sliced in the expression
# expect: rotary_embedding apply_cached
def apply_cached(q, cos, sin):
    q_len = q.shape[-2]
    return rotary(q, cos[..., -q_len:, :], sin[..., -q_len:, :], rotate_half)


# expect: rotary_embedding apply_rotary_single
def apply_rotary_single(x, cos, sin):
    return rotary(x, cos, sin, rotate_half)
