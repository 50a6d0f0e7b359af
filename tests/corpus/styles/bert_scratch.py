"""BERT encoder written from scratch for a research project (post-norm, single-class layers).

Not the HuggingFace layout: one ``BertLayer`` holds the output projection, dropouts and both
LayerNorms; the feed-forward uses functional GeLU and functional dropout.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class BertSelfAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, attn_dropout=0.1):
        super().__init__()
        assert hidden % heads == 0
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(attn_dropout)

    def transpose_for_scores(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))

        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
        probs = self.dropout(probs)

        context = torch.matmul(probs, v)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


class BertLayer(nn.Module):
    def __init__(self, hidden=32, heads=4, intermediate=128, p=0.1):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads, p)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(p)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)
        self.p = p

    def forward(self, x, attention_mask=None):
        h = self.attention(x, attention_mask)
        x = self.norm1(x + self.dropout(self.proj(h)))
        h = F.gelu(self.fc1(x))
        h = self.fc2(h)
        h = F.dropout(h, p=self.p, training=self.training)
        x = self.norm2(x + h)
        return x


class BertEmbeddings(nn.Module):
    def __init__(self, vocab=100, hidden=32, max_len=64, type_vocab=2, p=0.1):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_len, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(p)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        emb = self.word(input_ids) + self.position(pos) + self.token_type(torch.zeros_like(input_ids))
        emb = self.LayerNorm(emb)
        emb = self.dropout(emb)
        return emb


class MaskedLMHead(nn.Module):
    def __init__(self, hidden=32, vocab=100):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x):
        h = self.act(self.dense(x))
        h = self.norm(h)
        return self.decoder(h)


class BertForMaskedLM(nn.Module):
    def __init__(self, vocab=100, hidden=32, layers=2, heads=4):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, hidden)
        self.layers = nn.ModuleList([BertLayer(hidden, heads, 4 * hidden) for _ in range(layers)])
        self.head = MaskedLMHead(hidden, vocab)

    def forward(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        if attention_mask is not None:
            attention_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.head(x)
