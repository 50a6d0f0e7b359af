# expect: Conv_BatchNorm ConvLayer.forward
# expect: Conv_BatchNorm SequentialBlock.__init__
# expect: Conv_BatchNorm SequentialBlock.__init__
from adopter.kernels import GuardedSequential, conv_bn
from torch import nn


class ConvLayer(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1):
        super().__init__()
        self.convolution = nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size, stride=stride,
                                     padding=kernel_size // 2, bias=False)
        self.normalization = nn.BatchNorm2d(out_channels)
        self.activation = nn.ReLU()

    def forward(self, input):
        hidden_state = conv_bn(self.convolution, self.normalization, input, self.activation)
        return hidden_state


class SequentialBlock(nn.Module):
    # Layers inside nn.Sequential: each Conv2d -> BatchNorm2d pair is a match where it is built.
    def __init__(self, c):
        super().__init__()
        self.block = GuardedSequential(
            nn.Conv2d(c, c, 1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        )

    def forward(self, x):
        return self.block(x)
