"""``compile.graphs``: the compiled blocks ran compiled, and compiled only where something changed.

A cell with ``compile`` other than ``none`` claims its blocks ran as graphs
(:mod:`parity.model.compiling`). Numbers alone cannot show it: a block that fell back to
eager (a recompile limit hit, a guard failing on every call) computes much the same values.
Each rank's log of the graphs dynamo handed the backend is judged on its own:

- every training forward (each micro-batch of every step) and every evaluation forward ran the
  same number of graphs as the cell's first forward (or the first after an unfreezing), at
  least one per compiled block, every compiled block running at least one of them (a block
  run eagerly beside one whose graphs split at FSDP's hooks keeps the count), and no more than
  the reference's same forward (the same blocks compiled with the same backend,
  without FSDP, broken where the path's units' hooks run): a block run eagerly shows as fewer,
  a graph break of a probe or of a state FSDP leaves behind as more. Fewer than the reference's
  is not a finding by itself: dynamo runs a nested FSDP unit's ``nn.Linear`` forward eagerly
  where the reference compiles it (measured on ``frozen``, legacy: 8 graphs per forward, the
  reference's 12);
- graphs were compiled only where a guard legitimately changes: the first training forward,
  the first evaluation forward (``no_grad``), and the first forward of a step that unfreezes
  parameters (``requires_grad``). A recompile anywhere else means something the graph guards
  on -- a parameter's dtype, layout, shape or identity as FSDP hands it over -- changed between
  forwards that should see the same tensors.
"""

from __future__ import annotations

from parity.execute.observation import Observation
from parity.judge.record import Record, Verdict
from parity.judge.rows import contract_row
from parity.matrix.cell import Cell
from parity.model.compiling import compiled_names
from parity.model.plan import PrecisionPlan


def _steps(cell: Cell) -> int:
    return cell.trace_step + 1 if cell.trace else cell.steps


def _compiles_allowed(cell: Cell, plan: PrecisionPlan) -> set[tuple[int, str]]:
    """Where a graph may be compiled: the first training forward and the first evaluation segment
    after it, and again from a step that unfreezes parameters."""
    starts = {0} | {t.trainable_from for t in plan.params if t.trainable_from}
    allowed = {(k, "mb0/forward") for k in starts}
    for k in starts:  # requires_grad is guarded on no_grad graphs too
        first_eval = next((s for s in range(k, _steps(cell)) if cell.eval_labels(s)), None)
        if first_eval is not None:
            allowed.add((first_eval, "eval"))
    return allowed


def _segments(cell: Cell) -> list[tuple[int, str]]:
    """The segments that run the compiled blocks forward: every training micro-batch and every
    step's evaluation forwards."""
    out = []
    for step in range(_steps(cell)):
        out += [(step, f"mb{mb}/forward") for mb in range(cell.microbatches)]
        out += [(step, "eval")] if cell.eval_labels(step) else []
    return out


def graph_problems(cell: Cell, obs: Observation, plan: PrecisionPlan, blocks: int, ref_runs: dict) -> list[str]:
    """What this rank's compile log shows wrong (empty: every forward ran the same graphs, no more
    than the reference's, compiled where owed). ``ref_runs``: the reference's graph runs per
    segment, over its emulated data ranks."""
    c = obs.contracts
    if c.compiles is None:
        return ["no compile log: the blocks were not compiled"]
    world, problems, first = cell.topology().data_world, [], None
    allowed = _compiles_allowed(cell, plan)
    for s, seg in _segments(cell):
        forwards = len(cell.eval_labels(s)) if seg == "eval" else 1
        got, ref = c.graph_runs.get((s, seg), 0) / forwards, ref_runs.get((s, seg), 0) / world / forwards
        if first is None or (seg != "eval" and (s, seg) in allowed):  # a training forward that compiles anew
            first = got
        if not blocks <= got <= ref or got != first:
            problems.append(f"step {s} {seg}: {got:g} graphs per forward (the first forward's {first:g}, the "
                            f"reference's {ref:g}, {blocks} compiled blocks)")
        eager = [b for b in compiled_names(cell) if c.block_runs.get((s, seg, b), 0) < forwards]
        if eager:  # the count alone: one block's graphs split at FSDP's hooks can make up for another's
            problems.append(f"step {s} {seg}: {', '.join(eager)} ran no graph (eagerly)")
    problems += [f"recompiled at step {s} {seg}" for s, seg in sorted({tuple(w) for w in c.compiles} - allowed)]
    if not c.compiles:
        problems.append("no graph was compiled")
    return problems


def check(cell: Cell, obs: Observation, plan: PrecisionPlan, base: dict, blocks: int,
          ref_runs: dict) -> list[Record]:
    """One ``compile.graphs`` record for this rank (none for an eager cell)."""
    if cell.compile == "none":
        return []
    if not blocks:
        return [Record(**base, check="compile.graphs", name=cell.compile, verdict=Verdict.ERROR,
                       detail="compile claimed, but the fixture declares no blocks to compile")]
    problems = graph_problems(cell, obs, plan, blocks, ref_runs)
    runs = sum(obs.contracts.graph_runs.values())
    compiled = len(obs.contracts.compiles or [])
    expected = (f"every forward runs the first forward's graphs, >= {blocks} and <= the reference's, compiled only at "
                f"{', '.join(f'step {s} {g}' for s, g in sorted(_compiles_allowed(cell, plan)))}")
    observed = "; ".join(problems[:4]) if problems else f"{compiled} graphs compiled, {runs} graph runs"
    return [contract_row(base, "compile.graphs", cell.compile, not problems, expected, observed,
                         f"backend {cell.compile}, dynamo's graphs counted at the backend")]
