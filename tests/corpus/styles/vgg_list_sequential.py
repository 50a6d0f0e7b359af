"""Networks whose layers are collected in Python lists and unpacked into ``nn.Sequential``
(torchvision VGG's ``make_layers``, a strided conv stem, a U-Net style double conv)."""
from typing import List, Union

import torch
import torch.nn as nn

cfgs = {
    "A": [64, "M", 128, "M", 256, 256, "M"],
    "T": [16, "M", 32, "M"],
}


def make_layers(cfg: List[Union[str, int]], batch_norm: bool = False) -> nn.Sequential:
    layers: List[nn.Module] = []
    in_channels = 3
    for v in cfg:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            v = int(v)
            conv2d = nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
            if batch_norm:
                layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
            else:
                layers += [conv2d, nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, features: nn.Module, num_classes: int = 10, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(32 * 2 * 2, 64),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def vgg_tiny_bn(**kwargs) -> VGG:
    return VGG(make_layers(cfgs["T"], batch_norm=True), **kwargs)


class ConvStem(nn.Module):
    """Strided 3x3 conv stem: conv-bn-relu repeated, collected with ``layers.append``."""

    def __init__(self, in_chs: int = 3, widths=(16, 32)):
        super().__init__()
        layers = []
        c = in_chs
        for w in widths:
            layers.append(nn.Conv2d(c, w, 3, stride=2, padding=1, bias=False))
            layers.append(nn.BatchNorm2d(w))
            layers.append(nn.ReLU(inplace=True))
            c = w
        self.stem = nn.Sequential(*layers)

    def forward(self, x):
        return self.stem(x)


class DoubleConv(nn.Module):
    """(convolution => [BN] => ReLU) * 2"""

    def __init__(self, in_channels, out_channels, mid_channels=None, pool=False):
        super().__init__()
        if not mid_channels:
            mid_channels = out_channels
        self.double_conv = self._build(in_channels, mid_channels, out_channels, pool)

    @staticmethod
    def _build(in_channels, mid_channels, out_channels, pool):
        layers = [
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
        ]
        layers.append(nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False))
        layers.append(nn.BatchNorm2d(out_channels))
        layers.append(nn.ReLU(inplace=True))
        if pool:
            layers.append(nn.MaxPool2d(2))
        return nn.Sequential(*layers)

    def forward(self, x):
        return self.double_conv(x)


class StemNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = ConvStem(3, (16, 32))
        self.body = DoubleConv(32, 32, pool=True)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(x.mean((2, 3)))
