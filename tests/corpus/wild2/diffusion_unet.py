"""Diffusion U-Nets as LDM / diffusers write them: ``Normalize`` = GroupNorm, ``ResnetBlock`` with a
timestep projection, LDM's ``AttnBlock`` (1x1-conv q/k/v, ``torch.bmm`` scores, softmax over
dim 2, ``bmm(v, w_.permute(0, 2, 1))``), a diffusers-like ``Attention`` whose scores come from
``torch.baddbmm`` with ``beta=0`` and heads folded into the batch, ``to_q``/``to_k``/``to_v``
shared by self- and cross-attention, ``GEGLU`` in a ``FeedForward`` ModuleList, a
``BasicTransformerBlock``, a sinusoidal timestep MLP and a tiny denoiser."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def Normalize(in_channels, num_groups=8):
    return nn.GroupNorm(num_groups=num_groups, num_channels=in_channels, eps=1e-6, affine=True)


def nonlinearity(x):
    return x * torch.sigmoid(x)


def get_timestep_embedding(timesteps, embedding_dim):
    half_dim = embedding_dim // 2
    emb = math.log(10000) / (half_dim - 1)
    emb = torch.exp(torch.arange(half_dim, dtype=torch.float32, device=timesteps.device) * -emb)
    emb = timesteps.float()[:, None] * emb[None, :]
    return torch.cat([torch.sin(emb), torch.cos(emb)], dim=1)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels, out_channels=None, temb_channels=64, dropout=0.0):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        self.norm1 = Normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.temb_proj = nn.Linear(temb_channels, out_channels)
        self.norm2 = Normalize(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x, temb):
        h = self.norm1(x)
        h = nonlinearity(h)
        h = self.conv1(h)
        h = h + self.temb_proj(nonlinearity(temb))[:, :, None, None]
        h = self.norm2(h)
        h = nonlinearity(h)
        h = self.dropout(h)
        h = self.conv2(h)
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.norm = Normalize(in_channels)
        self.q = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.k = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.v = nn.Conv2d(in_channels, in_channels, kernel_size=1)
        self.proj_out = nn.Conv2d(in_channels, in_channels, kernel_size=1)

    def forward(self, x):
        h_ = self.norm(x)
        q = self.q(h_)
        k = self.k(h_)
        v = self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w)
        q = q.permute(0, 2, 1)
        k = k.reshape(b, c, h * w)
        w_ = torch.bmm(q, k)
        w_ = w_ * (int(c) ** (-0.5))
        w_ = torch.nn.functional.softmax(w_, dim=2)
        v = v.reshape(b, c, h * w)
        w_ = w_.permute(0, 2, 1)
        h_ = torch.bmm(v, w_)
        h_ = h_.reshape(b, c, h, w)
        h_ = self.proj_out(h_)
        return x + h_


class Attention(nn.Module):
    """diffusers-like: heads folded into the batch, scores by ``baddbmm``; self or cross."""

    def __init__(self, query_dim, cross_attention_dim=None, heads=4, dim_head=8, dropout=0.0, bias=False):
        super().__init__()
        inner_dim = dim_head * heads
        cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=bias)
        self.to_k = nn.Linear(cross_attention_dim, inner_dim, bias=bias)
        self.to_v = nn.Linear(cross_attention_dim, inner_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(dropout)])

    def head_to_batch_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, self.heads, dim // self.heads)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size * self.heads, seq_len, dim // self.heads)

    def batch_to_head_dim(self, tensor):
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // self.heads, self.heads, seq_len, dim)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size // self.heads, seq_len, dim * self.heads)

    def forward(self, hidden_states, encoder_hidden_states: Optional[torch.Tensor] = None):
        query = self.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)
        query = self.head_to_batch_dim(query)
        key = self.head_to_batch_dim(key)
        value = self.head_to_batch_dim(value)
        baddbmm_input = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype,
                                    device=query.device)
        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=0, alpha=self.scale)
        attention_probs = attention_scores.softmax(dim=-1)
        hidden_states = torch.bmm(attention_probs, value)
        hidden_states = self.batch_to_head_dim(hidden_states)
        hidden_states = self.to_out[0](hidden_states)
        hidden_states = self.to_out[1](hidden_states)
        return hidden_states


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, hidden_states):
        hidden_states, gate = self.proj(hidden_states).chunk(2, dim=-1)
        return hidden_states * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=2, dropout=0.0):
        super().__init__()
        inner_dim = int(dim * mult)
        self.net = nn.ModuleList([GEGLU(dim, inner_dim), nn.Dropout(dropout), nn.Linear(inner_dim, dim)])

    def forward(self, hidden_states):
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads=heads, dim_head=dim_head)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim, heads=heads, dim_head=dim_head)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, hidden_states, encoder_hidden_states=None):
        hidden_states = self.attn1(self.norm1(hidden_states)) + hidden_states
        hidden_states = self.attn2(self.norm2(hidden_states), encoder_hidden_states) + hidden_states
        hidden_states = self.ff(self.norm3(hidden_states)) + hidden_states
        return hidden_states


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels, heads=4, dim_head=8, context_dim=24):
        super().__init__()
        inner_dim = heads * dim_head
        self.norm = Normalize(in_channels)
        self.proj_in = nn.Conv2d(in_channels, inner_dim, kernel_size=1)
        self.block = BasicTransformerBlock(inner_dim, heads, dim_head, context_dim)
        self.proj_out = nn.Conv2d(inner_dim, in_channels, kernel_size=1)

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.proj_in(self.norm(x))
        x = x.permute(0, 2, 3, 1).reshape(b, h * w, -1)
        x = self.block(x, context)
        x = x.reshape(b, h, w, -1).permute(0, 3, 1, 2)
        return self.proj_out(x) + x_in


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels, time_embed_dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample):
        return self.linear_2(self.act(self.linear_1(sample)))


class TinyUNet(nn.Module):
    def __init__(self, ch=16, temb_ch=64, context_dim=24):
        super().__init__()
        self.ch = ch
        self.time_embedding = TimestepEmbedding(ch, temb_ch)
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down = ResnetBlock(ch, 2 * ch, temb_ch)
        self.downsample = nn.Conv2d(2 * ch, 2 * ch, 3, stride=2, padding=1)
        self.mid_res = ResnetBlock(2 * ch, 2 * ch, temb_ch)
        self.mid_attn = AttnBlock(2 * ch)
        self.mid_transformer = SpatialTransformer(2 * ch, context_dim=context_dim)
        self.up = ResnetBlock(4 * ch, ch, temb_ch)
        self.norm_out = Normalize(ch)
        self.conv_out = nn.Conv2d(ch, 3, 3, padding=1)
        self.context = nn.Parameter(torch.randn(1, 5, context_dim))

    def forward(self, x, t: Optional[torch.Tensor] = None):
        if t is None:
            t = torch.full((x.shape[0],), 10, device=x.device)
        temb = self.time_embedding(get_timestep_embedding(t, self.ch))
        h0 = self.down(self.conv_in(x), temb)
        h = self.downsample(h0)
        h = self.mid_res(h, temb)
        h = self.mid_attn(h)
        h = self.mid_transformer(h, self.context.expand(x.shape[0], -1, -1))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = self.up(torch.cat([h, h0], dim=1), temb)
        return self.conv_out(nonlinearity(self.norm_out(h)))
