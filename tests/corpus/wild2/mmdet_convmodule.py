"""mmcv/mmdet-like: layers built from config dicts through registries (``build_conv_layer``,
``build_norm_layer`` returning a ``(name, layer)`` tuple registered with ``add_module`` and read
back through a property), ``ConvModule`` running conv/norm/act in the order a tuple gives, a
ResNet ``Bottleneck`` and a ``ResLayer`` built that way, an FPN of ConvModules, and a plain
stem written with torch modules beside them."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

CONV_LAYERS = {"Conv": nn.Conv2d, "Conv1d": nn.Conv1d, "Conv2d": nn.Conv2d, "Conv3d": nn.Conv3d}
NORM_LAYERS = {"BN": nn.BatchNorm2d, "BN1d": nn.BatchNorm1d, "BN2d": nn.BatchNorm2d, "GN": nn.GroupNorm,
               "LN": nn.LayerNorm, "IN": nn.InstanceNorm2d}
ACT_LAYERS = {"ReLU": nn.ReLU, "GELU": nn.GELU, "SiLU": nn.SiLU, "LeakyReLU": nn.LeakyReLU}


def build_conv_layer(cfg, *args, **kwargs):
    if cfg is None:
        cfg_ = dict(type="Conv2d")
    else:
        cfg_ = cfg.copy()
    layer_type = cfg_.pop("type")
    conv_layer = CONV_LAYERS[layer_type]
    return conv_layer(*args, **kwargs, **cfg_)


def build_norm_layer(cfg, num_features, postfix=""):
    cfg_ = cfg.copy()
    layer_type = cfg_.pop("type")
    norm_layer = NORM_LAYERS[layer_type]
    abbr = "gn" if layer_type == "GN" else "bn" if layer_type.startswith("BN") else "ln"
    name = abbr + str(postfix)
    requires_grad = cfg_.pop("requires_grad", True)
    cfg_.setdefault("eps", 1e-5)
    if layer_type != "GN":
        layer = norm_layer(num_features, **cfg_)
    else:
        layer = norm_layer(num_channels=num_features, **cfg_)
    for param in layer.parameters():
        param.requires_grad = requires_grad
    return name, layer


def build_activation_layer(cfg):
    cfg_ = cfg.copy()
    return ACT_LAYERS[cfg_.pop("type")](**cfg_)


class ConvModule(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, conv_cfg=None,
                 norm_cfg=None, act_cfg=dict(type="ReLU"), order=("conv", "norm", "act")):  # noqa: B006
        super().__init__()
        self.order = order
        self.with_norm = norm_cfg is not None
        self.with_activation = act_cfg is not None
        bias = not self.with_norm
        self.conv = build_conv_layer(conv_cfg, in_channels, out_channels, kernel_size, stride=stride,
                                     padding=padding, bias=bias)
        if self.with_norm:
            norm_channels = out_channels if order.index("norm") > order.index("conv") else in_channels
            self.norm_name, norm = build_norm_layer(norm_cfg, norm_channels)
            self.add_module(self.norm_name, norm)
        else:
            self.norm_name = None
        if self.with_activation:
            act_cfg_ = copy.deepcopy(act_cfg)
            if act_cfg_["type"] == "ReLU":
                act_cfg_.setdefault("inplace", True)
            self.activate = build_activation_layer(act_cfg_)

    @property
    def norm(self):
        if self.norm_name:
            return getattr(self, self.norm_name)
        return None

    def forward(self, x, activate=True, norm=True):
        for layer in self.order:
            if layer == "conv":
                x = self.conv(x)
            elif layer == "norm" and norm and self.with_norm:
                x = self.norm(x)
            elif layer == "act" and activate and self.with_activation:
                x = self.activate(x)
        return x


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, conv_cfg=None, norm_cfg=dict(type="BN")):  # noqa: B006
        super().__init__()
        self.norm1_name, norm1 = build_norm_layer(norm_cfg, planes, postfix=1)
        self.norm2_name, norm2 = build_norm_layer(norm_cfg, planes, postfix=2)
        self.norm3_name, norm3 = build_norm_layer(norm_cfg, planes * self.expansion, postfix=3)
        self.conv1 = build_conv_layer(conv_cfg, inplanes, planes, kernel_size=1, bias=False)
        self.add_module(self.norm1_name, norm1)
        self.conv2 = build_conv_layer(conv_cfg, planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.add_module(self.norm2_name, norm2)
        self.conv3 = build_conv_layer(conv_cfg, planes, planes * self.expansion, kernel_size=1, bias=False)
        self.add_module(self.norm3_name, norm3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    @property
    def norm1(self):
        return getattr(self, self.norm1_name)

    @property
    def norm2(self):
        return getattr(self, self.norm2_name)

    @property
    def norm3(self):
        return getattr(self, self.norm3_name)

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.norm1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.norm2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.norm3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResLayer(nn.Sequential):
    def __init__(self, block, inplanes, planes, num_blocks, stride=1, conv_cfg=None, norm_cfg=dict(type="BN")):  # noqa: B006
        downsample = None
        if stride != 1 or inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                build_conv_layer(conv_cfg, inplanes, planes * block.expansion, kernel_size=1, stride=stride,
                                 bias=False),
                build_norm_layer(norm_cfg, planes * block.expansion)[1],
            )
        layers = [block(inplanes, planes, stride, downsample, conv_cfg=conv_cfg, norm_cfg=norm_cfg)]
        inplanes = planes * block.expansion
        for _ in range(1, num_blocks):
            layers.append(block(inplanes, planes, conv_cfg=conv_cfg, norm_cfg=norm_cfg))
        super().__init__(*layers)


class PlainStem(nn.Module):
    """A deep stem written with torch modules directly (ResNet-D / mmdet ``deep_stem``)."""

    def __init__(self, in_channels=3, stem_channels=16):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, stem_channels // 2, kernel_size=3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(stem_channels // 2),
            nn.ReLU(inplace=True),
            nn.Conv2d(stem_channels // 2, stem_channels, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(stem_channels),
            nn.ReLU(inplace=True),
        )
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

    def forward(self, x):
        return self.maxpool(self.stem(x))


class FPN(nn.Module):
    def __init__(self, in_channels=(64, 128), out_channels=16):
        super().__init__()
        self.lateral_convs = nn.ModuleList()
        self.fpn_convs = nn.ModuleList()
        for c in in_channels:
            self.lateral_convs.append(ConvModule(c, out_channels, 1, act_cfg=None))
            self.fpn_convs.append(ConvModule(out_channels, out_channels, 3, padding=1,
                                             norm_cfg=dict(type="GN", num_groups=4), act_cfg=None))

    def forward(self, inputs):
        laterals = [lateral_conv(inputs[i]) for i, lateral_conv in enumerate(self.lateral_convs)]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], size=laterals[i - 1].shape[2:],
                                                              mode="nearest")
        return tuple(self.fpn_convs[i](laterals[i]) for i in range(len(laterals)))


class TinyDetector(nn.Module):
    """Stem, two ResLayers, an FPN and a shared head of ConvModules with BN."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.stem = PlainStem(3, 16)
        self.layer1 = ResLayer(Bottleneck, 16, 16, 2)
        self.layer2 = ResLayer(Bottleneck, 64, 32, 1, stride=2)
        self.neck = FPN((64, 128), 16)
        self.head = ConvModule(16, 16, 3, padding=1, norm_cfg=dict(type="BN", requires_grad=True))
        self.cls = nn.Conv2d(16, num_classes, 1)

    def forward(self, x):
        x = self.stem(x)
        c2 = self.layer1(x)
        c3 = self.layer2(c2)
        feats = self.neck((c2, c3))
        return torch.cat([self.cls(self.head(f)).flatten(2) for f in feats], dim=2)
