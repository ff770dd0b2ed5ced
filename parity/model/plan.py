"""The precision plan: what dtype every parameter and buffer is stored, computed and reduced in.

Compute dtype resolves in this order (first match wins):

1. **strict FP32 names** - the model's declared ``_keep_in_fp32_modules_strict`` (matched as
   transformers matches them, or on whole name parts: :data:`FP32_RULES`) plus tensors marked with
   :func:`parity.model.markers.mark_keep_fp32`;
2. **recorded compute dtype** - metadata a loader wrote on the tensor
   (:func:`parity.model.markers.set_compute_dtype`);
3. **default policy** - FP32 storage under a lower-precision ``param_dtype`` is an FP32 master
   weight computing in ``param_dtype``; any other floating storage keeps its own dtype;
   non-float tensors keep theirs.

Gradient dtype: what a trainable parameter's gradient is stored in for the optimizer -- the
``grad_dtype`` the model sets on the parameter (torch >= 2.15; e.g. BF16 weights keeping FP32
gradients), else its storage dtype. FSDP keeps it through sharding; its sharded gradient
takes it after the reduction.

Reduce dtype: a trainable managed parameter computing in ``param_dtype`` reduces in the
configured ``reduce_dtype`` (its gradient dtype when that is None: FSDP >= 2.15 follows the
parameter's ``grad_dtype``); one computing above ``param_dtype`` reduces at least in its
compute dtype (legacy FP32 units reduce in FP32). Frozen, ignored and non-float tensors have
no reduce dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from parity.model.dtypes import dtype_name, finer
from parity.model.markers import fp32_marked, recorded_compute_dtype

#: The prefix parity's own activation-checkpoint wrapper inserts into ``named_parameters()``;
#: removed so names stay canonical. Only what parity adds: a path that introduces any other
#: wrapper changes the model's names, which the ``names`` check must see.
WRAPPER_TOKENS = ("_checkpoint_wrapped_module",)


def canonical_fqn(name: str) -> str:
    """Drop wrapper tokens: ``blocks.0._checkpoint_wrapped_module.w`` -> ``blocks.0.w``."""
    return ".".join(t for t in name.split(".") if t not in WRAPPER_TOKENS)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The training recipe's mixed-precision intent (what a ``MixedPrecisionPolicy`` derives from)."""

    param_dtype: torch.dtype = torch.bfloat16
    """Default compute (all-gather) dtype of FP32 master weights."""
    reduce_dtype: torch.dtype | None = torch.float32
    """Gradient reduction dtype for parameters computing in ``param_dtype``."""
    output_dtype: torch.dtype | None = None
    """Dtype of the outermost unit's floating outputs; None keeps their natural dtype."""


@dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """One parameter or buffer of the plan."""

    fqn: str
    """Canonical FQN (first name under which the tensor is reachable)."""
    kind: str
    """``param`` or ``buffer``."""
    storage: torch.dtype
    """Dtype the tensor is stored (and optimized) in."""
    compute: torch.dtype
    """Dtype forward/backward must see."""
    reduce: torch.dtype | None
    """Dtype its gradient is reduced in; None when it has no FSDP-reduced gradient."""
    grad: torch.dtype | None = None
    """Dtype of its gradient as the optimizer sees it (the sharded gradient): the parameter's
    declared ``grad_dtype``, else its storage dtype; None when it never has a gradient."""
    requires_grad: bool
    ownership: str
    """``managed`` (sharded by FSDP), ``ignored`` (owned by another parallelism unit) or ``buffer``."""
    tie_group: tuple[str, ...] = ()
    """Every FQN aliasing this tensor when it is tied, canonical FQN first; else empty."""
    rule: str = "default"
    """Which resolution rule decided ``compute``: strict, recorded, default."""
    numel: int = 0
    trainable_from: int = 0
    """The first optimizer step that trains it (> 0: built frozen, unfrozen by the recipe)."""
    format: str = "none"
    """Weight format of what is all-gathered (:mod:`parity.model.formats`); the main weight
    stays in ``storage`` and the GEMM runs in ``compute`` on the dequantized values."""
    parallel: str = ""
    """Another parallelism's ownership: ``tp-colwise`` / ``tp-rowwise`` (FSDP shards it over its
    data-parallel dimension, TP's placement stays), ``ep`` (its expert-parallel module owns it,
    FSDP ignores it); empty: none."""

    @property
    def trainable(self) -> bool:
        return self.kind == "param" and self.requires_grad and self.ownership == "managed"

    @property
    def sum_dtype(self) -> torch.dtype:
        """The dtype its gradient is summed in -- across ranks, micro-batches and uses: the
        planned ``reduce`` dtype, else (ignored parameters, reduced by their owner) its gradient
        dtype. The one rule the reference, the allowances and the checkpoint checks share."""
        return self.reduce or self.grad or self.storage

    @property
    def kept_grad(self) -> torch.dtype:
        """The dtype its gradient is kept in after the reduction: :attr:`grad`, else storage."""
        return self.grad or self.storage

    def row(self) -> dict[str, str]:
        return {
            "fqn": self.fqn,
            "kind": self.kind,
            "storage": dtype_name(self.storage),
            "compute": dtype_name(self.compute),
            "reduce": dtype_name(self.reduce) if self.reduce else "-",
            "grad": dtype_name(self.grad) if self.grad else "-",
            "requires_grad": str(self.requires_grad),
            "ownership": self.ownership,
            "tie_group": ",".join(self.tie_group) or "-",
            "rule": self.rule + (f", unfrozen at step {self.trainable_from}" if self.trainable_from else ""),
            **({"parallel": self.parallel} if self.parallel else {}),
            **({"format": self.format} if self.format != "none" else {}),
        }


