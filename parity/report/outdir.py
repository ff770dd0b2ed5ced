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


def _usable(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: is a file; give a directory (it is created if missing)")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".parity-write-test-")
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose a writable directory") from None


def prepare(out: str, manifest: dict, *, overwrite: bool) -> None:
    """Make ``out`` ready for a new run and write its manifest (status ``running``)."""
    _usable(out)
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


def read_manifest(out: str) -> dict:
    path = os.path.join(out, MANIFEST)
    if not os.path.isfile(path):
        raise UsageError(f"{out}: no {MANIFEST} there; give the --out directory of an earlier parity run")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{out}: {MANIFEST} is unreadable ({exc}); start a new run with --overwrite") from None


def mark_group_done(out: str, group: str) -> None:
    """Record that ``group``'s rows are all in ``cells.csv`` (after they were flushed)."""
    size = os.path.getsize(os.path.join(out, CELLS))
    with open(os.path.join(out, PROGRESS), "a") as fh:
        fh.write(json.dumps({"group": group, "bytes": size}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def resume_point(out: str) -> set[str]:
    """Groups already recorded; cuts ``cells.csv`` back to the end of the last of them."""
    entries: list[dict] = []
    path = os.path.join(out, PROGRESS)
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line: the group before it is the last one recorded
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
    with open(path, "w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)
    return {e["group"] for e in entries}
