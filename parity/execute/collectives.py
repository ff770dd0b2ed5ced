"""Collectives counted where ``torch.distributed`` issues them (worker side).

FSDP2 and the training step call ``all_gather_single`` / ``all_gather_into_tensor``,
``reduce_scatter_single`` / ``reduce_scatter_tensor``, ``all_reduce`` and ``broadcast``;
wrapping those module functions sees every call with its buffers. DTensor's functional
collectives (the gradient norm's all-reduce) bypass them and are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

#: torch.distributed functions FSDP and the training step issue, and the kind each is.
COLLECTIVES = {
    "all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
    "reduce_scatter_single": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "all_reduce": "all-reduce", "broadcast": "broadcast",
}


def nbytes(args, kwargs) -> int:
    """The larger buffer of a call (all-gather output, reduce-scatter input, all-reduce tensor)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


@contextlib.contextmanager
def counting(calls: dict, key: Callable[[str], object]) -> Iterator[None]:
    """While open, every collective appends its bytes to ``calls[key(kind)]`` (one entry per call)."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        kind = COLLECTIVES[name]

        def counted(*args, **kwargs):
            calls.setdefault(key(kind), []).append(nbytes(args, kwargs))
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def totals(calls: dict) -> dict:
    """``calls`` as key -> [count, bytes]."""
    return {k: [len(sizes), sum(sizes)] for k, sizes in calls.items()}


class Segments:
    """Each call's bytes per segment of the training loop (``step``, label such as ``mb0/forward``)
    and kind: ``calls[(step, label, kind)]`` (how many: its length)."""

    def __init__(self):
        self.calls: dict[tuple[int, str, str], list[int]] = {}
        self.current: tuple[int, str] = (-1, "outside")

    @contextlib.contextmanager
    def segment(self, step: int, label: str) -> Iterator[None]:
        outer, self.current = self.current, (step, label)
        try:
            yield
        finally:
            self.current = outer

    def key(self, kind: str) -> tuple[int, str, str]:
        return (*self.current, kind)

    @contextlib.contextmanager
    def counted(self, step: int | None = None, label: str = "") -> Iterator[None]:
        """While open, every collective is counted here (:func:`counting`), under ``(step, label)``
        when a label is given, else under whichever segment is current."""
        with counting(self.calls, self.key), self.segment(step, label) if label else contextlib.nullcontext():
            yield
