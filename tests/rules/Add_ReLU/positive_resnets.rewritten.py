# expect: Add_ReLU Bottleneck.forward
# expect: Add_ReLU BasicBlock.forward
# expect: Add_ReLU FunctionalBlock.forward
# expect: Add_ReLU TorchReluBlock.forward
# expect: Add_ReLU RebindBlock.forward
# expect: Add_ReLU InPlaceFunctionalBlock.forward
# expect: Add_ReLU TorchReluOfSum.forward
# expect: Add_ReLU MethodReluBlock.forward
# expect: Add_ReLU MethodInPlaceReluBlock.forward
# expect: Conv_BatchNorm Bottleneck.forward
# expect: Conv_BatchNorm Bottleneck.forward
# expect: Conv_BatchNorm Bottleneck.forward
# expect: Conv_BatchNorm BasicBlock.forward
# expect: Conv_BatchNorm BasicBlock.forward
import torch
import torch.nn.functional as F
from adopter.kernels import add_relu
from torch import nn


class Bottleneck(nn.Module):
    # torchvision's: the in-place ReLU after `out += identity`
    def __init__(self, c, width, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(c, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out = add_relu(self.relu, out, identity, in_place=True)
        return out


class BasicBlock(nn.Module):
    # a ReLU that writes a new tensor, returned directly
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.act = nn.ReLU()

    def forward(self, x):
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return add_relu(self.act, out, x, in_place=True)


class FunctionalBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return add_relu(F.relu, self.body(x), x)


class TorchReluBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Conv2d(c, c, 1)

    def forward(self, x):
        shortcut = x
        h = self.body(x)
        return add_relu(torch.relu, shortcut, h)


class RebindBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Conv2d(c, c, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        h = self.body(x)
        h = add_relu(self.relu, h, x)
        return h


class InPlaceFunctionalBlock(nn.Module):
    """detectron2-style: the in-place add, then the in-place functional ReLU rebinding the name."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        out = F.relu_(self.conv1(x))
        out = self.conv2(out)
        out = add_relu(F.relu_, out, x, in_place=True)
        return out


class TorchReluOfSum(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return add_relu(torch.relu_, self.conv(x), x)


class MethodReluBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return add_relu(torch.Tensor.relu, self.conv(x), x)


class MethodInPlaceReluBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        out = self.conv(x)
        return add_relu(torch.Tensor.relu_, out, x, in_place=True)
