import pytest
import torch
from torch import nn

from parity_fixtures import FIXTURES
from parity.model.dtypes import DTYPES, dtype_name, parse_dtype
from parity.errors import UsageError
from parity.model.markers import convert_except_marked, fp32_marked, mark_keep_fp32, set_compute_dtype
from parity.model.plan import PrecisionConfig, canonical_fqn, resolve_plan


class Tiny(nn.Module):
    _keep_in_fp32_modules_strict = ["router.bias"]

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.router = nn.Linear(4, 2)
        self.norm = nn.LayerNorm(4)
        self.frozen = nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        set_compute_dtype(self.norm.weight, torch.float32)
        set_compute_dtype(self.router.bias, torch.bfloat16)  # strict names win over metadata


def test_resolution_order_strict_then_recorded_then_default():
    plan = resolve_plan(Tiny(), PrecisionConfig())
    assert plan["router.bias"].compute == torch.float32 and plan["router.bias"].rule == "strict"
    assert plan["norm.weight"].compute == torch.float32 and plan["norm.weight"].rule == "recorded"
    assert plan["proj.weight"].compute == torch.bfloat16 and plan["proj.weight"].rule == "default"
    assert plan["router.weight"].compute == torch.bfloat16  # "router.bias" does not match the weight
    assert plan["frozen.weight"].compute == torch.bfloat16 and plan["frozen.weight"].reduce is None
    assert plan["steps"].compute == torch.long and plan["steps"].kind == "buffer"


def test_keep_in_fp32_modules_applies_under_float16_only_as_transformers_loads():
    """transformers keeps a class's (non-strict) ``_keep_in_fp32_modules`` in FP32 when it loads
    a model in float16, not in bfloat16; the plan follows (found by review: GptOss's norms)."""
    class Half(Tiny):
        _keep_in_fp32_modules = ["proj"]

    half = resolve_plan(Half(), PrecisionConfig(param_dtype=torch.float16))
    assert half["proj.weight"].compute == torch.float32 and half["proj.weight"].rule == "strict"
    assert resolve_plan(Half(), PrecisionConfig())["proj.weight"].compute == torch.bfloat16


def test_reduce_dtype_rules():
    plan = resolve_plan(Tiny(), PrecisionConfig(reduce_dtype=torch.bfloat16))
    assert plan["proj.weight"].reduce == torch.bfloat16
    assert plan["norm.weight"].reduce == torch.float32  # FP32-compute params reduce at least in FP32


def test_ties_and_ignored():
    fx = FIXTURES["lm"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig())
    assert plan["embed.weight"].tie_group == ("embed.weight", "head.weight")
    assert plan["head.weight"] is plan["embed.weight"]
    fx = FIXTURES["ignored"]
    model = fx.make(0)
    plan = resolve_plan(model, PrecisionConfig(), fx.ignored(model))
    entry = plan["blocks.0.ep_scale.weight"]
    assert entry.ownership == "ignored" and entry.compute == torch.float32 and entry.reduce is None


def test_strict_names_match_as_the_chosen_rule_reads_them():
    class M(nn.Module):
        _keep_in_fp32_modules_strict = ["A_log"]

        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(2))
            self.A_logits = nn.Parameter(torch.zeros(2))

    tokens = resolve_plan(M(), PrecisionConfig(), fp32_rule="tokens")
    assert tokens["A_log"].compute == torch.float32 and tokens["A_logits"].compute == torch.bfloat16
    framework = resolve_plan(M(), PrecisionConfig())  # transformers searches the pattern: A_logits too
    assert framework["A_log"].compute == torch.float32 and framework["A_logits"].compute == torch.float32


def test_canonical_fqn_drops_wrapper_tokens():
    assert canonical_fqn("blocks.0._checkpoint_wrapped_module.w") == "blocks.0.w"
    # only parity's own wrapper: any other wrapper a path adds must show up in the names check
    assert canonical_fqn("_orig_mod.a.b") == "_orig_mod.a.b"
    assert canonical_fqn("a._fsdp_wrapped_module.b") == "a._fsdp_wrapped_module.b"


