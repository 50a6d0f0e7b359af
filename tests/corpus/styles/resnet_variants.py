"""Convolution blocks from assorted research repos (DLA, SENet, EfficientNet ports, ...), each
choosing its BatchNorm in a different way: a module-level alias, a class-valued default argument,
``functools.partial`` and an ``OrderedDict`` Sequential."""
import functools
from collections import OrderedDict
from typing import Type

import torch
import torch.nn as nn
import torch.nn.functional as F

BatchNorm = nn.BatchNorm2d

TFBatchNorm2d = functools.partial(nn.BatchNorm2d, eps=1e-3, momentum=0.01)


class DLABasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, dilation=1):
        super(DLABasicBlock, self).__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=dilation,
                               bias=False, dilation=dilation)
        self.bn1 = BatchNorm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=dilation,
                               bias=False, dilation=dilation)
        self.bn2 = BatchNorm(planes)
        self.stride = stride

    def forward(self, x, residual=None):
        if residual is None:
            residual = x

        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)

        out = self.conv2(out)
        out = self.bn2(out)

        out += residual
        out = self.relu(out)

        return out


class Root(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, residual):
        super(Root, self).__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, stride=1, bias=False,
                              padding=(kernel_size - 1) // 2)
        self.bn = BatchNorm(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.residual = residual

    def forward(self, *x):
        children = x
        x = self.conv(torch.cat(x, 1))
        x = self.bn(x)
        if self.residual:
            x += children[0]
        x = self.relu(x)

        return x


class ConvBNReLU(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1,
                 norm_layer: Type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size, stride, kernel_size // 2, bias=False)
        self.norm = norm_layer(out_ch)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


class MBConvStem(nn.Module):
    def __init__(self, in_chs: int = 3, out_chs: int = 32, norm_layer=TFBatchNorm2d):
        super().__init__()
        self.conv_stem = nn.Conv2d(in_chs, out_chs, 3, stride=2, padding=1, bias=False)
        self.bn1 = norm_layer(out_chs)
        self.act1 = nn.SiLU(inplace=True)

    def forward(self, x):
        x = self.conv_stem(x)
        x = self.bn1(x)
        x = self.act1(x)
        return x


class SeparableConvBN(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-3):
        super().__init__()
        norm = functools.partial(nn.BatchNorm2d, eps=eps, momentum=0.01)
        self.conv_dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn_dw = norm(channels)
        self.conv_pw = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn_pw = norm(channels)

    def forward(self, x):
        x = F.relu(self.bn_dw(self.conv_dw(x)))
        return self.bn_pw(self.conv_pw(x))


class SEResNetStem(nn.Module):
    def __init__(self, in_chs: int = 3, inplanes: int = 64):
        super().__init__()
        self.layer0 = nn.Sequential(OrderedDict([
            ("conv1", nn.Conv2d(in_chs, inplanes, kernel_size=7, stride=2, padding=3, bias=False)),
            ("bn1", nn.BatchNorm2d(inplanes)),
            ("relu1", nn.ReLU(inplace=True)),
            ("pool", nn.MaxPool2d(3, stride=2, ceil_mode=True)),
        ]))

    def forward(self, x):
        return self.layer0(x)


class VariantsNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = MBConvStem(3, 16)
        self.layer0 = SEResNetStem(16, 32)
        self.block = ConvBNReLU(32, 32)
        self.sep = SeparableConvBN(32)
        self.dla = DLABasicBlock(32, 32)
        self.root = Root(64, 32, 1, residual=True)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer0(x)
        x = self.block(x)
        x = self.sep(x)
        y = self.dla(x)
        x = self.root(y, x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)
