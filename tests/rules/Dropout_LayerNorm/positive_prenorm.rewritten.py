# Pre-norm blocks: the dropout + residual sum is also kept as the next residual.
# expect: Dropout_LayerNorm ResearchBlock.forward
# expect: Dropout_LayerNorm ViTStyleLayer.forward
# expect: Dropout_LayerNorm StableLayerNormStyle.forward
# expect: Dropout_LayerNorm FunctionalPreNorm.forward
# expect: Dropout_LayerNorm SumReturnedToo.forward
import torch
import torch.nn.functional as F
from adopter.kernels import dropout_add_layer_norm
from torch import nn


class ResearchBlock(nn.Module):
    # timm/nanoGPT style: `x = x + drop(f(norm(x)))` twice; the first sum feeds norm2 and the second add.
    def __init__(self, dim, p):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.drop1 = nn.Dropout(p)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)
        self.drop2 = nn.Dropout(p)

    def forward(self, x):
        x, norm2_out = dropout_add_layer_norm(
            self.drop1, self.norm2, self.attn(self.norm1(x)), x, prenorm=True
        )
        x = x + self.drop2(self.ff(norm2_out))
        return x


class ViTStyleLayer(nn.Module):
    # ViTLayer: the sum is kept as `residual` for the second add.
    def __init__(self, hidden):
        super().__init__()
        self.layernorm_before = nn.LayerNorm(hidden)
        self.layernorm_after = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(0.1)
        self.attention = nn.Linear(hidden, hidden)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.layernorm_before(hidden_states)
        hidden_states = self.attention(hidden_states)
        hidden_states, layernorm_after_out = dropout_add_layer_norm(
            self.dropout, self.layernorm_after, hidden_states, residual, prenorm=True
        )

        residual = hidden_states
        hidden_states = layernorm_after_out
        hidden_states = self.mlp(hidden_states)
        return hidden_states + residual


class StableLayerNormStyle(nn.Module):
    # Wav2Vec2EncoderLayerStableLayerNorm: the norm call nested in the next residual add.
    def __init__(self, hidden):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.final_layer_norm = nn.LayerNorm(hidden)
        self.feed_forward = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attn_output):
        attn_residual = hidden_states
        hidden_states, final_layer_norm_out = dropout_add_layer_norm(
            self.dropout, self.final_layer_norm, attn_output, attn_residual, prenorm=True
        )
        hidden_states = hidden_states + self.feed_forward(final_layer_norm_out)
        return hidden_states


class FunctionalPreNorm(nn.Module):
    # Whisper encoder layer: functional dropout, pre-norm.
    def __init__(self, hidden, dropout):
        super().__init__()
        self.dropout = dropout
        self.self_attn = nn.Linear(hidden, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states, final_layer_norm_out = dropout_add_layer_norm(
            F.dropout,
            self.final_layer_norm,
            hidden_states,
            residual,
            p=self.dropout,
            training=self.training,
            prenorm=True,
        )

        residual = hidden_states
        hidden_states = final_layer_norm_out
        hidden_states = self.fc(hidden_states)
        return residual + hidden_states


class SumReturnedToo(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, residual):
        s, norm_out = dropout_add_layer_norm(self.dropout, self.norm, x, residual, prenorm=True)
        kept = s
        return norm_out, kept
