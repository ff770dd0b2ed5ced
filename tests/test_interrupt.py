"""SIGINT/SIGTERM at several points of a real run, then ``--resume`` to the same result."""

import csv
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

SELECT = ["--matrix", "smoke", "-k", "fixture in ('kda', 'frozen')"]
#: Imported by every process of the run (parent and workers): once some rows are recorded,
#: pauses the next call of the chosen torch function, after touching a marker file, so a
#: signal lands inside it.
PAUSE = textwrap.dedent("""
    import os
    where = os.environ.get("PARITY_TEST_PAUSE")
    if where:
        import time, torch
        import torch.distributed.checkpoint as dcp
        owner, name = {"save": (dcp, "save"), "step": (torch.optim.AdamW, "step")}[where]
        original = getattr(owner, name)
        marker = os.environ["PARITY_TEST_MARKER"]
        rows = os.environ["PARITY_TEST_ROWS"]
        def recorded():
            try:
                with open(rows) as fh:
                    return len(fh.readlines()) > 1
            except FileNotFoundError:
                return False
        def paused(*args, **kwargs):
            if not os.path.exists(marker) and recorded():
                open(marker, "w").close()
                time.sleep(120)
            return original(*args, **kwargs)
        setattr(owner, name, paused)
""")


def _run(out, tmp, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "parity", "run", *SELECT, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append(int(pid))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return alive


def _wait_for(predicate, seconds=300):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the run never reached the point to interrupt"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    proc = _run(out, None)
    proc.communicate()
    assert proc.returncode == 0
    return (out / "cells.csv").read_bytes()


@pytest.mark.xdist_group("interrupt")
@pytest.mark.parametrize("point, sig, code", [
    ("start-up", "TERM", 143),
    ("mid-cell", "INT", 130),
    ("checkpoint lifecycle", "TERM", 143),
])
def test_interrupt_keeps_rows_cleans_up_and_resumes_to_the_same_result(tmp_path, uninterrupted, point, sig, code):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PAUSE)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    marker = tmp_path / "paused"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(site), "PARITY_TEST_MARKER": str(marker)}
    if point != "start-up":
        env["PARITY_TEST_PAUSE"] = "step" if point == "mid-cell" else "save"
    out = tmp_path / "run"
    env["PARITY_TEST_ROWS"] = str(out / "cells.csv")
    proc = _run(out, tmp, env=env)
    if point == "start-up":
        _wait_for(lambda: (out / "run.json").exists())
    else:
        _wait_for(marker.exists)
    if sig == "INT":  # a terminal's Ctrl-C reaches the whole process group
        os.killpg(proc.pid, 2)
    else:
        proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code
    assert err.strip().splitlines()[-1].startswith(f"parity: interrupted by SIG{sig}")
    assert "Traceback" not in err and "leaked" not in err
    _wait_for(lambda: not _group_alive(proc.pid), seconds=30)
    # the run's temporary folder, checkpoints included, is gone (torch may leave its own caches)
    assert [e for e in os.listdir(tmp) if e.startswith("parity-")] == []
    summary = (out / "summary.md").read_text()
    assert f"**Interrupted** (SIG{sig})" in summary
    with open(out / "cells.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert all(r["verdict"] in ("PASS", "SKIP") for r in rows)  # no torn or bogus row
    if point != "start-up":
        assert rows  # what finished before the signal is kept
    resumed = subprocess.run([sys.executable, "-m", "parity", "run", "--resume", str(out)],
                             capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "cells.csv").read_bytes() == uninterrupted
    assert "Interrupted" not in (out / "summary.md").read_text()
