# Paper Fig. 3/5: DPT pre-activation residual layer, BatchNorm2d only under `if self.use_batch_norm`.
# expect: Conv_BatchNorm DPTPreActResidualLayer.forward
# expect: Conv_BatchNorm DPTPreActResidualLayer.forward
import torch
from adopter.kernels import conv_bn
from torch import nn


class DPTPreActResidualLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.use_batch_norm = config.use_batch_norm_in_fusion_residual
        use_bias_in_fusion_residual = (
            config.use_bias_in_fusion_residual
            if config.use_bias_in_fusion_residual is not None
            else not self.use_batch_norm
        )
        self.activation1 = nn.ReLU()
        self.convolution1 = nn.Conv2d(
            config.fusion_hidden_size, config.fusion_hidden_size, kernel_size=3, stride=1, padding=1,
            bias=use_bias_in_fusion_residual,
        )
        self.activation2 = nn.ReLU()
        self.convolution2 = nn.Conv2d(
            config.fusion_hidden_size, config.fusion_hidden_size, kernel_size=3, stride=1, padding=1,
            bias=use_bias_in_fusion_residual,
        )
        if self.use_batch_norm:
            self.batch_norm1 = nn.BatchNorm2d(config.fusion_hidden_size)
            self.batch_norm2 = nn.BatchNorm2d(config.fusion_hidden_size)

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        residual = hidden_state
        hidden_state = self.activation1(hidden_state)

        if self.use_batch_norm:
            hidden_state = conv_bn(self.convolution1, self.batch_norm1, hidden_state)
        else:
            hidden_state = self.convolution1(hidden_state)

        hidden_state = self.activation2(hidden_state)

        if self.use_batch_norm:
            hidden_state = conv_bn(self.convolution2, self.batch_norm2, hidden_state)
        else:
            hidden_state = self.convolution2(hidden_state)

        return hidden_state + residual
