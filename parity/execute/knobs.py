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

``placement = "dim1"``: every ``fully_shard`` call gets a ``shard_placement_fn`` sharding
parameters of two or more dimensions on dimension 1 where it splits evenly (:func:`placement_fn`;
FSDP 2.15 raises on an uneven dimension other than 0); read back as each
sharded parameter's DTensor placement (``placement``), the bytes on the wire padded on that
dimension (``collectives``).

``cast_inputs = "model"``: every unit's policy has ``cast_forward_inputs=False``
(:func:`units`), on a model that casts its own inputs; the reference emulates the same
units, ``dtype.boundary`` holds every unit to the input dtypes that follow, ``unit.policy``
reads the flag back.

``unshard_in_backward = "needed"``: the units the model declares no backward reads
(``Fixture.backward_free``, an embedding) get ``set_unshard_in_backward(False)``; numerics do
not change, ``collectives`` holds each backward to the all-gathers of the other units.

``reshard_backward = "last"``: per micro-batch (:func:`before_microbatch`), the units stay
gathered after every backward but the last, as gradient-accumulation recipes keep them; the
forwards after the first gather nothing, the last backward reshards before the optimizer step
(``collectives`` counts both; a unit left gathered computes the next step with stale weights).

``unshard = "explicit"``: the recipe gathers every unit itself before each training forward
(:func:`before_forward`: ``unshard(async_op=True)``, FSDP's pre-forward waits on the handles
the recipe does not) and runs evaluation as a phase of its own (:func:`evaluation_phase`):
units stay gathered after the evaluation forward, the recipe reshards each one and restores
the cell's ``reshard_after_forward``. Numerics do not change; ``collectives`` holds every
forward to one all-gather per unit, ``eval.reshard`` reads the units' state after the forward,
after ``reshard()`` and the restored setting.

``finalize = "flagged"``: ``set_is_last_backward`` before each micro-batch, True only for the
last (:func:`before_microbatch`); ``finalize = "manual"``: the root finalizes each backward that
synchronizes itself (:func:`after_backward`). Numerics and collectives do not change: the
gradients and ``collectives`` hold them to it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from torch import nn
from torch.distributed.fsdp import FSDPModule

from parity.matrix.cell import KNOB_VALUES, Cell
from parity.paths.base import ShardReport
from parity.paths.units import module_index


def before_microbatch(cell: Cell, model: nn.Module, mb: int) -> None:
    """FSDP's per-micro-batch flags as the recipe sets them before micro-batch ``mb``: gradient
    sync for a backward that synchronizes (all but the last off under ``sync = "last"``), the
    replicas' all-reduce for the last only under ``replicas-last``; under ``reshard_backward =
    "last"`` every unit keeps its parameters gathered after each backward but the last
    (``set_reshard_after_backward``); under ``finalize = "flagged"`` only the last backward is
    flagged last (``set_is_last_backward``). Before each micro-batch, or under ``flags =
    "changed"`` before the first and the last only (:attr:`Cell.flags`)."""
    last = mb == cell.microbatches - 1
    if cell.flags != "each" and 0 < mb < cell.microbatches - 1:
        return
    model.set_requires_gradient_sync(cell.synchronizes(mb))
    if cell.sync == "replicas-last":
        model.set_requires_all_reduce(last)
    if cell.reshard_backward == "last":
        model.set_reshard_after_backward(last)
    if cell.finalize == "flagged":
        model.set_is_last_backward(last)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP unit of ``model``, the root first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def before_forward(cell: Cell, model: nn.Module) -> None:
    """Under ``unshard = "explicit"``: every unit's ``unshard(async_op=True)`` before a training
    forward; the recipe waits on the root's handle, FSDP's pre-forward on the others."""
    if cell.unshard != "explicit":
        return
    handles = [unit.unshard(async_op=True) for unit in fsdp_units(model)]
    if handles and handles[0] is not None:
        handles[0].wait()


def after_backward(cell: Cell, model: nn.Module, syncs: bool) -> None:
    """Under ``finalize = "manual"``: the root finalizes a backward that synchronized
    (``finalize_backward(async_op=True)``) and waits on its handle before anything reads a
    gradient; backwards inside a no-sync window are left to the one that ends it."""
    if cell.finalize == "manual" and syncs:
        model.finalize_backward(async_op=True).wait()


@contextlib.contextmanager
def evaluation_phase(cell: Cell, model: nn.Module):
    """Under ``unshard = "explicit"``: an evaluation forward keeps every unit gathered
    (``set_reshard_after_forward(False)``); the body reads their state, then calls the yielded
    function, which reshards each unit (``reshard()``) and restores the cell's setting. Under
    ``hooks`` it yields None: FSDP's hooks end the forward."""
    if cell.unshard != "explicit":
        yield None
        return
    model.set_reshard_after_forward(False)

    def end() -> None:
        for unit in fsdp_units(model):
            unit.reshard()
        model.set_reshard_after_forward(cell.reshard)
    yield end


def shard_dim(cell: Cell, shape) -> int:
    """The dimension ``cell``'s recipe shards a parameter of ``shape`` on: under ``dim1``, dimension
    1 where it splits evenly over the ranks (FSDP 2.15 shards only dimension 0 unevenly), else 0."""
    return 1 if cell.placement == "dim1" and len(shape) >= 2 and shape[1] % cell.ranks == 0 else 0


def placement_fn(cell: Cell):
    """The ``shard_placement_fn`` every ``fully_shard`` call of the cell gets; None: FSDP's dim 0."""
    if cell.placement == "dim0":
        return None
    from torch.distributed.tensor import Shard

    return lambda p: Shard(1) if shard_dim(cell, p.shape) == 1 else None


