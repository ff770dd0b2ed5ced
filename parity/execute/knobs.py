"""Recipe knobs: the FSDP settings a recipe turns on its sharded model after ``fully_shard``,
applied by every build of a cell (its training, the checkpoint lifecycle, moved layouts).

``reduction = "sum"`` (:attr:`parity.matrix.cell.Cell.reduction`): every unit sums its
gradients instead of averaging them -- ``set_gradient_divide_factor(1.0)`` -- with
sum-only collectives (``set_force_sum_reduction_for_comms(True)``: gloo has no
pre-multiplied sum; NCCL runs the same way). The recipe divides its loss by the number of
data-parallel ranks instead (:func:`parity.model.recipe.loss_divisor`), so a correct run
trains the same numbers as with FSDP's mean when that number is a power of two.

``prefetch = "explicit"``: the fixture's block units, in order, each prefetch the next
block's all-gather in forward and the previous block's in backward (replacing FSDP's
implicit backward prefetch), as transformer recipes set it. Numerics do not change; the
units' prefetch lists are read back (``unit.policy``) and every all-gather is counted
(``collectives``: a unit gathered twice in one pass is a finding).

``reshard_backward = "last"``: per micro-batch (:func:`before_microbatch`), the units stay
gathered after every backward but the last, as gradient-accumulation recipes keep them; the
forwards after the first gather nothing, the last backward reshards before the optimizer step
(``collectives`` counts both; a unit left gathered computes the next step with stale weights).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from parity.matrix.cell import Cell
from parity.paths.units import module_index


def before_microbatch(cell: Cell, model: nn.Module, last: bool) -> None:
    """Knobs a recipe turns per micro-batch: under ``reshard_backward = "last"`` every unit keeps
    its parameters gathered after each backward but the last (``set_reshard_after_backward``)."""
    if cell.reshard_backward == "last":
        model.set_reshard_after_backward(last)


def unsupported(cell: Cell) -> str:
    """Why ``cell`` cannot turn its knobs on its model (empty: it can). Explicit prefetching
    chains block units: with fewer than two there is nothing to prefetch, and a cell claiming
    it would pass without having prefetched anything."""
    if cell.prefetch != "explicit":
        return ""
    from parity.model.registry import get_fixture

    fixture = get_fixture(cell.fixture, cell.source)
    units = [b for b in fixture.blocks if b in fixture.unit_roots]
    if len(units) < 2:
        return (f"prefetch 'explicit' chains block units; {cell.fixture!r} declares {len(units)} "
                f"(Fixture.blocks that are unit_roots: {', '.join(units) or 'none'})")
    return ""


def block_units(model: nn.Module, blocks) -> list[FSDPModule]:
    """The FSDP units that are the fixture's blocks (``Fixture.blocks``), in the blocks' order."""
    modules = module_index(model)
    return [modules[b] for b in blocks if isinstance(modules.get(b), FSDPModule)]


def apply(cell: Cell, model: nn.Module, blocks=()) -> None:
    """Turn ``cell``'s knobs on every FSDP unit of ``model`` (each unit holds its own setting);
    ``blocks``: the fixture's block FQNs."""
    if cell.prefetch == "explicit":
        units = block_units(model, blocks)
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 2])
            unit.set_modules_to_backward_prefetch(units[i - 1:i] if i else [])
    if cell.reduction == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