def test_kda_plan_matches_its_contract():
    plan = resolve_plan(FIXTURES["kda"].make(0), PrecisionConfig())
    fp32 = sorted(t.fqn for t in plan.params if t.compute == torch.float32)
    assert fp32 == ["blocks.0.holder.A_log", "blocks.0.holder.dt_bias", "blocks.1.holder.A_log", "blocks.1.holder.dt_bias"]
    assert plan["blocks.0.holder.gate_scale"].compute == torch.float32  # marked buffer


def _simulated_device_move(module):
    # nn.Module._apply replaces buffer objects exactly like a CPU->GPU move does
    return module._apply(lambda t: t.clone())


def test_buffer_marker_survives_device_and_dtype_moves():
    model = FIXTURES["kda"].make(0)
    before = fp32_marked(model)
    buf_before = model.blocks[0].holder.gate_scale
    _simulated_device_move(model)
    assert model.blocks[0].holder.gate_scale is not buf_before  # the buffer object was replaced
    model.to(torch.float64).to(torch.float32)
    assert fp32_marked(model) == before
    convert_except_marked(model, torch.bfloat16)
    assert model.blocks[0].holder.gate_scale.dtype == torch.float32
    assert model.blocks[0].q_proj.weight.dtype == torch.bfloat16


def test_marking_params_and_unknown_names():
    model = nn.Sequential(nn.Linear(2, 2))
    mark_keep_fp32(model, "0.bias")
    convert_except_marked(model, torch.float16)
    assert model[0].bias.dtype == torch.float32 and model[0].weight.dtype == torch.float16
    with pytest.raises(KeyError, match="nope"):
        mark_keep_fp32(model, "0.nope")


def test_dtype_table_is_the_single_source():
    for name, dtype in DTYPES.items():
        assert parse_dtype(name) is dtype and dtype_name(dtype) == name
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("natural", allow_natural=True) is None
    with pytest.raises(UsageError, match="valid: natural, float32, bfloat16, float16"):
        parse_dtype("float8", what="output_dtype", allow_natural=True, allowed=("float32", "bfloat16", "float16"))


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.gate_proj = torch.nn.Linear(4, 4, bias=False)


class _Declares(torch.nn.Module):
    """A model a new user would try: ``norm`` and ``gate`` declared strict FP32."""

    _keep_in_fp32_modules_strict = ["norm", "gate"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block()])
        self.final_norm = _Norm()


def test_strict_fp32_names_mean_what_transformers_means_and_the_other_reading_is_shown():
    from parity.model.plan import fp32_disagreements

    model = _Declares()
    by_framework = resolve_plan(model, PrecisionConfig())
    by_tokens = resolve_plan(model, PrecisionConfig(), fp32_rule="tokens")
    fp32 = {p: {t.fqn for t in plan.params if t.compute == torch.float32} for p, plan in
            (("transformers", by_framework), ("tokens", by_tokens))}
    assert fp32["transformers"] == {"blocks.0.norm.weight", "blocks.0.gate_proj.weight", "final_norm.weight"}
    assert fp32["tokens"] == {"blocks.0.norm.weight"}
    assert fp32_disagreements(model) == [("blocks.0.gate_proj.weight", True, False), ("final_norm.weight", True, False)]


def test_the_transformers_rule_agrees_with_the_installed_transformers():
    """The second oracle for the name rule: transformers' own pattern builder and search."""
    loading = pytest.importorskip("transformers.core_model_loading")
    from parity.model.plan import matches

    patterns = ["norm", "gate", "A_log", "dt_bias", "e_score_correction_bias", "mlp.gate.weight", "layers.*.norm"]
    names = ["final_norm.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
             "model.layers.0.linear_attn.A_log", "x.dt_bias", "model.layers.3.input_layernorm.weight", "lm_head.weight"]
    for pattern in patterns:
        regex = loading.build_glob_alternation([pattern])[0]
        for name in names:
            assert matches(name, pattern) == bool(regex.search(name)), (pattern, name)
