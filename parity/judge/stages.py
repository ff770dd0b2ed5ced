"""``stage``: where a failing cell went wrong first, across the stages of training.

A cell's records already judge every stage it observes; what they do not say is which broke
*first*. A fault in a collective, the gradient scaler or a checkpoint reaches every later
stage, so the record with the highest ratio is rarely where it started. This module orders
the failing records the way training runs and names the earliest:

- ``setup``: what sharding built, before anything ran (the plan, names, identities,
  ownership, placements, storage dtypes, unit policies, buffers, FP32 markers);
- per step, in order: ``gather`` (the parameters as all-gathered for compute: their dtypes,
  their values against the masters they were gathered from, quantized copies), ``forward`` (outputs, boundary and output dtypes, evaluation forwards,
  tensor-parallel reductions), ``backward`` (the input's gradient), ``collectives`` (the
  step's all-gathers and reductions: counts, bytes, reduce, accumulation and kept gradient
  dtypes),
  ``gradients`` (each gradient as the reduction left it, divided by the loss scale, and
  the global norm after the scaler unscaled; the optimizer segment's collectives), ``clipping`` (the clipped norm and the gradient
  the optimizer steps with, where unscaling or clipping changed it: ``grad.clipped``),
  ``optimizer`` (the updated parameters and their trajectory);
- ``state-dict`` (state dicts taken during training), ``trained`` (the trained model's
  names, identities and dtypes), then the checkpoint lifecycle: ``checkpoint-save`` (the
  optimizer state as DCP maps it, every entry as the files hold it, the save's collectives),
  ``checkpoint-load`` (every entry right after loading, a moved checkpoint's entries and
  layouts, the load's collectives) and ``resumed`` (the step after loading).

Names and identities read right after the first forward (``@lazy_init``) belong to step 0's
``forward``.

Within a step's stage, records are ordered by micro-batch, then by the order in which training
reaches their checks (:data:`ORDER`: a reduce-scatter's input before its output); a record
without a step belongs to the first step of its stage, one without a micro-batch to the first
micro-batch. The ``stage`` record names the first stage and step, the micro-batch and rank
(where the record names them), the check and tensor that failed first there (the worst of the
records tied for first), the stages before it that held, and the checks of that stage and step
that held (on HSDP,
``grad.partial`` holding where ``grad.shard`` fails puts the fault after the shard group's
reduce-scatter); the ``divergence`` record of a traced re-run narrows a forward
or backward stage down to a module. A cell that did not finish (``run``) has no stage.
"""

from __future__ import annotations

import re

from parity.judge.record import Record, Verdict

#: The stages in training order, each with its checks in the order training reaches them.
ORDER = {
    "setup": ("plan", "names", "identity", "ownership", "placement", "dtype.storage", "unit.policy", "buffer",
              "marker", "expected_error", "fallback"),
    "gather": ("quant.scale", "quant.blocks", "quant.values", "quant.gather", "quant.refresh", "dtype.compute",
               "unshard", "gathered"),
    "forward": ("compile.graphs", "dtype.boundary", "tp.partial", "dtype.tp_reduce", "output", "dtype.output", "eval", "eval.reshard",
                "reshard.forward"),
    "backward": ("finalize.flagged", "tp.partial", "input_grad", "recompute"),
    "collectives": ("grad.accum", "dtype.reduce", "reshard.backward", "grad.freed", "collectives", "grad.partial",
                    "dtype.accum", "grad.shard", "dtype.grad"),
    "gradients": ("grad", "collectives", "grad_norm", "ranks"),
    "clipping": ("clip", "grad.clipped"),
    "optimizer": ("lr", "optim.moments", "param", "trajectory", "trajectory.emulation"),
    "state-dict": ("state_dict",),
    "trained": ("names", "identity", "dtype.storage"),
    "checkpoint-save": ("optim.state", "checkpoint.collectives", "checkpoint.saved"),
    "checkpoint-load": ("checkpoint.collectives", "checkpoint.loaded", "checkpoint.moved"),
    "resumed": ("checkpoint.same", "checkpoint.cross", "checkpoint.moved", "checkpoint.collectives"),
}
STAGES = tuple(ORDER)
_STEPPED = ("gather", "forward", "backward", "collectives", "gradients", "clipping", "optimizer")
#: Check -> the first stage that lists it (:func:`stage_of` places the others by the record's name).
STAGE_OF: dict[str, str] = {}
for _stage, _checks in ORDER.items():
    for _check in _checks:
        STAGE_OF.setdefault(_check, _stage)
