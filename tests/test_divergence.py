"""The first-divergence locator must be quiet on a correct run: a traced re-run of a cell with
nothing wrong names no module (it once named ``blocks.1.norm``, ``blocks.1.lora`` and
``blocks.1.adapter`` whatever the fault: a hook on a module's input summed the gradients of the
input's other readers, e.g. the residual connection, on one side only)."""

import pytest

from parity.execute.pool import RankPool
from parity.judge.cell import base_fields
from parity.judge.divergence import locate
from parity.matrix.cell import Cell

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("divergence")]

#: The cells whose correct traces used to report a divergence.
CELLS = [("lm", "legacy"), ("mixed_storage", "native"), ("mixed_storage", "legacy"), ("frozen", "legacy")]


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_traced_rerun_of_a_correct_cell_reports_nothing(ranks):
    pool = RankPool(ranks)
    try:
        for fixture, path in CELLS:
            cell = Cell(fixture=fixture, path=path, ranks=ranks, microbatches=3, sync="last", trace=True)
            record = locate(cell, pool.run(cell, 120), base_fields(cell))
            assert record.verdict == "PASS", f"{cell.id}: {record.detail}"
    finally:
        pool.stop()
