"""The suite's own machinery: what makes it fast must hold, or it silently costs twice."""

import pytest


@pytest.mark.xdist_group("canary")
def test_xdist_groups_reach_one_worker(request):
    """Under ``--dist loadgroup`` a test marked ``xdist_group`` carries its group in its id: that
    is how xdist sends a group to one worker, where its session-scoped results (the fault cells,
    the interrupted runs, the sharded run) are computed once. pytest 9.2 with pytest-xdist 3.8
    drops the marks (pinned in the test extra)."""
    if not request.config.getvalue("loadgroup"):
        pytest.skip("not under pytest -n N --dist loadgroup")
    assert request.node.nodeid.endswith("@canary"), (
        f"{request.node.nodeid}: xdist_group ignored by pytest {pytest.__version__}; pip install -e '.[test]'")
