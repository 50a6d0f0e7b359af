# nn.Conv2d subclasses defined in the file (EfficientNet's depthwise conv): matched as Conv2d when
# they define nothing but __init__ (forward inherited); not when they override forward.
# expect: Conv_BatchNorm DepthwiseLayer.forward
# expect: Conv_BatchNorm DepthwiseLayer.forward
from adopter.kernels import conv_bn
from torch import nn


class DepthwiseConv2d(nn.Conv2d):
    def __init__(self, in_channels, depth_multiplier=1, kernel_size=3, stride=1, padding=0, bias=True):
        out_channels = in_channels * depth_multiplier
        super().__init__(
            in_channels=in_channels,
            out_channels=out_channels,
            kernel_size=kernel_size,
            stride=stride,
            padding=padding,
            groups=in_channels,
            bias=bias,
        )


class StillDepthwise(DepthwiseConv2d):
    """Through a same-file base: still Conv2d's forward."""


class SamePaddingConv2d(nn.Conv2d):
    def forward(self, x):
        return super().forward(nn.functional.pad(x, (1, 1, 1, 1)))


class DepthwiseLayer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.depthwise_conv = DepthwiseConv2d(dim, kernel_size=3, padding=1, bias=False)
        self.depthwise_norm = nn.BatchNorm2d(dim)
        self.deeper_conv = StillDepthwise(dim)
        self.deeper_norm = nn.BatchNorm2d(dim)
        self.padded_conv = SamePaddingConv2d(dim, dim, 3)
        self.padded_norm = nn.BatchNorm2d(dim)

    def forward(self, x):
        x = conv_bn(self.depthwise_conv, self.depthwise_norm, x)
        y = conv_bn(self.deeper_conv, self.deeper_norm, x)
        z = self.padded_conv(x)
        z = self.padded_norm(z)
        return x + y + z
