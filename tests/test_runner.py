"""Run-level behaviour of ``python -m parity run`` as a process."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.xdist_group("runner")
def test_a_killed_run_keeps_every_finished_row(tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity", "run", "--matrix", "default", "-k", "fixture == 'kda' and ranks == 1",
         "--out", str(out), "--timeout", "30"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its pools' folder outlives a SIGKILL: not in /tmp
    )
    csv_path = out / "cells.csv"
    deadline = time.monotonic() + 120
    cells = set()
    while time.monotonic() < deadline and len(cells) < 3:
        time.sleep(0.2)
        if csv_path.exists():
            with open(csv_path) as fh:
                cells = {r["cell"] for r in csv.DictReader(fh)}
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    assert len({r["cell"] for r in rows}) >= 3
    assert all(r["verdict"] in ("PASS", "FAIL", "ERROR", "TIMEOUT", "SKIP") for r in rows)  # no torn row
    assert not (out / "summary.md").exists()  # the summary is written at the end only


@pytest.mark.xdist_group("runner")
def test_workers_exit_when_the_parent_is_killed(tmp_path):
    import multiprocessing as mp


    # a child process owns the pool; SIGKILL it and its ranks must go away on their own
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    owner = ctx.Process(target=_own_pool, args=(pids, str(tmp_path)))
    owner.start()
    workers = pids.get(timeout=120)
    os.kill(owner.pid, signal.SIGKILL)
    owner.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _own_pool(pids, tmp):
    from parity.matrix.cell import Cell
    from parity.execute.pool import RankPool

    pool = RankPool(1, tmp=tmp)  # a SIGKILL leaves the folder: the test's own
    pool.run(Cell(fixture="frozen", path="native", steps=2), timeout=60)
    pids.put([p.pid for p in pool.procs])
    time.sleep(600)


@pytest.mark.xdist_group("runner")
def test_a_deep_temporary_folder_and_a_folder_named_like_the_matrix_change_nothing(tmp_path):
    """The fork server's socket lives in TMPDIR: a path too long for a Unix socket address (107
    bytes) starts ranks with spawn instead of failing; and a folder named ``smoke`` in the
    working directory is not the matrix ``smoke``."""
    deep = tmp_path / ("d" * (120 - len(str(tmp_path))))
    deep.mkdir()
    (tmp_path / "smoke").mkdir()
    proc = subprocess.run([sys.executable, "-m", "parity", "run", "--matrix", "smoke", "-k",
                           "fixture == 'frozen' and ranks == 1 and microbatches == 1", "--out", str(tmp_path / "run")],
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(deep)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-1500:]


def test_every_idle_pool_is_handed_its_next_cell(tmp_path):
    """While a cell is judged, each pool without a cell ahead gets the first cell after the
    current one that it runs: not one already collected, nor a skipped one."""
    from dataclasses import replace

    from parity.matrix.cell import Cell
    from parity.runner import RunOptions, _Run

    one = [Cell(fixture="kda", path=p, ranks=1, seed=s) for s in (0, 1) for p in ("legacy", "native")]
    two = [replace(c, ranks=2) for c in one]
    todo = [one[0], one[1], two[0], two[1], one[2], one[3], two[2], two[3]]
    skipped = two[1].id
    run = _Run(todo, todo, RunOptions(out_dir=str(tmp_path)), lambda c: "skipped" if c.id == skipped else "", None)
    try:
        run.position = 0
        assert run._upcoming() == [one[1], two[0]]
        run.pools.ahead[1] = one[1]
        run.position = 2
        assert run._upcoming() == [two[2]]  # the 1-rank pool is busy; the 2-rank one skips a skipped cell
        run.pools.ahead = {}
        run.pools.finished[one[2].id] = object()
        assert run._upcoming() == [one[3], two[2]]  # skips what was collected and what is skipped
    finally:
        run.writer.close()


def test_the_fork_server_builds_the_registry_and_refuses_cuda_meanwhile(monkeypatch):
    """``parity.execute.warm`` (preloaded by the fork server) leaves the registry built for every
    rank it forks; model code that would initialize CUDA meanwhile meets a refusal, and a
    registry that fails to build is left unbuilt (the ranks report it)."""
    import types

    import torch

    from parity.execute import starting, warm
    from parity.model import registry

    assert "parity.execute.warm" in starting.PRELOAD
    registry.registered.cache_clear()
    assert warm.warm() and registry.registered.cache_info().currsize == 1
    refused = []

    def factory():
        try:
            torch.cuda._lazy_init()
        except RuntimeError as exc:
            refused.append(str(exc))

    bad = types.SimpleNamespace(name="cuda_at_build", value="x:y", load=lambda: factory)
    monkeypatch.setattr(registry, "entry_points", lambda group: [bad])
    registry.registered.cache_clear()
    try:
        assert not warm.warm() and registry.registered.cache_info().currsize == 0
        assert refused == ["the fork server does not initialize CUDA"]
        assert torch.cuda._lazy_init is not warm._refuse  # restored
    finally:
        monkeypatch.undo()
        registry.registered.cache_clear()


AGREE = """
import sys
import torch.distributed as dist
from parity.execute.torchrun import agreed
dist.init_process_group("gloo")
code = agreed(int(sys.argv[1]))
dist.destroy_process_group()
sys.exit(code)
"""


def test_every_torchrun_rank_exits_with_rank_0s_verdict():
    """Each node of a multi-node torchrun job is its own CI step: a peer (which returns -1: it
    judges nothing) must not exit 0 when rank 0's verdict is 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, code in ((0, 1), (1, -1)):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", AGREE, str(code)], env=env, stderr=subprocess.PIPE))
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [1, 1], [p.stderr.read()[-500:] for p in procs]


