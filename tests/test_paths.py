
import pytest
import torch
from torch import nn

from parity_fixtures import FIXTURES
from parity.errors import IsolationError, RankMismatchError
from parity.paths import check_rank_consistency, plan_sharding
from parity.paths import native as native_mod
from parity.model.markers import set_compute_dtype
from parity.model.plan import PrecisionConfig, resolve_plan
from parity.paths.reads import check_reads


def _report(fixture: str, path: str, config=PrecisionConfig()):
    fx = FIXTURES[fixture]
    model = fx.make(0)
    plan = resolve_plan(model, config, fx.ignored(model))
    return plan_sharding(model, fx.unit_roots, plan, path)


def test_legacy_isolates_the_fp32_holder_and_keeps_contract_policies():
    report = _report("kda", "legacy")
    units = {u.root: u for u in report.units}
    assert list(units) == ["blocks.0.holder", "blocks.0", "blocks.1.holder", "blocks.1", "<root>"]
    holder = units["blocks.0.holder"]
    assert holder.params == ("blocks.0.holder.A_log", "blocks.0.holder.dt_bias")
    assert holder.param_dtype == torch.float32 and holder.reduce_dtype == torch.float32
    assert holder.cast_forward_inputs is False and holder.output_dtype is None
    assert units["blocks.0"].param_dtype == torch.bfloat16 and units["blocks.0"].output_dtype is None


def test_only_the_outermost_unit_casts_outputs():
    for path in ("legacy", "native"):
        report = _report("kda", path, PrecisionConfig(output_dtype=torch.float32))
        assert [u.root for u in report.units if u.output_dtype] == ["<root>"]


def test_native_is_one_unit_per_root_with_overrides():
    report = _report("kda", "native")
    assert report.taken == "native" and not report.fallback_reason
    assert [u.root for u in report.units] == ["blocks.0", "blocks.1", "<root>"]
    assert report.units[0].overrides == ("blocks.0.holder.A_log", "blocks.0.holder.dt_bias")


def test_tied_parameters_share_a_grouped_unit():
    for path in ("legacy", "native"):
        units = {u.root: u for u in _report("lm", path).units}
        assert units["embed+head"].modules == ("embed", "head")
        assert units["embed+head"].params == ("embed.weight",)


def test_isolation_error_names_every_parameter_and_the_fix():
    with pytest.raises(IsolationError) as err:
        _report("unisolatable", "legacy")
    assert err.value.params == ["blocks.0.lin.gain", "blocks.1.lin.gain"]
    assert "submodule of its own whose forward() uses it" in str(err.value)
    # the declaration that makes it the expected outcome, spelled for these parameters
    assert "Fixture.expect={'dtype-split': 'isolation-error:blocks.0.lin.gain,blocks.1.lin.gain'}" in str(err.value)


def test_native_falls_back_for_mixed_trainable_storage_without_changing_dtypes():
    report = _report("mixed_storage", "native")
    assert report.taken == "legacy"
    assert "mixes trainable storage dtypes" in report.fallback_reason
    assert "blocks.0.lora.down.weight" in report.fallback_reason
    assert report.units == _report("mixed_storage", "legacy").units  # same units as legacy asked directly


def test_frozen_params_are_exempt_from_uniform_storage():
    assert _report("frozen", "native").taken == "native"


def test_fallback_for_unsupported_build(monkeypatch):
    monkeypatch.setattr(native_mod, "native_api_available", lambda: False)
    report = _report("kda", "native")
    assert report.taken == "legacy" and report.fallback_reason.startswith("unsupported build")


def test_fallback_when_mixed_compute_has_no_common_reduce_dtype():
    report = _report("kda", "native", PrecisionConfig(reduce_dtype=torch.bfloat16))
    assert report.taken == "legacy"
    assert "without a common reduce dtype" in report.fallback_reason
    holder = next(u for u in report.units if u.root == "blocks.0.holder")
    assert holder.reduce_dtype == torch.float32  # the FP32 unit still reduces in FP32


def test_fallback_when_an_override_would_need_a_third_dtype():
    fx = FIXTURES["kda"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig())
    for name in ("blocks.0.holder.A_log", "blocks.0.holder.dt_bias"):
        plan = plan.replace(name, compute=torch.float16)
    report = plan_sharding(model, fx.unit_roots, plan, "native")
    assert report.taken == "legacy"
    assert "blocks.0.holder.A_log computes in float16" in report.fallback_reason


class ThreeGroups(nn.Module):
    """Three (storage, compute) groups under one root: every uniform subtree is a unit."""

    _keep_in_fp32_modules_strict = ["fp32_part"]

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.fp32_part = nn.Linear(2, 2)
        self.bf16_stored = nn.Linear(2, 2).to(torch.bfloat16)


def test_three_groups_give_every_uniform_subtree_a_unit():
    model = ThreeGroups()
    plan = resolve_plan(model, PrecisionConfig())
    report = plan_sharding(model, ("",), plan, "legacy")
    roots = [u.root for u in report.units]
    assert set(roots) == {"big", "fp32_part", "bf16_stored", "<root>"}
    assert roots[-1] == "<root>"


def test_tie_across_non_module_roots_is_an_error():
    fx = FIXTURES["lm"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig())
    with pytest.raises(ValueError, match="declare each owning module"):
        plan_sharding(model, ("blocks.0", "blocks.1", "head", ""), plan, "legacy")


