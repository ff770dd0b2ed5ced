"""Tensor parallelism as the reference emulates it, in one process; the order and the
divisions of FSDP's own reductions (:func:`ordered_sum`, :func:`shard_group_divisor`).

A colwise layer computes each rank's slice of output features and concatenates them
(exact: each element is one rank's dot product); its input gradient is the sum of the
ranks' partial input gradients, each rounded to the compute dtype -- autograd adds the
chunks' contributions in that dtype, as TP's all-reduce does, per layer: sibling layers
reading one input (q, k, v) are summed after each layer's own reduction. A rowwise layer sums the
ranks' partial outputs, each rounded to the compute dtype, in rank order: TP's forward
all-reduce. Only bias-free ``nn.Linear`` layers are planned for TP (a bias would be added
once after the reduction).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from parity.model.plan import PrecisionPlan, tp_reduction_key


class Partials:
    """What each emulated TP rank's reduction takes, per layer, while ``on``: ``seen[KEY][c]``, KEY
    ``MODULE@forward`` (a rowwise layer's partial output of chunk ``c``) or ``MODULE@backward``
    (a colwise layer's partial input gradient of chunk ``c``), the first of each."""

    def __init__(self):
        self.on = False
        self.seen: dict[str, dict[int, torch.Tensor]] = {}

    def keep(self, key: str, chunk: int, value: torch.Tensor) -> None:
        self.seen.setdefault(key, {}).setdefault(chunk, value.detach().cpu().clone())


class _Tap(torch.autograd.Function):
    """Identity whose backward hands the gradient through unchanged and keeps a copy."""

    @staticmethod
    def forward(ctx, x, partials, key, chunk):
        ctx.partials, ctx.key, ctx.chunk = partials, key, chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.partials.keep(ctx.key, ctx.chunk, grad)
        return grad, None, None, None


def _colwise(tp: int, key: str, partials: Partials | None):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tap = partials is not None and partials.on and x.requires_grad
        # one node per layer: its chunks' input gradients are summed there first, in the compute
        # dtype, as TP all-reduces each layer's partial input gradient; autograd then adds the
        # layers that read x (q, k and v of one attention), as it adds their all-reduced gradients
        x = x.view_as(x)
        return torch.cat([F.linear(_Tap.apply(x, partials, key, c) if tap else x, w)
                          for c, w in enumerate(self.weight.chunk(tp, dim=0))], dim=-1)
    return forward


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` left to right, in the parts' dtype: a collective's sum in
    rank order, each addition rounded."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _rowwise(tp: int, key: str, partials: Partials | None):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [F.linear(xi, wi) for xi, wi in zip(x.chunk(tp, dim=-1), self.weight.chunk(tp, dim=1))]
        if partials is not None and partials.on:
            for c, part in enumerate(parts):
                partials.keep(key, c, part)
        return ordered_sum(parts)
    return forward


class _Restore:
    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def emulate_tensor_parallel(model: nn.Module, plan: PrecisionPlan, tp: int,
                            partials: Partials | None = None) -> list[_Restore]:
    """Replace the forward of every layer the plan gives a TP owner; returns handles whose
    ``remove()`` restores it. ``tp`` 1: nothing to emulate. ``partials``: where each chunk's
    partial sums are kept while it is ``on`` (the backward's through an identity that passes
    the gradient on unchanged)."""
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
        mod.forward = types.MethodType(make(tp, tp_reduction_key(t.fqn, t.parallel), partials), mod)
        handles.append(_Restore(mod))
    return handles


def shard_group_divisor(reduce_dtype: torch.dtype, shard: int, data: int, factor: float | None = None,
                        force_sum: bool = False) -> float:
    """What FSDP divides a shard group's gradient sum by before the all-reduce across replicas
    (torch 2.15's ``_get_gradient_divide_factors``, held to it by a test): in FP32 and BF16 the
    reduce-scatter averages over the shard group (or pre-multiplies by ``1 / factor`` when the
    recipe set a divide factor) and the all-reduce averages (sums) the rest; with sum-only
    collectives both sum and the whole factor is divided after them (the group's sum is not
    divided); in other dtypes (overflow risk) each rank pre-divides by the power of two nearest
    below the square root of the factor (``data`` ranks by default) and both collectives sum."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        if force_sum:
            return 1.0
        if factor is None:
            return float(shard) if data > 1 else 1.0
        return float(factor)
    factor = float(data) if factor is None else factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre)
