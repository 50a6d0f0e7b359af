"""Look-alikes of the LLM patterns (written for the llm_styles corpus, plain torch), with a few
positive controls next to them.

Norms that resemble RMSNorm (centered, eps outside the square root, over the channel dim, gated,
a `_norm` helper a subclass overrides); rotations that resemble rotary embeddings (flipped signs,
interleaved selection concatenated in halves, rotating another tensor, a complex product with a
learned weight); gated-MLP shapes (activation of the product, gate and up on different inputs,
sigmoid gate, a norm before the down projection) next to a biased GeGLU and a SwiGLU built by a
same-file factory; losses on things other than a plain head output (temperature, soft-capping,
z-loss, contrastive logits); a softmax over slots.
"""
import torch
import torch.nn.functional as F
from torch import nn


# --- norms ---------------------------------------------------------------------------------------


class CenteredNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight


class EpsOutsideRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        rms = torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + self.eps
        return self.weight * (h / rms).type_as(x)


class ChannelRMSNorm(nn.Module):
    """Normalises (B, C, T) activations over the channels."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + self.eps)
        return self.weight[None, :, None] * h.type_as(x)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        input_dtype = x.dtype
        h = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


class QKNormBase(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class L2QKNorm(QKNormBase):
    def _norm(self, x):
        return F.normalize(x, dim=-1)


# --- rotations -----------------------------------------------------------------------------------


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_flipped(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((x2, -x1), dim=-1)


def rotate_pairs_concat(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two_flipped(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((x2, -x1), dim=-1).flatten(-2)


def half_cos_sin(seq_len, dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_flipped(x, cos, sin):
    return (x * cos) + (rotate_half_flipped(x) * sin)


def apply_pairs_concat(x, cos, sin):
    return (x * cos) + (rotate_pairs_concat(x) * sin)


def apply_every_two_flipped(x, cos, sin):
    return (x * cos) + (rotate_every_two_flipped(x) * sin)


def mix_query_key(q, k, cos, sin):
    return (q * cos) + (rotate_half(k) * sin)


class SpectralMix(nn.Module):
    """Multiplies feature pairs, read as complex numbers, by a learned complex weight."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim // 2, 2) * 0.02 + torch.tensor([1.0, 0.0]))

    def forward(self, x):
        x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        w = torch.view_as_complex(self.weight)
        return torch.view_as_real(x_c * w).flatten(-2).type_as(x)


class RotationLookalikes(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.spectral = SpectralMix(dim)

    def forward(self, q, k):
        cos, sin = half_cos_sin(q.shape[-2], q.shape[-1])
        a = apply_flipped(q, cos, sin)
        b = apply_pairs_concat(q, cos, sin)
        c = apply_every_two_flipped(k, cos, sin)
        d = mix_query_key(q, k, cos, sin)
        return a + b + c + d + self.spectral(q)


# --- gated MLP shapes ----------------------------------------------------------------------------


def linear(in_features, out_features):
    return nn.Linear(in_features, out_features, bias=False)


class FactorySwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = linear(dim, hidden)
        self.w2 = linear(hidden, dim)
        self.w3 = linear(dim, hidden)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class BiasedGEGLUMlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.gate(x)) * self.up(x))


class ActOfProductMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x) * self.up(x)))


class CrossGatedMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, context):
        return self.down(F.silu(self.gate(x)) * self.up(context))


class SigmoidGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.sigmoid(self.gate(x)) * self.up(x))


class NormFormerMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.ffn_ln = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(self.ffn_ln(h))


# --- losses --------------------------------------------------------------------------------------


class TemperatureHead(nn.Module):
    def __init__(self, dim, vocab_size, temperature=0.7):
        super().__init__()
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, h, targets):
        logits = self.head(h) / self.temperature
        return F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1))


class SoftcapHead(nn.Module):
    def __init__(self, dim, vocab_size, cap=30.0):
        super().__init__()
        self.vocab_size = vocab_size
        self.cap = cap
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, h, targets):
        logits = self.lm_head(h)
        logits = torch.tanh(logits / self.cap) * self.cap
        return F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1), ignore_index=-1)