def _torchrun(tmp_path, *args, script: str = ""):
    """``parity run`` on smoke's 2-rank kda cells under a real torchrun (2 ranks, gloo); ``script``
    (Python run on each rank before parity's CLI) patches in what a test needs to happen."""
    entry = ["-m", "parity"]
    if script:  # each rank also leaves its exit code in a file: torchrun may SIGTERM a rank that is exiting
        (tmp_path / "entry.py").write_text(
            "import os, sys\n" + script + "\nfrom parity.cli import main\ncode = main(sys.argv[1:])\n"
            "open(os.path.join(os.environ['PARITY_TEST_CODES'], os.environ['RANK']), 'w').write(str(code))\n"
            "sys.exit(code)\n")
        entry = [str(tmp_path / "entry.py")]
    out, junit = tmp_path / "run", tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *entry, "run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 2",
                           "--out", str(out), "--junit", str(junit), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), "PARITY_TEST_CODES": str(tmp_path)})
    with open(out / "cells.csv") as fh:
        rows = list(csv.DictReader(fh))
    return proc, out, rows, junit.read_text()


@pytest.mark.xdist_group("runner")
def test_a_rank_that_dies_under_torchrun_is_its_cells_error_and_the_results_are_written(tmp_path):
    """torchrun tears the group down when a rank exits: rank 0 (whose next exchange fails) records
    the cell in flight as an ERROR naming the loss, starts no further cell, and writes the summary
    (marked interrupted, naming what was not run), the report and JUnit before it is stopped. Where
    the teardown's SIGTERM reaches rank 0 first, during its own part of the cell, that is a stop:
    the cell is not finished (no row), the rest as before (CI at 6cb87b8 drew that order once)."""
    proc, out, rows, junit = _torchrun(tmp_path, "--fault", "crash")
    assert proc.returncode != 0
    if rows:  # rank 0's exchange with the dead rank failed first: the cell in flight is its ERROR
        assert [(r["path"], r["check"], r["verdict"]) for r in rows] == [("legacy", "run", "ERROR")], rows
        assert rows[0]["detail"].startswith("a rank left the torchrun group during this cell"), rows[0]["detail"]
        cause = "a rank left the torchrun group"
        assert 'errors="2"' in junit
    else:  # torchrun's teardown SIGTERM reached rank 0 in its own part of the cell first (a race, about one
        cause = "rank 0 was stopped by a signal"  # run in twenty here): a stop, that cell not finished
    assert '"status": "interrupted"' in (out / "run.json").read_text()
    summary = (out / "summary.md").read_text()
    assert f"**Interrupted** ({cause}" in summary and "## Not run" in summary, summary
    assert (out / "report.html").exists() and 'type="INTERRUPTED"' in junit
    assert f"{cause} during kda/legacy/r2" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.xdist_group("runner")
