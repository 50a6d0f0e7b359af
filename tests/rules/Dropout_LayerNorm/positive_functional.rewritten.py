# Functional dropout (Bart/Whisper/research style): F.dropout with any spelling of p/training.
# expect: Dropout_LayerNorm BartStyleLayer.forward
# expect: Dropout_LayerNorm BartStyleLayer.forward
# expect: Dropout_LayerNorm PositionalArguments.forward
# expect: Dropout_LayerNorm DefaultTraining.forward
# expect: Dropout_LayerNorm NestedResidualLeft.forward
import torch
import torch.nn.functional as F
from adopter.kernels import dropout_add_layer_norm
from torch import nn


class BartStyleLayer(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.dropout = dropout  # a float, not a module
        self.self_attn = nn.Linear(hidden, hidden)
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states)
        hidden_states = dropout_add_layer_norm(
            nn.functional.dropout,
            self.self_attn_layer_norm,
            hidden_states,
            residual,
            p=self.dropout,
            training=self.training,
        )

        residual = hidden_states
        hidden_states = self.fc(hidden_states)
        hidden_states = dropout_add_layer_norm(
            torch.nn.functional.dropout,
            self.final_layer_norm,
            hidden_states,
            residual,
            p=self.dropout,
            training=self.training,
        )
        return hidden_states


class PositionalArguments(nn.Module):
    def __init__(self, hidden, p):
        super().__init__()
        self.p = p
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-6)

    def forward(self, x, residual):
        return dropout_add_layer_norm(F.dropout, self.norm, self.proj(x), residual, self.p, self.training)


class DefaultTraining(nn.Module):
    # F.dropout(x, p) drops in eval mode too (training defaults to True): kept as written.
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, residual):
        return dropout_add_layer_norm(F.dropout, self.norm, x, residual, 0.25)


class NestedResidualLeft(nn.Module):
    def __init__(self, hidden, p):
        super().__init__()
        self.p = p
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, residual):
        return dropout_add_layer_norm(F.dropout, self.norm, x, residual, p=self.p, training=self.training)
