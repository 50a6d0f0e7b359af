"""Layers in the style of timm (``timm.layers``): ``create_conv2d``, ``ConvNormAct``, ``Mlp``,
depthwise-separable blocks; layer classes are passed around as ``*_layer`` arguments."""
from typing import Optional, Tuple, Union

import torch.nn as nn
import torch.nn.functional as F


def get_padding(kernel_size: int, stride: int = 1, dilation: int = 1) -> int:
    padding = ((stride - 1) + dilation * (kernel_size - 1)) // 2
    return padding


def create_conv2d(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                  dilation: int = 1, depthwise: bool = False, bias: bool = False, **kwargs) -> nn.Conv2d:
    """Select a 2d convolution; only the static-padding nn.Conv2d in this port."""
    groups = in_channels if depthwise else kwargs.pop("groups", 1)
    padding = kwargs.pop("padding", get_padding(kernel_size, stride, dilation))
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                     dilation=dilation, groups=groups, bias=bias)


def to_2tuple(x):
    return x if isinstance(x, tuple) else (x, x)


class ConvNormAct(nn.Module):
    def __init__(
            self,
            in_channels: int,
            out_channels: int,
            kernel_size: int = 1,
            stride: int = 1,
            dilation: int = 1,
            groups: int = 1,
            bias: bool = False,
            apply_act: bool = True,
            norm_layer=nn.BatchNorm2d,
            act_layer=nn.ReLU,
    ):
        super(ConvNormAct, self).__init__()
        self.conv = create_conv2d(in_channels, out_channels, kernel_size, stride=stride,
                                  dilation=dilation, groups=groups, bias=bias)
        self.bn = norm_layer(out_channels)
        self.act = act_layer(inplace=True) if apply_act else nn.Identity()

    @property
    def in_channels(self):
        return self.conv.in_channels

    def forward(self, x):
        x = self.conv(x)
        x = self.bn(x)
        x = self.act(x)
        return x


ConvBnAct = ConvNormAct


class BatchNormAct2d(nn.BatchNorm2d):
    """BatchNorm + activation in one module (its own forward)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, apply_act=True, act_layer=nn.ReLU):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.act = act_layer(inplace=True) if apply_act else nn.Identity()

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         self.training, self.momentum, self.eps)
        return self.act(x)


class ConvNormActFused(nn.Module):
    """Conv followed by a norm+act module."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1,
                 norm_act_layer=BatchNormAct2d):
        super().__init__()
        self.conv = create_conv2d(in_channels, out_channels, kernel_size, stride=stride)
        self.bn = norm_act_layer(out_channels)

    def forward(self, x):
        x = self.conv(x)
        x = self.bn(x)
        return x


class DepthwiseSeparableConv(nn.Module):
    """Depthwise-separable block (MobileNet-V1 / EfficientNet-B0 first stage)."""

    def __init__(self, in_chs: int, out_chs: int, dw_kernel_size: int = 3, stride: int = 1,
                 noskip: bool = False, act_layer=nn.ReLU, norm_layer=nn.BatchNorm2d):
        super(DepthwiseSeparableConv, self).__init__()
        self.has_skip = (stride == 1 and in_chs == out_chs) and not noskip
        self.conv_dw = create_conv2d(in_chs, in_chs, dw_kernel_size, stride=stride, depthwise=True)
        self.bn1 = norm_layer(in_chs)
        self.act1 = act_layer(inplace=True)
        self.conv_pw = create_conv2d(in_chs, out_chs, 1)
        self.bn2 = norm_layer(out_chs)

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x)
        x = self.bn1(x)
        x = self.act1(x)
        x = self.conv_pw(x)
        x = self.bn2(x)
        if self.has_skip:
            x = x + shortcut
        return x


class Mlp(nn.Module):
    """MLP as used in Vision Transformer, MLP-Mixer and related networks"""

    def __init__(
            self,
            in_features: int,
            hidden_features: Optional[int] = None,
            out_features: Optional[int] = None,
            act_layer=nn.GELU,
            norm_layer=None,
            bias: Union[bool, Tuple[bool, bool]] = True,
            drop: float = 0.,
    ):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        bias = to_2tuple(bias)
        drop_probs = to_2tuple(drop)

        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias[0])
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop_probs[0])
        self.norm = norm_layer(hidden_features) if norm_layer is not None else nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias[1])
        self.drop2 = nn.Dropout(drop_probs[1])

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class TinyEfficientNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv_stem = ConvBnAct(3, 16, 3, stride=2)
        self.block0 = DepthwiseSeparableConv(16, 16)
        self.block1 = ConvNormActFused(16, 32, 3, stride=2)
        self.conv_head = ConvNormAct(32, 64, 1)
        self.head = Mlp(64, 128, num_classes, drop=0.1)

    def forward(self, x):
        x = self.conv_stem(x)
        x = self.block0(x)
        x = self.block1(x)
        x = self.conv_head(x)
        x = x.mean((2, 3))
        return self.head(x)
