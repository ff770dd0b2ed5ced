"""What a model plugin is: a tiny seeded model plus how a training recipe hands it to FSDP.

Built-in fixtures (the ``parity_fixtures`` package, folder ``fixtures/``) and a user's own
model (``--model pkg.module:factory``) are the same thing: a :class:`Fixture`. The factory
returns one; :func:`validate` says in one line what is missing or wrong.
"""

from __future__ import annotations

import difflib
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from parity.errors import UsageError
from parity.model.dtypes import parse_dtype
from parity.model.formats import BLOCK
from parity.model.markers import set_compute_dtype
from parity.model.plan import FP32_RULES, resolve_plan, tied_alias, unfreeze_step, unmatched

#: Outcomes a fixture may declare per path name or per path contract.
OUTCOMES = ("isolation-error", "fallback")
#: How the emulated owner of ignored parameters reduces their gradients across ranks.
IGNORED_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, kw_only=True)
class Batch:
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(inputs=tuple(t.to(device) for t in self.inputs), target=self.target.to(device))


def _no_ignored(model: nn.Module) -> set:
    return set()


def _same(output):
    return output


@dataclass(frozen=True, kw_only=True)
class Fixture:
    """A model and its training recipe, as data. Fields are what a recipe knows about it."""

    name: str
    """Registry name (``fixture`` column, ``-k "fixture == ..."``)."""
    description: str
    """One line for listings."""
    build: Callable[[], nn.Module]
    """Constructs the model; weights come from the global RNG, seeded by :meth:`make`."""
    unit_roots: tuple[str, ...]
    """FQNs handed to ``fully_shard`` in order (blocks first, ``""`` = root last)."""
    blocks: tuple[str, ...]
    """Modules activation checkpointing wraps."""
    make_batch: Callable[[torch.Generator], Batch]
    """One micro-batch from a seeded CPU generator."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Scalar FP32 loss from (output, target)."""
    output: Callable[[object], torch.Tensor] = _same
    """The tensor of the model's return value that the loss reads and parity compares
    (e.g. ``lambda out: out.logits`` for a Hugging Face ``ModelOutput``)."""
    token_input: bool = False
    """True when inputs are integer tokens (no input gradient exists)."""
    backward_free: tuple[str, ...] = ()
    """Units (``unit_roots``) whose parameters no backward reads -- an untied embedding: its
    weight's gradient scatters the output's, its values are not needed -- which a recipe tells
    FSDP not to all-gather for backward (``unshard_in_backward = "needed"``)."""
    casts_inputs: bool = False
    """The model casts its floating inputs to its weights' dtype itself (each block at its first
    op, FP32 modules upcasting), so it trains with every unit's ``cast_forward_inputs=False``
    (the ``cast_inputs = "model"`` knob runs only on such models)."""
    keep_fp32: tuple[str, ...] = ()
    """Strict-FP32 name patterns besides the class's ``_keep_in_fp32_modules_strict``; each
    must select a parameter or buffer (a typo would keep nothing in FP32 and pass)."""
    compute_dtypes: Mapping[str, str] = field(default_factory=dict)
    """FQN -> compute dtype recorded on the parameter at load time (plan rule 2)."""
    grad_dtypes: Mapping[str, str] = field(default_factory=dict)
    """FQN pattern (a parameter, or a module above it) -> the ``grad_dtype`` the recipe sets on
    those parameters (torch >= 2.15): the dtype their gradients are kept in, e.g. ``float32``
    for BF16-stored weights. Set on every build, after the move to its device (moving
    rebuilds parameters, which drops the attribute). A model may also set it itself."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Groups of FQNs the model must tie (checked when the model is validated)."""
    ignored: Callable[[nn.Module], set[nn.Parameter]] = _no_ignored
    """Parameters owned by another parallelism unit (passed as ``ignored_params``)."""
    ignored_reduction: str = "mean"
    """How their owner reduces their gradients across ranks: ``mean`` or ``sum``."""
    expect: Mapping[str, str] = field(default_factory=dict)
    """Path name or path contract (``dtype-split``, ``per-parameter``) -> expected outcome
    other than training: ``isolation-error:P1,P2`` (the path raises an isolation error that
    names every listed parameter, on every rank), or ``fallback:TEXT`` (the path falls back
    for a reason containing TEXT). A path name wins over its contract."""
    unused_params: bool = False
    """Some parameters get no gradient on some ranks or micro-batches (routed experts, a
    branch): the recipe calls ``set_reduce_scatter_unused_params(True)`` so every rank reduces
    the same tensors, and an unused trainable parameter's gradient is zero, not None."""
    unfreeze: Mapping[str, int] = field(default_factory=dict)
    """FQN pattern -> step: parameters the model builds frozen and training unfreezes before
    that optimizer step (staged fine-tuning). The plan treats them as trainable."""
    tensor_parallel: Mapping[str, str] = field(default_factory=dict)
    """Module FQN -> ``colwise`` or ``rowwise``: the ``parallelize_module`` plan mesh ``fsdp+tp``
    applies on its ``tp`` dimension (linear layers without bias)."""
    expert_parallel: tuple[str, ...] = ()
    """Modules that own their experts under mesh ``ep``: each has ``shard_experts(mesh)``
    (keep this rank's experts on the ``ep`` dimension) and an ``experts`` parameter, which
    ``ignored`` must return (on other meshes an emulated owner reduces it over all ranks)."""
    expert_exchanges: tuple[str, ...] = ("all-to-all", "all-to-all")
    """The functional collectives each ``expert_parallel`` module issues in one forward under
    mesh ``ep``, in order (dispatch, combine): ``all-to-all``, ``all-gather`` or
    ``reduce-scatter``; its backward issues their adjoints. Counted per segment
    (:mod:`parity.judge.exchanges`)."""
    quantizable: tuple[str, ...] = ()
    """Linear layers (module FQNs) whose weights take the cell's ``weights`` format (FP8 all-gather,
    :mod:`parity.model.formats`); ``mixed`` alternates the two FP8 formats in this order."""
    fp32_rule: str = "transformers"
    """How ``_keep_in_fp32_modules_strict`` and ``keep_fp32`` patterns select tensors
    (:data:`parity.model.plan.FP32_RULES`): as transformers does (the default: a pattern is
    searched anywhere in the name), or ``tokens`` (whole name parts). ``parity plan`` lists
    every tensor the two rules resolve differently."""
    expect_fp32: tuple[str, ...] | None = None
    """The FQNs the model intends to compute in FP32 under a BF16/FP16 ``param_dtype`` (FP32
    parameters and marked FP32 buffers), declared by hand: the ``plan`` check holds the
    resolved plan to it. None: not declared (the plan is then checked across processes only)."""
    source: str = ""
    """Where a plugin came from (``pkg.module:factory`` or ``file.py:factory``); workers
    load it again from here. Empty for registered models."""

    def resolve(self, model: nn.Module, config, ignored=frozenset(), *, parallel=None, formats=None):
        """The precision plan of ``model`` (this fixture's instance) under ``config``: the one
        place a fixture's FP32 patterns, rule and unfreezing reach :func:`resolve_plan`."""
        return resolve_plan(model, config, ignored, self.keep_fp32, self.unfreeze, parallel, formats,
                            fp32_rule=self.fp32_rule)

    def expects(self, path: str, contract: str = "", weights: str = "none") -> tuple[str, str]:
        """(outcome, reason text) expected on ``path``; ("", "") when it should just train.
        ``mixed`` weight formats put two formats in one unit, which the per-parameter
        contract cannot represent: it falls back (a rule of the format, not of the fixture)."""
        if weights == "mixed" and contract == "per-parameter" and path not in self.expect:
            return "fallback", MIXED_FORMATS
        value = self.expect.get(path) or self.expect.get(contract, "")
        kind, _, reason = value.partition(":")
        return kind, reason

    def make(self, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """A fresh instance: seeded weights on CPU, recorded compute dtypes applied, then
        moved to ``device`` (``meta`` builds without storage, for structure checks)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if torch.device(device).type == "meta":
                with torch.device("meta"):
                    model = self.build()
            else:
                model = self.build()
        if not isinstance(model, nn.Module):
            raise UsageError(f"{self.name}: Fixture.build returned {type(model).__name__}, not a torch.nn.Module; "
                             "return the model instance")
        params = dict(model.named_parameters(remove_duplicate=False))
        for fqn, dtype in self.compute_dtypes.items():
            if fqn not in params:
                raise UsageError(f"{self.name}: Fixture.compute_dtypes names {fqn!r}, which is not a parameter of the "
                                 "model; list parameter FQNs (python -m parity plan --model ... lists them)")
            set_compute_dtype(params[fqn], parse_dtype(dtype, what=f"{self.name}: compute_dtypes[{fqn!r}]"))
        if torch.device(device).type != "meta":
            model = model.to(device)
        for pattern, dtype in self.grad_dtypes.items():
            for fqn, p in model.named_parameters():
                if unfreeze_step(fqn, {pattern: 0}) is not None:
                    p.grad_dtype = parse_dtype(dtype, what=f"{self.name}: grad_dtypes[{pattern!r}]")
        return model

    def batch(self, seed: int, step: int, rank: int, microbatch: int) -> Batch:
        key = f"{self.name}/{seed}/{step}/{rank}/{microbatch}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key))
        return self.make_batch(gen)

    def eval_batch(self, seed: int, step: int, rank: int, index: int) -> Batch:
        """The batch of a cell's ``index``-th evaluation forward in ``step``: its own data, not a
        training micro-batch's."""
        key = f"{self.name}/{seed}/{step}/{rank}/eval{index}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key))
        return self.make_batch(gen)


TP_STYLES = ("colwise", "rowwise")
#: The collectives an expert-parallel module may declare (:attr:`Fixture.expert_exchanges`).
EXCHANGES = ("all-to-all", "all-gather", "reduce-scatter")
#: The native path's fallback reason for a unit mixing quantized weight formats.
MIXED_FORMATS = "mixes weight formats"


def unknown_expect_keys(spec: Fixture, expect_keys) -> list[str]:
    """``Fixture.expect`` keys naming neither a contract nor a registered path (``expect_keys``)."""
    return [k for k in spec.expect if k not in expect_keys]


def _check_ignored(spec: Fixture, model: nn.Module, where: str) -> None:
    """What ``Fixture.ignored`` returns must be a set (or other collection) of the model's own
    parameters: a module, a foreign tensor or ``None`` would leave the parallelism it declares
    untested (its parameters sharded as any other) or fail every cell."""
    try:
        ignored = spec.ignored(model)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is named
        raise UsageError(f"{where}: Fixture.ignored failed: {type(exc).__name__}: {exc}") from None
    fix = "return a set of the model's own parameters, e.g. lambda m: set(m.experts.parameters())"
    if isinstance(ignored, (nn.Module, torch.Tensor, str, bytes, Mapping)) or not isinstance(ignored, Iterable):
        raise UsageError(f"{where}: Fixture.ignored returned {type(ignored).__name__}; {fix}")
    own = {id(p) for p in model.parameters()}
    stray = next((x for x in list(ignored) if not isinstance(x, nn.Parameter) or id(x) not in own), None)
    if stray is not None:
        what = "a parameter that is not the model's" if isinstance(stray, nn.Parameter) else type(stray).__name__
        raise UsageError(f"{where}: Fixture.ignored returned {what} among its items; {fix}")


def _check_covered(spec: Fixture, model: nn.Module, where: str) -> None:
    """Every parameter FSDP manages (every one ``Fixture.ignored`` leaves) must lie under a
    declared root: one under none would stay a plain tensor, and every path refuses the model."""
    if "" in spec.unit_roots:
        return
    ignored = {id(p) for p in spec.ignored(model)}
    loose = next((n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in ignored
                  and not any(n.startswith(r + ".") for r in spec.unit_roots)), None)
    if loose is not None:
        raise UsageError(f"{where}: Fixture.unit_roots {list(spec.unit_roots)} holds no module of parameter {loose!r}; "
                         'add its module, or the root "" last, to unit_roots')


#: Fixture fields by the kind of value each holds, checked before any is read (a wrong kind would
#: surface as an error deep in parity, or as a bare string iterated letter by letter).
_TEXTS = ("name", "description", "ignored_reduction", "fp32_rule")
_FLAGS = ("token_input", "casts_inputs", "unused_params")
_NAMES = ("unit_roots", "blocks", "keep_fp32", "backward_free", "quantizable", "expert_parallel", "expert_exchanges")
_MAPPINGS = ("expect", "compute_dtypes", "grad_dtypes", "unfreeze", "tensor_parallel")


def _names(value) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(n, str) for n in value)


