"""The registry of sharding paths: parity's two, plus the ``parity.paths`` entry-point group.

An entry point names a :class:`~parity.paths.base.ShardingPath` instance, a class, or a
factory returning one. Nothing else in parity treats ``legacy`` or ``native`` specially:
baseline, fallback and contract are each path's declared attributes.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import re
from importlib.metadata import entry_points

from parity.errors import UsageError, plugin_fix
from parity.paths.base import CONTRACTS, ShardingPath
from parity.paths.legacy import LegacyPath
from parity.paths.native import NativePath

GROUP = "parity.paths"
_extra: dict[str, ShardingPath] = {}


#: How parity calls a path's methods (positionally; ``apply`` may get recipe keywords beside).
CALLS = {"unavailable": (), "plan": ("model", "roots", "plan", "ignored"),
         "apply": ("model", "report", "mesh", "reshard_after_forward", "ignored")}


def _check(path: object, where: str) -> ShardingPath:
    if isinstance(path, type) or (callable(path) and not isinstance(path, ShardingPath)):
        try:
            path = path()
        except Exception as exc:  # noqa: BLE001 - a plugin failing to construct is bad input
            hint = "" if isinstance(path, type) else (
                "; a sharding helper function is wrapped in a ShardingPath class whose apply() calls it "
                "(examples/external_path)")
            raise UsageError(f"{where}: constructing the path failed: {type(exc).__name__}: {exc}{hint}") from None
    if not isinstance(path, ShardingPath):
        raise UsageError(f"{where} is not a ShardingPath (needs name, contract, fallback, unavailable, plan, apply); "
                         "subclass parity.paths.ShardingPath, as examples/external_path does")
    name = getattr(path, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):  # a cell id's part, a --paths item
        raise UsageError(f"{where}: path name {name!r} is not a word (letters, digits, _ -); name the path like "
                         "owner_split")
    if path.contract not in CONTRACTS:
        raise UsageError(f"{where}: contract {path.contract!r}; valid: {', '.join(CONTRACTS)}")
    for method, args in CALLS.items():  # a wrong signature would fail every cell, far from the cause
        try:
            inspect.signature(getattr(path, method)).bind(*args)
        except TypeError as exc:
            raise UsageError(f"{where}: {method}() cannot be called as {method}({', '.join(args)}) ({exc}); "
                             f"define {method}(self{''.join(', ' + a for a in args)}) as parity.paths.base."
                             "ShardingPath does") from None
        except ValueError:  # no signature to read (a builtin): it is called as it is
            pass
    return path


def _taken_by(name: str, plugins) -> str:
    """What already goes by ``name`` ('' when nothing): a built-in path or another plugin of
    ``plugins``; one of the two would be judged in the other's place."""
    return "a built-in path" if name in ("legacy", "native") else "another plugin" if name in plugins else ""


@functools.cache
def _entry_point_paths() -> dict[str, ShardingPath]:
    found = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        where = f"entry point {GROUP}:{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}; fix that plugin's package "
                             f"or uninstall it ({plugin_fix(ep)})") from None
        path = _check(obj, where)
        clash = _taken_by(path.name, found)
        if clash:  # one of the two would be judged in the other's place, silently
            raise UsageError(f"{where} names its path {path.name!r}, as {clash} does; give the plugin's path "
                             "its own name")
        found[path.name] = path
    return found


def register(path: ShardingPath) -> ShardingPath:
    """Register a path in this process (tests, notebooks); entry points do it for installs. Rank
    processes start without it: a run hands them the registered paths it can pickle
    (:func:`carried`), and refuses a selected one it cannot (:func:`check_carried`)."""
    path = _check(path, f"path {getattr(path, 'name', path)!r}")
    clash = _taken_by(path.name, _entry_point_paths())
    if clash:  # paths() would keep the other one, silently
        raise UsageError(f"path {path.name!r} is the name of {clash}; give the registered path its own name")
    if path.fallback is not None and path.fallback not in {**paths(), path.name: path}:
        raise UsageError(f"path {path.name!r} declares fallback {path.fallback!r}, which is not registered; register "
                         "that path first or give a registered one")
    _extra[path.name] = path
    return path


def carried() -> tuple[ShardingPath, ...]:
    """The paths :func:`register` added in this process that a rank process can unpickle (its
    class importable by name), for the ranks to register in turn."""
    return tuple(p for p in _extra.values() if _pickles(p))


def receive(paths: tuple[ShardingPath, ...]) -> None:
    """In a rank process: the paths its run :func:`carried`, as registered there (checked there)."""
    _extra.update((p.name, p) for p in paths)


def check_carried(names) -> None:
    """Refuse a selected path of ``names`` (and its fallback) registered in this process that the
    rank processes could not receive: each of its cells would fail with "unknown path"."""
    seen = set()
    for name in names:
        while name in _extra and name not in seen:
            seen.add(name)
            if not _pickles(_extra[name]):
                raise UsageError(f"path {name!r} was registered in this process, and rank processes cannot import its "
                                 f"class {type(_extra[name]).__qualname__!r}; define the class at the top level of "
                                 "a module, or install it through the parity.paths entry point (examples/external_path)")
            name = _extra[name].fallback


def _pickles(path: ShardingPath) -> bool:
    try:
        pickle.dumps(path)
    except Exception:  # noqa: BLE001 - a local or dynamic class, an unpicklable attribute
        return False
    return True


def paths() -> dict[str, ShardingPath]:
    """Every registered path by name: legacy, native, then plugins."""
    found: dict[str, ShardingPath] = {"legacy": LegacyPath(), "native": NativePath()}
    for name, path in {**_entry_point_paths(), **_extra}.items():
        found.setdefault(name, path)
    for name, path in list(found.items()):
        if path.fallback is not None and path.fallback not in found:
            raise UsageError(f"path {name!r} declares fallback {path.fallback!r}, which is not registered")
    return found


def path_names() -> list[str]:
    return list(paths())


def get_path(name: str) -> ShardingPath:
    registered = paths()
    if name not in registered:
        raise UsageError(f"unknown path {name!r}; valid: {', '.join(registered)}")
    return registered[name]


def check_path(name: str) -> str:
    get_path(name)
    return name
