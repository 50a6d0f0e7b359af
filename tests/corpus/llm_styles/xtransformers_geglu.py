"""x-transformers style decoder (written for the llm_styles corpus, plain torch; einops replaced by
reshape / unbind).

`exists` / `default` helpers, an RMSNorm written with F.normalize and a sqrt(dim) scale, rotary
frequencies concatenated per half with a `rotate_half` that splits through `reshape(..., 2, -1)`
and `unbind`, attention whose keys / values read `default(context, x)`, einsum scores with
`.softmax(dim=-1)`, a GEGLU projection module inside a FeedForward Sequential, a SwiGLU
feed-forward with one fused projection chunked into value and gate, a TransformerWrapper whose
`to_logits` head returns logits, and an AutoregressiveWrapper computing the shifted loss on the
wrapped network's output.
"""
import torch
import torch.nn.functional as F
from torch import nn


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.g


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1. / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], 2, -1)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :]
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (rotate_half(t) * freqs.sin())
    return torch.cat((t, t_unrotated), dim=-1)


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, dropout=0.):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = default(dim_out, dim)
        self.ff = nn.Sequential(
            GEGLU(dim, inner_dim),
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim_out),
        )

    def forward(self, x):
        return self.ff(x)


class SwiGLUFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        inner_dim = int(dim * mult * 2 / 3)
        self.proj_in = nn.Linear(dim, inner_dim * 2, bias=False)
        self.proj_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x):
        x, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(x * F.silu(gate))


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=True, dropout=0.):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, rotary_pos_emb=None):
        b, n, _, h = *x.shape, self.heads
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)

        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))

        if exists(rotary_pos_emb):
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)

        dots = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, -torch.finfo(dots.dtype).max)

        attn = dots.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads=4, dim_head=16, ff_kinds=("geglu", "swiglu"), rotary_emb_dim=8):
        super().__init__()
        self.rotary_pos_emb = RotaryEmbedding(rotary_emb_dim)
        self.layers = nn.ModuleList([])
        for ind in range(depth):
            kind = ff_kinds[ind % len(ff_kinds)]
            ff = FeedForward(dim) if kind == "geglu" else SwiGLUFeedForward(dim)
            self.layers.append(nn.ModuleList([
                RMSNorm(dim),
                Attention(dim, dim_head=dim_head, heads=heads),
                RMSNorm(dim),
                ff,
            ]))
        self.final_norm = RMSNorm(dim)

    def forward(self, x):
        rotary_pos_emb = self.rotary_pos_emb(x.shape[1], x.device)
        for attn_norm, attn, ff_norm, ff in self.layers:
            x = attn(attn_norm(x), rotary_pos_emb=rotary_pos_emb) + x
            x = ff(ff_norm(x)) + x
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens=128, max_seq_len=32, dim=32, depth=2, heads=4):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.attn_layers = Decoder(dim=dim, depth=depth, heads=heads, dim_head=dim // heads)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x):
        x = self.token_emb(x)
        x = self.attn_layers(x)
        return self.to_logits(x)


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net=None, ignore_index=-100, pad_value=0):
        super().__init__()
        self.net = net if net is not None else TransformerWrapper()
        self.max_seq_len = self.net.max_seq_len
        self.ignore_index = ignore_index
        self.pad_value = pad_value

    @torch.no_grad()
    def generate(self, start_tokens, seq_len, temperature=1., filter_thres=0.9):
        out = start_tokens
        for _ in range(seq_len):
            x = out[:, -self.max_seq_len:]
            logits = self.net(x)[:, -1]
            k = max(int((1 - filter_thres) * logits.shape[-1]), 1)
            val, ind = torch.topk(logits, k)
            filtered_logits = torch.full_like(logits, float('-inf')).scatter_(1, ind, val)
            probs = F.softmax(filtered_logits / temperature, dim=-1)
            sample = torch.multinomial(probs, 1)
            out = torch.cat((out, sample), dim=-1)
        return out[:, start_tokens.shape[1]:]

    def forward(self, x):
        inp, target = x[:, :-1], x[:, 1:]
        logits = self.net(inp)
        loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=self.ignore_index)
        return loss
