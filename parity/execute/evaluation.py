"""Evaluation forwards between training steps or micro-batches, as a recipe's validation loop
runs them: ``model.eval()``, ``torch.no_grad()``, a batch of its own, then back to training.

FSDP2 keeps state across such a forward (unsharded parameters, the lazy-init state, pending
reductions inside a no-sync window). A rank records the forward's output and, right after it,
each unit's sharded state: torch 2.15 reshards a unit after any forward iff its
``reshard_after_forward`` says so (parity passes it explicitly, root included), grad mode or
not, so with reshard off an evaluation leaves the parameters unsharded until the next backward.
"""

from __future__ import annotations

import torch
from torch import nn

from parity.execute.observation import EvalSeen
from parity.paths.base import ShardReport
from parity.paths.units import module_index


def unit_states(model: nn.Module, report: ShardReport) -> dict[str, str]:
    """Unit root -> the sharded state FSDP holds for its parameters (units without any: none)."""
    modules = module_index(model)
    out = {}
    for unit in report.units:
        if not unit.params:
            continue
        state = modules[unit.modules[0]]._get_fsdp_state()
        group = state._fsdp_param_group
        names = sorted({p.sharded_state.name.lower() for p in group.fsdp_params}) if group else ["no parameter group"]
        out[unit.state_name] = ",".join(names)
    return out


def gather_states(model: nn.Module, report: ShardReport) -> dict[str, str]:
    """Unit root -> ``pending`` (an all-gather issued, its result not yet taken), else the
    sharded state FSDP holds (:func:`unit_states`): what a recipe's explicit ``unshard()``
    leaves before the forward."""
    modules = module_index(model)
    states = unit_states(model, report)
    for unit in report.units:
        group = modules[unit.modules[0]]._get_fsdp_state()._fsdp_param_group if unit.params else None
        if group is not None and getattr(group, "_all_gather_result", None) is not None:
            states[unit.state_name] = "pending"
    return states


def post_forward(group) -> str:
    """Where a parameter group reshards after forward, as FSDP holds it: ``off`` (stays gathered),
    ``on`` (over every rank it shards over) or ``N ranks`` (an int ``reshard_after_forward``)."""
    info = group.post_forward_mesh_info
    return "off" if info is None else "on" if info is group.mesh_info else f"{info.shard_mesh_size} ranks"


def reshard_settings(model: nn.Module, report: ShardReport) -> dict[str, str]:
    """Unit root -> where FSDP reshards it after a forward (:func:`post_forward`)."""
    modules = module_index(model)
    out = {}
    for unit in report.units:
        group = modules[unit.modules[0]]._get_fsdp_state()._fsdp_param_group if unit.params else None
        if group is not None:
            out[unit.state_name] = post_forward(group)
    return out


def evaluate(model: nn.Module, report: ShardReport, inputs: tuple[torch.Tensor, ...], output,
             *, step: int, label: str, end=None) -> EvalSeen:
    """One evaluation forward; ``output`` maps the model's return value to the judged tensor.
    ``end``: the recipe's end of an evaluation phase (:func:`parity.execute.knobs.evaluation_phase`),
    called after the units' state is read; their state and settings are read again after it."""
    model.eval()
    try:
        with torch.no_grad():
            out = output(model(*inputs))
    finally:
        model.train()
    seen = EvalSeen(step=step, label=label, output=out, units=unit_states(model, report))
    if end is not None:
        end()
        seen.resharded, seen.restored = unit_states(model, report), reshard_settings(model, report)
    return seen
