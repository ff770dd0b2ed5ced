"""SIGINT/SIGTERM at several points of a real run, then ``--resume`` to the same result;
the same for ``gate``, ``bench``, ``fuzz`` and while a run's result files are written;
workers that die with their parent before they import torch; a disk that fills up."""

import csv
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

#: One pool, four cells, each with a checkpoint lifecycle (mb1-every): its saves and steps come
#: both before and after the first rows are recorded, so every pause point below is reached.
SELECT = ["--matrix", "smoke", "-k", "fixture in ('kda', 'lm') and ranks == 1 and microbatches == 1"]
#: Imported by every process of the run (parent and workers): once some rows are recorded,
#: pauses a worker's next call of the chosen torch function, after touching a marker file, so a
#: signal lands inside it. Never the parent (the session leader the test started): its reference
#: steps an optimizer too, and on a busy machine it could reach one first -- a parent asleep
#: there cannot poll the signal, and the run outlived the test's wait (seen once beside a
#: looping ``default``).
PAUSE = textwrap.dedent("""
    import os
    where = os.environ.get("PARITY_TEST_PAUSE")
    if where and os.getpid() != os.getsid(0):
        import glob, time, torch
        import torch.distributed.checkpoint as dcp
        owner, name = {"save": (dcp, "save"), "step": (torch.optim.AdamW, "step")}[where]
        original = getattr(owner, name)
        marker = os.environ["PARITY_TEST_MARKER"]
        rows = os.environ["PARITY_TEST_ROWS"]  # a glob
        def recorded():
            for path in glob.glob(rows):
                try:
                    with open(path) as fh:
                        if len(fh.readlines()) > 1:
                            return True
                except FileNotFoundError:
                    pass
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


@pytest.fixture(scope="session")  # once per test worker, even when xdist interleaves modules
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
    # the counts are of what finished, not of what was asked (review: "8 cells", "8 cells run" after 3)
    held, timed = len({r["cell"] for r in rows if "~" not in r["path"]}), json.loads((out / "timings.json").read_text())["cells"]
    assert timed == held and (f"{held} of " in summary if held else True), summary
    assert all(r["verdict"] in ("PASS", "SKIP") for r in rows)  # no torn or bogus row
    if point != "start-up":
        assert rows  # what finished before the signal is kept
    (out / "gate.json").write_text('{"decisions": [{"model": "kda", "decision": "NO-GO", "reasons": []}]}')
    resumed = subprocess.run([sys.executable, "-m", "parity", "run", "--resume", str(out)],
                             capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "cells.csv").read_bytes() == uninterrupted
    assert "Interrupted" not in (out / "summary.md").read_text()
    assert not (out / "gate.json").exists()  # a gate --from on the interrupted run decided on part of it


def _paused_env(tmp_path, rows: str, where: str = "step") -> dict:
    """An environment whose processes pause in ``where`` once ``rows`` (a glob) has rows;
    TMPDIR is ``tmp_path/tmp``, checked for leftovers by :func:`_stopped_cleanly`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PAUSE)
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(site),
            "PARITY_TEST_MARKER": str(tmp_path / "paused"), "PARITY_TEST_PAUSE": where, "PARITY_TEST_ROWS": rows}


