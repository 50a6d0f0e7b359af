"""EfficientNet in two styles.

EfficientNet (torchvision style): Conv2dNormActivation, an nn.Sequential subclass that takes
norm_layer / activation_layer classes, module-level functools.partial aliases (ConvBNAct,
BatchNorm2dTF), MBConv blocks with squeeze-excitation and stochastic depth, configs in dataclasses.

EfficientNetSamePad (EfficientNet-PyTorch style): a Conv2d subclass with TF "SAME" static padding
whose forward pads then convolves, obtained from a get_same_padding_conv2d factory, and blocks
wiring _conv / _bn attributes explicitly in forward.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Conv2dNormActivation(nn.Sequential):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        padding: Optional[int] = None,
        groups: int = 1,
        norm_layer: Optional[Callable[..., nn.Module]] = nn.BatchNorm2d,
        activation_layer: Optional[Callable[..., nn.Module]] = nn.ReLU,
        dilation: int = 1,
        inplace: Optional[bool] = True,
        bias: Optional[bool] = None,
    ) -> None:
        if padding is None:
            padding = (kernel_size - 1) // 2 * dilation
        if bias is None:
            bias = norm_layer is None
        layers = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding,
                      dilation=dilation, groups=groups, bias=bias)
        ]
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation_layer is not None:
            params = {} if inplace is None else {"inplace": inplace}
            layers.append(activation_layer(**params))
        super().__init__(*layers)
        self.out_channels = out_channels


BatchNorm2dTF = partial(nn.BatchNorm2d, eps=1e-3, momentum=0.01)
ConvBNAct = partial(Conv2dNormActivation, norm_layer=BatchNorm2dTF, activation_layer=nn.SiLU)


class SqueezeExcitation(nn.Module):
    def __init__(self, input_channels, squeeze_channels, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def _scale(self, input: Tensor) -> Tensor:
        scale = self.avgpool(input)
        scale = self.fc1(scale)
        scale = self.activation(scale)
        scale = self.fc2(scale)
        return self.scale_activation(scale)

    def forward(self, input: Tensor) -> Tensor:
        scale = self._scale(input)
        return scale * input


def stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    if mode == "row":
        size = [input.shape[0]] + [1] * (input.ndim - 1)
    else:
        size = [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


class StochasticDepth(nn.Module):
    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, input: Tensor) -> Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)


@dataclass
class MBConvConfig:
    expand_ratio: int
    kernel: int
    stride: int
    input_channels: int
    out_channels: int
    num_layers: int


class MBConv(nn.Module):
    def __init__(self, cnf: MBConvConfig, stochastic_depth_prob: float, norm_layer: Callable[..., nn.Module],
                 se_layer: Callable[..., nn.Module] = SqueezeExcitation) -> None:
        super().__init__()
        self.use_res_connect = cnf.stride == 1 and cnf.input_channels == cnf.out_channels
        layers: List[nn.Module] = []
        activation_layer = nn.SiLU
        expanded_channels = cnf.input_channels * cnf.expand_ratio
        if expanded_channels != cnf.input_channels:
            layers.append(Conv2dNormActivation(cnf.input_channels, expanded_channels, kernel_size=1,
                                               norm_layer=norm_layer, activation_layer=activation_layer))
        layers.append(Conv2dNormActivation(expanded_channels, expanded_channels, kernel_size=cnf.kernel,
                                           stride=cnf.stride, groups=expanded_channels, norm_layer=norm_layer,
                                           activation_layer=activation_layer))
        squeeze_channels = max(1, cnf.input_channels // 4)
        layers.append(se_layer(expanded_channels, squeeze_channels, activation=partial(nn.SiLU, inplace=True)))
        layers.append(Conv2dNormActivation(expanded_channels, cnf.out_channels, kernel_size=1,
                                           norm_layer=norm_layer, activation_layer=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")
        self.out_channels = cnf.out_channels

    def forward(self, input: Tensor) -> Tensor:
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


class EfficientNet(nn.Module):
    def __init__(self, stochastic_depth_prob: float = 0.2, num_classes: int = 10,
                 norm_layer: Optional[Callable[..., nn.Module]] = None, dropout: float = 0.2) -> None:
        super().__init__()
        setting = [
            MBConvConfig(1, 3, 1, 16, 8, 1),
            MBConvConfig(4, 3, 2, 8, 16, 2),
            MBConvConfig(4, 5, 2, 16, 24, 2),
        ]
        if norm_layer is None:
            norm_layer = BatchNorm2dTF
        layers: List[nn.Module] = [ConvBNAct(3, setting[0].input_channels, kernel_size=3, stride=2)]
        total_stage_blocks = sum(cnf.num_layers for cnf in setting)
        stage_block_id = 0
        for cnf in setting:
            stage: List[nn.Module] = []
            for i in range(cnf.num_layers):
                block_cnf = MBConvConfig(cnf.expand_ratio, cnf.kernel, cnf.stride if i == 0 else 1,
                                         cnf.input_channels if i == 0 else cnf.out_channels, cnf.out_channels,
                                         cnf.num_layers)
                sd_prob = stochastic_depth_prob * float(stage_block_id) / total_stage_blocks
                stage.append(MBConv(block_cnf, sd_prob, norm_layer))
                stage_block_id += 1
            layers.append(nn.Sequential(*stage))
        lastconv_input_channels = setting[-1].out_channels
        lastconv_output_channels = 4 * lastconv_input_channels
        layers.append(ConvBNAct(lastconv_input_channels, lastconv_output_channels, kernel_size=1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout, inplace=True),
            nn.Linear(lastconv_output_channels, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


class Conv2dStaticSamePadding(nn.Conv2d):
    """TF "SAME" padding computed once for a fixed image size; forward pads, then convolves."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, image_size=None, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, **kwargs)
        ih, iw = (image_size, image_size) if isinstance(image_size, int) else image_size
        kh, kw = self.weight.size()[-2:]
        sh, sw = self.stride
        oh, ow = math.ceil(ih / sh), math.ceil(iw / sw)
        pad_h = max((oh - 1) * sh + (kh - 1) * self.dilation[0] + 1 - ih, 0)
        pad_w = max((ow - 1) * sw + (kw - 1) * self.dilation[1] + 1 - iw, 0)
        self.static_padding = nn.ZeroPad2d((pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))

    def forward(self, x):
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def get_same_padding_conv2d(image_size):
    return partial(Conv2dStaticSamePadding, image_size=image_size)


