"""parity in a team's own pytest suite: the ``parity_run`` and ``parity_gate`` fixtures.

Registered as a pytest plugin (entry point ``pytest11``); it only defines the two fixtures and
imports nothing heavy until a test uses one. Each fixture is a callable taking what
:func:`parity.run` / :func:`parity.gate` take, writing into the test's ``tmp_path``; a bad
verdict fails the test with the worst records (check, tensor, observed / allowed / ratio, cell,
detail) and each failing cell's first divergence where it was located::

    def test_my_model_may_enable_native(parity_gate):
        parity_gate(model="my_pkg.models:parity_model", matrix="default")

Under ``pytest -n N`` each pytest worker runs its own cells (parity's rank pools live in that
worker's process), so N workers and 2-rank cells use 2N processes at a time: size ``-n`` for
the machine.
"""

from __future__ import annotations

import pytest

#: Failing records shown in a test's failure message.
SHOWN = 8


def explain(result) -> str:
    """A failed result as a test failure message: exit code, where the results are, the worst records."""
    lines = [f"parity exit code {result.code}; results in {result.out}"]
    for d in result.decisions:
        lines.append(f"  {d['model']}: {d['decision']}" + (f" ({'; '.join(d['reasons'])[:300]})" if d["reasons"] else ""))
    import pandas as pd

    bad = result.failures()
    located = bad[bad["check"] == "divergence"]
    for _, r in bad[bad["check"] != "divergence"].head(SHOWN).iterrows():
        ratio = "" if pd.isna(r["ratio"]) else f" observed {r['observed']:.3g} allowed {r['allowed']:.3g} ratio {r['ratio']:.3g}"
        lines.append(f"  {r['verdict']} {r['check']} {r['name']}{ratio} [{r['cell']}] {str(r['detail'])[:200]}")
    for _, r in located.head(SHOWN).iterrows():
        lines.append(f"  first divergence in {r['cell']}: {r['name']} {str(r['detail'])[:200]}")
    if len(bad) > SHOWN:
        lines.append(f"  ... {len(bad)} failing records in all (summary.md, report.html)")
    return "\n".join(lines)


def _fixture(command: str, tmp_path):
    from parity import api

    def call(**options):
        result = getattr(api, command)(out=options.pop("out", str(tmp_path / f"parity-{command}")), quiet=True,
                                       **options)
        if not result.ok:
            pytest.fail(explain(result), pytrace=False)
        return result

    return call


@pytest.fixture
def parity_run(tmp_path):
    """``parity_run(matrix=..., model=..., **options)``: run cells; the test fails unless every one passed."""
    return _fixture("run", tmp_path)


@pytest.fixture
def parity_gate(tmp_path):
    """``parity_gate(model=..., matrix="default", **options)``: the test fails unless every model is GO."""
    return _fixture("gate", tmp_path)
