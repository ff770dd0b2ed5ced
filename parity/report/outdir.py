"""Output directories: one run per directory, resumable, never two runs' files side by side.

Rules (``docs/ci.md``, "Results"):

- ``--out DIR`` must be a directory parity can create and write; anything else exits 2.
- A directory that already holds parity results (any of :data:`RUN_FILES`) is refused
  unless ``--overwrite`` (which removes them first) or ``--resume DIR`` is given. Other
  files in it are left alone.
- ``run.json`` names the run (options, torch version, the cell list) and its status:
  ``running``, ``interrupted`` or ``complete``. ``progress.jsonl`` gains a line, with the
  byte length of ``cells.csv`` and a digest of the group's bytes, each time a pair group of cells
  is fully recorded (a reader refuses a file whose length or bytes differ); ``--resume``
  cuts ``cells.csv`` back to the last such line and runs the rest, so a resumed run's
  files equal an uninterrupted run's (timings apart).
- One writer per directory: a run holds :data:`LOCK` (``flock``, the holder's pid inside)
  for its whole life; a second run, ``--overwrite`` or ``--resume`` of a directory in use is
  refused naming that pid. The kernel drops the lock when its holder dies, so a killed
  run's directory is never blocked; the file is removed when the run ends.
- A file that cannot be written (disk full) is an :class:`~parity.errors.OutputError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile

from parity.digests import data_sha256
from parity.errors import UsageError, text_file, writing

MANIFEST = "run.json"
PROGRESS = "progress.jsonl"
CELLS = "cells.csv"
GATE_FILES = ("gate.md", "gate.json")
"""What a gate writes beside a run's records: its decision on them."""
#: A fuzz campaign's manifest (:mod:`parity.report.fuzz_merge`): a folder holding one is a campaign's.
CAMPAIGN = "fuzz.json"
#: What a bench writes (:mod:`parity.bench`), besides its plots.
BENCH_FILES = ("bench.csv", "bench.md", "bench.json")
#: A compare digest (``compare --write-digest``, :mod:`parity.report.compare`).
DIGEST = "digest.json"
#: Results of other kinds than a run's, by the files that mark them: a run never writes beside
#: them, nor one of them beside another kind's.
OTHER_RESULTS = {"a fuzz campaign": (CAMPAIGN,), "a bench": ("bench.json", "bench.csv"), "a compare digest": (DIGEST,)}
RUN_FILES = (CELLS, "summary.md", "timings.json", MANIFEST, PROGRESS, *GATE_FILES, "report.html")
#: Where a run writes the traces of its failing cells (:func:`write_trace`).
TRACES = "traces"
LOCK = ".parity.lock"
_held: set[str] = set()


