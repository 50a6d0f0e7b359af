"""Look-alikes: convolution/linear/dropout layers next to normalisations where no fused kernel applies."""
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


NORM2FN = {
    "bn": nn.BatchNorm2d,
    "gn": lambda c: nn.GroupNorm(4, c),
    "in": nn.InstanceNorm2d,
}


class ConvGN(nn.Module):
    def __init__(self, in_ch, out_ch, groups=4):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(groups, out_ch)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.conv(x)
        x = self.gn(x)
        return self.act(x)


class ConvReluBN(nn.Module):
    """Activation before the norm (as in some GAN discriminators / old Keras ports)."""

    def __init__(self, in_ch, out_ch):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x):
        x = self.conv(x)
        x = self.relu(x)
        x = self.bn(x)
        return x


class ConvNormByName(nn.Module):
    def __init__(self, in_ch, out_ch, norm_type: str):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False)
        self.norm = NORM2FN[norm_type](out_ch)

    def forward(self, x):
        x = self.conv(x)
        x = self.norm(x)
        return x


class UpBlock(nn.Module):
    """DCGAN-generator style upsampling block."""

    def __init__(self, in_ch, out_ch):
        super().__init__()
        self.deconv = nn.ConvTranspose2d(in_ch, out_ch, 4, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x):
        return torch.relu(self.bn(self.deconv(x)))


class TokenProjector(nn.Module):
    """Projects tokens, then normalises every (channel, token) position as its own feature."""

    def __init__(self, in_dim=8, dim=16, tokens=4):
        super().__init__()
        self.fc = nn.Linear(in_dim, dim)
        self.bn = nn.BatchNorm1d(dim * tokens)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.fc(x)
        h = h.transpose(1, 2)
        h = self.bn(h.flatten(1))
        return h.view(B, -1, T)


class RMSPostNormLayer(nn.Module):
    def __init__(self, dim=16, p=0.1):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(p)
        self.norm = RMSNorm(dim)

    def forward(self, x, h):
        x = self.norm(x + self.dropout(self.proj(h)))
        return x


class RMSPreNormLayer(nn.Module):
    def __init__(self, dim=16, p=0.1):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.mix = nn.Linear(dim, dim)
        self.drop1 = nn.Dropout(p)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.ff = nn.Linear(dim, dim)
        self.drop2 = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop1(self.mix(self.norm1(x)))
        x = x + self.drop2(self.ff(self.norm2(x)))
        return x


class DropoutKeptLayer(nn.Module):
    """Returns the dropped-out branch as well (e.g. for an auxiliary loss)."""

    def __init__(self, dim=16, p=0.1):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, h):
        d = self.dropout(h)
        x = self.norm(x + d)
        return x, d


class LookalikeNormsNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ConvGN(3, 8)
        self.b = ConvReluBN(8, 8)
        self.c = ConvNormByName(8, 8, "gn")
        self.d = ConvNormByName(8, 8, "in")
        self.up = UpBlock(8, 4)
        self.tokens = TokenProjector(in_dim=4, dim=16, tokens=4)
        self.post = RMSPostNormLayer(16)
        self.pre = RMSPreNormLayer(16)
        self.kept = DropoutKeptLayer(16)

    def forward(self, x):
        x = self.up(self.d(self.c(self.b(self.a(x)))))  # (B, 4, 2H, 2W)
        t = x.flatten(2)[:, :, :4].transpose(1, 2)  # (B, 4 tokens, 4)
        h = self.tokens(t).transpose(1, 2)  # (B, 4, 16)
        y = self.pre(self.post(h, h))
        y, aux = self.kept(y, h)
        return y + aux