def test_under_torchrun_a_rank_that_dies_at_a_cells_start_fails_that_cell_not_the_one_being_judged(tmp_path):
    """The peers wait for rank 0's word before each cell: a rank dying as the second cell starts,
    while rank 0 still judges the first, makes the second the ERROR (not a stop of the run)."""
    script = """import os, sys, time
import parity.runner as R, parity.execute.torchrun as T
if os.environ["RANK"] == "0":
    judge = R.judge_cell
    R.judge_cell = lambda *a, **k: (judge(*a, **k), time.sleep(1.0))[0]
else:
    run, calls = T.TorchrunExecutor.run, []
    def dying(self, cell, timeout, **kw):
        calls.append(cell)
        if len(calls) == 2:
            os._exit(17)
        return run(self, cell, timeout, **kw)
    T.TorchrunExecutor.run = dying
"""
    proc, out, rows, junit = _torchrun(tmp_path, script=script)
    errors = [(r["path"], r["check"]) for r in rows if r["verdict"] == "ERROR"]
    assert errors == [("native", "run")], (errors, proc.stderr[-2000:])
    assert all(r["verdict"] in ("PASS", "SKIP") for r in rows if r["path"] == "legacy")
    assert "a rank left the torchrun group during kda/native/r2" in proc.stderr


@pytest.mark.xdist_group("runner")
def test_under_torchrun_a_hung_rank_makes_its_cell_a_timeout_after_timeout_seconds(tmp_path):
    """--timeout is the group's timeout: rank 1 hanging in the first cell leaves rank 0 waiting
    for its observations that long, not the backend's 30 minutes (the test's 300 s would expire);
    the cell is TIMEOUT, no further cell starts, and the results are written."""
    script = """import os, time
import parity.execute.torchrun as T
if os.environ["RANK"] == "1":
    T.TorchrunExecutor.run = lambda self, cell, timeout, **kw: time.sleep(10**6)
"""
    proc, out, rows, junit = _torchrun(tmp_path, "--timeout", "5", script=script)
    assert [(r["path"], r["check"], r["verdict"]) for r in rows] == [("legacy", "run", "TIMEOUT")], \
        (rows, proc.stderr[-2000:])
    assert rows[0]["detail"].startswith("a rank did not answer within --timeout 5 s"), rows[0]["detail"]
    assert '"status": "interrupted"' in (out / "run.json").read_text() and (tmp_path / "0").read_text() == "1"
    # said as a hang, not as a rank that left, and without a --resume torchrun cannot do
    summary = (out / "summary.md").read_text()
    assert "**Interrupted** (a rank did not answer within --timeout 5 s)" in summary and "--resume" not in summary
    assert "a rank did not answer within --timeout 5 s during kda/legacy/r2" in proc.stderr
    assert "that cell is TIMEOUT" in proc.stderr and "left the torchrun group" not in proc.stderr + summary + junit


@pytest.mark.xdist_group("runner")
def test_under_torchrun_rank_0_hung_in_its_own_part_of_a_cell_is_a_timeout_and_the_results_are_written(tmp_path):
    """Every rank sleeps in the cell (no exchange ever times out): rank 0, which judges and writes,
    watches its own part by silence (its heartbeats), makes the cell TIMEOUT after --timeout seconds,
    writes the results and exits 1; torchrun then stops the peers."""
    proc, out, rows, junit = _torchrun(tmp_path, "--fault", "hang", "--timeout", "5")
    assert [(r["path"], r["check"], r["verdict"]) for r in rows] == [("legacy", "run", "TIMEOUT")], \
        (rows, proc.stderr[-2000:])
    assert rows[0]["detail"].startswith("a rank did not answer within --timeout 5 s during this cell (a hang; "
                                        "rank 0's own part of it reported nothing)"), rows[0]["detail"]
    assert '"status": "interrupted"' in (out / "run.json").read_text() and proc.returncode != 0
    assert (out / "summary.md").exists() and (out / "report.html").exists() and 'errors="2"' in junit


@pytest.mark.xdist_group("runner")
def test_under_torchrun_a_peer_that_would_skip_rank_0s_cell_makes_it_an_error_naming_it(tmp_path):
    """Nodes may differ (a compiler, a library): each rank runs the cell rank 0 names, and one
    whose own rules skip it says so -- that cell is an ERROR, the ones after it run. Ranks that
    each followed their own list ran different cells and aborted gloo with nothing written."""
    script = """import os
import parity.runner as R
if os.environ["RANK"] == "1":
    skip = R._skip_reason
    R._skip_reason = lambda cell, *a, **k: "no compiler on this node" if cell.path == "legacy" else skip(cell, *a, **k)
"""
    proc, out, rows, junit = _torchrun(tmp_path, script=script)
    run = {r["path"]: (r["verdict"], r["detail"]) for r in rows if r["check"] == "run"}
    assert run["legacy"][0] == "ERROR" and run["legacy"][1].startswith(
        "rank 1 would not run this cell here (no compiler on this node)"), (run, proc.stderr[-2000:])
    assert all(r["verdict"] in ("PASS", "SKIP") for r in rows if r["path"] == "native" and r["check"] != "pair")
    assert '"status": "complete"' in (out / "run.json").read_text()
    assert [(tmp_path / str(rank)).read_text() for rank in (0, 1)] == ["1", "1"]


