"""Checkpoint entries, one record each: a checkpoint moves bytes and never changes them.

``checkpoint.saved`` judges the save: every entry as each saving rank handed it to DCP (its
local piece of a sharded entry, placed by torch's placement rule) against the same region of the
entry the checkpoint's files hold (read by rank 0 without DCP's loader,
:mod:`parity.execute.dcp_files`). ``checkpoint.loaded`` judges the load into each path: every
entry as each rank holds it right after loading, before the resumed step, against the files
again -- so a save that wrote wrong bytes fails the save, not the load. Both bitwise, in the same
dtype and shape; an entry on one side only is a FAIL naming the side it is missing from; each
record names the first rank whose piece differs. The step after
loading is ``checkpoint.same`` / ``checkpoint.cross`` (:mod:`parity.judge.resumed`), and a
checkpoint that moves to another layout is ``checkpoint.moved`` (:mod:`parity.judge.moved`),
whose ``entry:`` records use the same rule (:func:`entries`, with rank 0's whole copy).

Entries are named ``model/FQN``, ``optim/FQN/KEY``, ``optim/param_groups/I/KEY``, ``scaler/KEY``,
``scheduler/KEY``.
"""

from __future__ import annotations

import torch

from parity.execute import dcp_files
from parity.execute.observation import Observation, Resumed
from parity.judge.compare import max_abs, piece
from parity.judge.record import Record, Verdict
from parity.judge.rows import contract_row, skipped
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


def _held(base: dict, check: str, name: str, want, per_rank: list[tuple[int | None, dict]], key: str, note: str,
          sides: tuple[str, str]) -> Record:
    """One entry on every rank: each rank's piece (``(value, region)``) bitwise the same region of
    the whole ``want``; the first rank's record that fails, else the first rank's."""
    rows = []
    for rank, held in per_rank:
        on = f" on rank {rank}" if rank is not None else ""
        if key not in held:
            rows.append(missing(base, check, name, f"{sides[0]}, not {sides[1]}{on} ({note})"))
            continue
        value, region = held[key]
        row = exact(base, check, name, piece(want, region) if isinstance(want, torch.Tensor) else want, value,
                    note, sides)
        if rank is not None:
            row.detail = f"rank {rank}: {row.detail}"
        rows.append(row)
    return next((r for r in rows if r.verdict != Verdict.PASS), rows[0])


def entries(base: dict, check: str, prefix: str, want: dict, per_rank: list[tuple[int | None, dict]], note: str,
            sides: tuple[str, str]) -> list[Record]:
    """One record per entry of ``want`` (whole values) or of any rank's pieces (``(value,
    region)``; a rank of None: one whole copy, named by no rank), named ``prefix + entry``
    (:func:`_held`)."""
    rows = []
    for key in dict.fromkeys([*want, *(k for _, held in per_rank for k in held)]):
        name = f"{prefix}{key}"
        if key not in want:
            ranks = [r for r, held in per_rank if key in held and r is not None]
            on = f" on rank(s) {ranks}" if ranks else ""
            rows.append(missing(base, check, name, f"{sides[1]}{on}, but no such entry was {sides[0]} ({note})"))
        else:
            rows.append(_held(base, check, name, want[key], per_rank, key, note, sides))
    return rows


def _left_alone(base: dict, per_rank: list[tuple[int, Resumed | None]]) -> Record:
    """``checkpoint.saved`` ``live``: on every saving rank the save left the model and optimizer
    it saved as they were (a job trains on after it saves; the resumed runs load the files, so a
    save that changed the live state shows nowhere else). A rank that reported no save is no
    witness of it: a FAIL naming the rank."""
    changed = [f"rank {rank}: no report of its save" if r is None else f"rank {rank}: {', '.join(r.disturbed[:4])}"
               for rank, r in per_rank if r is None or r.disturbed]
    return contract_row(base, "checkpoint.saved", "live", not changed, "the live state as handed to DCP after the save",
                        "; ".join(changed)[:600] or f"unchanged on {len(per_rank)} rank(s)")


def checks(cell: Cell, observations: list[Observation], base: dict) -> list[Record]:
    """``checkpoint.saved`` (every rank's entries as handed to DCP against the files, read by
    rank 0) and ``checkpoint.loaded`` (every rank's entries after each load against the files).
    Where the save or a load failed or a path could not be loaded into, a SKIP points at the
    ``checkpoint.same`` / ``checkpoint.cross`` record saying why."""
    resume = [(o.rank, o.contracts.resume or {}) for o in observations]
    own = resume[0][1].get(cell.path, Resumed())
    if own.save_failed:
        why = f"no checkpoint to read: {own.error[:300]} (the checkpoint.same record)"
        return [skipped(base, "checkpoint.saved", cell.path, why), skipped(base, "checkpoint.loaded", cell.path, why)]
    try:
        if own.unread or not own.written:
            raise ValueError(own.unread or "rank 0 reported none")
        written = dcp_files.read(own.written)
    except Exception as exc:  # noqa: BLE001 -- an unreadable checkpoint is a finding, not a crash
        return [missing(base, "checkpoint.saved", cell.path, f"the checkpoint's files could not be read: {exc}")]
    saving = f"saved by {cell.path}"
    handed = [(rank, r.get(cell.path, Resumed()).saved) for rank, r in resume]
    rows = entries(base, "checkpoint.saved", "entry:", written, handed, saving, ("written", "handed to DCP"))
    rows.append(_left_alone(base, [(rank, r.get(cell.path)) for rank, r in resume]))
    for target, r0 in resume[0][1].items():
        if r0.error or r0.skip:
            rows.append(skipped(base, "checkpoint.loaded", target, f"not loaded into {target}: {(r0.error or r0.skip)[:300]}"))
            continue
        loaded = [(rank, r.get(target, Resumed()).loaded) for rank, r in resume]
        rows += entries(base, "checkpoint.loaded", f"{target}:entry:", written, loaded,
                        f"{saving}, loaded into {r0.taken or target}", ("written", "loaded"))
        rows.append(no_gradients(base, "checkpoint.loaded", target, [(rank, r.get(target)) for rank, r in resume]))
    return rows


def no_gradients(base: dict, check: str, target: str, per_rank: list[tuple[int, object]]) -> Record:
    """``check``'s ``TARGET:grads``: on every loading rank (``(rank, report)``, each report's
    ``held_grads``) no parameter holds a gradient right after the load. DCP's helpers step a
    fresh optimizer once with zero gradients to create its state and must free them: one left is
    a full gradient's memory per parameter from load time on, numerically invisible (the next
    backward adds to zeros). A rank that reported none is no witness: a FAIL naming it."""
    held = [f"rank {rank}: " + (f"{len(r.held_grads)} ({', '.join(r.held_grads[:4])})"
                                if r is not None and r.held_grads is not None
                                else "no report of the gradients after its load")
            for rank, r in per_rank if r is None or r.held_grads is None or r.held_grads]
    return contract_row(base, check, f"{target}:grads", not held, "no gradient held after the load",
                        "; ".join(held)[:600] or f"none on {len(per_rank)} rank(s)")
