"""Look-alikes of every rule in shapes the other wild2 files do not have, each beside a positive
control: sequence BatchNorm through a transpose, a bound ``nn.Softmax`` and a log-softmax, a
Linear output read twice, q/k/v of three different tensors, a sum fed to LeakyReLU, an RMSNorm
with the cast only on the way back, torch's own ``nn.RMSNorm``, a rotation by minus the angle,
a LayerNorm reading a dropout output that is also returned, a Conv3d block; positive controls
(Llama and Gemma RMSNorms, grouped-query attention with rotary and a causal fill) beside them."""
import torch
import torch.nn.functional as F
from torch import nn


class SeqBatchNormProj(nn.Module):
    """(B, T, C) features: BatchNorm1d wants channels at dim 1, so the code transposes."""

    def __init__(self, dim=16):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.fc_flat = nn.Linear(dim, dim)
        self.bn_flat = nn.BatchNorm1d(dim)

    def forward(self, x):
        y = self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)
        z = self.bn_flat(self.fc_flat(y).flatten(0, 1)).reshape_as(y)
        return z


class HeadsAndSoftmaxes(nn.Module):
    def __init__(self, dim=16, classes=6):
        super().__init__()
        self.proj = nn.Linear(dim, classes)
        self.softmax = nn.Softmax(dim=-1)
        self.gate = nn.Linear(dim, dim)
        self.ffn_in = nn.Linear(dim, 2 * dim)
        self.ffn_out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        logits = self.proj(x)
        probs = self.softmax(logits)
        log_probs = F.log_softmax(logits, dim=-1)
        g = self.gate(x)
        gated = F.gelu(g) + g
        h = F.gelu(self.ffn_in(x), approximate="tanh")
        return probs.sum(-1, keepdim=True) + log_probs.mean(-1, keepdim=True) + gated + self.ffn_out(h)


class ThreeStreamAttention(nn.Module):
    """q from the normalised tokens, k from a memory, v from the raw tokens."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.memory = nn.Parameter(torch.randn(1, 8, dim))

    def forward(self, x):
        b, n, d = x.shape
        mem = self.memory.expand(b, -1, -1)
        q = self.q(self.norm(x)).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.k(mem).view(b, 8, self.heads, -1).transpose(1, 2)
        v = self.v(mem).view(b, 8, self.heads, -1).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        probs = scores.softmax(-1)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, n, d)


class AlbertishSelfAttention(nn.Module):
    """Positive control: q/k/v of one tensor, written-out core with an additive mask."""

    def __init__(self, dim=16, heads=2, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.attention_dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(dim, dim)
        self.output_dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(dim)

    def forward(self, hidden_states, attention_mask=None):
        b, n, d = hidden_states.shape
        q = self.query(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.key(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        v = self.value(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / (d // self.heads) ** 0.5
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        probs = self.attention_dropout(probs)
        ctx = torch.matmul(probs, v).transpose(2, 1).flatten(2)
        projected = self.dense(ctx)
        projected = self.output_dropout(projected)
        return self.LayerNorm(projected + hidden_states)


class LeakyResidual(nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.LeakyReLU(0.1)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.act(self.conv(x) + x)
        return self.relu(y + x)


class CastBackOnlyRMSNorm(nn.Module):
    """Normalises in the input's dtype and casts the weight: no float32 upcast."""

    def __init__(self, dim=16, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm * self.weight.to(x.dtype)


class LlamaStyleRMSNorm(nn.Module):
    """Positive control: float32 upcast, rsqrt(mean + eps), weight times the cast back."""

    def __init__(self, dim=16, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half_inverse(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotaryPair(nn.Module):
    """``unrotate`` applies minus the angle (a look-alike); ``rotate`` is the rotation."""

    def __init__(self, dim=16, max_len=32):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_len).float()
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)
        self.builtin_norm = nn.RMSNorm(dim)

    def forward(self, x):
        n = x.shape[1]
        cos, sin = self.cos_cached[:n], self.sin_cached[:n]
        rotated = (x * cos) + (rotate_half(x) * sin)
        unrotated = (rotated * cos) + (rotate_half_inverse(rotated) * sin)
        return self.builtin_norm(unrotated)


class GemmaStyleRMSNorm(nn.Module):
    """Positive control: ``(1 + weight)`` in float32, then the cast back."""

    def __init__(self, dim=16, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class GroupedQueryAttention(nn.Module):
    """Positive controls: GQA projections of one tensor, half-split rotary on q and k, keys and values
    repeated with repeat_interleave, a causal fill from a tril buffer."""

    def __init__(self, dim=16, n_heads=4, n_kv_heads=2, max_len=32):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        emb = torch.outer(torch.arange(max_len).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        att = att.masked_fill(self.causal[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class DropoutReadTwice(nn.Module):
    def __init__(self, dim=16, p=0.1):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.drop(self.fc(x))
        out = self.norm(x + h)
        return out, h


class Conv3dBlock(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv3d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class LookalikeZoo2(nn.Module):
    """Runs every look-alike on (B, T, 16) tokens."""

    def __init__(self):
        super().__init__()
        self.seq_bn = SeqBatchNormProj()
        self.heads = HeadsAndSoftmaxes()
        self.three = ThreeStreamAttention()
        self.albert = AlbertishSelfAttention()
        self.leaky = LeakyResidual()
        self.rms_a = CastBackOnlyRMSNorm()
        self.rms_b = LlamaStyleRMSNorm()
        self.rms_c = GemmaStyleRMSNorm()
        self.gqa = GroupedQueryAttention()
        self.rotary = RotaryPair()
        self.drop_twice = DropoutReadTwice()
        self.conv3d = Conv3dBlock()

    def forward(self, x):
        b, t, d = x.shape
        x = self.seq_bn(x)
        x = self.heads(x)
        x = self.three(x) + self.albert(x)
        img = x.reshape(b, 4, t // 2, 8)
        x = x + self.leaky(img).reshape(b, t, d)
        x = self.rms_a(x) + self.rms_b(x) + self.rms_c(x)
        x = x + self.gqa(x)
        x = self.rotary(x)
        x, h = self.drop_twice(x)
        vol = x.reshape(b, 4, 2, t // 2, 4)
        return x + h + self.conv3d(vol).reshape(b, t, d)
