"""Recipe knobs whose effect no number shows, read from FSDP's state on each rank, one record per
step: ``unshard`` (a recipe that gathers its units by hand), ``reshard.forward`` (what
``reshard_after_forward`` leaves after a training forward), ``reshard.backward`` (units kept
gathered across a no-sync window) and ``finalize.flagged`` (the last backward flagged by the
recipe).

Each knob changes when FSDP gathers, frees or finalizes, never what it computes: FSDP's own hooks
would gather the same parameters, and its default already treats a backward as the last. What
shows the knob is the state FSDP holds at the moment the knob speaks for, read there
(:mod:`parity.execute.training`, :mod:`parity.execute.evaluation`).
"""

from __future__ import annotations

from collections.abc import Callable

from parity.execute.knobs import kept_out_of_backward, post_forward_state
from parity.execute.observation import Observation
from parity.judge.record import Record
from parity.judge.rows import contract_row, few, skipped
from parity.matrix.cell import Cell

READY = ("pending", "unsharded")


def _per_microbatch(cell: Cell, base: dict, check: str, name: str, expected: str, read: dict,
                    problems_of: Callable[[int, object], list[str]], held: str) -> list[Record]:
    """One record per step: ``problems_of(mb, seen)`` over what each micro-batch read (``read[(step,
    mb)]``); a micro-batch that read nothing is a problem naming it."""
    rows = []
    for step in range(cell.steps):
        problems = []
        for mb in range(cell.microbatches):
            seen = read.get((step, mb))
            problems += [f"mb{mb}: not read"] if seen is None else problems_of(mb, seen)
        rows.append(contract_row({**base, "step": step}, check, name, not problems, expected,
                                 "; ".join(problems)[:800] or held))
    return rows


def _units(obs: Observation) -> list[str]:
    """The units holding parameters, by :attr:`UnitSpec.state_name`."""
    return sorted({u.state_name for u in obs.report.units if u.params})


def _nothing_to_read(cell: Cell, base: dict, check: str, name: str, why: str, verdict_fail: bool) -> list[Record]:
    """A step with no unit to read is no evidence: a FAIL where the path reported no unit holding
    parameters (the observation is missing), a SKIP saying why where the knob does not reach any."""
    rows = []
    for step in range(cell.steps):
        at = {**base, "step": step}
        rows.append(contract_row(at, check, name, False, "at least one unit to read", why) if verdict_fail
                    else skipped(at, check, name, why))
    return rows


def owed(cell: Cell) -> bool:
    return cell.unshard == "explicit"


def check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``unshard``: right after the recipe's ``unshard(async_op=True)`` calls, before each training
    forward, every unit holding parameters has an all-gather pending or is unsharded."""
    if not owed(cell):
        return []
    units = _units(obs)
    if not units:
        return _nothing_to_read(cell, base, "unshard", "explicit", "no unit holding parameters reported", True)
    return _per_microbatch(
        cell, base, "unshard", "explicit",
        "every unit's all-gather pending or its parameters unsharded before each training forward",
        obs.contracts.unshard,
        lambda mb, states: [f"mb{mb}: {u}: {states.get(u, 'not reported')}" for u in units if states.get(u) not in READY],
        f"{len(units)} unit(s) ready in every micro-batch")


def reshard_owed(cell: Cell) -> bool:
    return cell.reshard_backward == "last"


def forward_name(cell: Cell) -> str:
    """The ``reshard.forward`` record's name: the setting whose state it reads."""
    return {"unsharded": "off", "sharded_post_forward": "half", "sharded": "on"}[post_forward_state(cell)]


