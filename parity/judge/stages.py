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
  names, identities and dtypes), ``checkpoint`` (optimizer state as DCP maps it, saving,
  loading and resuming).

Names and identities read right after the first forward (``@lazy_init``) belong to step 0's
``forward``.

A record without a step belongs to the first step of its stage. The ``stage`` record names
the stage and step, the check and tensor that failed first there (the worst of them), the
stages before it that held, and the checks of that stage and step that held (on HSDP,
``grad.partial`` holding where ``grad.shard`` fails puts the fault after the shard group's
reduce-scatter); the ``divergence`` record of a traced re-run narrows a forward
or backward stage down to a module. A cell that did not finish (``run``) has no stage.
"""

from __future__ import annotations

from parity.judge.record import Record, Verdict

#: The stages in training order (:data:`STAGE_OF` maps checks to them).
STAGES = ("setup", "gather", "forward", "backward", "collectives", "gradients", "clipping", "optimizer",
          "state-dict", "trained", "checkpoint")
_STEPPED = ("gather", "forward", "backward", "collectives", "gradients", "clipping", "optimizer")
STAGE_OF = {
    **dict.fromkeys(("plan", "names", "identity", "ownership", "placement", "dtype.storage", "unit.policy",
                     "buffer", "marker", "expected_error", "fallback"), "setup"),
    **dict.fromkeys(("dtype.compute", "gathered", "quant.gather", "quant.scale", "quant.blocks", "quant.values",
                     "quant.refresh"), "gather"),
    **dict.fromkeys(("output", "dtype.boundary", "dtype.output", "eval", "eval.reshard", "dtype.tp_reduce",
                     "tp.partial"), "forward"),
    "input_grad": "backward",
    **dict.fromkeys(("collectives", "dtype.reduce", "dtype.accum", "grad.accum", "grad.partial", "grad.shard",
                     "dtype.grad"),
                    "collectives"),
    **dict.fromkeys(("grad", "grad_norm", "ranks"), "gradients"),
    **dict.fromkeys(("clip", "grad.clipped"), "clipping"),
    **dict.fromkeys(("param", "optim.moments", "trajectory", "trajectory.emulation"), "optimizer"),
    "state_dict": "state-dict",
    **dict.fromkeys(("optim.state", "checkpoint.same", "checkpoint.cross", "checkpoint.moved",
                     "checkpoint.collectives"), "checkpoint"),
}
#: Setup checks taken again later, by the suffix of their name: on the trained model, and
#: right after the first forward (lazy initialization, step 0).
_LATER = {"@trained": "trained", "@lazy_init": "forward"}


def stage_of(r: Record) -> str:
    """The stage ``r`` judges ("" for records that judge no stage: coverage, the run itself). The
    ``collectives`` of a step's optimizer segment (an owner's reduction, the scaler's found-inf,
    the gradient norm) come after the backward's reductions: ``gradients``; a colwise layer's
    ``tp.partial`` (``MODULE@backward``) is the backward's."""
    stage = STAGE_OF.get(r.check, "")
    if r.check == "collectives" and r.name == "optimizer":
        return "gradients"
    if r.check == "tp.partial" and str(r.name).endswith("@backward"):  # a colwise input gradient's
        return "backward"
    if stage == "setup":
        return next((later for suffix, later in _LATER.items() if str(r.name).endswith(suffix)), stage)
    return stage


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


def _where(r: Record) -> str:
    """The rank and micro-batch of ``r``'s worst tensor, as its detail opens by naming them."""
    head = str(r.detail).split(": ", 1)[0]
    return f" ({head})" if len(head) <= 120 and ("rank" in head or "micro-batch" in head) else ""


def first_stage(records: list[Record], steps: int, base: dict) -> Record | None:
    """The ``stage`` record of a cell whose records failed a staged check; None otherwise."""
    bad = [r for r in records if r.verdict in (Verdict.FAIL, Verdict.ERROR) and stage_of(r)]
    if not bad:
        return None
    first = min(_position(r, steps) for r in bad)
    here = [r for r in bad if _position(r, steps) == first]
    worst = max(here, key=lambda r: r.ratio if isinstance(r.ratio, float) else 0.0)
    step, index = first
    stage = STAGES[index]
    stepped = stage in _STEPPED
    ratio = f" (ratio {worst.ratio:.3g})" if isinstance(worst.ratio, float) and worst.ratio > 0 else ""
    if index == 0:
        held = []
    elif stepped:
        held = ["setup"] + (["step 0" if step == 1 else f"steps 0-{step - 1}"] if step else [])
        held += [f"{s} at step {step}" for s in _STEPPED[:_STEPPED.index(stage)]]
    else:
        held = ["setup", "every step", *STAGES[STAGES.index("state-dict"):index]]
    failed = {r.check for r in here}
    within = sorted({r.check for r in records if r.verdict == Verdict.PASS and stage_of(r)
                     and _position(r, steps) == first} - failed)
    detail = (f"first divergent stage: {stage}{f' at step {step}' if stepped else ''}: {worst.check} {worst.name}"
              f"{ratio}{_where(worst)}; {len(here)} failing record(s) there; "
              f"held before it: {', '.join(held) or 'nothing'}"
              f"{'; held within it: ' + ', '.join(within) if within else ''}")
    return Record(**base, check="stage", name=stage, step=step if stage in _STEPPED else "",
                  observed=worst.observed, allowed=worst.allowed, ratio=worst.ratio, dtype=worst.dtype,
                  verdict=Verdict.FAIL, detail=detail)
