"""A user's own model, outside parity: a small transformer-like block stack.

What parity needs to know about it is returned by :func:`parity_model` -- nothing here is
registered anywhere; run it with ``--model examples/own_model/my_model.py:parity_model``.

Precision contract, as the model class states it:
- ``norm.weight`` in every RMSNorm computes in FP32 (strict-FP32 name, as Hugging Face
  models declare with ``_keep_in_fp32_modules_strict``);
- each block's ``DecayGate`` holder owns ``A_log`` and ``dt_bias`` and computes the decay
  gate in FP32 (also strict names);
- everything else is an FP32 master computing in BF16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parity.model import Batch, Fixture

DIM, HEADS, SEQ, BATCH = 48, 4, 6, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight.float() * h).to(x.dtype)


class DecayGate(nn.Module):
    """Holds the decay parameters; the gate is computed in FP32 whatever the input dtype."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(1.0, 8.0)))
        self.dt_bias = nn.Parameter(torch.zeros(heads))

    def forward(self, g):
        decay = -torch.exp(self.A_log.float()) * F.softplus(g.float() + self.dt_bias.float())
        return torch.exp(torch.cumsum(decay, dim=1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.gate_proj = nn.Linear(DIM, HEADS, bias=False)
        self.gate = DecayGate(HEADS)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        decay = self.gate(self.gate_proj(h))  # FP32, [B, T, H]
        mix = (q * k * v).view(b, t, HEADS, DIM // HEADS).float() * decay.unsqueeze(-1)
        x = x + self.out(mix.view(b, t, DIM).to(x.dtype))
        return x + self.mlp(x)


class MyModel(nn.Module):
    _keep_in_fp32_modules_strict = ["norm_weight", "A_log", "dt_bias"]

    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.final_norm = RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.proj(self.final_norm(x))


def _batch(gen: torch.Generator) -> Batch:
    return Batch(inputs=(torch.randn(BATCH, SEQ, DIM, generator=gen),),
                 target=torch.randn(BATCH, SEQ, DIM, generator=gen))


def _loss(out, target):
    return F.mse_loss(out.float(), target.float())


def parity_model() -> Fixture:
    """How the training recipe hands MyModel to FSDP: each layer, then the root."""
    return Fixture(
        name="my_model",
        description="a user's block stack: FP32 RMSNorm weights and an FP32 decay-gate holder (strict names)",
        build=MyModel,
        unit_roots=("layers.0", "layers.1", ""),
        blocks=("layers.0", "layers.1"),
        make_batch=_batch,
        loss=_loss,
    )
