"""Meta-device initialization: what a large model's recipe does after ``fully_shard``.

The model was built on ``meta`` and sharded there. ``to_empty`` gives every sharded
parameter and buffer storage; then the weights come from a seeded full state dict
(``set_model_state_dict``, each rank keeping its shard) and every buffer, persistent or not,
from the same seeded model, the way a model's own buffer init restores them (a rotary
``inv_freq`` registered ``persistent=False`` is in no state dict).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from parity.model.plan import canonical_fqn


def materialize(model: nn.Module, seeded: nn.Module, device) -> None:
    """Give the meta-built, sharded ``model`` storage on ``device`` and ``seeded``'s values."""
    model.to_empty(device=device)
    full = {canonical_fqn(k): v for k, v in seeded.state_dict().items()}
    options = dcp_state_dict.StateDictOptions(full_state_dict=True, strict=True)
    dcp_state_dict.set_model_state_dict(model, full, options=options)
    values = {canonical_fqn(n): b for n, b in seeded.named_buffers()}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            src = values.get(canonical_fqn(name))
            if src is not None:
                buf.copy_(src.to(buf.device))
