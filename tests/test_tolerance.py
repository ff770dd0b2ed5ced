import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from parity.judge import tolerance
from parity.judge.compare import Assembled, Comparison, cross_path
from parity.model.dtypes import unit_roundoff
from parity.judge.record import judge

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def test_unit_roundoffs():
    assert unit_roundoff(torch.float32) == 2**-24
    assert unit_roundoff(torch.bfloat16) == 2**-8
    assert unit_roundoff(torch.float16) == 2**-11


@given(st.sampled_from(FLOATS), st.integers(1, 64), st.floats(1e-6, 1e3))
def test_gradient_allowance_is_terms_times_u_times_scale(dtype, terms, scale):
    a = tolerance.gradient(dtype, dtype, terms, scale)
    assert math.isclose(a.allowed, terms * unit_roundoff(dtype) * scale)
    assert a.dtype == dtype


def test_gradient_uses_the_reduce_dtype_not_the_compute_dtype():
    # an FP32 reduction of BF16-computed gradients is judged at FP32 precision
    a = tolerance.gradient(torch.float32, torch.float32, 2, 1.0, uses=1, compute_dtype=torch.bfloat16)
    assert a.dtype == torch.float32 and a.allowed == 2 * 2**-24
    # a BF16 error on such a gradient is far outside it
    assert judge(2**-9, a.allowed)[1] == "FAIL"


def test_coarser_storage_and_tied_uses_widen_with_the_right_dtype():
    a = tolerance.gradient(torch.float32, torch.bfloat16, 1, 1.0)
    assert a.dtype == torch.bfloat16 and a.allowed == 2**-24 + 2**-8
    t = tolerance.gradient(torch.float32, torch.float32, 3, 1.0, uses=2, compute_dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and math.isclose(t.allowed, 3 * 2**-24 + 3 * 2**-8)


@given(st.integers(1, 10), st.floats(1e-3, 10.0))
def test_parameter_allowance_grows_linearly_with_steps(steps, scale):
    one = tolerance.parameter(torch.float32, 1, scale)
    many = tolerance.parameter(torch.float32, steps, scale)
    assert math.isclose(many.allowed, steps * one.allowed)


def test_judge_reports_exact_and_ratios():
    assert judge(0.0, 1e-7) == (0.0, "PASS", "exact")
    assert judge(1e-7, 1e-7)[1] == "PASS"
    assert judge(2e-7, 1e-7)[:2] == (2.0, "FAIL")
    assert judge(float("nan"), 1.0)[1] == "FAIL"
    assert judge(1e-9, 0.0)[1] == "FAIL"


def test_cross_path_check_fails_when_the_paths_disagree():
    # pure logic: legacy's comparison and a native run that differs in one gradient
    g = torch.ones(4)
    allow = tolerance.gradient(torch.float32, torch.float32, 1, 1.0)
    legacy = [Comparison(0, "grad", "w", g, g, allow)]
    same = Assembled(grads=[{"w": g.clone()}])
    off = Assembled(grads=[{"w": g + 1e-3}])
    base = dict(cell="c", fixture="kda", path="legacy~native")
    assert cross_path(legacy, same, 1)[0].record(base).verdict == "PASS"
    assert cross_path(legacy, off, 1)[0].record(base).verdict == "FAIL"
