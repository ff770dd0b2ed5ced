"""Checkpoint entries, one record each: a checkpoint moves bytes and never changes them.

``checkpoint.saved`` judges the save: every entry the checkpoint's files hold (read without
DCP's loader, :mod:`parity.execute.dcp_files`) against the same entry as the saving run handed
it to DCP. ``checkpoint.loaded`` judges the load into each path: every entry right after loading,
before the resumed step, against the entry handed to the save. Both bitwise, in the same dtype
and shape; an entry on one side only is a FAIL naming the side it is missing from. The step after
loading is ``checkpoint.same`` / ``checkpoint.cross`` (:mod:`parity.judge.resumed`), and a
checkpoint that moves to another layout is ``checkpoint.moved`` (:mod:`parity.judge.moved`),
whose ``entry:`` records use the same rule (:func:`entries`).

Entries are named ``model/FQN``, ``optim/FQN/KEY``, ``optim/param_groups/I/KEY``, ``scaler/KEY``.
"""

from __future__ import annotations

import torch

from parity.execute.observation import Observation, Resumed
from parity.judge.compare import max_abs
from parity.judge.record import Record, Verdict
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name


def exact(base: dict, check: str, name: str, want, got, note: str, sides=("saved", "loaded")) -> Record:
    """One entry: same dtype and shape, bitwise the same values (or the same plain value).
    ``sides`` name what ``want`` and ``got`` are."""
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        same_kind = want.dtype == got.dtype and want.shape == got.shape
        observed = max_abs(got, want) if same_kind else float("inf")
        if observed != observed:  # NaN in both at the same place counts as equal only bitwise
            observed = 0.0 if torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)) \
                else float("inf")
        shown_got, shown_want = f"{dtype_name(got.dtype)} {list(got.shape)}", f"{dtype_name(want.dtype)} {list(want.shape)}"
        dtype = dtype_name(want.dtype)
    else:
        observed = 0.0 if want == got and type(want) is type(got) else float("inf")
        shown_got, shown_want, dtype = repr(got)[:80], repr(want)[:80], ""
    ok = observed == 0.0
    detail = f"{sides[0]} {shown_want}, {sides[1]} {shown_got}; max |{sides[1]} - {sides[0]}| {observed:.3g}; {note}"
    return Record(**base, check=check, name=name, observed=observed, allowed=0.0, ratio=0.0 if ok else float("inf"),
                  dtype=dtype, verdict=Verdict.PASS if ok else Verdict.FAIL, detail=detail)


def missing(base: dict, check: str, name: str, what: str) -> Record:
    return Record(**base, check=check, name=name, observed=float("inf"), allowed=0.0, ratio=float("inf"),
                  verdict=Verdict.FAIL, detail=f"missing: {what}")


def entries(base: dict, check: str, prefix: str, want: dict, got: dict, note: str,
            sides=("saved", "loaded")) -> list[Record]:
    """One record per entry of either side, named ``prefix + entry``."""
    rows = []
    for key in dict.fromkeys([*want, *got]):
        name = f"{prefix}{key}"
        if key not in got:
            rows.append(missing(base, check, name, f"{sides[0]}, not {sides[1]} ({note})"))
        elif key not in want:
            rows.append(missing(base, check, name, f"{sides[1]}, but no such entry was {sides[0]} ({note})"))
        else:
            rows.append(exact(base, check, name, want[key], got[key], note, sides))
    return rows


def _skip(base: dict, check: str, name: str, why: str) -> Record:
    return Record(**base, check=check, name=name, verdict=Verdict.SKIP, detail=why)


def checks(cell: Cell, observations: list[Observation], base: dict) -> list[Record]:
    """``checkpoint.saved`` and ``checkpoint.loaded`` from rank 0's report (every entry whole:
    each rank's shard is in it). Where the save or a load failed or a path could not be loaded
    into, a SKIP points at the ``checkpoint.same`` / ``checkpoint.cross`` record saying why."""
    resume = observations[0].contracts.resume or {}
    own = resume.get(cell.path, Resumed())
    if not own.saved:
        if own.error:
            return [_skip(base, "checkpoint.saved", cell.path, f"no checkpoint to read: {own.error[:300]} "
                                                               "(the checkpoint.same record)")]
        return [missing(base, "checkpoint.saved", cell.path, "rank 0 reported no entry as handed to the save")]
    saving = f"saved by {cell.path}"
    rows = ([missing(base, "checkpoint.saved", cell.path, f"the checkpoint's files could not be read: {own.unread}")]
            if own.unread else
            entries(base, "checkpoint.saved", "entry:", own.saved, own.written, saving, ("handed to DCP", "written")))
    for target, r in resume.items():
        if r.error or r.skip:
            rows.append(_skip(base, "checkpoint.loaded", target, f"not loaded into {target}: {(r.error or r.skip)[:300]}"))
        elif not r.loaded:
            rows.append(missing(base, "checkpoint.loaded", target, f"rank 0 reported no entry after loading into {target}"))
        else:
            rows += entries(base, "checkpoint.loaded", f"{target}:entry:", own.saved, r.loaded,
                            f"{saving}, loaded into {r.taken or target}")
    return rows
