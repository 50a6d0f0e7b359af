# Nested call, residual on the left, module aliases via `import torch.nn as nn`.
# expect: Dropout_LayerNorm Projection.forward
import torch.nn as tnn
from adopter.kernels import dropout_add_layer_norm


class Projection(tnn.Module):
    def __init__(self, hidden, p):
        super().__init__()
        self.layer_norm = tnn.LayerNorm(hidden)
        self.drop = tnn.Dropout(p=p)

    def forward(self, x, residual):
        return dropout_add_layer_norm(self.drop, self.layer_norm, x, residual)
