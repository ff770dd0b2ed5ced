"""parity in a team's own pytest suite, for the model in ``my_model.py`` (run it from the
repository root: ``pytest examples/own_model/test_my_model.py``).

Two ways, both from the plugin parity registers (entry point ``pytest11``):

- ``@pytest.mark.parity(...)`` makes one pytest test per cell (``-k`` selects cells, ``--junitxml``
  gets one case per cell); the cell's verdict is the test's outcome, and a failure lists the worst
  records (observed / allowed / ratio) and the first divergence;
- the ``parity_run`` fixture runs a selection and fails unless every cell passed
  (``parity_gate(model=MODEL)`` asks for GO / NO-GO over the whole ``default`` matrix; a gate over
  a filtered selection is PARTIAL, never GO).
"""

import pytest

MODEL = "examples/own_model/my_model.py:parity_model"
#: A few cells for a pull request; drop the filter (or use matrix "default") for the full check.
FEW = "ranks == 1 and microbatches == 1"


@pytest.mark.parity(model=MODEL, matrix="smoke", filter=FEW)
def test_each_cell_matches_the_reference(parity_cell):
    assert parity_cell.records  # the cell's verdict is checked after the test body


def test_the_selection_passes(parity_run):
    result = parity_run(model=MODEL, matrix="smoke", filter=FEW)
    assert len(result.cells)
