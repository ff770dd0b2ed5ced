"""FP32 markers for parameters and buffers, and a conversion helper that respects them.

A marker is recorded on the *owning module* under the tensor's local name, not on the
tensor: ``nn.Module._apply`` (behind ``.to()``, ``.cuda()``, ``.bfloat16()``) keeps
parameter objects but replaces buffer objects, so an attribute on a buffer tensor would be
silently lost on the first device move. Names on the module survive every such move.

A second, separate piece of metadata is the *recorded compute dtype*
(:func:`set_compute_dtype`): what a loader writes on a parameter it loaded (e.g. "this
norm weight computes in FP32"). It is rule (2) of the precision plan; markers feed rule (1).
"""

from __future__ import annotations

import torch
from torch import nn

_MARK_ATTR = "_parity_keep_fp32"
_COMPUTE_ATTR = "_parity_compute_dtype"


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, local = name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if local not in owner._parameters and local not in owner._buffers:
        raise KeyError(f"{name!r} is neither a parameter nor a buffer of {type(owner).__name__}")
    return owner, local


def _store(owner: nn.Module, local: str) -> None:
    owner.__dict__.setdefault(_MARK_ATTR, set()).add(local)


def _stored(owner: nn.Module) -> set[str]:
    return owner.__dict__.get(_MARK_ATTR, set())


def mark_keep_fp32(module: nn.Module, *names: str) -> None:
    """Mark parameters or buffers (dotted names relative to ``module``) to stay FP32."""
    for name in names:
        _store(*_owner(module, name))


def fp32_marked(module: nn.Module) -> set[str]:
    """Dotted names (relative to ``module``) of every marked parameter and buffer."""
    found = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for local in _stored(sub):
            found.add(f"{prefix}.{local}" if prefix else local)
    return found


def convert_except_marked(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating parameters and buffers to ``dtype``, leaving marked tensors in FP32.

    Works in place, like ``module.to(dtype)``; returns the module for chaining.
    """
    for sub in module.modules():
        marks = _stored(sub)
        for local, param in sub._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            target = torch.float32 if local in marks else dtype
            if param.dtype != target:
                param.data = param.data.to(target)
        for local, buf in sub._buffers.items():
            if buf is None or not buf.is_floating_point():
                continue
            target = torch.float32 if local in marks else dtype
            if buf.dtype != target:
                sub._buffers[local] = buf.to(target)
    return module


def set_compute_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Record, on a parameter, the dtype it must compute in (load-time metadata)."""
    setattr(tensor, _COMPUTE_ATTR, dtype)


def recorded_compute_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    return getattr(tensor, _COMPUTE_ATTR, None)
