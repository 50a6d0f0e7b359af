"""detectron2-like: a ``Conv2d`` wrapper subclass taking ``norm`` and ``activation`` and applying
them in its own ``forward``, ``FrozenBatchNorm2d``, ``get_norm`` by name, ``BasicStem`` and
``BottleneckBlock`` with ``F.relu_``, a ``ShapeSpec``-free FPN, a box head with ``fc`` layers and
a ``FastRCNNOutputLayers``-like predictor whose inference softmax runs in eval mode."""
import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.Module):
    def __init__(self, num_features, eps=1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        scale = scale.reshape(1, -1, 1, 1)
        bias = bias.reshape(1, -1, 1, 1)
        out_dtype = x.dtype
        return x * scale.to(out_dtype) + bias.to(out_dtype)


def get_norm(norm, out_channels):
    if norm is None:
        return None
    if isinstance(norm, str):
        if len(norm) == 0:
            return None
        norm = {
            "BN": nn.BatchNorm2d,
            "FrozenBN": FrozenBatchNorm2d,
            "GN": lambda channels: nn.GroupNorm(4, channels),
        }[norm]
    return norm(out_channels)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` with ``norm`` and ``activation`` applied in its own forward."""

    def __init__(self, *args, **kwargs):
        norm = kwargs.pop("norm", None)
        activation = kwargs.pop("activation", None)
        super().__init__(*args, **kwargs)
        self.norm = norm
        self.activation = activation

    def forward(self, x):
        x = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if self.norm is not None:
            x = self.norm(x)
        if self.activation is not None:
            x = self.activation(x)
        return x


class BasicStem(nn.Module):
    def __init__(self, in_channels=3, out_channels=16, norm="BN"):
        super().__init__()
        self.conv1 = Conv2d(in_channels, out_channels, kernel_size=7, stride=2, padding=3, bias=False,
                            norm=get_norm(norm, out_channels))

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu_(x)
        x = F.max_pool2d(x, kernel_size=3, stride=2, padding=1)
        return x


class BottleneckBlock(nn.Module):
    def __init__(self, in_channels, out_channels, bottleneck_channels, stride=1, norm="BN"):
        super().__init__()
        if in_channels != out_channels:
            self.shortcut = Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False,
                                   norm=get_norm(norm, out_channels))
        else:
            self.shortcut = None
        self.conv1 = Conv2d(in_channels, bottleneck_channels, kernel_size=1, stride=stride, bias=False,
                            norm=get_norm(norm, bottleneck_channels))
        self.conv2 = Conv2d(bottleneck_channels, bottleneck_channels, kernel_size=3, padding=1, bias=False,
                            norm=get_norm(norm, bottleneck_channels))
        self.conv3 = Conv2d(bottleneck_channels, out_channels, kernel_size=1, bias=False,
                            norm=get_norm(norm, out_channels))

    def forward(self, x):
        out = self.conv1(x)
        out = F.relu_(out)
        out = self.conv2(out)
        out = F.relu_(out)
        out = self.conv3(out)
        if self.shortcut is not None:
            shortcut = self.shortcut(x)
        else:
            shortcut = x
        out += shortcut
        out = F.relu_(out)
        return out


class PlainBottleneck(nn.Module):
    """The torchvision spelling beside it: plain Conv2d and BatchNorm2d attributes."""

    def __init__(self, channels, bottleneck_channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, bottleneck_channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(bottleneck_channels)
        self.conv2 = nn.Conv2d(bottleneck_channels, bottleneck_channels, 3, padding=1, bias=False)
        self.bn2 = FrozenBatchNorm2d(bottleneck_channels)
        self.conv3 = nn.Conv2d(bottleneck_channels, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + x, inplace=True)


class FastRCNNConvFCHead(nn.Module):
    def __init__(self, in_channels=16, resolution=4, fc_dim=32, num_fc=2):
        super().__init__()
        self.conv_norm_relus = []
        conv = Conv2d(in_channels, in_channels, kernel_size=3, padding=1, bias=False,
                      norm=get_norm("GN", in_channels), activation=nn.ReLU())
        self.add_module("conv1", conv)
        self.conv_norm_relus.append(conv)
        self.fcs = []
        in_dim = in_channels * resolution * resolution
        for k in range(num_fc):
            fc = nn.Linear(in_dim, fc_dim)
            self.add_module("fc{}".format(k + 1), fc)
            self.fcs.append(fc)
            in_dim = fc_dim

    def forward(self, x):
        for layer in self.conv_norm_relus:
            x = layer(x)
        x = torch.flatten(x, start_dim=1)
        for layer in self.fcs:
            x = F.relu(layer(x))
        return x


class FastRCNNOutputLayers(nn.Module):
    def __init__(self, input_size=32, num_classes=4):
        super().__init__()
        self.cls_score = nn.Linear(input_size, num_classes + 1)
        self.bbox_pred = nn.Linear(input_size, num_classes * 4)

    def forward(self, x):
        scores = self.cls_score(x)
        proposal_deltas = self.bbox_pred(x)
        if not self.training:
            return self.predict_probs(scores), proposal_deltas
        return scores, proposal_deltas

    def predict_probs(self, scores):
        probs = F.softmax(scores, dim=-1)
        return probs

    def losses(self, scores, gt_classes):
        return F.cross_entropy(scores, gt_classes, reduction="mean")


class TinyRCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = BasicStem(3, 16)
        self.res2 = nn.Sequential(BottleneckBlock(16, 32, 8), BottleneckBlock(32, 32, 8, norm="FrozenBN"),
                                  PlainBottleneck(32, 8))
        self.reduce = Conv2d(32, 16, kernel_size=1)
        self.box_head = FastRCNNConvFCHead(16, 4)
        self.predictor = FastRCNNOutputLayers(32, 4)

    def forward(self, x):
        x = self.res2(self.stem(x))
        x = F.adaptive_avg_pool2d(self.reduce(x), 4)
        return self.predictor(self.box_head(x))[0]