def _check_kinds(spec: Fixture, where: str) -> None:
    """Each declared field holds the kind of value its annotation says; the first that does not
    is named with an example of the kind."""
    def bad(name: str, kind: str, example: str):
        value = getattr(spec, name)
        hint = f" ({value!r},)" if isinstance(value, str) and kind.startswith("a tuple") else f" {example}"
        raise UsageError(f"{where}: Fixture.{name} = {value!r:.80}; it is {kind}, e.g.{hint}")

    for name in _TEXTS:
        if not isinstance(getattr(spec, name), str):
            bad(name, "a string", "'text'")
    for name in _FLAGS:
        if not isinstance(getattr(spec, name), bool):
            bad(name, "True or False", "False")
    for name in (*_NAMES, *(("expect_fp32",) if spec.expect_fp32 is not None else ())):
        if not _names(getattr(spec, name)):
            bad(name, "a tuple of strings", "('blocks.0', 'blocks.1')")
    for name in _MAPPINGS:
        value = getattr(spec, name)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            bad(name, "a dict keyed by strings", "{'blocks.0': ...}")
    if not isinstance(spec.tied, (tuple, list)) or not all(_names(g) for g in spec.tied):
        bad("tied", "a tuple of tuples of parameter FQNs", "(('embed.weight', 'head.weight'),)")
    for name in ("unit_roots", "blocks"):
        names = getattr(spec, name)
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise UsageError(f"{where}: Fixture.{name} lists {twice!r} twice; list each module once")


