"""``lr``: the learning rate of every optimizer step, against the recipe's schedule.

A scheduler is training state beside the model and the optimizer: a recipe steps it once per
optimizer step and saves and loads it with the checkpoint. Its rates are Python floats that
``LambdaLR`` forms as ``base_lr * factor(step)``; the schedule's own formula
(:func:`parity.model.recipe.scheduled_lr`) forms the same product, so each is judged exactly. Each
rank witnesses two rates per step: the one its optimizer stepped with (read at the optimizer's own
pre-step hook, after any global hook that moves it) and the one the scheduler left for the next
step -- after a resumed step that second one is the only trace of a scheduler the checkpoint did
not restore (the optimizer's param groups carry the first across the load). A resumed run's rates
are held to the uninterrupted run's same step (:func:`resumed_row`), a moved checkpoint's to the
straight run's (``TARGET:lr:rates`` in :mod:`parity.judge.moved`). Each load that finished owes
its row whatever it reported: a run that reported no rates is a FAIL naming it.
"""

from __future__ import annotations

from parity.execute.observation import Observation
from parity.judge.record import Record
from parity.judge.rows import contract_row
from parity.matrix.cell import Cell
from parity.model.recipe import scheduled_lr

CHECK = "lr"


def _differences(got, want: tuple[float, float]) -> list[str]:
    """What differs between ``got`` (stepped-with rates, next rates: one per param group) and the
    two expected rates; a missing or empty report is a difference."""
    if got is None:
        return ["not reported"]
    problems = []
    for label, rates, rate in (("stepped with", got[0], want[0]), ("next", got[1], want[1])):
        if not rates:
            problems.append(f"{label}: no param group")
        problems += [f"{label}: group {i} {r!r}" for i, r in enumerate(rates) if r != rate]
    return problems


def check(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """One record per step on this rank: the rate its optimizer step took and the one set for the
    next step, each param group's, bitwise the schedule's."""
    rows = []
    for step in range(cell.steps):
        want = (scheduled_lr(cell.schedule, step), scheduled_lr(cell.schedule, step + 1))
        problems = _differences(obs.lrs[step] if step < len(obs.lrs) else None, want)
        row = contract_row(base, CHECK, cell.schedule, not problems,
                           f"{want[0]!r} stepped with, {want[1]!r} next ({cell.schedule} schedule)",
                           "; ".join(problems[:4]) or "as expected")
        row.step = step
        rows.append(row)
    return rows


def resumed_row(base: dict, check_name: str, target: str, per_rank: list[tuple[Observation, object]],
                step: int) -> Record:
    """``TARGET:lr`` of a resumed run: on every rank, the resumed step's rates (stepped with, next)
    bitwise those of the uninterrupted run's same step on that rank."""
    problems = []
    for o, r in per_rank:
        want = o.lrs[step] if step < len(o.lrs) else None
        got = getattr(r, "lrs", None)
        if want is None:
            problems.append(f"rank {o.rank}: the uninterrupted run reported no rates for step {step}")
        elif got is None or tuple(map(list, got)) != tuple(map(list, want)):
            problems.append(f"rank {o.rank}: {got!r} after the resume, {tuple(want)!r} uninterrupted")
    if not per_rank:
        problems.append("no rank reported the resumed run")
    return contract_row(base, check_name, f"{target}:lr", not problems,
                        "the uninterrupted run's rates (stepped with, next) on every rank",
                        "; ".join(problems[:3]) or f"{per_rank[0][0].lrs[step]!r} on {len(per_rank)} rank(s)")