def test_rank_consistency_names_parameters_and_ranks(monkeypatch):
    # pure logic: a fake all_gather_object standing in for two ranks
    import torch.distributed as dist

    plan = resolve_plan(FIXTURES["kda"].make(0), PrecisionConfig())
    other = plan.replace("blocks.1.q_proj.weight", compute=torch.float32)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def fake_gather(out, obj, group=None):
        out[0], out[1] = obj, other.compute_dtypes()

    monkeypatch.setattr(dist, "all_gather_object", fake_gather)
    with pytest.raises(RankMismatchError, match=r"blocks\.1\.q_proj\.weight \(rank 0: bfloat16, rank 1: float32\)"):
        check_rank_consistency(plan)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(8))
        set_compute_dtype(self.A_log, torch.float32)

    def forward(self, x):
        return x.float() * torch.exp(self.A_log.float())


class _Block(nn.Module):
    def __init__(self, parent_reads: bool):
        super().__init__()
        self.lin, self.holder, self.parent_reads = nn.Linear(8, 8), _Holder(), parent_reads

    def forward(self, x):
        if self.parent_reads:  # the parent reads the holder's parameter itself: FSDP never gathers it here
            return self.lin(x) + x * self.holder.A_log
        return self.lin(x) + self.holder(x).to(x.dtype)


@pytest.mark.parametrize("parent_reads", [True, False])
def test_a_holder_parameter_read_by_its_parent_is_an_isolation_error_naming_the_reader(parent_reads):
    """The legacy path isolates the holder as a unit of its own; a parent reading its parameter
    would meet a sharded DTensor (torch: "got mixed torch.Tensor and DTensor"), so the probe
    forward names the parameter and the module that reads it before anything is sharded."""
    model = nn.Sequential(_Block(parent_reads))
    plan = resolve_plan(model, PrecisionConfig(), set())
    report = plan_sharding(model, ("0", ""), plan, "legacy")
    assert "0.holder" in [u.root for u in report.units]
    if not parent_reads:
        check_reads(model, (torch.randn(2, 8),), report, ("0", ""))
        return
    with pytest.raises(IsolationError) as err:
        check_reads(model, (torch.randn(2, 8),), report, ("0", ""))
    assert err.value.read_by == {"0.holder.A_log": "0"}
    assert "0.holder.A_log is read by 0's forward, outside the forward of the unit holding it" in str(err.value)
    # the declared roots are the user's units: nothing to check when the path made none of its own
    check_reads(model, (torch.randn(2, 8),), plan_sharding(model, ("0", ""), plan, "native"), ("0", ""))


def test_a_path_whose_apply_shards_less_than_its_plan_reports_is_named():
    """A plugin's apply() that returns without calling fully_shard on a reported unit: one error
    naming the path and the unit, not an AttributeError deep in the probes (review, 2026-12-06)."""
    from parity.model.plan import PrecisionConfig
    from parity.model.registry import get_fixture
    from parity.paths.apply import check_applied, plan_sharding

    fixture = get_fixture("kda")
    model = fixture.make(0)
    report = plan_sharding(model, fixture.unit_roots, fixture.resolve(model, PrecisionConfig(), set()), "legacy")
    first = report.units[0].modules[0]
    with pytest.raises(RuntimeError, match=f"path 'legacy': apply\\(\\) did not call fully_shard on '{first}', a unit "
                                           "its plan\\(\\) reports"):
        check_applied(model, report)


def test_a_path_whose_apply_shards_more_than_its_plan_reports_or_reports_nothing_is_named():
    """Units apply() made but plan() did not report would be judged as plain modules, failing far
    from the cause (a dtype check on an unreported FP32 unit); a report of no unit judges nothing."""
    import dataclasses

    from torch.distributed.fsdp import FSDPModule

    from parity.model.plan import PrecisionConfig
    from parity.model.registry import get_fixture
    from parity.paths.apply import check_applied, plan_sharding
    from parity.paths.units import module_index

    fixture = get_fixture("kda")
    model = fixture.make(0)
    report = plan_sharding(model, fixture.unit_roots, fixture.resolve(model, PrecisionConfig(), set()), "native")
    modules = module_index(model)
    for name in [*(m for u in report.units for m in u.modules), "blocks.0.q_proj"]:  # as fully_shard swaps classes
        mod = modules[name]
        mod.__class__ = type(f"FSDP{type(mod).__name__}", (FSDPModule, type(mod)), {})
    with pytest.raises(RuntimeError, match="path 'native': apply\\(\\) called fully_shard on 'blocks.0.q_proj', which "
                                           "no unit of its plan\\(\\) reports"):
        check_applied(model, report)
    with pytest.raises(RuntimeError, match="path 'native': its plan\\(\\) reports no unit"):
        check_applied(model, dataclasses.replace(report, units=()))


def test_units_are_checked_by_their_canonical_names_under_activation_checkpointing():
    """The plugin-name check compared canonical unit names with a checkpoint wrapper's raw ones and
    refused every path's plan in 144 cells of ``default`` (review of the same day)."""
    from parity.execute.checkpointing import apply_checkpointing

    fx = FIXTURES["kda"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig())
    apply_checkpointing(model, "selective", fx.blocks)  # a wrapper: the names gain a token
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    for path in ("legacy", "native"):
        assert plan_sharding(model, fx.unit_roots, plan, path).units