def validate(spec: object, where: str, expect_keys=()) -> Fixture:
    """Check what a factory returned; raise :class:`UsageError` naming the first problem. With
    ``expect_keys`` (the contracts and registered path names), a ``Fixture.expect`` key close to one
    of them but not it is a misspelling (its declaration would apply to no cell); another unknown
    key may name a path plugin not installed here (``run`` warns: :func:`unknown_expect_keys`)."""
    if not isinstance(spec, Fixture):
        raise UsageError(f"{where} returned {type(spec).__name__}, not parity.model.Fixture; "
                         "return Fixture(name=..., build=..., unit_roots=..., ...)")
    for attr in ("build", "make_batch", "loss", "ignored", "output"):
        if not callable(getattr(spec, attr)):
            raise UsageError(f"{where}: Fixture.{attr} must be callable")
    _check_kinds(spec, where)
    if not spec.name or not spec.name.replace("_", "").replace("-", "").isalnum():
        raise UsageError(f"{where}: Fixture.name {spec.name!r} must be a non-empty word (letters, digits, _ -)")
    if spec.ignored_reduction not in IGNORED_REDUCTIONS:
        raise UsageError(f"{where}: Fixture.ignored_reduction {spec.ignored_reduction!r}; valid: "
                         f"{', '.join(IGNORED_REDUCTIONS)}")
    for key, value in spec.expect.items():
        kind, _, text = value.partition(":") if isinstance(value, str) else ("", "", "")
        if kind not in OUTCOMES or not any(x.strip() for x in text.split(",")):  # a declaration names what it expects
            raise UsageError(f"{where}: Fixture.expect[{key!r}] = {value!r}; valid: isolation-error:PARAMS, "
                             "fallback:TEXT (TEXT: part of the reason)")
    for key in unknown_expect_keys(spec, expect_keys) if expect_keys else ():
        near = difflib.get_close_matches(str(key), expect_keys, n=1, cutoff=0.75)
        if near:  # a misspelling: its declaration would apply to no cell
            raise UsageError(f"{where}: Fixture.expect key {key!r} names no sharding path or contract; did you mean "
                             f"{near[0]!r}? (valid here: {', '.join(expect_keys)})")
    try:
        model = spec.make(0, "meta")
    except UsageError as exc:  # a field make() applies names itself
        raise UsageError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure of user code is named
        raise UsageError(f"{where}: building the model failed: {type(exc).__name__}: {exc}") from None
    modules = {n for n, _ in model.named_modules()}
    for what, names in (("unit_roots", spec.unit_roots), ("blocks", spec.blocks)):
        missing = [n for n in names if n not in modules]
        if missing:
            raise UsageError(f"{where}: Fixture.{what} names {missing[0]!r}, which is not a module of the model; "
                             "give module FQNs as model.named_modules() spells them")
    if not spec.unit_roots:
        raise UsageError(f"{where}: Fixture.unit_roots is empty; declare the modules handed to fully_shard")
    for i, outer in enumerate(spec.unit_roots):  # FSDP shards bottom-up: a root after every root inside it
        inner = next((r for r in spec.unit_roots[i + 1:] if r != outer and (outer == "" or r.startswith(outer + "."))), None)
        if inner is not None:
            name = repr(outer) if outer else 'the root ""'
            raise UsageError(f"{where}: Fixture.unit_roots lists {name} before {inner!r}, which it contains; list "
                             'inner roots first and the root "" last (fully_shard goes bottom-up)')
    params = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        params[n] = p
    _check_ignored(spec, model, where)
    _check_covered(spec, model, where)
    lazy = next((n for n, t in (*params.items(), *model.named_buffers())
                 if isinstance(t, nn.parameter.UninitializedTensorMixin)), None)
    if lazy:  # nothing can be planned, sharded or compared before its size is known
        raise UsageError(f"{where}: {lazy!r} is uninitialized (a lazy module); give its size in build (e.g. nn.Linear "
                         "for nn.LazyLinear) or run one forward there to materialize it")
    if spec.fp32_rule not in FP32_RULES:
        raise UsageError(f"{where}: Fixture.fp32_rule {spec.fp32_rule!r}; valid: {', '.join(FP32_RULES)}")
    typo = unmatched(model, spec.keep_fp32, spec.fp32_rule)
    alias = tied_alias(model, typo[0], spec.fp32_rule) if typo else None
    if alias:
        raise UsageError(f"{where}: Fixture.keep_fp32 pattern {typo[0]!r} selects only {alias[0]!r}, a tied alias of "
                         f"{alias[1]!r} (parity names a tied parameter by its first name); give a pattern for "
                         f"{alias[1]!r}")
    if typo:  # it would keep nothing in FP32, and both paths would agree on that
        raise UsageError(f"{where}: Fixture.keep_fp32 pattern {typo[0]!r} selects no parameter or buffer of the model "
                         f"(rule {spec.fp32_rule}); correct it or drop it (see python -m parity plan)")
    tensors = set(params) | {n for n, _ in model.named_buffers()}
    unknown = [f for f in spec.expect_fp32 or () if f not in tensors]
    if unknown:
        raise UsageError(f"{where}: Fixture.expect_fp32 names {unknown[0]!r}, which is not a parameter or buffer "
                         "of the model; list the FQNs the model keeps in FP32")
    for fqn in spec.compute_dtypes:
        if fqn not in params:
            raise UsageError(f"{where}: Fixture.compute_dtypes names {fqn!r}, which is not a parameter of the model")
    stray = [u for u in spec.backward_free if u not in spec.unit_roots]
    if stray:
        raise UsageError(f"{where}: Fixture.backward_free names {stray[0]!r}, which is not one of unit_roots")
    for pattern, dtype in spec.grad_dtypes.items():
        if not any(unfreeze_step(n, {pattern: 0}) is not None for n in params):
            raise UsageError(f"{where}: Fixture.grad_dtypes names {pattern!r}, which selects no parameter of the model")
    if not any(p.requires_grad for p in params.values()) and not spec.unfreeze:
        raise UsageError(f"{where}: no parameter of the model is trainable (all are frozen and Fixture.unfreeze is "
                         "empty); parity judges training: leave some parameters trainable")
    for pattern, step in spec.unfreeze.items():
        hits = [n for n in params if unfreeze_step(n, {pattern: 0}) is not None]
        if not hits or not isinstance(step, int) or step < 1:
            raise UsageError(f"{where}: Fixture.unfreeze[{pattern!r}] = {step!r}; give a parameter or module "
                             "FQN of the model and a step >= 1 (trainable from step 0: build it trainable)")
    for fqn, style in spec.tensor_parallel.items():
        if fqn not in modules or style not in TP_STYLES:
            raise UsageError(f"{where}: Fixture.tensor_parallel[{fqn!r}] = {style!r}; give a module FQN of the model "
                             f"and one of {', '.join(TP_STYLES)}")
    for fqn in spec.expert_parallel:
        mod = dict(model.named_modules()).get(fqn)
        if mod is None or not callable(getattr(mod, "shard_experts", None)) or f"{fqn}.experts" not in params:
            raise UsageError(f"{where}: Fixture.expert_parallel names {fqn!r}; give a module with shard_experts(mesh) "
                             "and an experts parameter")
    if spec.expert_parallel and (not spec.expert_exchanges or set(spec.expert_exchanges) - set(EXCHANGES)):
        raise UsageError(f"{where}: Fixture.expert_exchanges = {spec.expert_exchanges!r}; give the collectives one "
                         f"forward of an expert-parallel module issues, each one of {', '.join(EXCHANGES)}")
    for fqn in spec.quantizable:
        mod = dict(model.named_modules()).get(fqn)
        if not isinstance(mod, nn.Linear) or mod.in_features % BLOCK:
            raise UsageError(f"{where}: Fixture.quantizable names {fqn!r}; give nn.Linear modules whose in_features "
                             f"is a multiple of {BLOCK} (one MXFP8 block)")
    for group in spec.tied:
        if any(f not in params for f in group) or len({id(params[f]) for f in group}) != 1:
            raise UsageError(f"{where}: Fixture.tied declares {list(group)} tied, but the model does not tie them")
    try:
        batch = spec.batch(0, 0, 0, 0)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"{where}: Fixture.make_batch failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(batch, Batch):
        raise UsageError(f"{where}: Fixture.make_batch returned {type(batch).__name__}, not parity.model.Batch")
    tensors = isinstance(batch.inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in batch.inputs)
    if not tensors or not isinstance(batch.target, torch.Tensor):
        what = (f"inputs={type(batch.inputs).__name__}" if not tensors
                else f"target={type(batch.target).__name__}")
        raise UsageError(f"{where}: Fixture.make_batch returned Batch({what}); return Batch(inputs=(x, ...), "
                         "target=y), a tuple of tensors and a tensor")
    first = batch.inputs[0] if batch.inputs else None
    if not isinstance(first, torch.Tensor):
        raise UsageError(f"{where}: Fixture.make_batch returned no input tensor (Batch.inputs[0]); return "
                         "Batch(inputs=(x, ...), target=y)")
    if first.is_floating_point() == spec.token_input:
        raise UsageError(f"{where}: Batch.inputs[0] is {str(first.dtype).replace('torch.', '')} but Fixture.token_input "
                         f"is {spec.token_input}; set token_input={not spec.token_input} (True: integer token ids, "
                         "whose input has no gradient)")
    return spec