def reshard_after_forward(cell: Cell) -> bool | int:
    """What every ``fully_shard`` call of the cell gets as ``reshard_after_forward``: the cell's
    ``reshard``, or under ``reshard_to = "half"`` the size of the groups units reshard over."""
    return cell.ranks // 2 if cell.reshard_to == "half" else cell.reshard


def post_forward_state(cell: Cell) -> str:
    """The sharded state :func:`reshard_after_forward` leaves a unit's parameters in after any
    forward (torch 2.15, set explicitly on every unit, root included): ``sharded`` (reshard on),
    ``sharded_post_forward`` (over the smaller group), ``unsharded`` (off)."""
    return "unsharded" if not cell.reshard else "sharded_post_forward" if cell.reshard_to == "half" else "sharded"


def offload_policy(cell: Cell):
    """The ``offload_policy`` every ``fully_shard`` call of the cell gets; None: FSDP's default
    (no offloading). Pinned host memory needs an accelerator: pinned only on CUDA."""
    if cell.offload == "none":
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=cell.device == "cuda")


def sharding_options(cell: Cell) -> dict:
    """The keyword arguments the cell's recipe adds to every ``fully_shard`` call (through the
    path's ``apply``): only those a knob turns, so a path that takes none still runs the rest."""
    options = {"shard_placement_fn": placement_fn(cell), "offload_policy": offload_policy(cell)}
    return {k: v for k, v in options.items() if v is not None}


def units(cell: Cell, report: ShardReport) -> ShardReport:
    """The path's units as the recipe shards them: under ``cast_inputs = "model"`` no unit casts
    its forward inputs (the model does); the reference emulates exactly these units."""
    if cell.cast_inputs == "fsdp":
        return report
    return replace(report, units=tuple(replace(u, cast_forward_inputs=False) for u in report.units))


def unsupported(cell: Cell) -> str:
    """Why ``cell`` cannot turn its knobs on its model (empty: it can). Explicit prefetching
    chains block units: with fewer than two there is nothing to prefetch, and a cell claiming
    it would pass without having prefetched anything. A shard placement reaches ``fully_shard``
    through the path's ``apply``, which must take it."""
    wanted = [k for k, axis in (("shard_placement_fn", "placement"), ("offload_policy", "offload"))
              if getattr(cell, axis) != KNOB_VALUES[axis][0]]
    if wanted:
        import inspect

        from parity.paths.registry import get_path

        taken = inspect.signature(get_path(cell.path).apply).parameters
        for keyword in wanted:
            if keyword not in taken:
                axis = "placement" if keyword == "shard_placement_fn" else "offload"
                return (f"{axis} {getattr(cell, axis)!r}: path {cell.path!r} takes no {keyword} "
                        "(its apply() has no such keyword)")
    if (cell.unshard_in_backward, cell.cast_inputs, cell.prefetch, cell.compile) == ("all", "fsdp", "none", "none"):
        return ""
    from parity.model.compiling import compiler_missing
    from parity.model.registry import get_fixture

    fixture = get_fixture(cell.fixture, cell.source)
    if cell.compile != "none" and not fixture.blocks:
        return f"compile {cell.compile!r} compiles blocks; {cell.fixture!r} declares none (Fixture.blocks)"
    if missing := compiler_missing(cell.compile):
        return missing
    if cell.unshard_in_backward == "needed" and not fixture.backward_free:
        return (f"unshard_in_backward 'needed': {cell.fixture!r} declares no unit whose parameters backward does "
                "not read (Fixture.backward_free)")
    if cell.cast_inputs == "model" and not fixture.casts_inputs:
        return (f"cast_inputs 'model': {cell.fixture!r} does not cast its own inputs (Fixture.casts_inputs); "
                "with FSDP's casts off its low-precision weights would meet FP32 inputs")
    chained = [b for b in fixture.blocks if b in fixture.unit_roots]
    if cell.prefetch == "explicit" and len(chained) < 2:
        return (f"prefetch 'explicit' chains block units; {cell.fixture!r} declares {len(chained)} "
                f"(Fixture.blocks that are unit_roots: {', '.join(chained) or 'none'})")
    return ""


def block_units(model: nn.Module, blocks) -> list[FSDPModule]:
    """The FSDP units among the modules ``blocks`` names (``Fixture.blocks``, ...), in that order."""
    modules = module_index(model)
    return [modules[b] for b in blocks if isinstance(modules.get(b), FSDPModule)]


def kept_out_of_backward(cell: Cell, unit_modules: tuple[str, ...]) -> bool:
    """Whether :func:`apply` turns ``set_unshard_in_backward(False)`` on the unit built on
    ``unit_modules``: under ``unshard_in_backward = "needed"``, a unit on a module the model
    declares no backward reads (``Fixture.backward_free``)."""
    if cell.unshard_in_backward != "needed":
        return False
    from parity.model.registry import get_fixture

    return bool(set(unit_modules) & set(get_fixture(cell.fixture, cell.source).backward_free))


def apply(cell: Cell, model: nn.Module, blocks=(), backward_free=()) -> None:
    """Turn ``cell``'s knobs on every FSDP unit of ``model`` (each unit holds its own setting);
    ``blocks``: the fixture's block FQNs; ``backward_free``: its units no backward reads."""
    if cell.unshard_in_backward == "needed":
        for unit in block_units(model, backward_free):
            unit.set_unshard_in_backward(False)
    if cell.prefetch == "explicit":
        units = block_units(model, blocks)
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 2])
            unit.set_modules_to_backward_prefetch(units[i - 1:i] if i else [])
    if cell.finalize == "manual":
        model.set_manual_backward_finalization(True)
    if cell.reduction == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
