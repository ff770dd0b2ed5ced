"""Checkpoints that move (worker side): saved on one layout, loaded on another.

Real jobs resume on another number of GPUs or another mesh. For a cell with ``move`` set
(:meth:`parity.matrix.cell.Cell.move_layouts`), the saving layout trains
:attr:`~parity.matrix.cell.Cell.resume_step` steps and saves (DCP); then it trains one more
step itself (the uninterrupted run of that checkpoint) while the loading layout, sharded by
each target path, loads the checkpoint and trains the same step. A layout with fewer ranks
than the cell's trains the other ranks' batches as micro-batches, so both train on the same
global batch.

Each rank reports the layout (type, placements) of every state entry in the fresh model
before loading and after; rank 0 also reports every entry's whole value at the save and
after the load, and the step that followed on each side (whole tensors), for
:mod:`parity.judge.moved` to compare.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.tensor import DTensor

from parity.digests import value_sha256
from parity.errors import IsolationError, brief
from parity.execute import collectives, dcp_files, lifecycle, parallel, state_dicts
from parity.execute.observation import NORM, RATES, Moved, Observation
from parity.execute.training import Sharded, build, freeze_schedule, train_step, within
from parity.faults import Injector
from parity.matrix.cell import Cell

FAILURES = lifecycle.FAILURES
#: Subgroups of the first n ranks, made once per process (creating one is a collective).
_SUBMESHES: dict[tuple[int, str], object] = {}


def _mesh(layout: Cell, *, world: int, rank: int, world_mesh, device_type: str):
    """The 1-D mesh (and process group) the layout's ranks train on; None on a rank outside
    it. A layout on fewer ranks uses the first ones. Every rank must call this (new_group)."""
    if layout.ranks == world:
        return world_mesh, None
    key = (layout.ranks, device_type)
    if key not in _SUBMESHES:
        group = dist.new_group(list(range(layout.ranks)))
        mesh = None
        if rank < layout.ranks:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, device_type, mesh=list(range(layout.ranks)))
        _SUBMESHES[key] = (mesh, group)
    mesh, group = _SUBMESHES[key]
    return (mesh, group) if rank < layout.ranks else (None, None)


def _fold(cell: Cell, layout: Cell) -> int:
    """How many of the cell's data ranks each of ``layout``'s ranks trains (:func:`parity.execute.training.train_step`)."""
    return cell.ranks // layout.ranks


def _data(cell: Cell, layout: Cell):
    """(rank, micro-batch) of ``layout`` -> the cell's (data rank, micro-batch) it trains."""
    if layout.ranks == cell.ranks:
        return None
    return lambda r, m: (r + (m // cell.microbatches) * layout.ranks, m % cell.microbatches)


def describe(layout: Cell, path: str) -> str:
    return f"{path} on {layout.mesh} x {layout.ranks} rank{'s' if layout.ranks > 1 else ''}"


def _layout(v) -> str:
    if not isinstance(v, torch.Tensor):
        return type(v).__name__
    kind, placements = state_dicts.layout(v)
    return f"{kind}({placements}) over mesh {tuple(v.device_mesh.shape)}" if isinstance(v, DTensor) else kind


def _layouts(s: Sharded) -> dict[str, str]:
    msd, osd = dcp_state_dict.get_state_dict(s.model, s.opt)
    entries = dcp_files.flat({"model": msd, "optim": osd}, _layout)
    return {k: v for k, v in entries.items() if not k.startswith("optim/param_groups/")}


def _step(cell: Cell, layout: Cell, s: Sharded, *, rank: int, device, heartbeat) -> dict:
    """Train :attr:`Cell.resume_step` on ``layout``; its gradients, parameters and optimizer
    state, whole (collectives over the layout's ranks), its learning rates as it took them and as
    it left them for the next step (:data:`RATES`), and with clipping the global norm it clipped
    with (:data:`NORM`)."""
    obs = Observation(rank=rank)
    train_step(layout, s, cell.resume_step, rank=rank, world=layout.ranks, device=device, obs=obs,
               heartbeat=heartbeat, data=_data(cell, layout), keep=parallel.full, fold=_fold(cell, layout))
    state = {k: v for k, v in lifecycle.snapshot(s).items() if k.startswith("optim/") and not k.startswith("optim/param_groups")}
    norm = {NORM: torch.tensor(obs.grad_norms[0], dtype=torch.float64)} if layout.clip else {}
    return {**{f"grad:{f}": g for f, g in obs.grads[0].items()},
            **{f"param:{f}": p for f, p in obs.params[0].items()}, **state, **norm,
            RATES: [list(r) for r in obs.lrs[0]]}


def _save(cell: Cell, layout: Cell, mesh, group, ckpt: str, *, rank: int, device, inject: Injector,
          heartbeat, segments: collectives.Segments) -> tuple[dict, dict]:
    s = build(layout, cell.path, mesh=mesh, device=device, inject=inject)
    for step in range(cell.resume_step):
        train_step(layout, s, step, rank=rank, world=layout.ranks, device=device, obs=Observation(rank=rank),
                   heartbeat=heartbeat, data=_data(cell, layout), fold=_fold(cell, layout))
    saved = lifecycle.snapshot(s)
    with segments.counted(cell.resume_step, "checkpoint/save"):
        lifecycle.save(s, ckpt, group)
    heartbeat("moved checkpoint saved")
    return saved, _step(cell, layout, s, rank=rank, device=device, heartbeat=heartbeat)


def _load(cell: Cell, layout: Cell, target: str, mesh, group, ckpt: str, *, rank: int, device, inject: Injector,
          heartbeat) -> Moved:
    s = build(layout, target, mesh=mesh, device=device, inject=inject)
    freeze_schedule(s, cell.resume_step - 1)  # the freeze state the checkpoint was saved in
    lifecycle.init_optimizer_state(s.opt)  # before DCP's helpers read the fresh optimizer
    before = _layouts(s)
    segments = collectives.Segments(collectives.functional_scope(layout))
    with segments.counted(cell.resume_step, "checkpoint/load"):
        lifecycle.load(s, ckpt, group)
    heartbeat(f"moved checkpoint loaded into {target}")
    after, loaded = _layouts(s), lifecycle.snapshot(s)
    held = lifecycle.held_grads(s.model)
    resumed = _step(cell, layout, s, rank=rank, device=device, heartbeat=heartbeat)
    keep = rank == 0
    witness = {f"{what}:{k}": value_sha256(v) for what, values in (("loaded", loaded), ("resumed", resumed))
               for k, v in values.items()}
    return Moved(taken=s.report.taken, before=before, after=after, loaded=loaded if keep else {},
                 resumed=resumed if keep else {}, witness=witness, collectives=segments.calls, held_grads=held,
                 regathered=lifecycle.regathered(s.model))


def _agree(error: str, skip: str, world: int) -> tuple[str, str]:
    """The first rank's error and skip reason, on every rank (one collective), so that all ranks
    stop together."""
    if world == 1:
        return error, skip
    seen: list = [None] * world
    dist.all_gather_object(seen, (error, skip))
    return tuple(next((f"rank {r}: {pair[i]}" for r, pair in enumerate(seen) if pair[i]), "") for i in (0, 1))


def _unsupported(cell: Cell) -> str:
    """Why this cell's checkpoint cannot move (empty: it can)."""
    from parity.model.registry import get_fixture

    fixture = get_fixture(cell.fixture, cell.source)
    if cell.move in ("shrink", "grow") and fixture.ignored_reduction == "sum" \
            and fixture.ignored(fixture.make(cell.seed, "meta")):
        return ("the fixture's FSDP-ignored parameters are summed over the ranks by their owner (ignored_reduction "
                "'sum') while micro-batches average: on another number of ranks that is another recipe")
    return ""


def moved(cell: Cell, *, rank: int, world: int, mesh, device, inject: Injector,
          heartbeat=lambda what: None) -> dict[str, Moved]:
    """Save on the cell's saving layout, load into each target path on its loading layout,
    train one step on both; what each rank saw, per target path."""
    save_l, load_l = cell.move_layouts()
    device_type = torch.device(device).type
    save_mesh, save_group = _mesh(save_l, world=world, rank=rank, world_mesh=mesh, device_type=device_type)
    load_mesh, load_group = _mesh(load_l, world=world, rank=rank, world_mesh=mesh, device_type=device_type)
    targets = cell.load_targets
    label = {t: dict(save=describe(save_l, cell.path), load=describe(load_l, t)) for t in targets}
    ckpt = [tempfile.mkdtemp(prefix="parity-moved-") if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(ckpt, src=0)
    saved, straight, error, skip = {}, {}, "", ""
    saving = collectives.Segments(collectives.functional_scope(save_l))
    try:
        if save_mesh is not None:
            try:
                skip = _unsupported(cell)
                if not skip:
                    saved, straight = _save(cell, save_l, save_mesh, save_group, ckpt[0], rank=rank, device=device,
                                            inject=inject, heartbeat=within("moved checkpoint: saving", heartbeat),
                                            segments=saving)
            except FAILURES as exc:
                error = f"saving on {describe(save_l, cell.path)} failed: {brief(exc)}"
        error, skip = _agree(error, skip, world)
        if error or skip:
            return {t: Moved(**label[t], error=error, skip=skip) for t in targets}
        out = {}
        for t in targets:
            if load_mesh is None:
                out[t] = Moved(**label[t], part=False)
                continue
            try:
                out[t] = _load(cell, load_l, t, load_mesh, load_group, ckpt[0], rank=rank, device=device,
                               inject=inject, heartbeat=within(f"moved checkpoint: loading into {t}", heartbeat))
            except IsolationError as exc:
                out[t] = Moved(skip=f"{t} cannot shard this fixture: {exc}")
            except FAILURES as exc:
                out[t] = Moved(error=f"loading into {describe(load_l, t)} failed: {brief(exc)}")
            out[t].save, out[t].load = label[t]["save"], label[t]["load"]
        out[cell.path].collectives.update(saving.calls)
        if rank == 0:
            out[cell.path].saved, out[cell.path].straight = saved, straight
        return out
    finally:
        if world > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt[0], ignore_errors=True)