def writable_file(path: str, what: str, out: str = "", *inputs: str, example: str = "junit.xml") -> None:
    """``path`` can be written as a file at the end of a run (``--junit``): not a directory, in an existing
    folder parity can write or in ``out`` (which the run creates), and not one of the files of the results in ``out`` or in ``inputs`` (a
    merge's parts) (:data:`RUN_FILES`: a JUnit file written over ``cells.csv`` would destroy the run
    it reports). Checked before any work, so a finished run cannot fail on it."""
    if not path:
        raise UsageError(f"{what} '': give a file path, e.g. results/junit.xml (or leave the option out)")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a directory; give a file path, e.g. {os.path.join(path, example)}")
    for results in (out, *inputs):
        if results and os.path.basename(path) in RUN_FILES and os.path.realpath(folder) == os.path.realpath(results):
            raise UsageError(f"{what} {path}: is the results' own {os.path.basename(path)}; give another file, e.g. "
                             f"{os.path.join(out or results, example)}")
    if out and os.path.abspath(path) == os.path.abspath(out):
        raise UsageError(f"{what} {path}: is the --out directory; give a file in it, e.g. {os.path.join(out, example)}")
    if out and not os.path.exists(out) and os.path.abspath(folder) == os.path.abspath(out):
        return  # in the results folder the run creates (``--out`` is checked on its own)
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: no folder {folder}; give a path in an existing folder or in --out")
    existed = os.path.exists(path)
    try:
        with text_file(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot write there ({exc.strerror or exc}); choose a writable path") from None
    if not existed:
        os.remove(path)


def usable(out: str, what: str = "--out") -> None:
    """``out`` is a directory parity can create and write (``--out`` of every command, ``what`` names
    another option), else a :class:`UsageError`."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{what} {out}: is a file; give a directory (it is created if missing)")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".parity-write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"{what} {out}: cannot write there ({exc.strerror or exc}); "
                         "choose a writable directory") from None


def _holder(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            pid = fh.read().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "a process that is starting"


@contextlib.contextmanager
def locked(out: str, what: str = "--out"):
    """Hold ``out``'s lock for the block (see the module); a directory in use is exit 2.
    Reentrant within one process (a gate holds it across its run)."""
    usable(out)
    key = os.path.realpath(out)
    if key in _held:
        yield
        return
    path = os.path.join(out, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{what} {out} is in use by another parity run ({_holder(path)}); wait for it to "
                             "finish or stop it, or choose another --out") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break  # not a file its previous holder removed while we opened it
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held.add(key)
        yield
    finally:
        _held.discard(key)
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)


def other_results(out: str, besides: str = "") -> None:
    """Refuse ``out`` when it holds results of one of :data:`OTHER_RESULTS`' kinds but ``besides``
    (the kind about to be written, which replaces its own): two kinds side by side read as one (a
    merge takes a run's part for a campaign's, a compare a run beside a stopped bench as complete, a
    baseline digest is shadowed by the run's cells)."""
    for kind, files in OTHER_RESULTS.items():
        held = next((f for f in files if os.path.isfile(os.path.join(out, f))), None)
        if held and kind != besides:
            raise UsageError(f"--out {out} holds {kind}'s results ({held}); choose another --out")


def run_files_in(out: str) -> list[str]:
    """The files of a run's results (:data:`RUN_FILES`) present in ``out``."""
    return [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]


def prepare(out: str, manifest: dict, *, overwrite: bool, resumable: bool = True) -> None:
    """Make ``out`` ready for a new run and write its manifest (status ``running``). ``resumable``:
    whether the command writing it has ``--resume`` to suggest (``merge`` has not)."""
    usable(out)
    other_results(out)
    present = run_files_in(out)
    if present and not overwrite:
        resume = f", --resume {out} to continue that run" if resumable else ""
        raise UsageError(f"--out {out} holds another run's results ({', '.join(present)}); pass --overwrite to "
                         f"replace them{resume}, or choose another --out")
    for f in present:
        os.remove(os.path.join(out, f))
    shutil.rmtree(os.path.join(out, TRACES), ignore_errors=True)  # another run's traces
    write_manifest(out, {**manifest, "status": "running"})


def trace_path(out: str, cell_id: str) -> str:
    """``traces/<cell id with '/' as '__'>.json``."""
    return os.path.join(out, TRACES, cell_id.replace("/", "__") + ".json")


def copy_traces(source: str, out: str, cell_ids) -> None:
    """The traces (and operator logs) ``source`` holds of ``cell_ids``, copied into ``out`` (a
    merge: a part's failing cells keep the trace a single run would have written)."""
    for cell_id in cell_ids:
        for name in (trace_path, op_log_path):
            src, dst = name(source, cell_id), name(out, cell_id)
            if os.path.isfile(src):
                with writing(dst):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copyfile(src, dst)


def write_trace(out: str, cell_id: str, document: dict) -> None:
    """Write one failing cell's trace document (:func:`parity.judge.divergence.trace_document`)."""
    path = trace_path(out, cell_id)
    with writing(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with text_file(path) as fh:
            json.dump(document, fh, indent=1)


def op_log_path(out: str, cell_id: str) -> str:
    """``traces/<cell id with '/' as '__'>.ops.json``, beside the cell's trace."""
    return trace_path(out, cell_id).removesuffix(".json") + ".ops.json"


def write_op_log(out: str, cell_id: str, op_log: dict) -> str:
    """Write a traced re-run's operator log (:mod:`parity.execute.oplog`) beside its trace as
    ``traces/<cell>.ops.json``; returns that file's name, or why there is none."""
    if "log" not in op_log:
        return f"not written: {op_log.get('note') or 'rank 0 recorded no operator log'}"
    path = op_log_path(out, cell_id)
    with writing(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with text_file(path) as fh:
            fh.write(op_log["log"])
    return os.path.basename(path)


def write_manifest(out: str, manifest: dict) -> None:
    """Replace ``run.json`` atomically (a full disk leaves the previous one)."""
    tmp = os.path.join(out, MANIFEST + ".tmp")
    with writing(os.path.join(out, MANIFEST)):
        try:
            with text_file(tmp) as fh:
                json.dump(manifest, fh, indent=1)
            os.replace(tmp, os.path.join(out, MANIFEST))
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def set_status(out: str, status: str) -> bool:
    """Best effort: record ``status`` in ``run.json`` (e.g. ``failed`` when the disk is full);
    False when even that could not be written."""
    try:
        write_manifest(out, {**read_manifest(out), "status": status})
        return True
    except Exception:  # noqa: BLE001 - the error being reported matters more
        return False


def read_json(path: str, fix: str) -> dict:
    """A JSON object parity wrote (``run.json``, ``gate.json``, ``digest.json``); anything else -- unreadable,
    not JSON, not an object -- is a :class:`UsageError` naming ``path`` and ``fix``."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:  # ValueError: not JSON, not UTF-8
        raise UsageError(f"{path} is unreadable ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a JSON object as parity writes it; {fix}")
    return data


def read_manifest(out: str, fix: str = "start a new run with --overwrite") -> dict:
    """``out``'s ``run.json``: an object whose ``options``, ``environment`` and ``model_warnings``
    (if any) are objects, ``cells`` a list of strings and ``status`` a string; ``fix`` ends the error when it
    is not."""
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        raise UsageError(f"{out}: no {MANIFEST} there; give the --out directory of an earlier parity run")
    manifest = read_json(path, fix)
    for key, kind in (("options", dict), ("environment", dict), ("cells", list), ("status", str),
                      ("model_warnings", dict)):
        if key in manifest and not isinstance(manifest[key], kind):
            raise UsageError(f"{path}: {key} is not {'an object' if kind is dict else 'a ' + kind.__name__}; {fix}")
    if not all(isinstance(c, str) for c in manifest.get("cells", [])):
        raise UsageError(f"{path}: cells holds something other than cell ids; {fix}")
    for model, found in (manifest.get("model_warnings") or {}).items():  # as run writes them (cli.run.check_models)
        if not (isinstance(found, dict) and isinstance(found.get("notes", []), list)
                and all(isinstance(n, str) for n in found.get("notes", []))
                and isinstance(found.get("fp32_unselected", False), bool)):
            raise UsageError(f"{path}: model_warnings[{model!r}] is not {{notes: [text], fp32_unselected: true/false}}; "
                             f"{fix}")
    return manifest


def _recorded_end(path: str) -> int:
    """The byte length of ``cells.csv`` the last line of ``progress.jsonl`` records (0: none yet)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
            lines = [line for line in fh.read().split(b"\n") if line.strip()]
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["bytes"] if lines else 0


def mark_group_done(out: str, group: str) -> None:
    """Record that ``group``'s rows are all in ``cells.csv`` (after they were flushed): the file's
    length and a digest of the bytes the group added, so an edit of its rows that keeps the length
    is found (:func:`complete_records`)."""
    cells, progress = os.path.join(out, CELLS), os.path.join(out, PROGRESS)
    start = _recorded_end(progress)
    with open(cells, "rb") as fh:
        fh.seek(start)
        block = fh.read()
    entry = {"group": group, "bytes": start + len(block), "sha256": data_sha256(block)}
    with writing(progress), text_file(progress, "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _blocks(cells: str, entries: list[dict]) -> list[tuple[int, str]]:
    """(start, digest) of each entry's bytes of ``cells``: from the end the entry before records
    (0 for the first) to its own."""
    with open(cells, "rb") as fh:
        data = fh.read()
    starts = [0] + [e["bytes"] for e in entries[:-1]]
    return [(a, data_sha256(data[a:e["bytes"]])) for a, e in zip(starts, entries)]


def with_digests(out: str, entries: list[dict]) -> list[dict]:
    """``entries`` (group, bytes) with the digest of each one's bytes of ``cells.csv`` (a merge's)."""
    return [{**e, "sha256": digest} for e, (_, digest) in zip(entries, _blocks(os.path.join(out, CELLS), entries))]


def _edited_group(cells: str, entries: list[dict]) -> str:
    """The first group whose bytes of ``cells`` differ from the digest the run recorded ("" none)."""
    for e, (start, digest) in zip(entries, _blocks(cells, entries)):
        if digest != e["sha256"]:
            return f"{e.get('group')} (bytes {start}-{e['bytes']})"
    return ""


def write_progress(out: str, entries: list[dict]) -> None:
    """``progress.jsonl`` written at once (a merged run's groups, or a resumed run's kept ones)."""
    with writing(os.path.join(out, PROGRESS)), text_file(os.path.join(out, PROGRESS)) as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
        fh.flush()
        os.fsync(fh.fileno())


def _progress(path: str, who: str = "--resume", fix: str = "start a new run with --overwrite") -> list[dict]:
    """The entries of ``progress.jsonl``: ``{"group": str, "bytes": int, "sha256": str}`` each, in growing
    byte order. A torn last line (a killed run) ends them; any other malformed line -- one without its
    digest included: without it an edit of the group's rows could not be found -- is a :class:`UsageError`."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except (OSError, ValueError) as exc:
        raise UsageError(f"{who}: {path} is unreadable ({exc}); {fix}") from None
    entries: list[dict] = []
    for n, line in enumerate(lines, 1):
        if n == len(lines):  # after the last newline: empty, or a line torn by a kill
            break
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        ok = (isinstance(entry, dict) and isinstance(entry.get("group"), str) and type(entry.get("bytes")) is int
              and entry["bytes"] >= (entries[-1]["bytes"] if entries else 0)
              and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64)
        if not ok:
            raise UsageError(f"{who}: {path} line {n} is not a progress entry parity writes; {fix}")
        entries.append(entry)
    return entries


def resume_point(out: str) -> tuple[set[str], set[str]]:
    """(groups already recorded, cells with records); cuts ``cells.csv`` back to the end of the last
    of those groups, whose rows must read back (a corrupted row is a :class:`UsageError` before
    anything runs)."""
    from parity.report.records import read_records

    path = os.path.join(out, PROGRESS)
    entries = _progress(path)
    cells = os.path.join(out, CELLS)
    if not entries:
        for f in (cells, path):
            if os.path.exists(f):
                os.remove(f)
        return set(), set()
    size = os.path.getsize(cells) if os.path.exists(cells) else -1
    if size < entries[-1]["bytes"]:
        raise UsageError(f"--resume {out}: {CELLS} is missing or shorter than {PROGRESS} records; "
                         "start a new run with --overwrite")
    edited = _edited_group(cells, entries)
    if edited:  # a resumed run would judge, summarize and exit on rows it never wrote
        raise UsageError(f"--resume {out}: {CELLS}: the rows of group {edited} differ from what the run recorded "
                         f"(their digest in {PROGRESS}): they were edited after the run; start a new run with --overwrite")
    with writing(cells), open(cells, "r+b") as fh:
        fh.truncate(entries[-1]["bytes"])
    held = {r.cell for r in read_records(cells, whole=True)}
    write_progress(out, entries)
    return {e["group"] for e in entries}, held


def drop_decision(out: str) -> None:
    """Remove a gate's decision on ``out``'s records so far (``gate --from`` on an interrupted run):
    a resumed run that adds records is not what it decided on."""
    for decided in GATE_FILES:
        if os.path.exists(os.path.join(out, decided)):
            os.remove(os.path.join(out, decided))


def complete_records(out: str, manifest: dict, who: str, fix: str = "rerun the matrix into a new --out") -> list:
    """The records of ``out``, a run whose ``run.json`` says ``complete``, read only when ``cells.csv`` is
    what the run recorded: exactly as long as ``progress.jsonl``'s last entry says (a file cut,
    emptied or appended to after the run is not; a run of no cells, an empty part, holds no record)
    and holding records of every cell ``run.json`` lists. Anything else is a :class:`UsageError` naming the first difference: a decision or a
    merge on part of the evidence would read as one on all of it."""
    from parity.report.records import read_records
    from parity.report.summary import is_pair

    cells = os.path.join(out, CELLS)
    entries = _progress(os.path.join(out, PROGRESS), who, fix)
    size = os.path.getsize(cells) if os.path.isfile(cells) else None
    if not entries and not manifest.get("cells") and size is not None:  # an empty part of a sharded run
        entries = [{"bytes": size, "sha256": _blocks(cells, [{"bytes": size}])[0][1]}] if not read_records(
            cells, whole=True) else []
    if not entries or size != entries[-1]["bytes"]:
        recorded = f"{entries[-1]['bytes']} bytes" if entries else "nothing (no progress.jsonl)"
        held = "no file" if size is None else f"{size} bytes"
        raise UsageError(f"{who}: {cells} holds {held}, {PROGRESS} records {recorded}: the results were cut, "
                         f"emptied or appended to after the run; {fix}")
    edited = _edited_group(cells, entries)
    if edited:
        raise UsageError(f"{who}: {cells}: the rows of group {edited} differ from what the run recorded (their "
                         f"digest in {PROGRESS}): the results were edited after the run; {fix}")
    records = read_records(cells, whole=True)
    held_cells = {r.cell for r in records}
    listed = list(manifest.get("cells") or [])
    missing = [c for c in listed if c not in held_cells]
    if missing:
        raise UsageError(f"{who}: {cells} has no records of {len(missing)} of the {len(listed)} cells "
                         f"{MANIFEST} lists (e.g. {missing[0]}); {fix}")
    # a judged cell's records end with its coverage record, written with them: a cell that trained
    # (its outputs are judged) without one lost records after the run
    judged = {r.cell for r in records  # a cell's own outputs, judged (not a pair's comparison, not skipped)
              if r.check == "output" and not is_pair(r) and r.verdict != "SKIP"}
    uncovered = sorted(judged - {r.cell for r in records if r.check == "coverage"})
    if uncovered:
        raise UsageError(f"{who}: {cells} holds judged records of {len(uncovered)} cells without their coverage "
                         f"record (e.g. {uncovered[0]}): rows were removed after the run; {fix}")
    return records


def recorded(out: str, who: str, fix: str) -> list:
    """The records of results directory ``out`` for a command that reads any run: a run ``run.json``
    calls complete only as it recorded them (:func:`complete_records`: a cut file would read as a
    run of fewer cells); an interrupted run's, or a directory without ``run.json``, as they are."""
    from parity.report.records import read_records

    if os.path.isfile(os.path.join(out, MANIFEST)):
        manifest = read_manifest(out)
        if manifest.get("status") == "complete":
            return complete_records(out, manifest, who, fix)
    return read_records(os.path.join(out, CELLS))
