"""Attention classes named after the kernel policies (eager, SDPA, T5-style with a learned
relative bias passed between layers), q/k/v look-alikes, minGPT's ModuleDict MLP behind a lambda,
CLIP's QuickGELU, activations and norms that only look like the fused patterns, and softmax
variants (positional dim, a dim parameter, Softmax2d, a spatial softmax over a 2-D view)."""
import math
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyBertSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, dropout=0.1):
        super().__init__()
        self.num_attention_heads = num_heads
        self.attention_head_size = hidden_size // num_heads
        self.all_head_size = hidden_size
        self.query = nn.Linear(hidden_size, self.all_head_size)
        self.key = nn.Linear(hidden_size, self.all_head_size)
        self.value = nn.Linear(hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(dropout)
        self.softmax = nn.Softmax(dim=-1)

    def split_heads(self, x):
        new_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.split_heads(self.query(hidden_states))
        key_layer = self.split_heads(self.key(hidden_states))
        value_layer = self.split_heads(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.softmax(attention_scores)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class SdpaBertSelfAttention(TinyBertSelfAttention):
    def forward(self, hidden_states, attention_mask=None):
        q = self.split_heads(self.query(hidden_states))
        k = self.split_heads(self.key(hidden_states))
        v = self.split_heads(self.value(hidden_states))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             dropout_p=self.dropout.p if self.training else 0.0)
        out = out.permute(0, 2, 1, 3).contiguous()
        return out.view(out.size()[:-2] + (self.all_head_size,))


class MiniT5Attention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, num_buckets=8, has_relative_attention_bias=False, dropout=0.1):
        super().__init__()
        self.n_heads = n_heads
        self.d_kv = d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.num_buckets = num_buckets
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)
        self.dropout = dropout

    def compute_bias(self, q_len, k_len, device):
        ctx = torch.arange(q_len, device=device)[:, None]
        mem = torch.arange(k_len, device=device)[None, :]
        half = self.num_buckets // 2
        buckets = (mem - ctx).clamp(-half, half - 1) + half
        values = self.relative_attention_bias(buckets)
        return values.permute(2, 0, 1).unsqueeze(0)

    def forward(self, hidden_states, position_bias=None):
        B, L, _ = hidden_states.shape
        q = self.q(hidden_states).view(B, L, self.n_heads, self.d_kv).transpose(1, 2)
        k = self.k(hidden_states).view(B, L, self.n_heads, self.d_kv).transpose(1, 2)
        v = self.v(hidden_states).view(B, L, self.n_heads, self.d_kv).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            if self.has_relative_attention_bias:
                position_bias = self.compute_bias(L, L, scores.device)
            else:
                position_bias = torch.zeros((1, self.n_heads, L, L), device=scores.device, dtype=scores.dtype)
        scores += position_bias
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(B, L, -1)
        return self.o(out), position_bias


class KVNormAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.kv_norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        kv = self.kv_norm(x)
        q, k, v = self.to_q(x), self.to_k(kv), self.to_v(kv)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        sim = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        attn = torch.softmax(sim, -1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, d)
        return self.to_out(out)


class MixedBiasAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).reshape(b, n, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).reshape(b, n, self.heads, -1).transpose(1, 2)
        attn = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, d)
        return self.out_proj(out)


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MinGPTBlock(nn.Module):
    def __init__(self, n_embd=32, n_head=4, resid_pdrop=0.1):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(n_embd, 4 * n_embd),
            c_proj=nn.Linear(4 * n_embd, n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlpf(self.ln_2(x))
        return x


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class CLIPResidualBlock(nn.Module):
    def __init__(self, d_model=32, n_head=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.ln_1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, d_model * 4)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(d_model * 4, d_model)),
        ]))
        self.ln_2 = nn.LayerNorm(d_model)

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln_2(x))
        return x


class AttnLookalikeNet(nn.Module):
    def __init__(self, dim=32, vocab=50):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.bert = TinyBertSelfAttention(dim, 4)
        self.sdpa = SdpaBertSelfAttention(dim, 4)
        self.t5_first = MiniT5Attention(dim, 4, has_relative_attention_bias=True)
        self.t5_next = MiniT5Attention(dim, 4)
        self.kv_norm_attn = KVNormAttention(dim, 4)
        self.mixed_bias_attn = MixedBiasAttention(dim, 4)
        self.gpt_block = MinGPTBlock(dim, 4)
        self.clip_block = CLIPResidualBlock(dim, 4)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = (tokens == 0)[:, None, None, :].float() * -1e4
        x = x + self.bert(x, mask)
        x = x + self.sdpa(x)
        h, bias = self.t5_first(x)
        x = x + h
        h, _ = self.t5_next(x, position_bias=bias)
        x = x + h
        x = x + self.kv_norm_attn(x)
        x = x + self.mixed_bias_attn(x)
        x = self.gpt_block(x)
        x = self.clip_block(x)
        return self.head(x)


