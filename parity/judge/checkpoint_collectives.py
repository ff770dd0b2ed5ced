"""``checkpoint.collectives``: what ``torch.distributed`` issued around the checkpoint lifecycle
(:mod:`parity.execute.lifecycle`) and a checkpoint that moves (:mod:`parity.execute.moves`):
DCP's sharded save and load issue none of the collectives parity counts, and the step after a
load issues what the uninterrupted run's same step issued (:func:`checkpoint_checks`)."""

from __future__ import annotations

from collections import Counter

from parity.execute.observation import Observation
from parity.judge.record import Record
from parity.judge.rows import contract_row as _row
from parity.judge.rows import skipped as _skipped
from parity.matrix.cell import Cell


def _phases(resumed, label: str) -> list[str]:
    """What ``resumed`` issued in one lifecycle phase (nothing is expected there)."""
    issued = {kind: len(b) for (_, seg, kind), b in resumed.collectives.items() if seg == label}
    return [f"{label}: {n} {kind}, expected none" for kind, n in sorted(issued.items())]


def _kept_from_eval(cell: Cell) -> bool:
    """Whether the uninterrupted run may begin a step with units still gathered: an evaluation
    forward after the step before, with reshard off, leaves them unsharded (a state dict or an
    explicit reshard may shard them again). A freshly loaded model begins sharded, so its first
    forward gathers what the uninterrupted one kept: at most every unit once, each gather the
    uninterrupted run issued among them."""
    return cell.eval == "between-steps" and not cell.reshard


def checkpoint_checks(cell: Cell, obs: Observation, base: dict) -> list[Record]:
    """``checkpoint.collectives``: what ``torch.distributed`` issued around the checkpoint lifecycle,
    on each rank, one record per phase: ``PATH:save`` (the cell's own path), ``PATH:load`` for
    every path the checkpoint was loaded into, ``PATH:step`` (the step resumed on the own path):

    - saving and loading with DCP's sharded state dicts issue none of the collectives
      :mod:`parity.execute.collectives` counts: every rank writes and reads its own shards (DCP
      plans through object collectives, which are not counted), so a unit all-gathered to save
      or to load is a finding even where no value changes;
    - the step after loading into the cell's own path issues, segment by segment, the same
      collectives with the same bytes, in the same order, as the uninterrupted run's same step
      (which the step's own ``collectives`` record holds to the units): a resumed model that
      gathers, reduces or reduces in another dtype differently from one that never stopped is
      not the same training. Except where the uninterrupted step began with units an evaluation
      forward kept gathered (:func:`_kept_from_eval`): the resumed first forward gathers them. After loading into another path its units differ by design; only
      the load is held to none.

    A load that failed or was skipped is a SKIP here: its ``checkpoint.same`` / ``checkpoint.cross``
    row is the ERROR or SKIP saying why."""
    rows = []
    step = cell.resume_step
    units = sum(1 for u in obs.report.units if u.params)
    straight = {(seg, kind): b for (s, seg, kind), b in obs.contracts.collectives.items() if s == step}
    for target, r in (obs.contracts.resume or {}).items():
        if r.error or r.skip:  # its own checkpoint.same / .cross row says what failed or why not
            rows.append(_skipped(base, "checkpoint.collectives", target, "no resumed run on this path: "
                                 + (r.skip or "its checkpoint.same / checkpoint.cross row has the error")))
            continue
        own = target == cell.path
        if own:
            rows.append(_row(base, "checkpoint.collectives", f"{target}:save", not _phases(r, "checkpoint/save"),
                             "no collective to save", "; ".join(_phases(r, "checkpoint/save")) or "as expected"))
        rows.append(_row(base, "checkpoint.collectives", f"{target}:load", not _phases(r, "checkpoint/load"),
                         "no collective to load", "; ".join(_phases(r, "checkpoint/load")) or "as expected"))
        if own:
            problems = _resumed_step(cell, r, straight, units)
            rows.append(_row(base, "checkpoint.collectives", f"{target}:step", not problems,
                             f"the resumed step's collectives, segment by segment, those of the uninterrupted step {step}",
                             "; ".join(problems) or "as expected"))
    return rows


def _resumed_step(cell: Cell, r, straight: dict, units: int) -> list[str]:
    """How the resumed step's collectives differ from the uninterrupted step's, segment by segment."""
    step = cell.resume_step
    problems = []
    again = {(seg, kind): b for (s, seg, kind), b in r.collectives.items()
             if s == step and not seg.startswith("checkpoint/")}
    for seg, kind in sorted(set(straight) | set(again)):
        got, want = again.get((seg, kind), []), straight.get((seg, kind), [])
        if (seg, kind) == ("mb0/forward", "all-gather") and _kept_from_eval(cell):
            if not Counter(want) - Counter(got) and len(got) <= units:
                continue
        if got != want:
            problems.append(f"resumed {seg}: {len(got)} {kind} of {sum(got)} bytes, the uninterrupted "
                            f"step {step} issued {len(want)} of {sum(want)}")
    return problems


def moved_checks(cell: Cell, observations: list[Observation], base: dict) -> list[Record]:
    """``checkpoint.collectives`` of a checkpoint that moves (``move``), two records per path it is
    loaded into (``moved:PATH:save``, ``moved:PATH:load``): on every rank of the saving layout the save, on every rank of
    the loading layout the load, issue none of the counted collectives (DCP reshards a sharded
    checkpoint by reading each rank's own slices of the files). A move that failed or was
    skipped is a SKIP here: its ``checkpoint.moved`` row says why."""
    rows = []
    for target, first in (observations[0].contracts.moved or {}).items():
        name = f"moved:{target}"
        if first.error or first.skip:
            rows.append(_skipped(base, "checkpoint.collectives", name, "no moved load on this path: "
                                 + (first.skip or "its checkpoint.moved row has the error")))
            continue
        for phase, label, where in (("save", "checkpoint/save", first.save), ("load", "checkpoint/load", first.load)):
            problems = [f"rank {o.rank}: {p}" for o in observations
                        for m in [(o.contracts.moved or {}).get(target)] if m is not None for p in _phases(m, label)]
            rows.append(_row(base, "checkpoint.collectives", f"{name}:{phase}", not problems,
                             f"no collective to {phase} on {where}", "; ".join(problems)[:1000] or "as expected"))
    return rows
