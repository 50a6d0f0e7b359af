"""GRU encoder-decoder with additive (Bahdanau) or multiplicative (Luong) attention, in the style of
the classic PyTorch seq2seq tutorials: time-major tensors, softmax over the source positions of a
2-D or 3-D score tensor whose rank the code fixes, a time-major attention pooling, greedy decoding
in forward and sampling in generate."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class TimeMajorAttentionPool(nn.Module):
    """Pools (S, B, H) encoder states into (B, H); scores (S, B, 1) normalised over dim 0."""

    def __init__(self, hid_dim):
        super().__init__()
        self.proj = nn.Linear(hid_dim, hid_dim)
        self.score = nn.Linear(hid_dim, 1, bias=False)

    def forward(self, encoder_outputs):
        scores = self.score(torch.tanh(self.proj(encoder_outputs)))
        weights = F.softmax(scores, dim=0)
        return (weights * encoder_outputs).sum(0)


class Encoder(nn.Module):
    def __init__(self, input_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout):
        super().__init__()
        self.embedding = nn.Embedding(input_dim, emb_dim)
        self.rnn = nn.GRU(emb_dim, enc_hid_dim, bidirectional=True)
        self.pool = TimeMajorAttentionPool(enc_hid_dim * 2)
        self.fc = nn.Linear(enc_hid_dim * 2, dec_hid_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src):
        embedded = self.dropout(self.embedding(src))
        outputs, _ = self.rnn(embedded)
        hidden = torch.tanh(self.fc(self.pool(outputs)))
        return outputs, hidden


class BahdanauAttention(nn.Module):
    def __init__(self, enc_hid_dim, dec_hid_dim):
        super().__init__()
        self.attn = nn.Linear(enc_hid_dim * 2 + dec_hid_dim, dec_hid_dim)
        self.v = nn.Linear(dec_hid_dim, 1, bias=False)

    def forward(self, hidden, encoder_outputs):
        src_len, batch_size = encoder_outputs.shape[0], encoder_outputs.shape[1]
        hidden = hidden.unsqueeze(1).repeat(1, src_len, 1)
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        attention = self.v(energy).view(batch_size, src_len)
        return F.softmax(attention, dim=1)


class LuongAttention(nn.Module):
    """'general' score: (B, 1, H) bmm (B, H, S) -> (B, 1, S), normalised over the source positions."""

    def __init__(self, enc_dim, dec_dim):
        super().__init__()
        self.W = nn.Linear(enc_dim, dec_dim, bias=False)

    def forward(self, hidden, encoder_outputs):
        batch_size = hidden.shape[0]
        keys = self.W(encoder_outputs).permute(1, 2, 0)
        query = hidden.view(batch_size, 1, -1)
        scores = torch.bmm(query, keys)
        return torch.softmax(scores, dim=2).squeeze(1)


class AttnDecoder(nn.Module):
    def __init__(self, output_dim, emb_dim, enc_hid_dim, dec_hid_dim, dropout, attention):
        super().__init__()
        self.output_dim = output_dim
        self.attention = attention
        self.embedding = nn.Embedding(output_dim, emb_dim)
        self.rnn = nn.GRU(enc_hid_dim * 2 + emb_dim, dec_hid_dim)
        self.fc_out = nn.Linear(enc_hid_dim * 2 + dec_hid_dim + emb_dim, output_dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input, hidden, encoder_outputs):
        input = input.unsqueeze(0)
        embedded = self.dropout(self.embedding(input))
        a = self.attention(hidden, encoder_outputs).unsqueeze(1)
        encoder_outputs = encoder_outputs.permute(1, 0, 2)
        weighted = torch.bmm(a, encoder_outputs).permute(1, 0, 2)
        rnn_input = torch.cat((embedded, weighted), dim=2)
        output, hidden = self.rnn(rnn_input, hidden.unsqueeze(0))
        embedded, output, weighted = embedded.squeeze(0), output.squeeze(0), weighted.squeeze(0)
        prediction = self.fc_out(torch.cat((output, weighted, embedded), dim=1))
        return prediction, hidden.squeeze(0)


class Seq2Seq(nn.Module):
    def __init__(self, vocab=40, emb=16, enc_hid=16, dec_hid=16, dropout=0.1, attention="bahdanau", max_len=5):
        super().__init__()
        self.encoder = Encoder(vocab, emb, enc_hid, dec_hid, dropout)
        if attention == "bahdanau":
            attn = BahdanauAttention(enc_hid, dec_hid)
        else:
            attn = LuongAttention(enc_hid * 2, dec_hid)
        self.decoder = AttnDecoder(vocab, emb, enc_hid, dec_hid, dropout, attn)
        self.max_len = max_len
        self.out_dropout = nn.Dropout(dropout)
        self.out_norm = nn.LayerNorm(vocab)

    def forward(self, src):
        src = src.transpose(0, 1)
        encoder_outputs, hidden = self.encoder(src)
        batch_size = src.shape[1]
        input = torch.ones(batch_size, dtype=torch.long, device=src.device)
        outputs = []
        for _ in range(self.max_len):
            output, hidden = self.decoder(input, hidden, encoder_outputs)
            outputs.append(output)
            input = output.argmax(1)
        logits = torch.stack(outputs, dim=1)
        return self.out_norm(self.out_dropout(logits))

    @torch.no_grad()
    def generate(self, src, max_len=10, temperature=1.0):
        src = src.transpose(0, 1)
        encoder_outputs, hidden = self.encoder(src)
        input = torch.ones(src.shape[1], dtype=torch.long, device=src.device)
        tokens = []
        for _ in range(max_len):
            output, hidden = self.decoder(input, hidden, encoder_outputs)
            probs = F.softmax(output / temperature, dim=-1)
            input = torch.multinomial(probs, 1).squeeze(1)
            tokens.append(input)
        return torch.stack(tokens, dim=1)


def seq2seq_luong():
    return Seq2Seq(attention="luong")
