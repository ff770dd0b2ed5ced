"""Contracts that need their own models (worker side): FP32 markers across a device move,
optimizer state by FQN, and the DCP checkpoint lifecycle (save, load into the same path and
into another, resume)."""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parity.digests import value_sha256
from parity.errors import IsolationError, brief
from parity.execute import collectives, dcp_files, probes
from parity.execute.observation import MarkerSeen, Observation, Resumed
from parity.execute.training import build, freeze_schedule, observed, train_step, within
from parity.faults import Injector
from parity.matrix.cell import Cell
from parity.model.dtypes import dtype_name
from parity.model.markers import convert_except_marked, fp32_marked
from parity.model.plan import canonical_fqn
from parity.model.quantized import plain_state
from parity.model.registry import get_fixture

#: What a failed save or load raises: DCP gathers every rank's error into a CheckpointException,
#: which derives from BaseException, not Exception.
FAILURES = (Exception, CheckpointException)


def _move(model: nn.Module, device) -> None:
    """A real device move on accelerators; on CPU, ``_apply`` with a copy, which replaces
    buffer objects exactly as a CPU->GPU move does."""
    if torch.device(device).type == "cpu":
        model._apply(lambda t: t.clone())
    else:
        model.to(device)


def marker_contract(cell: Cell, device) -> dict[str, MarkerSeen]:
    """Mark (as the fixture declares), move, convert to BF16; each marked tensor's fate."""
    model = get_fixture(cell.fixture, cell.source).make(cell.seed)
    marked = sorted(fp32_marked(model))
    buffers = dict(model.named_buffers())
    _move(model, device)
    survived = fp32_marked(model)
    convert_except_marked(model, torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        name: MarkerSeen(kind="buffer" if name in buffers else "param", after_move=name in survived,
                         dtype=dtype_name(tensors[name].dtype))
        for name in marked
    }


