"""Generated from the fault registry: each fault is flagged by exactly the checks it declares."""

import pathlib

import pytest

from parity.faults import FAULTS
from parity.matrix.cell import Cell

#: The hang is judged by silence, with a timeout measured on this machine (test_integration).
RUN_HERE = [name for name in FAULTS if name != "hang"]
#: Faults only one configuration reveals: also run with that configuration turned off.
QUIET = [name for name in RUN_HERE if FAULTS[name].quiet]


def _failing(records, name: str, cell: dict | None = None) -> set[str]:
    target = Cell(**(cell or FAULTS[name].cell), faults=(name,)).id
    return {r["check"] for r in records
            if r["cell"] == target and r["verdict"] in ("FAIL", "ERROR", "TIMEOUT", "INCONCLUSIVE")}


@pytest.fixture(scope="module")
def fault_records(tmp_path_factory):
    from parity.runner import RunOptions, run_cells
    from tests.conftest import read_records

    out = str(tmp_path_factory.mktemp("faults") / "run")
    cells = [Cell(**FAULTS[name].cell, faults=(name,)) for name in RUN_HERE]
    cells += [Cell(**{**FAULTS[name].cell, **FAULTS[name].quiet}, faults=(name,)) for name in QUIET]
    code = run_cells(cells, RunOptions(out_dir=out, timeout=120, progress=False))
    assert code == 1
    return read_records(out)


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
@pytest.mark.parametrize("name", RUN_HERE)
def test_fault_is_flagged_by_exactly_its_declared_checks(fault_records, name):
    assert _failing(fault_records, name) == set(FAULTS[name].flags), FAULTS[name].where


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
@pytest.mark.parametrize("name", QUIET)
def test_a_configuration_fault_is_silent_without_its_configuration(fault_records, name):
    fault = FAULTS[name]
    quiet = {**fault.cell, **fault.quiet}
    assert any(r["cell"] == Cell(**quiet, faults=(name,)).id for r in fault_records)
    assert _failing(fault_records, name, quiet) == set(), f"{name} flagged with {dict(fault.quiet)}"


def test_every_check_kind_has_a_fault():
    flagged = set().union(*(f.flags for f in FAULTS.values()))
    assert {"output", "input_grad", "grad", "grad_norm", "param", "unit.policy", "dtype.storage", "dtype.compute",
            "dtype.reduce", "dtype.accum", "dtype.boundary", "dtype.output", "names", "identity", "marker",
            "optim.state", "checkpoint.same", "checkpoint.cross", "run", "buffer", "trajectory", "divergence",
            "dtype.tp_reduce", "ownership", "quant.gather", "quant.refresh", "quant.scale", "quant.blocks",
            "quant.values", "plan", "ranks"} <= flagged


def test_no_fault_name_appears_in_production_modules():
    root = pathlib.Path(__file__).resolve().parents[1] / "parity"
    for path in root.rglob("*.py"):
        if "faults" in path.parts:
            continue
        text = path.read_text()
        named = [n for n in FAULTS if f'"{n}"' in text or f"'{n}'" in text]
        assert not named, (path, named)


@pytest.mark.slow
@pytest.mark.xdist_group("faults")
def test_a_fault_confined_to_one_holder_is_located_there(fault_records):
    rows = [r for r in fault_records if r["cell"].endswith("fault-holder_dt_bias_bf16") and r["check"] == "divergence"]
    assert [(r["name"], r["verdict"]) for r in rows] == [("blocks.1.holder", "FAIL")]
    assert rows[0]["detail"].startswith("first in forward order: blocks.1.holder")
