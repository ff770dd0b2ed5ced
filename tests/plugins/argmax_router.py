"""A model whose router weight only picks an expert through ``argmax``: no gradient reaches it,
in the reference as in any sharded run (a property of the model, issue 19 §5); and a gain scaled
by zero, whose gradient is exact zeros at every step (which would pass any allowance)."""

import torch
import torch.nn.functional as F
from torch import nn

from parity.model import Batch, Fixture

DIM = 16


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Parameter(torch.randn(DIM, 2))
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, x):
        pick = (x.float() @ self.router.float()).argmax(-1, keepdim=True)  # not differentiable
        mixed = torch.where(pick == 0, self.experts[0](x), self.experts[1](x))
        return self.head(mixed * (self.gain * 0 + 1))  # a factor of 0: the gain's gradient is all zeros


def parity_model() -> Fixture:
    return Fixture(name="argmax_router", description="a router weight behind argmax (never differentiated)",
                   build=Routed, unit_roots=("",), blocks=(),
                   make_batch=lambda g: Batch(inputs=(torch.randn(4, DIM, generator=g),),
                                              target=torch.randn(4, DIM, generator=g)),
                   loss=lambda out, target: F.mse_loss(out.float(), target.float()))