def optimizer_state(cell: Cell, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """FQN -> {state key: tensor or value}, as DCP's state-dict helpers map it; tensors as
    the cell's ranks record them (local shards, or whole on a 2-D composition)."""
    _, osd = dcp_state_dict.get_state_dict(model, opt)
    keep = observed(cell)
    return {canonical_fqn(k): {sk: keep(v) if isinstance(v, torch.Tensor) else v for sk, v in st.items()}
            for k, st in osd["state"].items()}


def resume(cell: Cell, *, rank: int, world: int, mesh, device, inject: Injector,
           heartbeat=lambda what: None) -> dict[str, Resumed]:
    """Train ``cell.resume_step`` steps, save (DCP); load into a fresh model on the same path and
    on the cell's cross-load target (the baseline, or for the baseline the path it is
    compared with); train one more step. What each resumed run saw is compared with the
    uninterrupted run's same step. ``inject`` is the cell's: what breaks its training breaks
    these runs' too, so a resumed run is judged under the same conditions."""
    ckpt_dir = [tempfile.mkdtemp(prefix="parity-dcp-") if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(ckpt_dir, src=0)
    out: dict[str, Resumed] = {}
    saving = collectives.Segments(collectives.functional_scope(cell))
    targets = cell.load_targets
    try:
        try:
            handed, disturbed = _save(cell, ckpt_dir[0], rank=rank, world=world, mesh=mesh, device=device, inject=inject,
                           heartbeat=within("checkpoint lifecycle: saving", heartbeat), segments=saving)
        except FAILURES as exc:  # the cell's own evidence stands; this is an ERROR beside it
            return {cell.path: Resumed(error=f"saving the checkpoint failed: {brief(exc)}")}
        written, unread = _written(ckpt_dir[0]) if rank == 0 else ({}, "")
        for target in targets:
            try:
                out[target] = _load_and_step(cell, target, ckpt_dir[0], rank=rank, world=world, mesh=mesh,
                                             device=device, inject=inject,
                                             heartbeat=within(f"checkpoint lifecycle: loading into {target}", heartbeat))
            except IsolationError as exc:
                out[target] = Resumed(skip=f"{target} cannot shard this fixture: {exc}")
            except FAILURES as exc:  # recorded against the path that failed
                out[target] = Resumed(error=f"loading into {target} failed: {brief(exc)}")
        if cell.path in out:
            out[cell.path].collectives.update(saving.calls)
            out[cell.path].saved, out[cell.path].written, out[cell.path].unread = handed, written, unread
            out[cell.path].disturbed = disturbed
    finally:
        if world > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt_dir[0], ignore_errors=True)
    return out


def _state(s) -> dict:
    """What a checkpoint holds: model and optimizer state (DCP's sharded state dicts) and the
    training state beside them (:func:`_recipe_state`)."""
    msd, osd = dcp_state_dict.get_state_dict(s.model, s.opt)
    return {"model": plain_state(msd), "optim": osd, **_recipe_state(s)}


def _recipe_state(s) -> dict:
    """The recipe's own state a checkpoint holds: in float16 the gradient scaler's (the loss
    scale), with a schedule the learning-rate scheduler's (the step it is at)."""
    state = {}
    if s.scaler is not None:
        state["scaler"] = s.scaler.state_dict()
    if s.sched is not None:
        state["scheduler"] = s.sched.state_dict()
    return state


def _value(v):
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def snapshot(s) -> dict:
    """Every entry of what a checkpoint of ``s`` holds, whole (:func:`parity.execute.dcp_files.flat`
    names them): a collective over ``s``'s ranks, each of which gets every entry."""
    opts = dcp_state_dict.StateDictOptions(full_state_dict=True)
    msd, osd = dcp_state_dict.get_state_dict(s.model, s.opt, options=opts)
    return dcp_files.flat({"model": plain_state(msd), "optim": osd, **_recipe_state(s)}, _value)


def _piece(v):
    if isinstance(v, DTensor):
        return _value(v.to_local()), probes.region(v)
    return _value(v), ()


def pieces(s) -> dict:
    """Every entry of what a checkpoint of ``s`` holds, as this rank holds it: ``(value, region)``,
    a DTensor's local piece and where it sits in the whole (:func:`parity.execute.probes.region`),
    any other value whole (region ``()``). No collective: DCP's sharded state dicts."""
    return dcp_files.flat(_state(s), _piece)


def save(s, ckpt: str, group=None) -> None:
    """Save ``s`` (a :class:`~parity.execute.training.Sharded`) with DCP over ``group`` (default: all
    ranks), to files it does not fsync: the checkpoint is read back by this process and deleted."""
    dcp.save(_state(s), storage_writer=dcp.FileSystemWriter(ckpt, sync_files=False), process_group=group)


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state with one step of zero gradients at learning rate 0, each
    gradient in its parameter's ``grad_dtype``. DCP's state-dict helpers do the same on a fresh
    optimizer but with gradients in the parameter's dtype (torch 2.15), which a parameter whose
    ``grad_dtype`` differs rejects; a recipe with such parameters initializes the state itself.
    Nothing to do when every gradient dtype is the parameter's (DCP's own initialization runs)."""
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
    if opt.state or all(p.grad_dtype in (None, p.dtype) for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p, dtype=p.grad_dtype)
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)


#: What an entry holds before a load, so that one the load does not read stays visibly unread.
SENTINEL = float("nan")


def _blanked(value):
    """``value`` (a state dict, nested) with every floating tensor filled with :data:`SENTINEL` in
    place and every number replaced by it (``params`` lists and flags kept). A fresh model of the
    same seed and recipe already equals much of a checkpoint (constant buffers, parameters frozen
    so far, hyperparameters, step counters at the first resume): an entry the load skipped would
    then match the files by coincidence, and ``checkpoint.loaded`` could not fail on it."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            with torch.no_grad():
                value.fill_(SENTINEL)
        return value
    if isinstance(value, dict):
        return {k: v if k == "params" else _blanked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_blanked(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return SENTINEL
    return value


def load(s, ckpt: str, group=None) -> None:
    """Load a checkpoint into ``s`` with DCP over ``group`` and set its model, optimizer, scaler and scheduler;
    every entry is blanked first (:func:`_blanked`), so what the load does not read shows -- the
    live optimizer's hyperparameters too, so that what ``set_state_dict`` does not set shows."""
    init_optimizer_state(s.opt)
    state = _blanked(_state(s))
    # after _state, whose helpers step a fresh optimizer once with them; never an optimizer still
    # without state, which set_state_dict would step so again (NaN parameters)
    for hyper in s.opt.param_groups if s.opt.state else ():
        hyper.update(_blanked(hyper))  # its params kept
    dcp.load(state, checkpoint_id=ckpt, process_group=group)
    if s.scaler is not None:
        s.scaler.load_state_dict(state["scaler"])
    dcp_state_dict.set_state_dict(s.model, s.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if s.sched is not None:  # after the optimizer, as recipes restore it: what it sets in the groups stands
        s.sched.load_state_dict(state["scheduler"])


def _save(cell: Cell, ckpt: str, *, rank: int, world: int, mesh, device, inject: Injector, heartbeat,
          segments: collectives.Segments) -> tuple[dict, list[str]]:
    """Train ``cell.resume_step`` steps on the cell's path and save model, optimizer (and scaler) with
    DCP; the save's collectives go to ``segments`` (``checkpoint/save``). Returns every entry as this
    rank handed it to DCP (:func:`pieces`, taken outside the counted save) and the entries the save
    changed in the live model or optimizer."""
    first = build(cell, cell.path, mesh=mesh, device=device, inject=inject)
    for step in range(cell.resume_step):
        train_step(cell, first, step, rank=rank, world=world, device=device, obs=Observation(rank=rank),
                   heartbeat=heartbeat)
    handed = pieces(first)
    with segments.counted(cell.resume_step, "checkpoint/save"):
        save(first, ckpt)
    heartbeat("checkpoint saved")
    # a training job carries on after it saves: the save must leave its state alone, bitwise
    before, after = _digests(handed), _digests(pieces(first))
    return handed, [k for k in dict.fromkeys([*before, *after]) if before.get(k) != after.get(k)]


def _digests(entries: dict) -> dict:
    """:func:`pieces` entries as (digest of the value, region): equal only when bitwise equal."""
    return {k: (value_sha256(v), region) for k, (v, region) in entries.items()}


def _written(ckpt: str) -> tuple[dict, str]:
    """The checkpoint's files as bytes (:func:`parity.execute.dcp_files.files`), or why they could
    not be read."""
    try:
        return dcp_files.files(ckpt), ""
    except OSError as exc:  # an unreadable checkpoint is evidence, judged as such
        return {}, f"{type(exc).__name__}: {exc}"


def _load_and_step(cell: Cell, target: str, ckpt: str, *, rank: int, world: int, mesh, device, inject: Injector,
                   heartbeat) -> Resumed:
    """Load the checkpoint into a fresh model sharded by ``target`` and train one more step, counting
    the collectives of both (``checkpoint/load``, then the step's segments); every entry as the load
    left it on this rank is kept (:func:`pieces`, between the two, uncounted)."""
    s = build(cell, target, mesh=mesh, device=device, inject=inject)
    freeze_schedule(s, cell.resume_step - 1)  # the freeze state the checkpoint was saved in
    segments = collectives.Segments(collectives.functional_scope(cell))  # counted as the uninterrupted step
    with segments.counted(cell.resume_step, "checkpoint/load"):
        load(s, ckpt)
    heartbeat(f"checkpoint loaded into {target}")
    loaded = pieces(s)  # uncounted: parity's reading, not the load's
    held = held_grads(s.model)
    obs = Observation(rank=rank)
    with segments.counted():
        train_step(cell, s, cell.resume_step, rank=rank, world=world, device=device, obs=obs, heartbeat=heartbeat,
                   segments=segments, state_dicts=True)  # the step as the loop ran it, state dicts included
    optim = optimizer_state(cell, s.model, s.opt)
    return Resumed(taken=s.report.taken, grads=obs.grads[0], params=obs.params[0], optim=optim, lrs=obs.lrs[0],
                   collectives=segments.calls, loaded=loaded, held_grads=held, regathered=regathered(s.model))


def held_grads(model: nn.Module) -> list[str]:
    """The parameters of ``model`` holding a gradient (right after a load: none is owed)."""
    return [canonical_fqn(n) for n, p in model.named_parameters() if p.grad is not None]


def regathered(model: nn.Module) -> dict[str, tuple]:
    """What the next forward would compute with after the resumed step: every FSDP unit gathered
    explicitly (uncounted: parity's reading), each parameter read as gathered
    (:func:`parity.execute.probes.gathered_read`), then resharded. A load that left FSDP's
    all-gather input apart from the parameter the optimizer steps gathers correct values once,
    in the resumed step, and the step's stale ones from then on."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        return {canonical_fqn(n): probes.gathered_read(p.detach()) for n, p in model.named_parameters()}
    finally:
        for unit in units:
            unit.reshard()
