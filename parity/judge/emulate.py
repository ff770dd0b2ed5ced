"""Tensor parallelism as the reference emulates it, in one process.

A colwise layer computes each rank's slice of output features and concatenates them
(exact: each element is one rank's dot product); its input gradient is the sum of the
ranks' partial input gradients, each rounded to the compute dtype -- autograd adds the
chunks' contributions in that dtype, as TP's all-reduce does. A rowwise layer sums the
ranks' partial outputs, each rounded to the compute dtype, in rank order: TP's forward
all-reduce. Only bias-free ``nn.Linear`` layers are planned for TP (a bias would be added
once after the reduction).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from parity.model.plan import PrecisionPlan


def _colwise(tp: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, w) for w in self.weight.chunk(tp, dim=0)], dim=-1)
    return forward


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` left to right, in the parts' dtype: a collective's sum in
    rank order, each addition rounded."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _rowwise(tp: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ordered_sum([F.linear(xi, wi) for xi, wi in zip(x.chunk(tp, dim=-1), self.weight.chunk(tp, dim=1))])
    return forward


class _Restore:
    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def emulate_tensor_parallel(model: nn.Module, plan: PrecisionPlan, tp: int) -> list[_Restore]:
    """Replace the forward of every layer the plan gives a TP owner; returns handles whose
    ``remove()`` restores it. ``tp`` 1: nothing to emulate."""
    if tp <= 1:
        return []
    modules = dict(model.named_modules())
    handles = []
    for t in plan.params:
        if not t.parallel.startswith("tp-"):
            continue
        mod = modules[t.fqn.rpartition(".")[0]]
        if getattr(mod, "bias", None) is not None:
            raise ValueError(f"{t.fqn}: tensor-parallel emulation covers bias-free linear layers only")
        make = _colwise if t.parallel == "tp-colwise" else _rowwise
        mod.forward = types.MethodType(make(tp), mod)
        handles.append(_Restore(mod))
    return handles
