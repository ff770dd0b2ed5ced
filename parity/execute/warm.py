"""Imported once by the fork server (:data:`parity.execute.starting.PRELOAD`): builds the model
registry there, so every rank it forks starts with it. Without it each rank process validates
every registered model on the meta device at its first cell, while its pool's other ranks and
the parent do the same (0.2-0.5 s of CPU per rank process measured beside them; 0.04 s here).

A registry that fails to build (a broken entry point) is left unbuilt: each rank meets the
error itself at its first cell, as it would without this module, and the server lives on (it
skips only a preloaded module that raises ImportError). Model code that would initialize CUDA
while the registry is built fails here instead: a fork server holding a CUDA context forks
ranks that cannot use theirs."""

import torch

from parity.model.registry import registered


def _refuse() -> None:
    raise RuntimeError("the fork server does not initialize CUDA")


def warm() -> bool:
    """Build the registry, with CUDA's initialization refused meanwhile; whether it was built."""
    saved = torch.cuda._lazy_init
    torch.cuda._lazy_init = _refuse
    try:
        registered()
        return True
    except BaseException:  # noqa: BLE001 - the ranks report it, cell by cell
        return False
    finally:
        torch.cuda._lazy_init = saved


warm()
