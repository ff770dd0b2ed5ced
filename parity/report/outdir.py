"""Output directories: one run per directory, resumable, never two runs' files side by side.

Rules (``README.md``, "Results"):

- ``--out DIR`` must be a directory parity can create and write; anything else exits 2.
- A directory that already holds parity results (any of :data:`RUN_FILES`) is refused
  unless ``--overwrite`` (which removes them first) or ``--resume DIR`` is given. Other
  files in it are left alone.
- ``run.json`` names the run (options, torch version, the cell list) and its status:
  ``running``, ``interrupted`` or ``complete``. ``progress.jsonl`` gains a line, with the
  byte length of ``cells.csv``, each time a pair group of cells is fully recorded; ``--resume``
  cuts ``cells.csv`` back to the last such line and runs the rest, so a resumed run's
  files equal an uninterrupted run's (timings apart).
"""

from __future__ import annotations

import json
import os
import tempfile

from parity.errors import UsageError

MANIFEST = "run.json"
PROGRESS = "progress.jsonl"
CELLS = "cells.csv"
RUN_FILES = (CELLS, "summary.md", "timings.json", MANIFEST, PROGRESS, "gate.md", "gate.json", "report.html")


def writable_file(path: str, what: str) -> None:
    """``path`` can be written as a file at the end of a run (``--junit``): not a directory, in an existing
    folder parity can write. Checked before any work, so a finished run cannot fail on it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a directory; give a file path, e.g. {os.path.join(path, 'junit.xml')}")
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: no folder {folder}; give a path in an existing folder")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
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


def prepare(out: str, manifest: dict, *, overwrite: bool) -> None:
    """Make ``out`` ready for a new run and write its manifest (status ``running``)."""
    usable(out)
    present = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if present and not overwrite:
        raise UsageError(
            f"--out {out} holds another run's results ({', '.join(present)}); pass --overwrite to replace "
            f"them, --resume {out} to continue that run, or choose another --out"
        )
    for f in present:
        os.remove(os.path.join(out, f))
    write_manifest(out, {**manifest, "status": "running"})


def write_manifest(out: str, manifest: dict) -> None:
    tmp = os.path.join(out, MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
    os.replace(tmp, os.path.join(out, MANIFEST))


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


def read_manifest(out: str) -> dict:
    """``out``'s ``run.json``: an object whose ``options`` (if any) is an object, ``cells`` a list and
    ``status`` a string."""
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        raise UsageError(f"{out}: no {MANIFEST} there; give the --out directory of an earlier parity run")
    fix = "start a new run with --overwrite"
    manifest = read_json(path, fix)
    for key, kind in (("options", dict), ("cells", list), ("status", str)):
        if key in manifest and not isinstance(manifest[key], kind):
            raise UsageError(f"{path}: {key} is not {'an object' if kind is dict else 'a ' + kind.__name__}; {fix}")
    return manifest


def mark_group_done(out: str, group: str) -> None:
    """Record that ``group``'s rows are all in ``cells.csv`` (after they were flushed)."""
    size = os.path.getsize(os.path.join(out, CELLS))
    with open(os.path.join(out, PROGRESS), "a") as fh:
        fh.write(json.dumps({"group": group, "bytes": size}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _progress(path: str) -> list[dict]:
    """The entries of ``progress.jsonl``: ``{"group": str, "bytes": int}`` each, in growing byte order. A
    torn last line (a killed run) ends them; any other malformed line is a :class:`UsageError`."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume: {path} is unreadable ({exc}); start a new run with --overwrite") from None
    entries: list[dict] = []
    for n, line in enumerate(lines, 1):
        if n == len(lines):  # after the last newline: empty, or a line torn by a kill
            break
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        ok = (isinstance(entry, dict) and isinstance(entry.get("group"), str) and type(entry.get("bytes")) is int
              and entry["bytes"] >= (entries[-1]["bytes"] if entries else 0))
        if not ok:
            raise UsageError(f"--resume: {path} line {n} is not a progress entry parity writes; "
                             "start a new run with --overwrite")
        entries.append(entry)
    return entries


def resume_point(out: str) -> set[str]:
    """Groups already recorded; cuts ``cells.csv`` back to the end of the last of them, whose rows must
    read back (a corrupted row is a :class:`UsageError` before anything runs)."""
    from parity.report.records import read_records

    path = os.path.join(out, PROGRESS)
    entries = _progress(path)
    cells = os.path.join(out, CELLS)
    if not entries:
        for f in (cells, path):
            if os.path.exists(f):
                os.remove(f)
        return set()
    size = os.path.getsize(cells) if os.path.exists(cells) else -1
    if size < entries[-1]["bytes"]:
        raise UsageError(f"--resume {out}: {CELLS} is missing or shorter than {PROGRESS} records; "
                         "start a new run with --overwrite")
    with open(cells, "r+b") as fh:
        fh.truncate(entries[-1]["bytes"])
    read_records(cells, whole=True)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
    return {e["group"] for e in entries}
