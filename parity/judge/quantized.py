"""Contracts of quantized weight groups (FP8 all-gather), per quantized parameter.

- ``quant.gather``: measured on the wire, where ``torch.distributed`` issues FSDP's all-gather
  (not what the weight's extension reports it sends): every step's first forward all-gathers
  the weight's unit at the bytes its E4M3 payload makes (one byte per element of every rank's
  padded shard, the unit's other parameters in their compute dtypes), on every rank: a
  forward's all-gathers at those bytes are at least as many as the units that need them (a
  unit gathering other bytes is not covered by a neighbour of its size); one rank issues no
  all-gather (SKIP). The MX exponents travel in the extension's own gather, beside;
- ``quant.refresh``: the main weight was quantized exactly once per optimizer step, and no
  all-gather sent a quantization of an older main weight (a stale copy);
- ``quant.scale`` (tensorwise): every rank's shard was scaled from the *global* amax -- the
  scale of the whole main weight before the step;
- ``quant.blocks`` (MX): the gathered block exponents are the whole weight's, block by block
  (no block straddles a shard boundary); a step whose dequantization consumed none fails;
- both, a second oracle: every scale used is E4M3's own, read from torch and not from
  :mod:`parity.model.formats` (which derives the expectation above and the reference's
  quantization alike): the smallest power of two putting the amax within
  ``torch.finfo(torch.float8_e4m3fn).max`` (:func:`not_e4m3_scales`);
- ``quant.values``: every all-gather of a step (forward, backward, activation recompute)
  produced the same weight, the whole main weight quantized at once (the reference's), bitwise
  (:func:`parity.model.quantized.fingerprint`: a moved row or a flipped sign differs).

The main weight's FP32 storage is ``dtype.storage``; the effect on training is judged by the
numeric checks against the reference, which quantizes the same way.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from parity.execute.observation import Observation
from parity.judge.contracts import _row
from parity.judge.record import Record
from parity.matrix.cell import Cell
from parity.model import formats as F
from parity.model.plan import PrecisionPlan, TensorPlan
from parity.model.quantized import fingerprint


def _expected_payload(t: TensorPlan, shape: torch.Size, world: int) -> list[str]:
    padded = math.ceil(shape[0] / world)
    out = [f"uint8:{padded * shape[-1]}"]
    if t.format == "mxfp8":
        out.append(f"uint8:{padded * (shape[-1] // F.BLOCK)}")
    return out


def _wire_row(cell: Cell, observations: list[Observation], t: TensorPlan, plan: PrecisionPlan, befores: list,
              payload: str, base: dict) -> Record:
    """``quant.gather`` from the bytes of FSDP's all-gathers as ``torch.distributed`` saw them."""
    from parity.judge.collectives import unit_bytes
    from parity.judge.rows import skipped

    if cell.ranks == 1:
        return skipped(base, "quant.gather", t.fqn, "one rank: FSDP issues no all-gather, nothing travels")
    shapes = {f: tuple(w.shape) for f, w in befores[0].items()}
    problems, expected = [], ""
    for o in observations:
        unit = next((u for u in o.report.units if t.fqn in u.params), None) if o.report else None
        if unit is None:
            problems.append(f"rank {o.rank}: no unit holds {t.fqn}")
            continue
        for step in range(len(befores)):
            gathers = unit_bytes(cell, o, plan, shapes, step)[0]
            want = gathers[unit.root]
            needed = Counter(gathers.values())[want]  # the units whose all-gathers carry these bytes
            expected = (f"unit {unit.root or '<root>'} all-gathered at {want} bytes ({t.fqn}: {payload} per rank, "
                        "one E4M3 byte per element)")
            forwards = [Counter(calls) for (s, label, kind), calls in o.contracts.collectives.items()
                        if s == step and kind == "all-gather" and label.endswith("/forward")]
            got = max((c[want] for c in forwards), default=0)  # a forward gathers each unit at most once
            if got < needed:
                sizes = sorted({b for c in forwards for b in c})
                problems.append(f"step {step} rank {o.rank}: {got} forward all-gather(s) of {want} bytes for the "
                                f"{needed} unit(s) that need them (forward all-gathers of {sizes or 'nothing'} bytes)")
    return _row(base, "quant.gather", t.fqn, not problems, expected or f"{payload} per rank",
                "; ".join(problems[:4]) or "as expected", f"{t.format}: on the wire", "float8_e4m3fn")


def not_e4m3_scales(amax: torch.Tensor, scales: torch.Tensor) -> int:
    """How many of ``scales`` (one per amax) are not E4M3's: a power of two ``s`` with ``amax / s``
    in ``(max / 2, max]``, ``max`` the largest finite ``float8_e4m3fn`` as torch defines it (any
    power of two for an all-zero block). Independent of :func:`parity.model.formats.power_of_two_scale`,
    whose off-by-one exponent every other check would share."""
    top = torch.finfo(F.ELEMENT).max
    amax, scales = amax.double().flatten(), scales.double().flatten()
    exponent = torch.log2(scales)
    ratio = amax / scales
    ok = (exponent == exponent.round()) & (ratio <= top) & ((amax == 0) | (ratio > top / 2))
    return int((~ok).sum())


