"""rotary_embedding: rotations written with einops.rearrange (x-transformers): neighbours paired
('... (d r) -> ... d r', r=2, the interleaved layout) or the last dimension split in halves
('... (r d) -> ... r d', r=2); named leading axes too. A pattern that pairs across another axis
or keeps the halves the wrong way round is no rotation."""
import einops
import torch
from adopter.kernels import rotary, rotary_interleaved
from einops import rearrange


def rotate_every_pair(x):
    x = rearrange(x, '... (d r) -> ... d r', r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, '... d r -> ... (d r)')


def rotate_halves(x):
    x = einops.rearrange(x, 'b h n (two d) -> b h n two d', two=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def rotate_wrong_axis(x):
    x = rearrange(x, '... (r d) -> ... d r', r=2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return rearrange(x, '... d r -> ... (d r)')


# expect: rotary_embedding apply_pairs
def apply_pairs(t, freqs):
    return rotary_interleaved(t, freqs.cos(), freqs.sin(), rotate_every_pair)


# expect: rotary_embedding apply_halves
def apply_halves(t, cos, sin):
    return rotary(t, cos, sin, rotate_halves)


def apply_wrong_axis(t, cos, sin):
    return t * cos + rotate_wrong_axis(t) * sin
