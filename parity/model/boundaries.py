"""Module-boundary dtypes: the floating input/output dtypes each module sees.

The sharded run and the reference install the same hooks, so both observe boundaries the
same way; this module depends on nothing distributed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from parity.model.dtypes import dtype_name
from parity.model.plan import canonical_fqn
from parity.paths.units import under


def _float_dtypes(obj) -> list[str]:
    if isinstance(obj, torch.Tensor):
        return [dtype_name(obj.dtype)] if obj.is_floating_point() else []
    if isinstance(obj, (tuple, list)):
        return [d for o in obj for d in _float_dtypes(o)]
    if isinstance(obj, dict):
        return [d for o in obj.values() for d in _float_dtypes(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # FSDP's casts walk their fields too
        return [d for f in dataclasses.fields(obj) for d in _float_dtypes(getattr(obj, f.name))]
    return []


def float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical FQN -> a CPU copy of every floating buffer (both sides read buffers this way)."""
    return {canonical_fqn(n): b.detach().cpu().clone() for n, b in model.named_buffers() if b.is_floating_point()}


def hookable_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without compiled modules (``module.compile()``) and what they hold:
    a hook there would run inside the graph, on fake tensors, and its side effects would split the
    graph; probes read those modules another way (:mod:`parity.model.compiling`)."""
    named = list(model.named_modules())
    compiled = [name for name, mod in named if getattr(mod, "_compiled_call_impl", None) is not None]
    return [(name, mod) for name, mod in named if not any(under(name, c) for c in compiled)]


def params_read(fqn: str, module: nn.Module):
    """The parameters ``module``'s forward reads, as ``(name, own, parameter)``: its own
    (``own``), then each child's, which a parent may read directly (``F.conv1d(x,
    self.conv.weight)``) while the child's own forward never runs. ``fqn``: the module's
    canonical name. The sharded run and the reference note what forward read by this one rule."""
    for local, p in module._parameters.items():
        if p is not None:
            yield (f"{fqn}.{local}" if fqn else local), True, p
    for child_name, child in module._modules.items():
        if child is None:
            continue
        prefix = canonical_fqn(f"{fqn}.{child_name}" if fqn else child_name)
        for local, p in child._parameters.items():
            if p is not None:
                yield f"{prefix}.{local}", False, p


def record_boundaries(model: nn.Module, sink: dict, when=lambda: True) -> list:
    """Hooks recording each module's floating input/output dtypes into ``sink`` (canonical
    FQN -> {"in": [...], "out": [...]}) while ``when()`` holds. Used by the sharded run and
    by the reference, so both observe boundaries the same way."""
    handles = []
    for name, mod in hookable_modules(model):
        fqn = canonical_fqn(name)

        def pre(module, args, kwargs, fqn=fqn):
            if when():
                sink.setdefault(fqn, {})["in"] = _float_dtypes((args, kwargs))

        def post(module, args, output, fqn=fqn):
            if when():
                sink.setdefault(fqn, {})["out"] = _float_dtypes(output)

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    return handles


def record_boundary_variants(model: nn.Module, sink: dict) -> list:
    """Hooks adding each module's floating input and output dtypes, in every forward (training
    micro-batches, evaluation forwards, activation-checkpoint recomputes), to ``sink``: canonical
    FQN -> {"in": set of dtype tuples, "out": set of dtype tuples}. A module seen the same way
    every time has one of each. A checkpoint wrapper and the module it wraps share a canonical
    name: the module inside is the one read (as :func:`record_boundaries` ends up reading it)."""
    handles = []
    inner = {canonical_fqn(name): mod for name, mod in hookable_modules(model)}  # children come later
    for fqn, mod in inner.items():

        def pre(module, args, kwargs, fqn=fqn):
            sink.setdefault(fqn, {"in": set(), "out": set()})["in"].add(tuple(_float_dtypes((args, kwargs))))

        def post(module, args, output, fqn=fqn):
            sink.setdefault(fqn, {"in": set(), "out": set()})["out"].add(tuple(_float_dtypes(output)))

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    return handles