#: Setup checks taken again later, by the suffix of their name: on the trained model, and
#: right after the first forward (lazy initialization, step 0).
_LATER = {"@trained": "trained", "@lazy_init": "forward"}
#: Where each kind of per-parameter entry a rank may lack comes from (``ranks`` ``held:KIND``):
#: a gradient or reduced gradient from FSDP's reduction, a parameter or moment from the step.
_HELD = {"held:grad": "collectives", "held:reduced": "collectives", "held:param": "optimizer",
         "held:moment": "optimizer"}
#: Checkpoint records by what their name or detail says they judge: a checkpoint's collectives
#: by phase (``TARGET:save``, ``:load``, ``:step``), a moved checkpoint's entries, layouts and
#: gradients held after its load, and a lifecycle that failed by where it failed.
_CHECKPOINT_PHASE = {":save": "checkpoint-save", ":load": "checkpoint-load", ":step": "resumed"}


def _checkpoint_stage(r: Record) -> str:
    name = str(r.name)
    if r.check == "checkpoint.collectives":
        return next((stage for suffix, stage in _CHECKPOINT_PHASE.items() if name.endswith(suffix)), "resumed")
    if r.verdict == Verdict.ERROR:
        return "checkpoint-save" if "saving" in str(r.detail) else "checkpoint-load"
    if r.check == "checkpoint.moved":
        return "checkpoint-load" if ":entry:" in name or ":layout:" in name or name.endswith(":grads") else "resumed"
    return STAGE_OF[r.check]


def stage_of(r: Record) -> str:
    """The stage ``r`` judges ("" for records that judge no stage: coverage, the run itself). The
    ``collectives`` of a step's optimizer segment (an owner's reduction, the scaler's found-inf,
    the gradient norm) come after the backward's reductions: ``gradients``; a colwise layer's
    ``tp.partial`` (``MODULE@backward``) is the backward's."""
    stage = STAGE_OF.get(r.check, "")
    if r.check == "ranks" and r.name in _HELD:
        return _HELD[r.name]
    if r.check == "collectives" and r.name == "optimizer":
        return "gradients"
    if r.check == "tp.partial" and str(r.name).endswith("@backward"):  # a colwise input gradient's
        return "backward"
    if r.check.startswith("checkpoint."):
        return _checkpoint_stage(r)
    if stage == "setup":
        return next((later for suffix, later in _LATER.items() if str(r.name).endswith(suffix)), stage)
    return stage


_RANK = re.compile(r"\brank ?(\d+)")
_MICROBATCH = re.compile(r"(?:\bmicro-batch |\bmb)(\d+)\b")


def coordinates(r: Record) -> tuple[int | None, int | None]:
    """(rank, micro-batch) that ``r`` names first, in its name (``rank1/mb0``, ``mb0/backward``)
    or its detail (``rank 1 ... micro-batch 0``); None where it names none (a record judging a
    whole tensor assembled from every rank, or a whole step)."""
    found = []
    for pattern in (_RANK, _MICROBATCH):
        hit = pattern.search(str(r.name)) or pattern.search(str(r.detail))
        found.append(int(hit.group(1)) if hit else None)
    return found[0], found[1]


_FQN = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)+")
_STATE_KEY = re.compile(r"[./](?:exp_avg_sq|exp_avg|momentum_buffer|step)(?::dtype)?$")


def tensor_of(r: Record) -> str:
    """The parameter, buffer or module FQN ``r`` judges, from its name (``blocks.0.w``,
    ``w@sharded``, ``buffer:w``, ``native:entry:optim/w/exp_avg``, ``legacy:param:w``); "" for a
    record about no single tensor (a micro-batch's output, a segment's collectives, the global
    norm, the root's boundary, every name)."""
    name = str(r.name).removesuffix(":dtype").rsplit(":", 1)[-1]
    name = _STATE_KEY.sub("", name.split("@", 1)[0])
    if name.startswith(("model/", "optim/")):
        name = name.split("/", 1)[1]
    return name if _FQN.fullmatch(name) else ""


def _position(r: Record, steps: int) -> tuple[int, int]:
    """(step, stage index): setup before step 0, after-training stages after the last step."""
    stage = stage_of(r)
    if stage == "setup":
        step = -1
    elif stage in _STEPPED:
        step = int(r.step) if str(r.step) != "" else 0
    else:
        step = steps
    return step, STAGES.index(stage)