def unwitnessed(st, fmt: str, where: str) -> dict[str, list[str]]:
    """What of one rank's step of statistics ``st`` is missing, by check: a tensorwise all-gather
    without a scale from every rank of its group (``scale``), an all-gather whose dequantized
    weight was not read back (``values``). Nothing missing passes nothing: the values that are
    there are judged beside this."""
    missing: dict[str, list[str]] = {"scale": [], "values": []}
    if fmt == "fp8-tensorwise" and (not st.scale_ranks or len(st.scales) != st.gathers * st.scale_ranks):
        missing["scale"].append(f"{where}: {len(st.scales)} shard scale(s) received for {st.gathers} all-gather(s) "
                                f"over {st.scale_ranks or 'no'} ranks")
    if len(st.digests) != st.gathers:
        missing["values"].append(f"{where}: {st.gathers} all-gather(s), {len(st.digests)} dequantized weight(s) "
                                 "recorded")
    return missing


def _param_checks(cell: Cell, observations: list[Observation], t: TensorPlan, plan: PrecisionPlan, befores: list,
                  base: dict) -> list[Record]:
    rows, fqn = [], t.fqn
    shape = befores[0][fqn].shape
    want_payload = _expected_payload(t, shape, cell.ranks)
    refresh, scale, blocks, values = [], [], [], []
    for step, before in enumerate(befores):
        whole = before[fqn].float()
        want_scales = F.scales_of(whole, t.format)
        want_digest = fingerprint(F.fake_quantize(whole, t.format, t.compute))
        for o in observations:
            st = o.contracts.quant[step].get(fqn) if step < len(o.contracts.quant) else None
            if st is None or not st.gathers:  # no statistics: every check of this weight lacks its evidence
                for problems in (refresh, scale, blocks, values):
                    problems.append(f"step {step} rank {o.rank}: no all-gather statistics")
                continue
            missing = unwitnessed(st, t.format, f"step {step} rank {o.rank}")
            if st.quantized != 1 or st.stale:
                refresh.append(f"step {step} rank {o.rank}: quantized {st.quantized}x, {st.stale} stale all-gather(s)")
            if t.format == "fp8-tensorwise":
                bad = [s for s in st.scales if s != float(want_scales)]
                if bad:
                    scale.append(f"step {step} rank {o.rank}: shard scales {st.scales[:8]}, whole-tensor "
                                 f"{float(want_scales)}")
                amax = whole.abs().amax()
                if st.scales and not_e4m3_scales(amax.expand(len(st.scales)), torch.tensor(st.scales)):
                    scale.append(f"step {step} rank {o.rank}: scales {sorted(set(st.scales))[:4]} for amax "
                                 f"{float(amax):.6g}: not E4M3's smallest power of two")
                scale += missing["scale"]
            elif st.exponents is None:  # no MX dequantization ran: what the GEMM consumed is unknown
                blocks.append(f"step {step} rank {o.rank}: no block exponents consumed (the all-gather carried "
                              "no MX payload)")
            else:
                want = (torch.log2(want_scales) + 127).to(torch.uint8)
                differ = (st.exponents != want).any(dim=-1).nonzero().flatten().tolist()
                if differ:
                    blocks.append(f"step {step} rank {o.rank}: rows {differ[:6]} have other block exponents")
                used, amax = torch.exp2(st.exponents.double() - 127), F.block_amax(whole)
                wrong = not_e4m3_scales(amax, used) if used.shape == amax.shape else used.numel()
                if wrong:
                    blocks.append(f"step {step} rank {o.rank}: {wrong} of {used.numel()} block exponents are not "
                                  "E4M3's smallest power of two for their block's amax")
            values += missing["values"]
            off = [i for i, d in enumerate(st.digests) if d != want_digest]
            if off:
                values.append(f"step {step} rank {o.rank}: all-gather(s) {off[:6]} of {len(st.digests)} differ from "
                              "the whole weight quantized (values or their places)")
    fmt = t.format
    rows.append(_wire_row(cell, observations, t, plan, befores, want_payload[0], base))
    rows.append(_row(base, "quant.refresh", fqn, not refresh, "one quantization per step, none stale",
                     "; ".join(refresh) or "held", fmt, "float8_e4m3fn"))
    if fmt == "fp8-tensorwise":
        rows.append(_row(base, "quant.scale", fqn, not scale, "every shard scaled from the global amax",
                         "; ".join(scale) or "held", fmt, "float8_e4m3fn"))
    else:
        rows.append(_row(base, "quant.blocks", fqn, not blocks, f"the whole weight's {F.BLOCK}-element blocks",
                         "; ".join(blocks) or "held", fmt, "float8_e4m3fn"))
    rows.append(_row(base, "quant.values", fqn, not values, "every all-gather of a step = the whole weight quantized",
                     "; ".join(values) or "held", fmt, "float8_e4m3fn"))
    return rows


def check(cell: Cell, observations: list[Observation], plan: PrecisionPlan, befores: list[dict],
          base: dict) -> list[Record]:
    """``befores[k]``: the main weights before step ``k`` (what step ``k`` quantized)."""
    if observations[0].expected_error:
        return []
    rows = []
    for t in plan.params:
        if t.format != "none":
            rows += _param_checks(cell, observations, t, plan, befores, base)
    return rows
