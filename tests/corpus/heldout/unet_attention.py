"""Attention U-Net with module-level helpers returning nn.Sequentials (double_conv, up_conv,
conv_block with a norm chosen by name) and attention gates made of Conv2d + BatchNorm2d
Sequentials."""
import torch
import torch.nn as nn


def double_conv(in_channels, out_channels, mid_channels=None):
    mid_channels = mid_channels or out_channels
    return nn.Sequential(
        nn.Conv2d(in_channels, mid_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(mid_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def up_conv(in_channels, out_channels):
    return nn.Sequential(
        nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def conv_block(in_channels, out_channels, norm="bn"):
    norm_layer = nn.BatchNorm2d if norm == "bn" else nn.InstanceNorm2d
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        norm_layer(out_channels),
        nn.LeakyReLU(0.01, inplace=True),
    )


class AttentionGate(nn.Module):
    def __init__(self, F_g, F_l, F_int):
        super().__init__()
        self.W_g = nn.Sequential(
            nn.Conv2d(F_g, F_int, kernel_size=1, stride=1, padding=0, bias=True),
            nn.BatchNorm2d(F_int),
        )
        self.W_x = nn.Sequential(
            nn.Conv2d(F_l, F_int, kernel_size=1, stride=1, padding=0, bias=True),
            nn.BatchNorm2d(F_int),
        )
        self.psi = nn.Sequential(
            nn.Conv2d(F_int, 1, kernel_size=1, stride=1, padding=0, bias=True),
            nn.BatchNorm2d(1),
            nn.Sigmoid(),
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, g, x):
        g1 = self.W_g(g)
        x1 = self.W_x(x)
        psi = self.relu(g1 + x1)
        psi = self.psi(psi)
        return x * psi


class AttentionUNet(nn.Module):
    def __init__(self, in_channels=3, n_classes=2, base=8):
        super().__init__()
        c1, c2, c3, c4 = base, base * 2, base * 4, base * 8
        self.maxpool = nn.MaxPool2d(2)
        self.enc1 = double_conv(in_channels, c1)
        self.enc2 = double_conv(c1, c2)
        self.enc3 = double_conv(c2, c3)
        self.bottleneck = conv_block(c3, c4, norm="in")
        self.up3 = up_conv(c4, c3)
        self.att3 = AttentionGate(F_g=c3, F_l=c3, F_int=c2)
        self.dec3 = double_conv(c3 * 2, c3)
        self.up2 = up_conv(c3, c2)
        self.att2 = AttentionGate(F_g=c2, F_l=c2, F_int=c1)
        self.dec2 = double_conv(c2 * 2, c2)
        self.up1 = up_conv(c2, c1)
        self.att1 = AttentionGate(c1, c1, c1 // 2)
        self.dec1 = double_conv(c1 * 2, c1, mid_channels=c1 * 2)
        self.head = nn.Sequential(conv_block(c1, c1), nn.Conv2d(c1, n_classes, kernel_size=1))

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.maxpool(e1))
        e3 = self.enc3(self.maxpool(e2))
        b = self.bottleneck(self.maxpool(e3))
        d3 = self.up3(b)
        d3 = self.dec3(torch.cat((self.att3(g=d3, x=e3), d3), dim=1))
        d2 = self.up2(d3)
        d2 = self.dec2(torch.cat((self.att2(g=d2, x=e2), d2), dim=1))
        d1 = self.up1(d2)
        d1 = self.dec1(torch.cat((self.att1(g=d1, x=e1), d1), dim=1))
        return self.head(d1)