class ZLossHead(nn.Module):
    def __init__(self, dim, vocab_size, z_weight=1e-4):
        super().__init__()
        self.vocab_size = vocab_size
        self.z_weight = z_weight
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, h, targets):
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1), ignore_index=-1)
        z_loss = logits.float().logsumexp(-1).pow(2).mean()
        return loss + self.z_weight * z_loss


class ContrastiveHead(nn.Module):
    def __init__(self, dim, proj_dim=16, tau=0.07):
        super().__init__()
        self.proj_a = nn.Linear(dim, proj_dim, bias=False)
        self.proj_b = nn.Linear(dim, proj_dim, bias=False)
        self.tau = tau

    def forward(self, a, b):
        za = F.normalize(self.proj_a(a), dim=-1)
        zb = F.normalize(self.proj_b(b), dim=-1)
        logits = za @ zb.t() / self.tau
        labels = torch.arange(logits.shape[0], device=logits.device)
        return F.cross_entropy(logits, labels)


class SlotSoftmax(nn.Module):
    """Slot-attention style: slots compete for each input (softmax over the slot axis)."""

    def __init__(self, dim, num_slots=3):
        super().__init__()
        self.slots = nn.Parameter(torch.randn(1, num_slots, dim) * 0.02)
        self.scale = dim ** -0.5

    def forward(self, x):
        slots = self.slots.expand(x.shape[0], -1, -1)
        dots = torch.einsum('bid,bjd->bij', slots, x) * self.scale
        attn = dots.softmax(dim=1) + 1e-8
        attn = attn / attn.sum(dim=-1, keepdim=True)
        return torch.einsum('bij,bjd->bid', attn, x)


# --- the net that runs them all ------------------------------------------------------------------


class LookalikeLLMNet(nn.Module):
    def __init__(self, dim=32, hidden=48, vocab_size=64, heads=4):
        super().__init__()
        self.heads = heads
        self.vocab_size = vocab_size
        self.centered = CenteredNorm(dim)
        self.eps_outside = EpsOutsideRMSNorm(dim)
        self.channel_norm = ChannelRMSNorm(dim)
        self.gated_norm = GatedRMSNorm(dim)
        self.qk_norm = QKNormBase(dim // heads)
        self.l2_qk_norm = L2QKNorm(dim // heads)
        self.rotations = RotationLookalikes(dim // heads)
        self.factory_swiglu = FactorySwiGLU(dim, hidden)
        self.biased_geglu = BiasedGEGLUMlp(dim, hidden)
        self.act_of_product = ActOfProductMLP(dim, hidden)
        self.cross_gated = CrossGatedMLP(dim, hidden)
        self.sigmoid_glu = SigmoidGLU(dim, hidden)
        self.normformer = NormFormerMLP(dim, hidden)
        self.temperature_head = TemperatureHead(dim, vocab_size)
        self.softcap_head = SoftcapHead(dim, vocab_size)
        self.zloss_head = ZLossHead(dim, vocab_size)
        self.contrastive = ContrastiveHead(dim)
        self.slots = SlotSoftmax(dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.centered(x) + self.eps_outside(x) + self.channel_norm(x.transpose(1, 2)).transpose(1, 2)
        h = h + self.gated_norm(x, h)
        heads = h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q = self.qk_norm(heads)
        k = self.l2_qk_norm(heads)
        r = self.rotations(q, k).transpose(1, 2).reshape(b, t, d)
        h = h + r
        h = h + self.factory_swiglu(h) + self.biased_geglu(h) + self.act_of_product(h)
        h = h + self.cross_gated(h, x) + self.sigmoid_glu(h) + self.normformer(h)
        targets = (x.sum(-1) > 0).long() * (self.vocab_size - 1)
        loss = self.temperature_head(h, targets) + self.softcap_head(h, targets) + self.zloss_head(h, targets)
        loss = loss + self.contrastive(h[:, 0], h[:, -1])
        out = self.slots(h)
        return out.mean(dim=(1, 2)) + loss
