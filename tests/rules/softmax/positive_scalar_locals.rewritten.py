"""softmax over a positive dim of scores scaled by a local Python number: the rank of the scores
survives the product (the LDM/VAE AttnBlock, heads folded into the batch). A scale that is a local
tensor may broadcast to a higher rank: the dim is then not provably the last."""
# expect: softmax IntPowScale.forward
# expect: softmax MathSqrtScale.forward
# expect: softmax UnpackedPowScale.forward
# expect: softmax SizeScale.forward
# expect: softmax TensorScale.forward refused:dim-not-last
# expect: softmax ReboundScale.forward refused:dim-not-last
import math

import torch
import torch.nn.functional as F
from adopter.kernels import softmax
from torch import nn


class IntPowScale(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q = nn.Conv2d(c, c, 1)
        self.k = nn.Conv2d(c, c, 1)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)
        k = k.reshape(b, c, h * w)
        w_ = torch.bmm(q, k)
        w_ = w_ * (int(c) ** (-0.5))
        return softmax(w_, dim=2)


class MathSqrtScale(nn.Module):
    def forward(self, q, k):
        b, c, n = q.shape
        scores = torch.bmm(q.transpose(1, 2), k) / math.sqrt(c)
        return softmax(scores, dim=2)


class UnpackedPowScale(nn.Module):
    def forward(self, q, k):
        b, c, n = q.size()
        scores = torch.bmm(q.transpose(1, 2), k)
        scores = scores * c ** -0.5
        return softmax(scores, dim=2)


class SizeScale(nn.Module):
    def forward(self, q, k):
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(q.size(-1)))
        return softmax(scores, dim=2)


class TensorScale(nn.Module):
    def forward(self, q, k):
        scale = torch.ones(1, 1, 1, 1) * 0.5  # a rank-4 tensor: the product is rank 4
        scores = torch.bmm(q, k.transpose(1, 2)) * scale
        return F.softmax(scores, dim=2)


class ReboundScale(nn.Module):
    def forward(self, q, k, bias):
        b, c, n = q.shape
        if bias is not None:
            c = bias  # c may be a tensor here
        scores = torch.bmm(q.transpose(1, 2), k) * (c ** -0.5)
        return F.softmax(scores, dim=2)
