"""Recipe knobs: the FSDP settings a recipe turns on its sharded model after ``fully_shard``,
applied by every build of a cell (its training, the checkpoint lifecycle, moved layouts).

``reduction = "sum"`` (:attr:`parity.matrix.cell.Cell.reduction`): every unit sums its
gradients instead of averaging them -- ``set_gradient_divide_factor(1.0)`` -- with
sum-only collectives (``set_force_sum_reduction_for_comms(True)``: gloo has no
pre-multiplied sum; NCCL runs the same way). The recipe divides its loss by the number of
data-parallel ranks instead (:func:`parity.model.recipe.loss_divisor`), so a correct run
trains the same numbers as with FSDP's mean when that number is a power of two.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from parity.matrix.cell import Cell


def apply(cell: Cell, model: nn.Module) -> None:
    """Turn ``cell``'s knobs on every FSDP unit of ``model`` (each unit holds its own setting)."""
    if cell.reduction == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
