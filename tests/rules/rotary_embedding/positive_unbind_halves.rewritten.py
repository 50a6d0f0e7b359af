"""rotary_embedding positives whose ``rotate_half`` splits the halves by viewing the last dimension
as ``(2, d/2)`` and unbinding it (x-transformers / lucidrains style) instead of slicing; the angles
handed in as one ``freqs`` tensor whose cos and sin are taken at the product."""
import torch
import torch.nn as nn
from adopter.kernels import rotary


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], 2, -1)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_chained(x):
    x1, x2 = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_unflatten(x):
    halves = x.unflatten(-1, (2, -1))
    return torch.cat((-halves[..., 1, :], halves[..., 0, :]), dim=-1)


def rotate_pairs_unbound_wrong_dim(x):
    # views (d/2, 2) and unbinds the pairs: the interleaved layout, not the halves
    x1, x2 = x.reshape(*x.shape[:-1], 2, -1).unbind(-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_swapped(x):
    x1, x2 = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
    return torch.cat((x2, -x1), dim=-1)


# expect: rotary_embedding apply_rotary_emb
def apply_rotary_emb(t, freqs):
    return rotary(t, freqs.cos(), freqs.sin(), rotate_half)


# expect: rotary_embedding apply_partial
def apply_partial(freqs, t):
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = rotary(t, freqs.cos(), freqs.sin(), rotate_half_chained)
    return torch.cat((t, t_pass), dim=-1)


# expect: rotary_embedding apply_unflatten
def apply_unflatten(t, cos, sin):
    return rotary(t, cos, sin, rotate_half_unflatten)


def apply_wrong_dim(t, cos, sin):
    return t * cos + rotate_pairs_unbound_wrong_dim(t) * sin


def apply_swapped(t, cos, sin):
    return t * cos + rotate_half_swapped(t) * sin


# expect: rotary_embedding RotaryAttention.forward
class RotaryAttention(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.to_q = nn.Linear(dim, dim)

    def forward(self, x, freqs):
        q = self.to_q(x)
        q = rotary(q, freqs.cos(), freqs.sin(), rotate_half)
        return q