def test_under_torchrun_the_launched_world_decides_the_gpu_count_not_this_node(monkeypatch):
    """``torchrun --nnodes 2 --nproc-per-node 2``: a 4-rank cell runs on 4 GPUs over two nodes."""
    from parity.matrix.cell import Cell
    from parity.runner import _skip_reason

    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    cell = Cell(fixture="kda", path="native", ranks=4, device="cuda")
    assert _skip_reason(cell, "cuda", None) == "needs 4 GPUs; 2 visible"
    assert _skip_reason(cell, "cuda", None, spawned=False) == ""


@pytest.mark.xdist_group("runner")
def test_a_torchrun_rank_0_stopped_by_a_signal_stops_its_peers_with_its_code(tmp_path):
    """SIGTERM to rank 0 alone: it ends the cell, tells its peers no further cell runs, writes
    the results as interrupted, and every rank exits 143."""
    script = """import os, signal, sys
import parity.runner as R
if os.environ["RANK"] == "0":
    judge = R.judge_cell
    R.judge_cell = lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), judge(*a, **k))[1]
"""
    proc, out, rows, junit = _torchrun(tmp_path, script=script)
    assert {r["cell"] for r in rows} == {rows[0]["cell"]} and not [r for r in rows if r["verdict"] == "ERROR"]
    assert '"status": "interrupted"' in (out / "run.json").read_text()
    assert "**Interrupted** (SIGTERM)" in (out / "summary.md").read_text() and 'type="INTERRUPTED"' in junit
    codes = [(tmp_path / str(rank)).read_text() for rank in (0, 1)]
    assert codes == ["143", "143"], proc.stderr[-3000:]


@pytest.mark.xdist_group("runner")
def test_a_torchrun_rank_0_stopped_during_its_own_part_of_a_cell_is_a_stop_not_a_lost_rank(tmp_path):
    """SIGTERM to rank 0 while it trains its part of a cell (a CI job's cancel lands there): the
    run said "a rank left the torchrun group", "that cell is an ERROR" with no such row, and exit 1
    (review). Such a run, like any torchrun run, does not resume: --resume without torchrun mixed
    two launches' skips and called the result complete."""
    script = """import os, signal, sys
import parity.execute.worker as W
if os.environ["RANK"] == "0":
    run = W.run_rank
    def stopped(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return run(*a, **k)
    W.run_rank = stopped
"""
    proc, out, rows, junit = _torchrun(tmp_path, script=script)
    assert rows == [] and (tmp_path / "0").read_text() == "143", proc.stderr[-3000:]
    peer = tmp_path / "1"  # absent when torchrun's teardown stopped rank 1 before it could write its code
    assert not peer.exists() or peer.read_text() != "0"
    assert "rank 0 was stopped by a signal during kda/legacy/r2" in proc.stderr
    assert "that cell did not finish, the 3 cells after it were not run" in proc.stderr
    summary = (out / "summary.md").read_text()
    assert "a rank left" not in summary and "--resume" not in summary
    from parity.cli import main

    assert main(["run", "--resume", str(out)]) == 2


def test_a_rank_sends_only_messages_one_atomic_pipe_write_carries(tmp_path):
    """A rank killed while sending must leave a whole message or none: a half-written one held the
    parent in a read no timeout or signal ended (review, 2026-12-06). Payloads over INLINE bytes
    go through a file; every pickled message fits PIPE_BUF, which the kernel writes atomically."""
    import pickle
    import queue
    import select

    from parity.execute.pool import INLINE, _received, _send

    q = queue.SimpleQueue()
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200)  # the message names the file, not its folder
    deep.mkdir(parents=True)
    big, small = os.urandom(4 * 2**20), b"heartbeat"
    for payload in (big, small, os.urandom(INLINE)):
        _send(q, str(deep), ("error", 1, payload))
        message = q.get()
        assert len(pickle.dumps(message)) <= select.PIPE_BUF
        assert _received(message, str(deep)) == ("error", 1, payload)
    assert not os.listdir(deep)  # every file read and removed


