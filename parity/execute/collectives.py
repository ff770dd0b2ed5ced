"""Collectives counted where ``torch.distributed`` issues them (worker side).

FSDP2 and the training step call ``all_gather_single`` / ``all_gather_into_tensor``,
``reduce_scatter_single`` / ``reduce_scatter_tensor``, ``all_reduce`` and ``broadcast``;
wrapping those module functions sees every call with its buffers. DTensor's functional
collectives (tensor parallelism's redistributions, the experts' exchanges and their
backwards, a gradient norm over DTensors) bypass them: :class:`Exchanges` counts those at the
dispatcher, where the backwards torch issues from C++ pass too, as ``functional`` kinds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

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


#: ``torch.ops._c10d_functional`` ops (what DTensor and ``_functional_collectives`` dispatch, forward
#: and backward) and the kind each is; their ``wait_tensor`` is not a collective.
FUNCTIONAL = {
    "all_reduce": "all-reduce", "all_reduce_": "all-reduce", "all_reduce_coalesced": "all-reduce",
    "all_gather_into_tensor": "all-gather", "all_gather_into_tensor_out": "all-gather",
    "all_gather_into_tensor_coalesced": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_tensor_coalesced": "reduce-scatter", "all_to_all_single": "all-to-all",
    "broadcast": "broadcast", "broadcast_": "broadcast",
}
#: The prefix of a functional collective's kind (``functional all-reduce``).
FUNCTIONAL_PREFIX = "functional "
#: The :class:`Exchanges` modes counting now (paused together by :func:`unseen`).
_ACTIVE: list = []


class LocalOps(TorchDispatchMode):
    """A dispatch mode that sees the ops run on local tensors (:meth:`seen`): a DTensor op is
    handed back to DTensor first (``NotImplemented``), so the local ops it desugars into pass
    through here; a higher-order op passes unseen (its body's ops are not seen); a backward run by
    the autograd engine on this thread passes too."""

    def __init__(self):
        super().__init__()
        from torch.distributed.tensor import DTensor

        self.dtensor = DTensor

    def seen(self, func, args, kwargs) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, self.dtensor) for t in types):
            return NotImplemented
        self.seen(func, args, kwargs)
        return func(*args, **kwargs)


class Exchanges(LocalOps):
    """While entered, every functional collective appends its bytes to ``calls[key(kind)]``, the
    kind prefixed with :data:`FUNCTIONAL_PREFIX` (:class:`LocalOps`: those DTensor desugars into
    included). ``paused`` hides parity's own reads."""

    def __init__(self, calls: dict, key: Callable[[str], object]):
        super().__init__()
        self.calls, self.key, self.paused = calls, key, False
        ns = torch.ops._c10d_functional
        self.kinds = {getattr(ns, name): kind for name, kind in FUNCTIONAL.items() if hasattr(ns, name)}

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def seen(self, func, args, kwargs) -> None:
        kind = self.kinds.get(func._overloadpacket)
        if kind is not None and not self.paused:  # a coalesced call: one call, its list's bytes not summed
            self.calls.setdefault(self.key(FUNCTIONAL_PREFIX + kind), []).append(nbytes(args, kwargs))


def totals(calls: dict) -> dict:
    """``calls`` as key -> [count, bytes]."""
    return {k: [len(sizes), sum(sizes)] for k, sizes in calls.items()}


class Segments:
    """Each call's bytes per segment of the training loop (``step``, label such as ``mb0/forward``)
    and kind: ``calls[(step, label, kind)]`` (how many: its length)."""

    def __init__(self, functional: str = "none"):
        self.calls: dict[tuple[int, str, str], list[int]] = {}
        self.current: tuple[int, str] = (-1, "outside")
        self.functional = functional
        """Where functional collectives are counted too (:func:`functional_scope`)."""
        self.within: list[Callable[[str], contextlib.AbstractContextManager]] = []
        """Context managers opened inside each segment, given its label (another observer's, e.g.
        :mod:`parity.execute.recompute`'s matmul count in forwards and backwards)."""

    @contextlib.contextmanager
    def segment(self, step: int, label: str) -> Iterator[None]:
        outer, self.current = self.current, (step, label)
        try:
            with contextlib.ExitStack() as stack:
                for opened in self.within:
                    stack.enter_context(opened(label))
                yield
        finally:
            self.current = outer

    def reductions(self):
        """Open around the optimizer segment's own reductions (unscaling's found-inf agreement,
        the gradient norm, clipping): where the scope is ``reductions``, their functional
        collectives are counted there (and the optimizer's update, which owes none, runs
        without a dispatch mode)."""
        return self._exchanges() if self.functional == "reductions" else contextlib.nullcontext()

    def _exchanges(self):
        """:class:`Exchanges` into these calls, unless one counts into them already; another
        object's mode still open would take these collectives for its own."""
        if _ACTIVE and _ACTIVE[-1].calls is self.calls:
            return contextlib.nullcontext()
        if _ACTIVE:
            raise RuntimeError("functional collectives are being counted for another loop already")
        return Exchanges(self.calls, self.key)

    def key(self, kind: str) -> tuple[int, str, str]:
        return (*self.current, kind)

    @contextlib.contextmanager
    def counted(self, step: int | None = None, label: str = "") -> Iterator[None]:
        """While open, every collective is counted here (:func:`counting`), under ``(step, label)``
        when a label is given, else under whichever segment is current; the functional
        collectives too (:class:`Exchanges`) when built with ``functional``."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(counting(self.calls, self.key))
            if self.functional == "all":
                stack.enter_context(self._exchanges())
            if label:
                stack.enter_context(self.segment(step, label))
            yield


def functional_scope(cell) -> str:
    """Where a cell's training counts functional collectives (:class:`Exchanges`): everywhere on
    the meshes whose forwards and backwards issue them (``fsdp+tp``, ``ep``); elsewhere only
    around the optimizer segment's ``reductions`` (:meth:`Segments.reductions`), where a
    gradient norm over DTensors all-reduces (a dispatch mode over every op of a step costs
    50-80 % of its time, over the optimizer's update about 9 % of a smoke run); nowhere on one
    rank."""
    if cell.ranks == 1:
        return "none"
    return "all" if cell.mesh in ("fsdp+tp", "ep") else "reductions"


@contextlib.contextmanager
def unseen() -> Iterator[None]:
    """parity's own reads (a DTensor's ``full_tensor`` for a record) are not the recipe's exchanges."""
    paused = [(mode, mode.paused) for mode in _ACTIVE]
    for mode, _ in paused:
        mode.paused = True
    try:
        yield
    finally:
        for mode, was in paused:
            mode.paused = was
