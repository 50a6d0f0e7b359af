# expect: Linear_BatchNorm Head.forward
# expect: Linear_BatchNorm MLPLayerWithBN.forward
from adopter.kernels import linear_bn
from torch import nn


class Head(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.batchnorm = nn.BatchNorm1d(d_out)
        self.act = nn.ReLU()

    def forward(self, x):
        x = linear_bn(self.linear, self.batchnorm, x)
        return self.act(x)


class MLPLayerWithBN(nn.Module):
    # LeViT: batch norm over the flattened (batch * tokens, features) view.
    def __init__(self, input_dim, output_dim, bn_weight_init=1):
        super().__init__()
        self.linear = nn.Linear(in_features=input_dim, out_features=output_dim, bias=False)
        self.batch_norm = nn.BatchNorm1d(output_dim)

    def forward(self, hidden_state):
        hidden_state = self.linear(hidden_state)
        hidden_state = self.batch_norm(hidden_state.flatten(0, 1)).reshape_as(hidden_state)
        return hidden_state
