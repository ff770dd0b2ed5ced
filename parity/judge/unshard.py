"""``unshard``: a recipe that gathers its units by hand (``unshard = "explicit"``) did, on each rank.

The recipe calls every unit's ``unshard(async_op=True)`` before each training forward and waits
on the root's handle; FSDP's own pre-forward would gather the same parameters anyway, so an
``unshard()`` that issues nothing trains the same numbers with the same all-gather count. What
shows it is each unit's state right after those calls (:func:`parity.execute.evaluation.gather_states`):
every unit holding parameters has an all-gather pending or is already unsharded. One record per step.
"""

from __future__ import annotations

from parity.execute.observation import Observation
from parity.judge.record import Record
from parity.judge.rows import contract_row
from parity.matrix.cell import Cell

READY = ("pending", "unsharded")


def owed(cell: Cell) -> bool:
    return cell.unshard == "explicit"


def check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    if not owed(cell):
        return []
    units = {u.modules[0] or "<root>" for u in obs.report.units if u.params}  # as gather_states names them
    expected = "every unit's all-gather pending or its parameters unsharded before each training forward"
    rows = []
    for step in range(cell.steps):
        problems = []
        for mb in range(cell.microbatches):
            states = obs.contracts.unshard.get((step, mb))
            if states is None:
                problems.append(f"mb{mb}: not read")
                continue
            problems += [f"mb{mb}: {u}: {states.get(u, 'not reported')}" for u in sorted(units)
                         if states.get(u) not in READY]
        rows.append(contract_row({**base, "step": step}, "unshard", "explicit", not problems, expected,
                                 "; ".join(problems)[:800] or f"{len(units)} unit(s) ready in every micro-batch"))
    return rows


def reshard_owed(cell: Cell) -> bool:
    return cell.reshard_backward == "last"


def reshard_check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``reshard.backward``: under ``reshard_backward = "last"`` (``set_reshard_after_backward``
    False but for the last micro-batch) every unit holding parameters is still unsharded after
    each backward but the last, and sharded after the last. The gathers it saves show in
    ``collectives`` on several ranks only; this record reads the state on one rank too."""
    if not reshard_owed(cell):
        return []
    units = {u.modules[0] or "<root>" for u in obs.report.units if u.params}
    expected = "every unit unsharded after each backward but the last, sharded after the last"
    rows = []
    for step in range(cell.steps):
        problems = []
        for mb in range(cell.microbatches):
            states = obs.contracts.after_backward.get((step, mb))
            want = "unsharded" if mb < cell.microbatches - 1 else "sharded"
            if states is None:
                problems.append(f"mb{mb}: not read")
                continue
            problems += [f"after mb{mb}: {u}: {states.get(u, 'not reported')} (want {want})" for u in sorted(units)
                         if states.get(u) != want]
        rows.append(contract_row({**base, "step": step}, "reshard.backward", "last", not problems, expected,
                                 "; ".join(problems)[:800] or f"{len(units)} unit(s) as set after every backward"))
    return rows


def flagged_owed(cell: Cell) -> bool:
    return cell.finalize == "flagged"


def flagged_check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``finalize.flagged``: under ``finalize = "flagged"`` the root's state holds each backward
    to be the last exactly when it is the step's last micro-batch (``set_is_last_backward``),
    read before the backward. FSDP's own default is True, and inside a no-sync window the
    reductions are deferred anyway, so neither the numbers nor the collectives show a flag
    that was never stored."""
    if not flagged_owed(cell):
        return []
    expected = "is_last_backward True for the last micro-batch only"
    rows = []
    for step in range(cell.steps):
        problems = []
        for mb in range(cell.microbatches):
            got = obs.contracts.last_backward.get((step, mb))
            if got is None:
                problems.append(f"mb{mb}: not read")
            elif got != (mb == cell.microbatches - 1):
                problems.append(f"mb{mb}: {got}")
        rows.append(contract_row({**base, "step": step}, "finalize.flagged", "is_last_backward", not problems,
                                 expected, "; ".join(problems) or "as set"))
    return rows
