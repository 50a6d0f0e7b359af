"""Conv nets with batch norm outside vision-classification code: an audio CRNN on log-mel
spectrograms (Conv2d/BatchNorm2d attributes and a loop-built Sequential, a GRU, attention pooling
over time), a TCN of dilated ``Conv1d`` + ``BatchNorm1d`` with residual ReLUs, graph networks on
dense adjacency (GIN with a ``Linear``/``BatchNorm1d`` MLP, a dense GAT layer normalising over
neighbours) and a segmentation U-Net (``DoubleConv`` Sequential, ``Down``/``Up`` blocks)."""
import torch
import torch.nn.functional as F
from torch import nn


class ConvBlock(nn.Module):
    """PANNs-like: two conv/BN/ReLU with the BN as attributes, then pooling."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x, pool_size=(2, 2), pool_type="avg"):
        x = F.relu_(self.bn1(self.conv1(x)))
        x = F.relu_(self.bn2(self.conv2(x)))
        if pool_type == "max":
            x = F.max_pool2d(x, kernel_size=pool_size)
        else:
            x = F.avg_pool2d(x, kernel_size=pool_size)
        return x


class CRNN(nn.Module):
    def __init__(self, n_mels=32, n_classes=5, channels=(8, 16)):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(n_mels)
        layers = []
        c_in = 1
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d((1, 2))]
            c_in = c
        self.frontend = nn.Sequential(*layers)
        self.block = ConvBlock(c_in, 2 * c_in)
        self.gru = nn.GRU(2 * c_in * (n_mels // 8), 16, batch_first=True, bidirectional=True)
        self.att = nn.Linear(32, 1)
        self.fc = nn.Linear(32, n_classes)

    def forward(self, spec):
        x = spec.unsqueeze(1)
        x = x.transpose(1, 3)
        x = self.bn0(x)
        x = x.transpose(1, 3)
        x = self.frontend(x)
        x = self.block(x, pool_size=(1, 2))
        b, c, t, f = x.shape
        x = x.permute(0, 2, 1, 3).reshape(b, t, c * f)
        h, _ = self.gru(x)
        w = torch.softmax(self.att(h).squeeze(-1), dim=-1)
        pooled = torch.sum(w.unsqueeze(-1) * h, dim=1)
        return self.fc(pooled)


class TemporalBlock(nn.Module):
    def __init__(self, n_inputs, n_outputs, kernel_size, dilation, dropout=0.1):
        super().__init__()
        padding = (kernel_size - 1) * dilation // 2
        self.conv1 = nn.Conv1d(n_inputs, n_outputs, kernel_size, padding=padding, dilation=dilation)
        self.bn1 = nn.BatchNorm1d(n_outputs)
        self.conv2 = nn.Conv1d(n_outputs, n_outputs, kernel_size, padding=padding, dilation=dilation)
        self.bn2 = nn.BatchNorm1d(n_outputs)
        self.dropout = nn.Dropout(dropout)
        self.relu = nn.ReLU()
        self.downsample = nn.Conv1d(n_inputs, n_outputs, 1) if n_inputs != n_outputs else None

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.dropout(out)
        out = self.bn2(self.conv2(out))
        res = x if self.downsample is None else self.downsample(x)
        return self.relu(out + res)


class TCN(nn.Module):
    def __init__(self, n_mels=32, channels=(16, 16), n_classes=5):
        super().__init__()
        layers = []
        for i, c in enumerate(channels):
            layers.append(TemporalBlock(n_mels if i == 0 else channels[i - 1], c, 3, dilation=2 ** i))
        self.network = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(channels[-1], 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, n_classes))

    def forward(self, spec):
        y = self.network(spec.transpose(1, 2))
        return self.head(y.mean(dim=-1))


class GINConv(nn.Module):
    def __init__(self, in_dim, out_dim, eps=0.0):
        super().__init__()
        self.eps = nn.Parameter(torch.tensor([eps]))
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, out_dim),
            nn.BatchNorm1d(out_dim),
            nn.ReLU(),
            nn.Linear(out_dim, out_dim),
        )

    def forward(self, x, adj):
        out = (1 + self.eps) * x + adj @ x
        return self.mlp(out)


class DenseGATLayer(nn.Module):
    def __init__(self, in_features, out_features, dropout=0.1, alpha=0.2):
        super().__init__()
        self.dropout = dropout
        self.W = nn.Parameter(torch.empty(in_features, out_features))
        self.a = nn.Parameter(torch.empty(2 * out_features, 1))
        nn.init.xavier_uniform_(self.W, gain=1.414)
        nn.init.xavier_uniform_(self.a, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)
        self.out_features = out_features

    def forward(self, h, adj):
        Wh = torch.mm(h, self.W)
        Wh1 = torch.matmul(Wh, self.a[: self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features:, :])
        e = self.leakyrelu(Wh1 + Wh2.T)
        zero_vec = -9e15 * torch.ones_like(e)
        attention = torch.where(adj > 0, e, zero_vec)
        attention = F.softmax(attention, dim=1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        return F.elu(torch.matmul(attention, Wh))


class GraphNet(nn.Module):
    """Node features (N, F) of one graph; a self-looped ring adjacency built in forward."""

    def __init__(self, in_dim=12, hidden=16, n_classes=3):
        super().__init__()
        self.input_proj = nn.Linear(in_dim, hidden)
        self.input_bn = nn.BatchNorm1d(hidden)
        self.gin1 = GINConv(hidden, hidden)
        self.gat = DenseGATLayer(hidden, hidden)
        self.norm_then_proj = nn.Sequential(nn.BatchNorm1d(hidden), nn.Linear(hidden, hidden))
        self.act_between = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.BatchNorm1d(hidden))
        self.readout = nn.Linear(hidden, n_classes)

    def forward(self, x):
        n = x.shape[0]
        idx = torch.arange(n, device=x.device)
        adj = torch.zeros(n, n, device=x.device)
        adj[idx, idx] = 1.0
        adj[idx, (idx + 1) % n] = 1.0
        adj[(idx + 1) % n, idx] = 1.0
        h = self.input_bn(self.input_proj(x))
        h = F.relu(h)
        h = self.gin1(h, adj)
        h = self.gat(h, adj)
        h = self.act_between(self.norm_then_proj(h))
        return self.readout(h)


class DoubleConv(nn.Sequential):
    def __init__(self, in_channels, out_channels, mid_channels=None):
        if not mid_channels:
            mid_channels = out_channels
        super().__init__(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Down(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
        self.bn_up = nn.BatchNorm2d(in_channels // 2)
        self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.bn_up(self.up(x1))
        diff_y = x2.size()[2] - x1.size()[2]
        diff_x = x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class UNet(nn.Module):
    def __init__(self, n_channels=3, n_classes=2, base=8):
        super().__init__()
        self.inc = DoubleConv(n_channels, base)
        self.down1 = Down(base, 2 * base)
        self.down2 = Down(2 * base, 4 * base)
        self.up1 = Up(4 * base, 2 * base)
        self.up2 = Up(2 * base, base)
        self.outc = nn.Conv2d(base, n_classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.outc(x)
