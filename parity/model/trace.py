"""Per-module traces for locating the first divergence: each module's forward output and
the gradient arriving at its input, recorded once (the first forward of a traced run).

Installed on the sharded model (worker) and on the reference model, the same way, so both
sides name modules by canonical FQN and order them by when they finished (forward) and when
their input gradient arrived (backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from parity.model.boundaries import hookable_modules
from parity.model.plan import canonical_fqn


@dataclass(kw_only=True)
class Trace:
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Module FQN -> its first floating output, in the order modules finished forward."""
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Module FQN -> gradient of its first floating input, in the order backward reached it."""


def _first_float(obj):
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, (tuple, list)):
        return next((t for t in map(_first_float, obj) if t is not None), None)
    if isinstance(obj, dict):
        return next((t for t in map(_first_float, obj.values()) if t is not None), None)
    return None


def _replace_first_float(obj, new):
    """``obj`` with its first floating tensor (as :func:`_first_float` finds it) replaced by ``new``."""
    done = [False]

    def walk(o):
        if done[0]:
            return o
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                done[0] = True
                return new
            return o
        if isinstance(o, tuple):
            return tuple(walk(x) for x in o)
        if isinstance(o, list):
            return [walk(x) for x in o]
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        return o

    return walk(obj)


def install(model: nn.Module, trace: Trace, when=lambda: True) -> list:
    """Hooks filling ``trace`` while ``when()`` holds; returns the handles to remove."""
    handles = []
    for name, mod in hookable_modules(model):
        fqn = canonical_fqn(name) or "<root>"

        def pre(module, args, kwargs, fqn=fqn):
            x = _first_float((args, kwargs))
            if not (when() and x is not None and x.requires_grad and fqn not in trace.input_grads):
                return None
            # a view of its own, so the hook sees this module's gradient only: a hook on the input
            # itself would also sum the gradients of its other readers (a residual connection),
            # and whether the input is a tensor of its own depends on the boundary casts before it
            mine = x.view_as(x)
            mine.register_hook(lambda g, fqn=fqn: trace.input_grads.setdefault(fqn, g.detach().cpu().clone()))
            return _replace_first_float((args, kwargs), mine)

        def post(module, args, output, fqn=fqn):
            y = _first_float(output)
            if when() and y is not None:
                trace.outputs.setdefault(fqn, y.detach().cpu().clone())

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    return handles
