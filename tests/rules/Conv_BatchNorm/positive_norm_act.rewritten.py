# BatchNorm2d subclasses applying their own activation (timm's BatchNormAct2d style), recognised by
# what their forward computes: matched as BatchNorm2d; conv_bn folds the batch norm and applies the
# module's own submodules after it. Not when the forward computes anything else.
# expect: Conv_BatchNorm ConvNormAct.forward
# expect: Conv_BatchNorm ConvNormAct.forward
import torch.nn.functional as F
from adopter.kernels import conv_bn
from torch import nn


class BatchNormAct(nn.BatchNorm2d):
    def __init__(self, num_features, act_layer=nn.ReLU, drop_layer=None):
        super().__init__(num_features)
        self.drop = drop_layer() if drop_layer is not None else nn.Identity()
        self.act = act_layer()

    def forward(self, x):
        x = super().forward(x)
        x = self.drop(x)
        return self.act(x)


class WrittenOutNormAct(nn.BatchNorm2d):
    def __init__(self, num_features):
        super().__init__(num_features)
        self.act = nn.SiLU()

    def forward(self, x):
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         use_batch_stats, self.momentum, self.eps)
        return self.act(x)


class ScaledNorm(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 0.5


class ConvNormAct(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = WrittenOutNormAct(c)
        self.conv3 = nn.Conv2d(c, c, 1)
        self.bn3 = ScaledNorm(c)

    def forward(self, x):
        x = conv_bn(self.conv1, self.bn1, x)
        x = conv_bn(self.conv2, self.bn2, x)
        return self.bn3(self.conv3(x))
