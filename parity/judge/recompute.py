"""``recompute``: activation checkpointing ran as the cell declares it, on each rank.

Checkpointing changes no number: a block whose checkpoint kept its activations, or a recipe
whose checkpointing wrapped nothing, trains exactly as the checkpointed one, so only the
module calls show it (:mod:`parity.execute.recompute`). Under ``full``, ``selective`` and
``outer`` every watched module whose forward output joined the autograd graph in a micro-batch
runs again in that micro-batch's backward; under ``none`` no watched block does. One record per
step.
"""

from __future__ import annotations

from parity.execute.observation import Observation
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
    rows = []
    for step in range(cell.steps):
        problems = _problems(cell, runs, obs.contracts.watched, step, checkpointed)
        rows.append(contract_row({**base, "step": step}, "recompute", cell.checkpointing, not problems, expected,
                                 "; ".join(problems)[:800] if problems else _said(runs, step)))
    return rows


def _problems(cell: Cell, runs, watched: tuple[str, ...], step: int, checkpointed: bool) -> list[str]:
    if not runs:
        return [f"no watched module's forward was counted (watched: {', '.join(watched) or 'none'})"]
    mine = {(label, fqn): n for (s, label, fqn), n in runs.items() if s == step}
    if not mine:
        return [f"no watched module ran in step {step}"]
    problems = []
    for mb in range(cell.microbatches):
        modules = sorted({fqn for label, fqn in mine if label.startswith(f"mb{mb}/")})
        for fqn in modules:
            graded = mine.get((f"mb{mb}/forward", fqn), [0, 0])[1]
            again = mine.get((f"mb{mb}/backward", fqn), [0, 0])[0]
            if checkpointed and graded and not again:
                problems.append(f"{fqn or '<root>'} not run again in mb{mb}'s backward")
            elif not checkpointed and again:
                problems.append(f"{fqn or '<root>'} ran {again} time(s) again in mb{mb}'s backward")
    return problems


def _said(runs, step: int) -> str:
    again = sum(n[0] for (s, label, _), n in runs.items() if s == step and label.endswith("/backward"))
    return f"{again} forward call(s) of watched modules in step {step}'s backwards"