class SamePadMBConvBlock(nn.Module):
    def __init__(self, input_filters, output_filters, expand_ratio, kernel_size, stride, image_size,
                 bn_mom=0.01, bn_eps=1e-3, se_ratio=0.25):
        super().__init__()
        self._input_filters = input_filters
        self._output_filters = output_filters
        self._expand_ratio = expand_ratio
        self._stride = stride
        oup = input_filters * expand_ratio
        if expand_ratio != 1:
            self._expand_conv = nn.Conv2d(input_filters, oup, kernel_size=1, bias=False)
            self._bn0 = nn.BatchNorm2d(num_features=oup, momentum=bn_mom, eps=bn_eps)
        Conv2d = get_same_padding_conv2d(image_size=image_size)
        self._depthwise_conv = Conv2d(oup, oup, kernel_size=kernel_size, stride=stride, groups=oup, bias=False)
        self._bn1 = nn.BatchNorm2d(num_features=oup, momentum=bn_mom, eps=bn_eps)
        num_squeezed = max(1, int(input_filters * se_ratio))
        self._se_reduce = nn.Conv2d(oup, num_squeezed, kernel_size=1)
        self._se_expand = nn.Conv2d(num_squeezed, oup, kernel_size=1)
        self._project_conv = nn.Conv2d(oup, output_filters, kernel_size=1, bias=False)
        self._bn2 = nn.BatchNorm2d(num_features=output_filters, momentum=bn_mom, eps=bn_eps)
        self._swish = nn.SiLU()

    def forward(self, inputs):
        x = inputs
        if self._expand_ratio != 1:
            x = self._expand_conv(inputs)
            x = self._bn0(x)
            x = self._swish(x)
        x = self._depthwise_conv(x)
        x = self._bn1(x)
        x = self._swish(x)
        x_squeezed = F.adaptive_avg_pool2d(x, 1)
        x_squeezed = self._se_expand(self._swish(self._se_reduce(x_squeezed)))
        x = torch.sigmoid(x_squeezed) * x
        x = self._project_conv(x)
        x = self._bn2(x)
        if self._stride == 1 and self._input_filters == self._output_filters:
            x = x + inputs
        return x


class EfficientNetSamePad(nn.Module):
    def __init__(self, image_size=32, num_classes=10, bn_mom=0.01, bn_eps=1e-3):
        super().__init__()
        Conv2d = get_same_padding_conv2d(image_size=image_size)
        self._conv_stem = Conv2d(3, 16, kernel_size=3, stride=2, bias=False)
        self._bn0 = nn.BatchNorm2d(num_features=16, momentum=bn_mom, eps=bn_eps)
        self._blocks = nn.ModuleList([
            SamePadMBConvBlock(16, 16, 1, 3, 1, image_size // 2),
            SamePadMBConvBlock(16, 24, 6, 3, 2, image_size // 2),
            SamePadMBConvBlock(24, 24, 6, 5, 1, image_size // 4),
        ])
        self._conv_head = Conv2dStaticSamePadding(24, 64, kernel_size=1, bias=False, image_size=image_size // 4)
        self._bn1 = nn.BatchNorm2d(num_features=64, momentum=bn_mom, eps=bn_eps)
        self._fc = nn.Linear(64, num_classes)
        self._swish = nn.SiLU()

    def forward(self, inputs):
        x = self._swish(self._bn0(self._conv_stem(inputs)))
        for block in self._blocks:
            x = block(x)
        x = self._swish(self._bn1(self._conv_head(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self._fc(x)