def _start(*args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def _send(proc, sig: str) -> None:
    """INT to the process group (as a terminal's Ctrl-C), TERM to the parent (as a CI runner)."""
    if sig == "INT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.terminate()


def _stopped_cleanly(proc, sig: str, tmp, send: bool = True) -> tuple[str, str]:
    """Send ``sig`` and check the common promises: 130/143, one line, no traceback, nothing
    left running, no temporary folder left. Returns (stdout, stderr)."""
    if send:
        _send(proc, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == {"INT": 130, "TERM": 143}[sig], err[-2000:]
    assert "Traceback" not in err and "leaked" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"parity: interrupted by SIG{sig}")
    _wait_for(lambda: not _group_alive(proc.pid), seconds=60)
    assert [e for e in os.listdir(tmp) if e.startswith("parity-")] == []
    return out, err


SMALL = ["--matrix", "smoke", "-k", "fixture == 'frozen' and ranks == 1"]


@pytest.mark.xdist_group("interrupt")
def test_gate_interrupted_mid_cell(tmp_path):
    out = tmp_path / "gate"
    env = _paused_env(tmp_path, str(out / "cells.csv"))
    proc = _start("-m", "parity", "gate", *SMALL, "--out", str(out), env=env)
    _wait_for((tmp_path / "paused").exists)
    _stopped_cleanly(proc, "INT", tmp_path / "tmp")
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert not (out / "gate.json").exists()  # no decision from half a matrix


#: Runs ``parity`` with the first summary write paused (a marker file touched) until the
#: test, having sent its signal, creates the "go" file: the signal lands while results are
#: written. Test plumbing only: nothing in parity reads these variables.
WRITING = textwrap.dedent("""
    import os, sys, time
    import parity.runner as runner
    original = runner.summary_markdown
    def paused(*args, **kwargs):
        open(os.environ["PARITY_TEST_MARKER"], "w").close()
        while not os.path.exists(os.environ["PARITY_TEST_GO"]):
            time.sleep(0.05)
        return original(*args, **kwargs)
    runner.summary_markdown = paused
    from parity.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.xdist_group("interrupt")
@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_while_results_are_written_completes_them_and_resume_finishes(tmp_path, sig):
    (tmp_path / "tmp").mkdir()
    marker, go, out = tmp_path / "paused", tmp_path / "go", tmp_path / "run"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PARITY_TEST_MARKER": str(marker),
           "PARITY_TEST_GO": str(go)}
    proc = _start("-c", WRITING, "run", *SMALL, "--out", str(out), env=env)
    _wait_for(marker.exists)
    _send(proc, sig)
    go.touch()
    _, err = _stopped_cleanly(proc, sig, tmp_path / "tmp", send=False)
    assert "while writing the results" in err.strip().splitlines()[-1]
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert (out / "summary.md").exists() and (out / "report.html").exists()  # completed, not torn
    rows = (out / "cells.csv").read_bytes()
    resumed = subprocess.run([sys.executable, "-m", "parity", "run", "--resume", str(out)],
                             capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "[" not in resumed.stderr  # no cell ran again (no progress line)
    assert (out / "cells.csv").read_bytes() == rows
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


@pytest.mark.xdist_group("interrupt")
def test_bench_interrupted_keeps_what_was_measured(tmp_path):
    out, rows = tmp_path / "bench", tmp_path / "measured"
    env = _paused_env(tmp_path, str(rows))
    proc = _start("-m", "parity", "bench", "--fixtures", "frozen,kda", "--paths", "legacy", "--ranks", "1",
                  "--warmup", "0", "--steps", "2", "--device", "cpu", "--out", str(out), env=env)
    first = proc.stdout.readline()  # the first model is measured
    assert first.startswith("frozen"), first
    rows.write_text("measured\nfrozen\n")  # now the next training step pauses
    _wait_for((tmp_path / "paused").exists)
    _stopped_cleanly(proc, "INT", tmp_path / "tmp")
    with open(out / "bench.csv") as fh:
        measured = {(r["fixture"], r["path"]) for r in csv.DictReader(fh)}
    assert measured == {("frozen", "legacy")}
    assert "kda / legacy: not run (interrupted by SIGINT)" in (out / "bench.md").read_text()


@pytest.mark.xdist_group("interrupt")
def test_fuzz_interrupted_counts_the_finished_examples(tmp_path):
    out = tmp_path / "fuzz"
    # pause in the second example (its run directory appears inside the campaign's temporary folder)
    env = _paused_env(tmp_path, str(tmp_path / "tmp" / "parity-fuzz-*" / "example-2" / "run.json"))
    proc = _start("-m", "parity", "fuzz", "--examples", "5", "--device", "cpu", "--out", str(out), env=env)
    _wait_for((tmp_path / "paused").exists)
    _stopped_cleanly(proc, "TERM", tmp_path / "tmp")
    report = (out / "fuzz.md").read_text()
    assert report.startswith("fuzz: 1 runs")
    assert "interrupted by SIGTERM: the counts above are of the 1 runs that finished" in report


def _report_start(results) -> None:
    """A spawned target: is die-with-parent set, and was torch imported before this ran?"""
    import ctypes

    value = ctypes.c_int()
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(value))  # PR_GET_PDEATHSIG
    results.put((value.value, "torch" in sys.modules))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_ask_to_die_with_their_parent_before_importing_torch():
    from parity.execute import spawned

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=spawned.start, args=(f"{__name__}:_report_start", os.getpid(), results))
    proc.start()
    assert results.get(timeout=120) == (signal.SIGKILL, False)
    proc.join(timeout=60)


def test_a_full_disk_is_one_line_and_exit_74_and_resume_continues(tmp_path, monkeypatch, capsys):
    import errno

    from parity.cli import main
    from parity.report.records import RecordWriter

    out = tmp_path / "run"
    write, calls = RecordWriter.write, []

    def full(self, records):  # the disk fills up at the second pair group's first cell
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(self, records)

    monkeypatch.setattr(RecordWriter, "write", full)
    assert main(["run", *SMALL, "--out", str(out)]) == 74
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"parity: cannot write {out}/cells.csv (No space left on device); make room, "
                                            f"then continue: python -m parity run --resume {out}")
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    monkeypatch.setattr(RecordWriter, "write", write)  # space was freed
    assert main(["run", "--resume", str(out)]) == 0
    with open(out / "cells.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len({tuple(r.values()) for r in rows}) == len(rows)  # nothing recorded twice
    assert len({r["cell"] for r in rows if "~" not in r["path"]}) == 4  # every cell recorded
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
