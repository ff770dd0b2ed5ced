"""State dicts taken where a recipe takes them, with their values (worker side).

After the first optimizer step, after the first evaluation forward and between the forward
and the backward of the last step's first micro-batch (with reshard off FSDP holds the
parameters unsharded there, and its pre-save hook reshards them), a rank takes
``model.state_dict()`` (and, between the forward and the backward, DCP's ``get_model_state_dict``)
and records each parameter entry's type, placements, dtype and
value beside the master parameter's at that moment. The training that follows is judged by
every usual check, so a state dict that changed it shows there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from parity.execute.observation import EntrySeen, StateDictSeen
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.plan import canonical_fqn


def layout(t: torch.Tensor) -> tuple[str, str]:
    """(``DTensor`` or ``Tensor``, its placements): how an entry or a parameter is held."""
    if isinstance(t, DTensor):
        return "DTensor", ",".join(map(str, t.placements))
    return "Tensor", ""  # a Parameter is a Tensor here


def _entry(t: torch.Tensor, keep: Callable) -> EntrySeen:
    kind, placements = layout(t)
    return EntrySeen(kind=kind, placements=placements, dtype=dtype_name(t.dtype), value=keep(t))


def take(model: nn.Module, params: list[nn.Parameter], names: dict[int, str], keep: Callable, *,
         step: int, point: str) -> StateDictSeen:
    """Both APIs' parameter entries at ``point`` of ``step``, and the masters (``params``, the
    sharded parameters the optimizer steps) as the reference for their values."""
    seen = StateDictSeen(step=step, point=point,
                         masters={names[id(p)]: _entry(p, keep) for p in params})
    for api in Cell.state_dict_apis(point):
        state = model.state_dict() if api == "state_dict" else get_model_state_dict(model)
        seen.entries[api] = {canonical_fqn(k): _entry(v, keep) for k, v in state.items()
                             if canonical_fqn(k) in seen.masters and isinstance(v, torch.Tensor)}
    return seen