@pytest.mark.xdist_group("runner")
def test_a_torchrun_rank_0_refusing_its_out_stops_every_rank_with_exit_2(tmp_path):
    """An ``--out`` holding another run's results is found by rank 0 after the group started: its
    peers, waiting for a cell, are told none follows and exit 2 with it (not 1 at teardown)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.md").write_text("another run's\n")
    (tmp_path / "entry.py").write_text(
        "import os, sys\nfrom parity.cli import main\ncode = main(sys.argv[1:])\n"
        "open(os.path.join(os.environ['PARITY_TEST_CODES'], os.environ['RANK']), 'w').write(str(code))\n"
        "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "entry.py"), "run", "--matrix", "smoke", "-k", "fixture == 'kda' and ranks == 2",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd(), "PARITY_TEST_CODES": str(tmp_path)})
    codes = [(tmp_path / str(rank)).read_text() for rank in (0, 1)]
    assert codes == ["2", "2"], proc.stderr[-3000:]
    assert "holds another run's results" in proc.stderr and (tmp_path / "run" / "summary.md").read_text() == "another run's\n"


FORK_SERVER_SIGINT = """
import signal
from multiprocessing import forkserver
from parity.execute.starting import context, ensure_server, stop_server
ensure_server(context())
status = open(f"/proc/{forkserver._forkserver._forkserver_pid}/status").read()
ignored = int(next(l for l in status.splitlines() if l.startswith("SigIgn:")).split()[1], 16)
print(bool(ignored & (1 << (signal.SIGINT - 1))), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
stop_server()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server and /proc are Linux's")
def test_the_fork_server_ignores_sigint_from_its_start_and_the_parent_keeps_its_handler():
    """A Ctrl-C to the process group while the fork server imports torch (the first second of
    every command that runs cells) printed the server's KeyboardInterrupt traceback before
    parity's one line (review, 2026-12-06): the server starts with SIGINT ignored."""
    done = subprocess.run([sys.executable, "-c", FORK_SERVER_SIGINT], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr[-2000:]


@pytest.mark.xdist_group("runner")
def test_a_torchrun_rank_whose_peer_never_joins_exits_2_in_one_line(tmp_path):
    """A peer that refuses bad input only it sees (a model failing to import on one node) exits
    before the group forms: this rank waited ``--timeout`` seconds, then printed torch's store
    traceback and exited 1 (review). Now one line, exit 2, and no ``--out``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-m", "parity", "run", "--matrix", "smoke", "-k",
                           "fixture == 'kda' and ranks == 2", "--timeout", "2", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert "torchrun: rank 0: the process group did not form within 2 s" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_timeout_is_what_a_collective_says_when_it_timed_out_not_any_mention_of_one():
    """gloo's and NCCL's own words make a cell TIMEOUT (and the group in doubt); a model's error that
    merely mentions a timeout is that cell's ERROR, and the run goes on (review)."""
    from parity.execute.torchrun import _timed_out

    assert _timed_out("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv")
    assert _timed_out("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE) ran for "
                      "600000 milliseconds before timing out.")
    assert not _timed_out("rank 0 raised ValueError: timeout_ms must be positive")


def test_rank_0s_watchdog_and_signal_survive_code_that_catches_everything():
    """DCP wraps its steps in ``except BaseException``: a watchdog expiry or torchrun's SIGTERM taken
    there is raised again at the next heartbeat and where rank 0's part of the cell ends, never a
    false checkpoint ERROR of a cell that goes on (review)."""
    import signal
    import time

    from parity.execute.torchrun import _Silent, _watched
    from parity.interrupt import Interrupted, Signals, at_once

    def swallowed(seconds: float) -> None:
        try:
            time.sleep(seconds)
        except BaseException:  # noqa: BLE001 - as DCP does
            pass

    with pytest.raises(_Silent):
        with _watched(0, 0.1) as heartbeat:
            swallowed(1.0)
            heartbeat("step 0 micro-batch 0")
    with pytest.raises(_Silent):
        with _watched(0, 0.1):
            swallowed(1.0)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with Signals() as signals, pytest.raises(Interrupted):
        with at_once():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.0)
            except BaseException:  # noqa: BLE001
                pass
    assert signals.name == "SIGTERM"
