"""``recompute``: activation checkpointing ran as the cell declares it, on each rank.

Checkpointing changes no number: a block whose checkpoint kept its activations, or a recipe
whose checkpointing wrapped nothing, trains exactly as the checkpointed one, so only the
module calls show it (:mod:`parity.execute.recompute`). Every watched module runs in each
micro-batch's forward (one whose calls were not counted is no evidence). Under ``full``,
``selective`` and ``outer`` every one whose forward output joined the autograd graph in a
micro-batch runs again in that micro-batch's backward (its runs there less its checkpoint wrapper's: a
wrapper runs again only inside an enclosing recompute), and under ``selective`` and ``outer``
each watched module but the root runs inside its wrapper. Under ``selective`` the policy saves
every matmul: in the first step (where they are counted) the watched modules run matmuls in each micro-batch's forward (else the policy had
nothing to save) and none again in its backward (a policy SAC ignored recomputes them, the same
numbers). Under ``outer`` the root's recompute
runs every unit inside it again, and torch's nested non-reentrant checkpoints may recompute a
unit there only: its own wrapper in the forward is what shows the unit checkpointed. Under
``none`` no watched block runs again. One record per step.
"""

from __future__ import annotations

from parity.execute.observation import Observation
from parity.execute.recompute import MATMUL_STEP
from parity.judge.record import Record
from parity.judge.rows import contract_row, skipped
from parity.matrix.cell import Cell


def owed(cell: Cell) -> bool:
    """Compiled blocks are not watched (their hooks would be traced into the graphs)."""
    return cell.compile == "none"


def check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    if not owed(cell):
        return []
    runs = obs.contracts.module_runs
    checkpointed = cell.checkpointing != "none"
    if not obs.contracts.watched and not checkpointed:
        return [skipped({**base, "step": step}, "recompute", cell.checkpointing,
                        "the model declares no blocks (Fixture.blocks): no module to watch") for step in range(cell.steps)]
    expected = ("every watched module whose output required gradient runs again in its micro-batch's backward"
                if checkpointed else "no block runs again in backward")
    if cell.checkpointing == "selective":
        expected += ", no matmul inside one again"
    rows = []
    for step in range(cell.steps):
        problems = _problems(cell, runs, obs.contracts.watched, step, checkpointed)
        rows.append(contract_row({**base, "step": step}, "recompute", cell.checkpointing, not problems, expected,
                                 "; ".join(problems)[:800] if problems else _said(cell, runs, step)))
    return rows


def _problems(cell: Cell, runs, watched: tuple[str, ...], step: int, checkpointed: bool) -> list[str]:
    if not runs:
        return [f"no watched module's forward was counted (watched: {', '.join(watched) or 'none'})"]
    mine = {(label, fqn): n for (s, label, fqn), n in runs.items() if s == step}
    wrapped = cell.checkpointing == "selective" or cell.checkpointing == "outer"  # by a CheckpointWrapper
    problems = []
    for mb in range(cell.microbatches):
        forward = {fqn: n for (label, fqn), n in mine.items() if label == f"mb{mb}/forward" and n[0]}
        if not forward:
            problems.append(f"no watched module ran in mb{mb}'s forward")
        silent = [fqn or "<root>" for fqn in watched if fqn not in forward]
        if forward and silent:  # a block whose calls went uncounted is no evidence of its checkpoint
            problems.append(f"{', '.join(silent[:4])} not seen in mb{mb}'s forward (watched)")
        if cell.checkpointing == "selective" and step == MATMUL_STEP:
            problems += _policy(mine, forward, mb)
        for fqn, (calls, graded, wrapper, _) in sorted(forward.items()):
            again, around = mine.get((f"mb{mb}/backward", fqn), [0, 0, 0, 0])[:3:2]
            # outer: a unit inside the root's recompute may be recomputed there only (torch's nested
            # non-reentrant checkpoints); its wrapper in forward is what shows it checkpointed
            own = again if cell.checkpointing == "outer" else again - around
            name = fqn or "<root>"
            if wrapped and fqn and not wrapper:
                problems.append(f"{name} ran in mb{mb}'s forward without its checkpoint wrapper")
            elif checkpointed and graded and own < 1:
                problems.append(f"{name} not recomputed in mb{mb}'s backward ({again} run(s) there, {around} "
                                "inside an outer recompute)")
            elif not checkpointed and again:
                problems.append(f"{name} ran {again} time(s) again in mb{mb}'s backward")
    return problems


def _policy(mine: dict, forward: dict, mb: int) -> list[str]:
    """The selective policy as it ran in micro-batch ``mb``: matmuls saved in the forward, none
    run again in the backward."""
    if not any(n[3] for n in forward.values()):
        return [f"no matmul ran in the watched modules' mb{mb} forward: the selective policy saved nothing"]
    again = {fqn: n[3] for (label, fqn), n in mine.items() if label == f"mb{mb}/backward" and n[3]}
    return [f"{fqn or '<root>'} ran {n} matmul(s) again in mb{mb}'s backward (the selective policy saves them)"
            for fqn, n in sorted(again.items())]


def _said(cell: Cell, runs, step: int) -> str:
    again = sum(n[0] - n[2] for (s, label, _), n in runs.items() if s == step and label.endswith("/backward"))
    said = f"{again} recompute(s) of watched modules in step {step}'s backwards"
    if cell.checkpointing != "selective":
        return said
    if step != MATMUL_STEP:
        return f"{said} (the selective policy's matmuls are counted in step {MATMUL_STEP})"
    saved = sum(n[3] for (s, label, _), n in runs.items() if s == step and label.endswith("/forward"))
    return f"{said}; {saved} matmul(s) saved in its forwards, none run again"