@dataclass(frozen=True)
class PrecisionPlan:
    config: PrecisionConfig
    tensors: tuple[TensorPlan, ...]
    _by_fqn: dict[str, TensorPlan] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        self._by_fqn.update({t.fqn: t for t in self.tensors})
        for t in self.tensors:
            for alias in t.tie_group:
                self._by_fqn.setdefault(alias, t)

    def __getitem__(self, fqn: str) -> TensorPlan:
        return self._by_fqn[canonical_fqn(fqn)]

    def get(self, fqn: str) -> TensorPlan | None:
        """The entry, or None for a name the unsharded model does not have."""
        return self._by_fqn.get(canonical_fqn(fqn))

    @property
    def params(self) -> tuple[TensorPlan, ...]:
        return tuple(t for t in self.tensors if t.kind == "param")

    def compute_dtypes(self) -> dict[str, str]:
        """fqn -> compute dtype name; what ranks compare before sharding."""
        return {t.fqn: dtype_name(t.compute) for t in self.params}

    def replace(self, fqn: str, **changes) -> "PrecisionPlan":
        """A copy with one tensor's entry changed (used to inject faults in tests)."""
        tensors = tuple(dataclasses.replace(t, **changes) if t.fqn == fqn else t for t in self.tensors)
        return PrecisionPlan(self.config, tensors)

    def table(self) -> str:
        rows = [t.row() for t in self.tensors]
        cols = list(dict.fromkeys(c for r in rows for c in r))  # ``parallel`` only where some tensor has it
        rows = [{c: r.get(c, "-") for c in cols} for r in rows]
        widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
        lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
        lines.append("  ".join("-" * widths[c] for c in cols))
        lines += ["  ".join(r[c].ljust(widths[c]) for c in cols) for r in rows]
        return "\n".join(lines)


def tp_reduction_key(weight_fqn: str, owner: str) -> str:
    """Where a tensor-parallel layer all-reduces: ``MODULE@forward`` for a rowwise layer (its
    output), ``MODULE@backward`` for a colwise one (its input gradient); ``owner`` is the
    weight's ``tp-rowwise`` / ``tp-colwise``."""
    return f"{weight_fqn.rpartition('.')[0]}@{'forward' if owner == 'tp-rowwise' else 'backward'}"


def tp_reductions(plan: PrecisionPlan) -> dict[str, TensorPlan]:
    """The tensor-parallel all-reduces a forward and backward owe (:func:`tp_reduction_key`),
    with the layer's weight's plan."""
    return {tp_reduction_key(t.fqn, t.parallel): t for t in plan.params if t.parallel.startswith("tp-")}


#: How a strict-FP32 name pattern selects tensors:
#: ``transformers`` -- what Hugging Face transformers (5.x) does with ``_keep_in_fp32_modules_strict``
#: (every submodule's patterns pooled, unprefixed; each a regular expression with ``*`` as ``.*``,
#: *searched* anywhere in the parameter's full name: ``norm`` selects ``final_norm.weight``);
#: AutoModel loads through it. ``tokens`` -- whole name parts, contiguous, relative to the
#: declaring module (``norm`` selects ``blocks.0.norm.weight`` but not ``final_norm.weight``).
FP32_RULES = ("transformers", "tokens")