def forward_check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``reshard.forward``: right after each training forward, every unit holding parameters is in
    the state its ``reshard_after_forward`` gives (sharded with reshard on, over the smaller group
    with ``reshard_to = "half"``, unsharded with it off; parity passes it to every unit, root
    included). The numbers are the same either way and ``collectives`` bounds the backward's
    all-gathers from above only: a setting FSDP holds but does not act on shows here. Under
    ``unshard = "explicit"`` too: the recipe gathers ahead, FSDP's post-forward still reshards, and
    the setting an evaluation phase turned off must be back."""
    units = _units(obs)
    if not units:
        return _nothing_to_read(cell, base, "reshard.forward", forward_name(cell), "no unit holding parameters reported",
                                True)
    want = post_forward_state(cell)

    def problems(mb: int, states: dict) -> list[str]:
        return [f"after mb{mb}'s forward: {u}: {states.get(u, 'not reported')} (want {want})" for u in units
                if states.get(u) != want]
    return _per_microbatch(cell, base, "reshard.forward", forward_name(cell), f"every unit {want} after each forward",
                           obs.contracts.after_forward, problems, f"{len(units)} unit(s) {want} after every forward")


def reshard_check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``reshard.backward``: under ``reshard_backward = "last"`` (``set_reshard_after_backward``
    False but for the last micro-batch) every unit holding parameters is still unsharded after
    each backward but the last, and sharded after the last. The gathers it saves show in
    ``collectives`` on several ranks only; this record reads the state on one rank too. Units no
    backward gathers (:func:`_not_gathered_in_backward`) are not held to it."""
    if not reshard_owed(cell):
        return []
    last = cell.microbatches - 1
    every = _units(obs)
    units = [u for u in every if u not in _not_gathered_in_backward(cell, obs)]
    if not units:
        why = ("no unit holding parameters reported" if not every else
               f"none of the {len(every)} unit(s) is gathered in backward (frozen, or kept out of it by unshard_in_backward)")
        return _nothing_to_read(cell, base, "reshard.backward", "last", why, not every)

    def problems(mb: int, states: dict) -> list[str]:
        want = "unsharded" if mb < last else "sharded"
        return [f"after mb{mb}: {u}: {states.get(u, 'not reported')} (want {want})" for u in units
                if states.get(u) != want]
    return _per_microbatch(cell, base, "reshard.backward", "last",
                           "every unit unsharded after each backward but the last, sharded after the last",
                           obs.contracts.after_backward, problems, f"{len(units)} unit(s) as set after every backward")


def freed_check(cell: Cell, obs: Observation, plan, base: dict) -> list[Record]:
    """``grad.freed``: right after every backward that synchronizes, no parameter FSDP manages
    holds its unsharded gradient: FSDP takes each for its reduce-scatter and frees it, leaving the
    sharded one. One kept is a full-size gradient per parameter for the rest of training (FSDP's
    memory saving undone), which no value shows. A backward without sync keeps them by design
    (the accumulation); a cell FSDP trains no parameter of owes nothing."""
    if not any(t.ownership == "managed" and t.requires_grad for t in plan.params):
        return []

    def problems(mb: int, seen: tuple[bool, list[str]]) -> list[str]:
        synced, held = seen
        return [f"after mb{mb}: {few(held)}"] if synced and held else []
    return _per_microbatch(cell, base, "grad.freed", "unsharded", "no unsharded gradient left after a backward "
                           "that synchronizes", obs.contracts.grads_held, problems,
                           f"freed after every synchronizing backward ({cell.microbatches} micro-batch(es))")


def _not_gathered_in_backward(cell: Cell, obs: Observation) -> set[str]:
    """Units no backward gathers, so a forward that resharded them leaves them sharded whatever
    ``set_reshard_after_backward`` says: those the model declares no backward reads under
    ``unshard_in_backward = "needed"``, and those holding no trainable parameter."""
    plan = obs.plan
    return {u.state_name for u in obs.report.units
            if kept_out_of_backward(cell, u.modules)
            or not any(plan.get(p) is not None and plan.get(p).requires_grad for p in u.params)}


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
    last = cell.microbatches - 1
    return _per_microbatch(cell, base, "finalize.flagged", "is_last_backward",
                           "is_last_backward True for the last micro-batch only", obs.contracts.last_backward,
                           lambda mb, flag: [] if flag == (mb == last) else [f"mb{mb}: {flag}"], "as set")
