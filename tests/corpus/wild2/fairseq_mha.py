"""fairseq-like attention and encoder: the legacy ``in_proj_weight`` packed projection sliced with
``F.linear``, the newer separate ``q_proj``/``k_proj``/``v_proj`` with ``self_attention`` /
``encoder_decoder_attention`` flags, the ``utils.softmax`` helper with ``onnx_trace``, a
``FairseqDropout`` module, ``TransformerEncoderLayer`` with ``normalize_before`` and a plain
post-norm variant, time-major ``(T, B, C)`` tensors throughout."""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def utils_softmax(x, dim: int, onnx_trace: bool = False):
    if onnx_trace:
        return F.softmax(x.float(), dim=dim)
    else:
        return F.softmax(x, dim=dim, dtype=torch.float32)


class FairseqDropout(nn.Module):
    def __init__(self, p, module_name=None):
        super().__init__()
        self.p = p
        self.module_name = module_name
        self.apply_during_inference = False

    def forward(self, x, inplace: bool = False):
        if self.p > 0 and (self.training or self.apply_during_inference):
            return F.dropout(x, p=self.p, training=True, inplace=inplace)
        else:
            return x


class LegacyMultiheadAttention(nn.Module):
    """Packed projection: one ``in_proj_weight`` parameter sliced per role."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.onnx_trace = False
        nn.init.xavier_uniform_(self.in_proj_weight)

    def _in_proj(self, input, start=0, end=None):
        weight = self.in_proj_weight[start:end, :]
        bias = self.in_proj_bias[start:end] if self.in_proj_bias is not None else None
        return F.linear(input, weight, bias)

    def forward(self, query, key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = False):
        tgt_len, bsz, embed_dim = query.size()
        q = self._in_proj(query, end=embed_dim)
        k = self._in_proj(query, start=embed_dim, end=2 * embed_dim)
        v = self._in_proj(query, start=2 * embed_dim)
        q = q * self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights_float = utils_softmax(attn_weights, dim=-1, onnx_trace=self.onnx_trace)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        weights: Optional[torch.Tensor] = None
        if need_weights:
            weights = attn_weights_float.view(bsz, self.num_heads, tgt_len, src_len).mean(dim=1)
        return attn, weights


class MultiheadAttention(nn.Module):
    """Separate projections; one class serves self-attention and encoder-decoder attention."""

    def __init__(self, embed_dim, num_heads, kdim=None, vdim=None, dropout=0.0, bias=True,
                 self_attention=False, encoder_decoder_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.onnx_trace = False

    def forward(self, query, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                attn_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        tgt_len, bsz, embed_dim = query.size()
        if self.self_attention:
            q = self.q_proj(query)
            k = self.k_proj(query)
            v = self.v_proj(query)
        elif self.encoder_decoder_attention:
            q = self.q_proj(query)
            k = self.k_proj(key)
            v = self.v_proj(key)
        else:
            q = self.q_proj(query)
            k = self.k_proj(key)
            v = self.v_proj(value)
        q *= self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        attn_weights_float = utils_softmax(attn_weights, dim=-1, onnx_trace=self.onnx_trace)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), attn_weights_float.view(bsz, self.num_heads, tgt_len, -1)


class TransformerEncoderLayer(nn.Module):
    """fairseq's layer: FairseqDropout modules, LayerNorms applied under ``normalize_before``."""

    def __init__(self, embed_dim=32, ffn_embed_dim=64, heads=4, dropout=0.1, normalize_before=False):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads, dropout=dropout, self_attention=True)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.dropout_module = FairseqDropout(dropout)
        self.activation_dropout_module = FairseqDropout(0.0)
        self.normalize_before = normalize_before
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_padding_mask: Optional[torch.Tensor] = None):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x)
        x = self.dropout_module(x)
        x = residual + x
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = F.gelu(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        x = self.dropout_module(x)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class PostNormEncoderLayer(nn.Module):
    """The same layer written post-norm only, with torch's own dropout modules."""

    def __init__(self, embed_dim=32, ffn_embed_dim=64, heads=4, dropout=0.1):
        super().__init__()
        self.self_attn = LegacyMultiheadAttention(embed_dim, heads, dropout=dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.dropout2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(embed_dim)

    def forward(self, x):
        attn, _ = self.self_attn(x)
        x = self.norm1(x + self.dropout1(attn))
        h = self.fc2(F.relu(self.fc1(x)))
        x = self.norm2(x + self.dropout2(h))
        return x


class FairseqEncoder(nn.Module):
    """Token embedding scaled by sqrt(d), sinusoid-free learned positions, two layer kinds."""

    def __init__(self, vocab=100, embed_dim=32, layers=2):
        super().__init__()
        self.embed_scale = math.sqrt(embed_dim)
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx=1)
        self.embed_positions = nn.Embedding(64, embed_dim)
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(embed_dim) for _ in range(layers)] + [PostNormEncoderLayer(embed_dim)])
        self.classifier = nn.Linear(embed_dim, 5)

    def forward(self, src_tokens):
        x = self.embed_scale * self.embed_tokens(src_tokens)
        x = x + self.embed_positions(torch.arange(src_tokens.size(1), device=src_tokens.device))
        x = x.transpose(0, 1)
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x.mean(dim=0))