def _within(r: Record, stage: str) -> tuple[int, int]:
    """(micro-batch, check's place in its stage): the order within one step's stage."""
    checks = ORDER[stage]
    return coordinates(r)[1] or 0, checks.index(r.check) if r.check in checks else len(checks)


def _where(r: Record) -> str:
    """``, micro-batch M, rank R`` as far as ``r`` names them (:func:`coordinates`)."""
    rank, microbatch = coordinates(r)
    return "".join(f", {what} {n}" for what, n in (("micro-batch", microbatch), ("rank", rank)) if n is not None)


def _also(r: Record) -> list[str]:
    """The further ranks a record names as failing beside its own (``grad.shard``'s
    :data:`parity.judge.shards.ALSO`)."""
    from parity.judge.shards import ALSO

    _, found, rest = str(r.detail).partition(ALSO)
    return re.findall(r"\d+", rest.split(";")[0]) if found else []


def _other_ranks(here: list[Record], worst: Record) -> str:
    """``; rank(s) R failed at this stage too``: the other ranks whose records failed at the same step and stage as
    ``worst`` (every rank is a witness: a fault on every rank reads differently from one on one)."""
    named = {coordinates(r)[0] for r in here} | {int(n) for r in here for n in _also(r)}
    others = sorted(named - {None, coordinates(worst)[0]})
    if not others or coordinates(worst)[0] is None:
        return ""
    return f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed at this stage too"


#: The stages of the checkpoint lifecycle, which runs the steps before its resume step again,
#: saves, loads and repeats the resume step (:attr:`parity.matrix.cell.Cell.resume_step`).
_LIFECYCLE = ("checkpoint-save", "checkpoint-load", "resumed")


def first_stage(records: list[Record], steps: int, base: dict, resume_step: int = 0) -> Record | None:
    """The ``stage`` record of a cell whose records failed a staged check; None otherwise. Only the
    cell's own records count: a record judged here and filed under another cell (a load of this
    cell's checkpoint that failed in another path is that path's ERROR) locates nothing here.
    A lifecycle stage says which step's checkpoint (``resume_step``: the step it resumes at)."""
    records = [r for r in records if r.cell == base["cell"]]
    bad = [r for r in records if r.verdict in (Verdict.FAIL, Verdict.ERROR) and stage_of(r)]
    if not bad:
        return None
    first = min(_position(r, steps) for r in bad)
    here = [r for r in bad if _position(r, steps) == first]
    step, index = first
    stage = STAGES[index]
    earliest = min(_within(r, stage) for r in here)
    tied = [r for r in here if _within(r, stage) == earliest]
    worst = max(tied, key=lambda r: r.ratio if isinstance(r.ratio, float) else 0.0)
    stepped = stage in _STEPPED
    ratio = f" (ratio {worst.ratio:.3g})" if isinstance(worst.ratio, float) and worst.ratio > 0 else ""
    if index == 0:
        held = []
    elif stepped:
        held = ["setup"] + (["step 0" if step == 1 else f"steps 0-{step - 1}"] if step else [])
        held += [f"{s} at step {step}" for s in _STEPPED[:_STEPPED.index(stage)]]
    else:
        held = ["setup", "every step of the run", *STAGES[STAGES.index("state-dict"):index]]
    when = (f" (the checkpoint saved after step {resume_step - 1}, resumed at step {resume_step})"
            if stage in _LIFECYCLE and resume_step else "")
    failed = {r.check for r in here}
    within = sorted({r.check for r in records if r.verdict == Verdict.PASS and stage_of(r)
                     and _position(r, steps) == first} - failed)
    tensor = f"; tensor {tensor_of(worst)}" if tensor_of(worst) else ""
    detail = (f"first divergent stage: {stage}{f' at step {step}' if stepped else when}{_where(worst)}: "
              f"{worst.check} {worst.name}{ratio}{tensor}{_other_ranks(here, worst)}; {len(here)} failing record(s) there; "
              f"held before it: {', '.join(held) or 'nothing'}"
              f"{'; held within it: ' + ', '.join(within) if within else ''}")
    return Record(**base, check="stage", name=stage, step=step if stage in _STEPPED else "",
                  observed=worst.observed, allowed=worst.allowed, ratio=worst.ratio, dtype=worst.dtype,
                  verdict=Verdict.FAIL, detail=detail)