_ACT_CLASSES = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}


class ActByNameMlp(nn.Module):
    def __init__(self, dim, act_name):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * 2)
        self.act = _ACT_CLASSES[act_name]()
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class GeluOrReluMlp(nn.Module):
    def __init__(self, dim, use_gelu):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.act = nn.GELU() if use_gelu else nn.ReLU()

    def forward(self, x):
        h = self.fc(x)
        return self.act(h)


class BiasFreeGeluHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim, bias=False),
            nn.GELU(),
            nn.Linear(dim, dim),
        )

    def forward(self, x):
        return self.net(x)


class NormedGeluProj(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return F.gelu(self.norm(self.proj(x)))


class LayerScaleResidual(nn.Module):
    def __init__(self, dim, p=0.1, init_values=1e-2):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.gamma = nn.Parameter(init_values * torch.ones(dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.gamma * self.drop(self.fc(x)))


class FFOutput(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)


class ForeignNormResidual(nn.Module):
    def __init__(self, dim, p=0.1):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.out = FFOutput(dim)

    def forward(self, x):
        h = self.drop(self.out.dense(x))
        return self.out.norm(x + h)


class GroupNormResidual(nn.Module):
    def __init__(self, channels, p=0.1):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)
        self.drop = nn.Dropout(p)
        self.norm = nn.GroupNorm(1, channels)

    def forward(self, x):
        return self.norm(x + self.drop(self.conv(x)))


class FunctionalPostLN(nn.Module):
    def __init__(self, dim, p=0.1):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.p = p
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        h = nn.functional.dropout(self.fc(x), self.p, self.training)
        return self.ln(h + x)


class ParamNormPostLN(nn.Module):
    def __init__(self, dim, p=0.1, norm_layer=nn.LayerNorm):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.norm = norm_layer(dim)

    def forward(self, x):
        y = self.drop(self.fc(x))
        x = self.norm(x + y)
        return x


class BNNeckHead(nn.Module):
    def __init__(self, in_dim=32, feat_dim=16, num_classes=5):
        super().__init__()
        self.fc = nn.Linear(in_dim, feat_dim)
        self.fc_bn = nn.BatchNorm1d(feat_dim)
        self.classifier = nn.Sequential(
            nn.BatchNorm1d(feat_dim),
            nn.Linear(feat_dim, num_classes, bias=False),
        )

    def forward(self, x):
        feat = self.fc_bn(self.fc(x))
        return self.classifier(feat)


class ScaledSoftmax(nn.Module):
    def __init__(self, dim=-1, temperature=1.0):
        super().__init__()
        self.dim = dim
        self.t = temperature

    def forward(self, x):
        return torch.softmax(x / self.t, dim=self.dim)


class SpatialSoftArgmax(nn.Module):
    def forward(self, heat):
        b, k, h, w = heat.shape
        probs = F.softmax(heat.reshape(b * k, h * w), dim=1).view(b, k, h, w)
        ys = torch.linspace(-1, 1, h, device=heat.device)
        xs = torch.linspace(-1, 1, w, device=heat.device)
        return torch.stack([(probs.sum(3) * ys).sum(2), (probs.sum(2) * xs).sum(2)], dim=-1)


class ChannelGate(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.sm = nn.Softmax2d()

    def forward(self, x):
        return x * self.sm(self.conv(x))


class LayerLookalikeNet(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.act_gelu = ActByNameMlp(dim, "gelu")
        self.act_silu = ActByNameMlp(dim, "silu")
        self.gelu_on = GeluOrReluMlp(dim, use_gelu=True)
        self.gelu_off = GeluOrReluMlp(dim, use_gelu=False)
        self.bias_free = BiasFreeGeluHead(dim)
        self.normed = NormedGeluProj(dim)
        self.layer_scale = LayerScaleResidual(dim)
        self.foreign = ForeignNormResidual(dim)
        self.group_norm = GroupNormResidual(dim)
        self.post_ln = FunctionalPostLN(dim)
        self.param_ln = ParamNormPostLN(dim)
        self.bnneck = BNNeckHead(dim, 16, 5)
        self.scaled_softmax = ScaledSoftmax(dim=1, temperature=0.5)
        self.soft_argmax = SpatialSoftArgmax()
        self.gate = ChannelGate(8)

    def forward(self, x):
        x = self.act_gelu(x) + self.act_silu(x)
        x = self.gelu_on(x) + self.gelu_off(x)
        x = self.bias_free(x) + self.normed(x)
        x = self.layer_scale(x)
        x = self.foreign(x)
        x = self.group_norm(x.transpose(1, 2)).transpose(1, 2)
        x = self.param_ln(self.post_ln(x))
        img = x.reshape(x.shape[0], 8, 4, 8)
        img = self.gate(img) * self.scaled_softmax(img)
        pts = self.soft_argmax(img)
        logits = self.bnneck(x.mean(1))
        return logits + pts.flatten(1).sum(1, keepdim=True)
