# expect: softmax A.forward
# expect: softmax A.forward
# expect: softmax A.forward
# expect: softmax A.forward
# expect: softmax A.forward
# expect: softmax A.forward refused:dim-not-last
# expect: softmax B.forward
# expect: softmax helper
# expect: softmax Inline.forward
import torch
import torch.nn.functional as F
from adopter.kernels import Softmax, softmax as adopter_softmax
from torch import nn
from torch.nn.functional import softmax


class A(nn.Module):
    def forward(self, x):
        a = adopter_softmax(x, dim=-1)
        b = adopter_softmax(x, dim=-1)
        c = adopter_softmax(x, dim=-1, dtype=torch.float32)
        d = adopter_softmax(x, dim=-1)
        e = softmax(x, dim=1)  # refused: dim=1 of an input of unknown rank is not provably the last
        f = adopter_softmax(x.view(4, 8), dim=1)  # 2-D: dim=1 is the last
        return a + b + c + d + e + f


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = Softmax(dim=-1)

    def forward(self, x):
        return self.softmax(x)


def helper(scores):
    return adopter_softmax(scores.float(), dim=-1).type_as(scores)


class Inline(nn.Module):

    def forward(self, scores):
        return adopter_softmax(scores, dim=-1)
