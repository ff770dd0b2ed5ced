"""What made a results directory, so that ``--resume`` continues only the same run.

``run.json`` records parity's version (and the git commit when parity runs from a git
checkout) and the sha256 of the matrix file and of every file that defines a model of the
run: the module of each model's ``build`` and ``make_batch``, and each ``--model`` source's
file. ``--resume`` refuses a directory whose record differs from what would run now (an
edited model would otherwise mix two models in one ``cells.csv``). Files a model imports
from elsewhere (a library's classes) are not digested.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys

import parity
from parity.digests import file_sha256


def parity_version() -> dict[str, str]:
    """``{"version": ..., "commit": ...}`` (no commit outside a git checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = {"version": version("parity")}
    except PackageNotFoundError:
        found = {"version": parity.__version__}
    commit = _git_commit()
    return {**found, "commit": commit} if commit else found


@functools.cache
def _git_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(parity.__file__)))
    if not os.path.exists(os.path.join(root, ".git")):  # an installed copy: no commit to name
        return ""
    try:
        done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _file_of(obj) -> str:
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj))
    except (TypeError, OSError):
        return ""
    return os.path.realpath(path) if path and os.path.isfile(path) else ""


def _source_file(source: str) -> str:
    target = source.rpartition(":")[0]
    if target.endswith(".py"):
        return os.path.realpath(target)
    module = sys.modules.get(target)
    return os.path.realpath(module.__file__) if getattr(module, "__file__", None) else ""


def model_files(cells) -> list[str]:
    """The files that define the models of ``cells`` (see the module)."""
    from parity.model.registry import get_fixture

    files = set()
    for name, source in {(c.fixture, c.source) for c in cells}:
        fixture = get_fixture(name, source)
        files.update(_file_of(f) for f in (fixture.build, fixture.make_batch))
        if source:
            files.add(_source_file(source))
    return sorted(f for f in files if f)


def identity(matrix_file: str, cells) -> dict:
    """What ``run.json`` records: ``parity`` (version, commit) and ``sources`` (path -> sha256)."""
    files = ([os.path.realpath(matrix_file)] if matrix_file else []) + model_files(cells)
    return {"parity": parity_version(), "sources": {f: file_sha256(f) for f in files}}


def _named(version: dict | None) -> str:
    if not isinstance(version, dict):
        return "an unrecorded version"
    commit = version.get("commit")
    return f"{version.get('version')}" + (f" (commit {commit[:12]})" if commit else "")


def difference(recorded: dict, now: dict) -> str:
    """Why a directory recorded as ``recorded`` is not the run ``now`` describes; "" if it is."""
    if recorded.get("parity") != now["parity"]:
        return f"it was written by parity {_named(recorded.get('parity'))}, this is parity {_named(now['parity'])}"
    old = recorded.get("sources")
    if not isinstance(old, dict):
        return "it records no digests of its model and matrix files"
    for path, digest in now["sources"].items():
        if path not in old:
            return f"{path} was not part of it"
        if old[path] != digest:
            return f"{path} changed since"
    gone = sorted(set(old) - set(now["sources"]))
    return f"{gone[0]} is no longer part of it" if gone else ""
