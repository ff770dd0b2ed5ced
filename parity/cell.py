"""Run one cell on one rank of a real process group and return what happened.

The worker only observes; the parent process judges (reference, comparisons). What a rank
returns is an :class:`Observation` of plain CPU tensors: outputs, input gradients, local
gradient and parameter shards per step, the global gradient norm, the shard report.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parity.cellspec import Cell
from parity.checkpointing import apply_checkpointing
from parity.errors import IsolationError
from parity.fixture import get_fixture
from parity.paths import ShardReport, apply_sharding, plan_sharding
from parity.plan import PrecisionPlan, canonical_fqn, resolve_plan

LR, WEIGHT_DECAY = 1e-2, 0.1


def make_optimizer(params) -> torch.optim.Optimizer:
    """FP32 AdamW with non-zero weight decay; the reference uses the same constructor."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


@dataclass(kw_only=True)
class Observation:
    rank: int
    plan: PrecisionPlan | None = None
    report: ShardReport | None = None
    expected_error: str = ""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """Per (step, micro-batch), this rank's model output."""
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, fqn -> local gradient shard (full tensor for ignored parameters)."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per step, fqn -> local parameter shard after the optimizer step."""
    grad_norms: list[float] = field(default_factory=list)
    contracts: dict = field(default_factory=dict)
    """Contract observations (dtypes, names, identity) for :mod:`parity.contracts`."""
    timings: dict[str, float] = field(default_factory=dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu().clone()


def global_grad_norm(params: list[nn.Parameter]) -> float:
    """The 2-norm of all gradients as a training loop computes it on a sharded model."""
    sharded = [p for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
    plain = [p for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    total = 0.0
    if sharded:
        n = torch.nn.utils.clip_grad_norm_(sharded, max_norm=math.inf)
        total += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if plain:
        total += float(torch.nn.utils.get_total_norm([p.grad for p in plain])) ** 2
    return math.sqrt(total)


def _fault_rank_dependent(plan: PrecisionPlan, rank: int) -> PrecisionPlan:
    if rank != 1:
        return plan
    victim = next(t for t in plan.params if t.trainable and t.compute != t.storage)
    return plan.replace(victim.fqn, compute=victim.storage)


@dataclass(kw_only=True)
class Sharded:
    """A freshly built, sharded model with its optimizer."""

    model: nn.Module
    plan: PrecisionPlan
    report: ShardReport
    ignored: set
    opt: torch.optim.Optimizer
    params: list[nn.Parameter]
    names: dict[int, str]


def build(cell: Cell, path: str, *, rank: int, mesh, device, faults: frozenset[str], obs: Observation | None = None) -> Sharded:
    """Model -> plan -> (activation checkpointing) -> sharding along ``path`` -> optimizer.
    Raises :class:`IsolationError` when legacy cannot shard the fixture."""
    from parity import probes

    fixture = get_fixture(cell.fixture)
    model = fixture.make(cell.seed).to(device)
    ignored = fixture.ignored(model)
    plan = resolve_plan(model, cell.precision(), ignored)
    if obs is not None:
        obs.plan = plan
    if "rank_dependent_override" in faults:
        plan = _fault_rank_dependent(plan, rank)
    apply_checkpointing(model, cell.checkpointing, fixture.blocks)
    report = plan_sharding(model, fixture.unit_roots, plan, path)
    if obs is not None:
        obs.report = report
        obs.contracts = probes.before_sharding(model, plan)
    apply_sharding(
        model, report, plan, mesh=mesh, reshard_after_forward=cell.reshard, ignored=ignored,
        faults=faults, check_ranks="skip_rank_check" not in faults,
    )
    params = list(model.parameters())
    return Sharded(
        model=model, plan=plan, report=report, ignored=ignored, opt=make_optimizer(params), params=params,
        names={id(p): canonical_fqn(n) for n, p in model.named_parameters()},
    )


def train_step(cell: Cell, s: Sharded, step: int, *, rank: int, world: int, device, faults, obs: Observation, recorder=None) -> None:
    """One optimizer step over the cell's micro-batches; appends what it saw to ``obs``."""
    fixture = get_fixture(cell.fixture)
    for mb in range(cell.microbatches):
        last = mb == cell.microbatches - 1
        s.model.set_requires_gradient_sync(last or cell.sync == "every")
        batch = fixture.batch(cell.seed, step, rank, mb).to(device)
        inputs = batch.inputs
        if not fixture.token_input:
            inputs = tuple(x.requires_grad_() for x in inputs)
        with recorder.phase(step, mb) if recorder else contextlib.nullcontext():
            out = s.model(*inputs)
        if "perturb_output" in faults and rank == 0 and step == 0 and mb == 0:
            out = out + 1e-2 * out.detach().abs().max()
        loss = fixture.loss(out, batch.target) / cell.microbatches
        loss.backward()
        obs.outputs.append(_local(out))
        grad = None if fixture.token_input else inputs[0].grad
        if grad is not None and "perturb_input_grad" in faults and rank == 0:
            grad = grad * (1 + 1e-2)
        obs.input_grads.append(None if grad is None else _local(grad))
        if recorder:
            recorder.after_backward(s.model, step, mb, last)
    for p in s.ignored:  # the emulated owner of ignored parameters averages their gradients
        if p.grad is not None and world > 1:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
    if "perturb_grad" in faults:
        next(p for p in s.params if p.grad is not None).grad.mul_(1 + 1e-4)
    norm = global_grad_norm(s.params)
    obs.grad_norms.append(norm * (1.01 if "scale_grad_norm" in faults else 1.0))
    obs.grads.append({s.names[id(p)]: _local(p.grad) for p in s.params if p.grad is not None})
    s.opt.step()
    s.opt.zero_grad()
    if "perturb_param" in faults:
        with torch.no_grad():
            s.params[0].mul_(1 + 1e-4)
    obs.params.append({s.names[id(p)]: _local(p) for p in s.params})


def run_rank(cell: Cell, *, rank: int, world: int, mesh, device: torch.device) -> Observation:
    from parity import lifecycle, probes

    faults = frozenset(cell.faults)
    if "crash" in faults and rank == world - 1:
        os._exit(17)
    if "hang" in faults:
        time.sleep(10_000)
    if "raise" in faults:
        raise RuntimeError("deliberate fault: raise")
    t0 = time.perf_counter()
    obs = Observation(rank=rank)
    try:
        s = build(cell, cell.path, rank=rank, mesh=mesh, device=device, faults=faults, obs=obs)
    except IsolationError as exc:
        taken = "legacy"  # the only path that isolates; native reaches it by falling back
        if get_fixture(cell.fixture).expects(taken)[0] == "isolation-error":
            obs.expected_error = str(exc)
            obs.report = ShardReport(requested=cell.path, taken=taken, fallback_reason=exc.fallback_reason)
            return obs
        raise
    recorder = probes.install(s.model, s.report)
    obs.timings["build"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    optim = None
    try:
        for step in range(cell.steps):
            train_step(cell, s, step, rank=rank, world=world, device=device, faults=faults, obs=obs, recorder=recorder)
            if cell.lifecycle and step == lifecycle.RESUME_STEP:  # what a resumed run must reproduce
                if "misfile_optimizer_state" in faults:
                    lifecycle.misfile_state(s.opt)
                optim = lifecycle.optimizer_state(s.model, s.opt)
    finally:
        recorder.close()  # unpatch the collectives even when the cell fails; the worker lives on
    obs.timings["steps"] = time.perf_counter() - t1
    if cell.lifecycle:  # before the identity faults below rename or replace parameters
        t2 = time.perf_counter()
        resumed = lifecycle.resume(cell, rank=rank, world=world, mesh=mesh, device=device, faults=faults)
        obs.timings["checkpoint"] = time.perf_counter() - t2
    obs.contracts = recorder.finish(s.model, obs.contracts, faults)
    obs.contracts["markers"] = lifecycle.marker_contract(cell, device, faults)
    if cell.lifecycle:
        obs.contracts["optim"], obs.contracts["resume"] = optim, resumed
    return obs