def strict_fp32_names(model: nn.Module, extra: tuple[str, ...] = (), rule: str = "transformers",
                      half: bool = False) -> set[str]:
    """Declared strict-FP32 name patterns plus marked tensors and the recipe's ``extra``
    patterns; under ``tokens`` a class's patterns are prefixed with its module's FQN. ``half``
    (``param_dtype`` float16): the classes' ``_keep_in_fp32_modules`` too, as transformers keeps
    them in FP32 when it loads a model in float16 (not in bfloat16)."""
    declared = _declared_strict(model, rule, half)
    return set(fp32_marked(model)) | set(extra) | {full for *_, full in declared}


def _declared_strict(model: nn.Module, rule: str, half: bool = False):
    """(class name, list attribute, pattern, pattern as ``rule`` reads it) for every
    ``_keep_in_fp32_modules_strict`` entry (and, ``half``, every ``_keep_in_fp32_modules``
    entry) of every module's class; under ``tokens`` prefixed with the module's FQN."""
    lists = ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules") if half else ("_keep_in_fp32_modules_strict",)
    for prefix, sub in model.named_modules():
        for attr in lists:
            for pat in getattr(type(sub), attr, None) or ():
                yield type(sub).__name__, attr, pat, f"{prefix}.{pat}" if prefix and rule == "tokens" else pat


def matches(fqn: str, pattern: str, rule: str = "transformers") -> bool:
    """Whether ``pattern`` selects ``fqn`` under ``rule`` (:data:`FP32_RULES`)."""
    if rule == "transformers":
        return re.search(pattern.replace("*", ".*"), fqn) is not None
    toks, pat = fqn.split("."), canonical_fqn(pattern).split(".")
    return any(toks[i : i + len(pat)] == pat for i in range(len(toks) - len(pat) + 1))


def unmatched(model: nn.Module, patterns: tuple[str, ...], rule: str) -> list[str]:
    """The ``patterns`` (a fixture's ``keep_fp32``) that select no parameter or buffer of ``model``
    under ``rule``: a generic pattern may select nothing, a typo always does."""
    tensors = [canonical_fqn(n) for n, _ in [*model.named_parameters(), *model.named_buffers()]]
    return [p for p in patterns if not any(matches(fqn, p, rule) for fqn in tensors)]


