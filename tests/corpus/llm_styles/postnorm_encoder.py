"""From-scratch post-norm Transformer encoders (written for the llm_styles corpus, plain torch).

A BERT-style self-attention with separate query / key / value Linears and an eager core, a
post-norm encoder layer written inline (dropout, residual add and LayerNorm in one forward), a
layer in the style of torch.nn.TransformerEncoderLayer (`norm_first` branches, `_sa_block` /
`_ff_block` returning the dropout output), a masked-LM head whose loss goes through a bound
nn.CrossEntropyLoss, and a sequence classifier with a cross-entropy on its pooled logits.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class ScratchBertSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, dropout=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        q = self.split_heads(self.query(hidden_states))
        k = self.split_heads(self.key(hidden_states))
        v = self.split_heads(self.value(hidden_states))

        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        probs = self.dropout(probs)
        context = torch.matmul(probs, v)

        b, _, t, _ = context.shape
        return context.permute(0, 2, 1, 3).reshape(b, t, self.num_heads * self.head_dim)


class PostNormEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1, activation=nn.GELU):
        super().__init__()
        self.attention = ScratchBertSelfAttention(d_model, nhead, dropout)
        self.attn_out = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.attn_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, dim_feedforward)
        self.act = activation()
        self.fc2 = nn.Linear(dim_feedforward, d_model)
        self.ffn_dropout = nn.Dropout(dropout)
        self.ffn_norm = nn.LayerNorm(d_model)

    def forward(self, x, attention_mask=None):
        attn = self.attn_out(self.attention(x, attention_mask))
        x = self.attn_norm(x + self.attn_dropout(attn))
        h = self.fc2(self.act(self.fc1(x)))
        h = self.ffn_dropout(h)
        x = self.ffn_norm(h + x)
        return x


class TorchStyleEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=128, dropout=0.1, layer_norm_eps=1e-5, norm_first=False):
        super().__init__()
        self.self_attn = ScratchBertSelfAttention(d_model, nhead, dropout)
        self.out_proj = nn.Linear(d_model, d_model)
        # Implementation of Feedforward model
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)

        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = nn.GELU()

    def forward(self, src, src_mask: Optional[torch.Tensor] = None):
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask))
            x = self.norm2(x + self._ff_block(x))
        return x

    # self-attention block
    def _sa_block(self, x, attn_mask):
        x = self.out_proj(self.self_attn(x, attn_mask))
        return self.dropout1(x)

    # feed forward block
    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class Embeddings(nn.Module):
    def __init__(self, vocab_size, d_model, max_len, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)[None]
        return self.dropout(self.norm(x))


class Encoder(nn.Module):
    def __init__(self, vocab_size=120, d_model=32, nhead=4, dim_feedforward=64, num_layers=2, max_len=32,
                 dropout=0.1, torch_style=False):
        super().__init__()
        self.embeddings = Embeddings(vocab_size, d_model, max_len, dropout)
        if torch_style:
            layers = [TorchStyleEncoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_layers)]
        else:
            layers = [PostNormEncoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_layers)]
        self.layers = nn.ModuleList(layers)

    def forward(self, input_ids, padding_mask=None):
        x = self.embeddings(input_ids)
        attention_mask = None
        if padding_mask is not None:
            attention_mask = (1.0 - padding_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x


class EncoderForMaskedLM(nn.Module):
    def __init__(self, vocab_size=120, d_model=32, torch_style=False):
        super().__init__()
        self.vocab_size = vocab_size
        self.encoder = Encoder(vocab_size=vocab_size, d_model=d_model, torch_style=torch_style)
        self.transform = nn.Linear(d_model, d_model)
        self.transform_norm = nn.LayerNorm(d_model)
        self.decoder = nn.Linear(d_model, vocab_size)
        self.loss_fct = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, input_ids, labels=None):
        hidden = self.encoder(input_ids)
        hidden = self.transform_norm(F.gelu(self.transform(hidden)))
        prediction_scores = self.decoder(hidden)
        masked_lm_loss = None
        if labels is not None:
            masked_lm_loss = self.loss_fct(prediction_scores.view(-1, self.vocab_size), labels.view(-1))
        return prediction_scores, masked_lm_loss


class EncoderForSequenceClassification(nn.Module):
    def __init__(self, vocab_size=120, d_model=32, num_labels=3):
        super().__init__()
        self.encoder = Encoder(vocab_size=vocab_size, d_model=d_model, torch_style=True)
        self.pooler = nn.Linear(d_model, d_model)
        self.classifier = nn.Linear(d_model, num_labels)
        self.num_labels = num_labels

    def forward(self, input_ids, labels=None):
        hidden = self.encoder(input_ids)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return logits, loss


def torch_style_mlm():
    return EncoderForMaskedLM(torch_style=True)
