"""GPT-2 re-implemented from the paper, one file, plain torch (a course/blog-post style).

The class names follow the original checkpoint's modules so weights can be copied over.
"""
import math

import torch
import torch.nn as nn


class GPT2Attention(nn.Module):
    def __init__(self, d_model=32, n_head=4, n_ctx=64, attn_pdrop=0.1, resid_pdrop=0.1, scale=True):
        super().__init__()
        self.n_head = n_head
        self.d_model = d_model
        self.scale = scale
        self.c_attn = nn.Linear(d_model, d_model * 3)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(attn_pdrop)
        self.resid_dropout = nn.Dropout(resid_pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx))

    def split_heads(self, x):
        new_shape = x.size()[:-1] + (self.n_head, x.size(-1) // self.n_head)
        return x.view(*new_shape).permute(0, 2, 1, 3)  # (batch, head, seq, head_dim)

    def merge_heads(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], x.size(-2) * x.size(-1))

    def _attn(self, q, k, v):
        w = torch.matmul(q, k.transpose(-2, -1))
        if self.scale:
            w = w / math.sqrt(v.size(-1))
        nd, ns = w.size(-2), w.size(-1)
        mask = self.bias[:, :, ns - nd:ns, :ns]
        w = w * mask - 1e10 * (1 - mask)
        w = nn.functional.softmax(w, dim=-1)
        w = self.attn_dropout(w)
        return torch.matmul(w, v)

    def forward(self, x):
        query, key, value = self.c_attn(x).split(self.d_model, dim=2)
        query = self.split_heads(query)
        key = self.split_heads(key)
        value = self.split_heads(value)
        a = self._attn(query, key, value)
        a = self.merge_heads(a)
        a = self.c_proj(a)
        a = self.resid_dropout(a)
        return a


class GPT2MLP(nn.Module):
    def __init__(self, d_model=32, n_inner=128, resid_pdrop=0.1):
        super().__init__()
        self.c_fc = nn.Linear(d_model, n_inner)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(n_inner, d_model)
        self.dropout = nn.Dropout(resid_pdrop)

    def forward(self, x):
        h = self.act(self.c_fc(x))
        h2 = self.c_proj(h)
        return self.dropout(h2)


class GPT2Block(nn.Module):
    def __init__(self, d_model=32, n_head=4, n_ctx=64):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = GPT2Attention(d_model, n_head, n_ctx)
        self.ln_2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = GPT2MLP(d_model, 4 * d_model)

    def forward(self, x):
        a = self.attn(self.ln_1(x))
        x = x + a
        m = self.mlp(self.ln_2(x))
        x = x + m
        return x


class GPT2Model(nn.Module):
    def __init__(self, vocab_size=100, n_ctx=64, d_model=32, n_layer=2, n_head=4, embd_pdrop=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(n_ctx, d_model)
        self.drop = nn.Dropout(embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(d_model, n_head, n_ctx) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, input_ids):
        position_ids = torch.arange(input_ids.size(-1), dtype=torch.long, device=input_ids.device)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)[None]
        hidden_states = self.drop(hidden_states)
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)
