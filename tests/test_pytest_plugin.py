"""The pytest plugin: a team's own test file uses ``parity_run`` / ``parity_gate`` (pytester)."""

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.xdist_group("pytest-plugin")

TEST_FILE = '''
FEW = "fixture == 'kda' and ranks == 1 and microbatches == 1"

def test_green(parity_run):
    result = parity_run(matrix="smoke", filter=FEW)
    assert result.ok and len(result.cells)

def test_a_fault_fails_with_the_worst_records(parity_run):
    parity_run(matrix="smoke", filter=FEW, fault="drop_override")
'''


def test_the_fixtures_turn_verdicts_into_test_outcomes(pytester):
    pytester.makepyfile(test_own=TEST_FILE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "parity exit code 1; results in" in text
    assert "ratio" in text and "kda/native/r1" in text  # the failing records, with observed / allowed / ratio
    assert "Traceback" not in text.split("test_a_fault_fails_with_the_worst_records")[-1]