def tied_alias(model: nn.Module, pattern: str, rule: str) -> tuple[str, str] | None:
    """(alias, first name) where ``pattern`` selects a later name of a tied parameter
    (``lm_head.weight`` tied to ``model.embed_tokens.weight``): parity names a tied parameter by
    its first name, so such a pattern selects nothing; None otherwise."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = canonical_fqn(name)
        if first.setdefault(id(p), name) != name and matches(name, pattern, rule):
            return name, first[id(p)]
    return None


def unmatched_declared(model: nn.Module, rule: str, half: bool = False) -> list[tuple[str, str]]:
    """(class and list, pattern) -- ``("Cls._keep_in_fp32_modules_strict", pattern)`` -- for
    every pattern a module class declares FP32 (``half``: ``_keep_in_fp32_modules`` too, as the
    plan reads it under float16) that selects no parameter or buffer of ``model`` under ``rule``
    (as the plan reads it: prefixed with the module's FQN under ``tokens``)."""
    declared = list(_declared_strict(model, rule, half))
    missing = set(unmatched(model, tuple(full for *_, full in declared), rule))
    return list(dict.fromkeys((f"{owner}.{attr}", pat) for owner, attr, pat, full in declared if full in missing))


def unmatched_note(pattern: str, rule: str, owner: str) -> str:
    """What ``plan`` notes and ``run`` warns about a pattern that :func:`unmatched_declared`
    found (``owner``: the class and its list). A warning, not an error: a class's list is
    generic (one class, many configs), as transformers reads it; ``Fixture.keep_fp32`` is the
    model's own list, and one of its patterns selecting nothing is refused when the model loads."""
    return (f"{owner} pattern {pattern!r} selects no parameter or buffer (rule {rule}); "
            "a typo keeps nothing in FP32 (Fixture.expect_fp32 would catch it)")


def fp32_disagreements(model: nn.Module, extra: tuple[str, ...] = ()) -> list[tuple[str, bool, bool]]:
    """(FQN, FP32 under ``transformers``, FP32 under ``tokens``) for every floating tensor the
    two rules resolve differently -- where parity's plan would mean something else than the
    framework's if the other rule were chosen."""
    strict = {rule: strict_fp32_names(model, extra, rule) for rule in FP32_RULES}
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        fqn = canonical_fqn(name)
        if not t.is_floating_point():
            continue
        hits = [any(matches(fqn, p, rule) for p in strict[rule]) for rule in FP32_RULES]
        if hits[0] != hits[1]:
            out.append((fqn, *hits))
    return out


def _resolve_compute(fqn: str, tensor: torch.Tensor, strict: set[str], config: PrecisionConfig, rule: str):
    if not tensor.is_floating_point():
        return tensor.dtype, "non-float"
    if any(matches(fqn, p, rule) for p in strict):
        return torch.float32, "strict"
    if (recorded := recorded_compute_dtype(tensor)) is not None:
        return recorded, "recorded"
    pd = config.param_dtype
    if tensor.dtype == torch.float32 and pd is not None and pd != torch.float32:
        return pd, "default"
    return tensor.dtype, "default"


def declared_grad_dtype(p: nn.Parameter) -> torch.dtype:
    """The ``grad_dtype`` the model set on ``p`` (torch >= 2.15), else its storage dtype."""
    return p.grad_dtype if getattr(p, "_has_grad_dtype_override", False) else p.dtype


def unfreeze_step(fqn: str, unfreeze: Mapping[str, int]) -> int | None:
    """The step a recipe unfreezes ``fqn`` at (a pattern is the FQN or a module above it)."""
    hits = [step for pat, step in unfreeze.items() if fqn == pat or fqn.startswith(pat + ".")]
    return min(hits) if hits else None


def resolve_plan(
    model: nn.Module, config: PrecisionConfig, ignored: set[nn.Parameter] | frozenset = frozenset(),
    keep_fp32: tuple[str, ...] = (), unfreeze: Mapping[str, int] | None = None,
    parallel: Mapping[str, str] | None = None, formats: Mapping[str, str] | None = None,
    fp32_rule: str = "transformers",
) -> PrecisionPlan:
    """Resolve the plan for every parameter and buffer of ``model`` (see module docstring);
    ``keep_fp32`` adds strict-FP32 name patterns (a fixture's ``keep_fp32``); ``unfreeze``
    (pattern -> step) plans frozen parameters the recipe unfreezes later as trainable;
    ``parallel``: FQN -> ownership by tensor or expert parallelism; ``formats``: FQN -> weight format."""
    strict = strict_fp32_names(model, keep_fp32, fp32_rule, half=config.param_dtype == torch.float16)
    ignored_ids = {id(p) for p in ignored}
    aliases: dict[int, list[str]] = defaultdict(list)
    first: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(canonical_fqn(name))
        first.setdefault(id(p), p)
    tensors = []
    for pid, p in first.items():
        names = aliases[pid]
        fqn = names[0]
        compute, rule = _resolve_compute(fqn, p, strict, config, fp32_rule)
        ownership = "ignored" if pid in ignored_ids else "managed"
        later = None if p.requires_grad else unfreeze_step(fqn, unfreeze or {})
        requires_grad = p.requires_grad or later is not None
        reduce = None
        grad = declared_grad_dtype(p) if requires_grad and p.is_floating_point() else None
        if ownership == "managed" and grad is not None:
            base = config.reduce_dtype or grad
            reduce = base if compute == config.param_dtype else finer(base, compute)
        tensors.append(
            TensorPlan(
                fqn=fqn,
                kind="param",
                storage=p.dtype,
                compute=p.dtype if ownership == "ignored" else compute,
                reduce=reduce,
                grad=grad,
                requires_grad=requires_grad,
                ownership=ownership,
                tie_group=tuple(names) if len(names) > 1 else (),
                rule="ignored" if ownership == "ignored" else rule,
                numel=p.numel(),
                trainable_from=later or 0,
                parallel=(parallel or {}).get(fqn, ""),
                format=(formats or {}).get(fqn, "none"),
            )
        )
    for name, b in model.named_buffers():
        fqn = canonical_fqn(name)
        compute, rule = _resolve_compute(fqn, b, strict, config, fp32_rule)
        if rule == "default":
            compute = b.dtype  # FSDP never casts buffers
        tensors.append(
            TensorPlan(
                fqn=fqn, kind="buffer", storage=b.dtype, compute=compute, reduce=None,
                requires_grad=False, ownership="buffer", rule=rule, numel=b.numel(),
            )
        )
    return PrecisionPlan(config, tuple(tensors))
