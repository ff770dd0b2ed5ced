"""Operator logs of a traced re-run, in PyTorch's own ``DebugMode`` format.

With ``run --op-log``, rank 0 of a failing cell's traced re-run (:mod:`parity.judge.divergence`)
trains its step under ``torch.utils._debug_mode.DebugMode``: every ATen operator, FSDP op and
collective it issues, in order, with the hash of each computed output (``{"hash": ...}`` in
the call's log: DebugMode's L1-norm hash over the values that are not NaN, and how many are). The log is saved with ``DebugMode.save_logs``, so it
reads back with ``DebugMode.load_logs``, and two runs of one cell (two torch builds, a fix and
its regression) diff with ``DebugMode.check_hash_mismatches``: the operators whose output hash
moved, in order, or, when the runs issued different operators, the first index where they part.

What is not hashed: views (their hash is their base's, and a view of a buffer a collective is
still filling reads whatever is there), collectives themselves (on CPU, gloo fills their
outputs on its own thread after the call returns; a functional collective's value is hashed at
its ``wait_tensor`` where the log shows one, else in the first operator that reads it), allocations, and the all-gather output
buffer FSDP's copy-in returns beside this rank's input (the other ranks' parts are not there yet). What reads a collective's
output runs after FSDP waits for it, so every hashed value is the same in every run of the
cell: two logs of one correct cell have no mismatch.

Torch builds without ``DebugMode.save_logs`` write no log; the trace document says why.
"""

from __future__ import annotations

import contextlib
import io


def unavailable() -> str:
    """Why this torch cannot write an op log ("" when it can)."""
    try:
        from torch.utils._debug_mode import DebugMode
    except ImportError:
        return "this torch has no torch.utils._debug_mode"
    if not all(hasattr(DebugMode, a) for a in ("save_logs", "load_logs", "dispatch_hooks")):
        return "this torch's DebugMode cannot save its logs (DebugMode.save_logs)"
    return ""


#: Operator namespaces whose outputs are filled after the call returns (process-group collectives,
#: and DTensor's functional ones, which ``wait_tensor`` completes: that op's output is hashed).
_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional")


def _hashed(func) -> bool:
    """Whether an operator's output is a value it computed (see the module docstring)."""
    name = str(func)
    collective = getattr(func, "namespace", "") in _COLLECTIVES and "wait_tensor" not in name
    return not (getattr(func, "is_view", False) or collective or "empty" in name or "profiler" in name)


def _l1(t) -> tuple[float, int]:
    """DebugMode's hash of a tensor (its L1 norm in FP64) over its non-NaN values, and how many
    are NaN: NaN never equals itself and a log must equal its own rerun, yet an output that
    turns NaN must not hash like one holding zeros there."""
    import torch

    with torch._C._DisablePythonDispatcher():
        t = t.detach()
        if not (t.is_floating_point() or t.is_complex()):
            t = t.float()
        wide = t.contiguous().to(torch.complex128 if t.is_complex() else torch.float64)
        if not wide.numel():
            return 0.0, 0
        nans = wide.isnan()
        return float(torch.where(nans, 0, wide).abs().sum()), int(nans.sum())


def _log_hook(func, types, args, kwargs, result):
    if not _hashed(func):
        return None
    import torch
    from torch.utils._pytree import tree_all, tree_map

    if getattr(func, "namespace", "") == "fsdp" and "all_gather_copy_in" in str(func):  # (input, output buffer)
        result = (result[0], None)  # the buffer's other ranks' parts are filled by the all-gather later
    hashes = tree_map(lambda x: _l1(x) if isinstance(x, torch.Tensor) else None, result)
    return None if tree_all(lambda x: x is None, hashes) else {"hash": hashes}


@contextlib.contextmanager
def recording(sink: dict):
    """Record the operators run inside the block; on exit ``sink["log"]`` holds the serialized
    log (``DebugMode.save_logs``'s JSON), or ``sink["note"]`` why there is none."""
    why = unavailable()
    if why:
        sink["note"] = why
        yield
        return
    from torch.utils._debug_mode import DebugMode

    with DebugMode() as mode, DebugMode.dispatch_hooks(log_hook=_log_hook):
        yield
    buffer = io.StringIO()
    DebugMode.save_logs(mode.logs, buffer)
    sink["log"] = buffer.getvalue()
