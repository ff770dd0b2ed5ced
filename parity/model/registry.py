"""Where models come from: the ``parity.models`` entry-point group and ``--model SOURCE``.

An entry point (or a ``--model`` source) may name a :class:`~parity.model.spec.Fixture`, a
factory returning one, or a collection of them. parity's own fixtures are registered the
same way, by the ``parity_fixtures`` package this distribution installs (the ``fixtures/``
folder); nothing imports a top-level ``fixtures`` package, so no other package of that
name can shadow them or be shadowed.

A source is ``pkg.module:attr`` or ``path/to/file.py:attr``. Workers receive it with each
cell and load it again, so a plugin needs no installation to be run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from importlib.metadata import entry_points

import torch

from parity.digests import file_sha256
from parity.errors import UsageError, plugin_fix
from parity.model.spec import Fixture, validate
from parity.paths.base import CONTRACTS
from parity.paths.registry import path_names

GROUP = "parity.models"
_loaded_sources: dict[str, list[Fixture]] = {}
_imported_digests: dict[str, str] = {}
"""A model file's SHA-256 when this process imported it (see :func:`_still_as_imported`)."""
#: What user code (a model source's import, its factory, an entry point) may raise that makes it bad
#: input: any exception, and ``sys.exit`` -- a source that exits must not end parity with its code.
_USER_FAILURES = (Exception, SystemExit)


def _failed(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}); a model source must not exit"
    if isinstance(exc, TypeError) and "Fixture.__init__()" in str(exc):  # a field left out or misspelled
        return (f"{type(exc).__name__}: {exc}; give Fixture(name=..., description=..., build=..., unit_roots=..., "
                "blocks=..., make_batch=..., loss=...) (the README's table of Fixture fields)")
    return f"{type(exc).__name__}: {exc}"


def built(fixture: Fixture, where: str):
    """``fixture``'s model as seed 0 builds it on this process's device, and the parameters it
    ignores; a failure of that user code is a :class:`UsageError` naming the model (exit 2)."""
    try:
        model = fixture.make(0)
        return model, fixture.ignored(model)
    except _USER_FAILURES as exc:
        raise UsageError(f"{where}: building model {fixture.name!r} failed: {_failed(exc)}; fix the model's "
                         "build (it built on meta, not here)") from None


def exercised(fixture: Fixture, model, where: str) -> None:
    """One forward and backward of ``model`` (a fresh build) on the first batch, as the reference
    runs it: a forward whose result is not a tensor, a loss that is not one number or that no
    gradient flows from, or a first input the forward never differentiates would fail every cell
    (or judge nothing), so it is a
    :class:`UsageError` naming the field and the fix now. A forward, loss or backward that
    raises is left to the cells, which record it with the rank."""
    batch = fixture.batch(0, 0, 0, 0)
    _reproducible(fixture, batch, where)
    inputs = tuple(x.detach().requires_grad_() if not fixture.token_input and x.is_floating_point() else x
                   for x in batch.inputs)
    try:
        raw = model(*inputs)
        out = fixture.output(raw)
        loss = fixture.loss(out, batch.target) if isinstance(out, torch.Tensor) else None
    except _USER_FAILURES:
        return
    name = f"{where}: model {fixture.name!r}"
    if not isinstance(out, torch.Tensor):
        what = "its forward" if out is raw else "Fixture.output"
        raise UsageError(f"{name}: {what} returns {type(out).__name__}, not a tensor; set Fixture.output to pick the "
                         "tensor the loss reads (e.g. output=lambda out: out[0], or lambda out: out.logits)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"{name}: Fixture.loss returns {shape}, not one number; return a scalar loss (e.g. .mean())")
    if not loss.requires_grad:  # backward would raise in every cell: no step could be judged
        what = ("Fixture.loss returns a tensor cut off from the output's graph" if out.requires_grad else
                f"{'its forward' if out is raw else 'Fixture.output'} returns a tensor no trainable parameter reaches")
        raise UsageError(f"{name}: {what} (requires_grad False), so no gradient can be computed; compute the loss "
                         "from the output without .detach(), .item() or torch.no_grad()")
    if fixture.token_input:
        return  # integer input: no input gradient to look for
    try:
        loss.backward()
    except _USER_FAILURES:
        return
    if inputs[0].grad is None:
        raise UsageError(f"{name}: its forward does not differentiate Batch.inputs[0] (no gradient reaches it), and "
                         "parity judges input gradients; make the forward read it (integer token ids: set "
                         "Fixture.token_input=True)")


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaN equal to NaN (a batch may mark missing labels with it)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _reproducible(fixture: Fixture, batch, where: str) -> None:
    """The same generator seed gives the same batch: the reference and every rank draw a cell's
    batches apart, from seeded generators, and a ``make_batch`` that draws elsewhere (torch's global
    generator, say) would have each of them train on other data -- a divergence in every cell,
    blamed on the model's first module."""
    again = fixture.batch(0, 0, 0, 0)
    tensors = list(zip((*batch.inputs, batch.target), (*again.inputs, again.target)))
    if len(batch.inputs) != len(again.inputs) or not all(_identical(a, b) for a, b in tensors):
        raise UsageError(f"{where}: model {fixture.name!r}: Fixture.make_batch returns other tensors for the same "
                         "seeded torch.Generator; draw every tensor from the generator it is given (e.g. "
                         "torch.randn(..., generator=g)), not from torch's global generator")


def expect_keys() -> tuple[str, ...]:
    """What a ``Fixture.expect`` key may name: a contract or a registered path."""
    return (*CONTRACTS, *path_names())


def _specs(obj, where: str, called: bool = False) -> list[Fixture]:
    """The fixtures ``obj`` describes: a Fixture, a list or mapping of them, or a factory returning
    those (called once: what it returns is not called again)."""
    if isinstance(obj, Fixture):
        return [validate(obj, where, expect_keys())]
    if isinstance(obj, Mapping):
        return [s for v in obj.values() for s in _specs(v, where, called)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _specs(v, where, called)]
    if isinstance(obj, torch.nn.Module) or (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        name = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise UsageError(f"{where}: names the model {name}, not a parity model description; point at a factory "
                         f"returning parity.model.Fixture(name=..., build={name}, ...) (see examples/own_model)")
    if callable(obj) and not called:
        try:
            made = obj()
        except _USER_FAILURES as exc:  # user code: name it, exit 2
            raise UsageError(f"{where}: the factory failed: {_failed(exc)}") from None
        return _specs(made, where, called=True)
    return [validate(obj, where, expect_keys())]


@functools.cache
def registered() -> dict[str, Fixture]:
    """Every model registered through the ``parity.models`` entry-point group, by name."""
    found: dict[str, Fixture] = {}
    eps = sorted(entry_points(group=GROUP), key=lambda ep: (ep.name != "builtin", ep.name))
    for ep in eps:
        where = f"entry point {GROUP}:{ep.name} ({ep.value})"
        try:
            obj = ep.load()
        except _USER_FAILURES as exc:
            raise UsageError(f"{where} cannot be loaded: {_failed(exc)}; fix that plugin's package or uninstall it "
                             f"({plugin_fix(ep)})") from None
        for spec in _specs(obj, where):
            found.setdefault(spec.name, spec)
    return found


def _import_source(source: str, label: str = "--model"):
    target, sep, attr = source.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"{label} {source!r}: write pkg.module:factory or path/to/file.py:factory")
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise UsageError(f"{label} {source!r}: no file {target}")
        name = "parity_user_model_" + str(abs(hash(path)))
        if name in sys.modules:
            _still_as_imported(path, source, label)
        else:
            _imported_digests[path] = file_sha256(path)
            if os.path.dirname(path) not in sys.path:  # modules beside it import, as under `python file.py`
                sys.path.append(os.path.dirname(path))
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except _USER_FAILURES as exc:
                del sys.modules[name]
                raise UsageError(f"{label} {source!r}: importing {target} failed: {_failed(exc)}") from None
        module = sys.modules[name]
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"{label} {source!r}: cannot import {target} ({exc}); install it or give a file path") from None
        except _USER_FAILURES as exc:  # user code failing at import is bad input too
            raise UsageError(f"{label} {source!r}: importing {target} failed: {_failed(exc)}") from None
    if not hasattr(module, attr):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
        raise UsageError(f"{label} {source!r}: {target} has no attribute {attr!r}; name one it defines"
                         + (f" ({', '.join(callables[:8])})" if callables else ""))
    return getattr(module, attr)


def _still_as_imported(path: str, source: str, label: str) -> None:
    """A model file this process imported must still read as it did: edited since (a notebook, a
    long pytest session), the rank processes would import the new code while this process judges
    with the old one, and their disagreement would read as FSDP's."""
    if path in _imported_digests and os.path.isfile(path) and file_sha256(path) != _imported_digests[path]:
        raise UsageError(f"{label} {source!r}: {path} changed since this process imported it; the ranks would "
                         "run the new code and the reference the old: restart the process (a notebook: its kernel)")


def unchanged(source: str, label: str = "--model") -> None:
    """For a model file (``path/to/file.py:attr``) this process imported: a :class:`UsageError`
    if it was edited since (:func:`_still_as_imported`); other sources pass."""
    target = source.rpartition(":")[0]
    if target.endswith(".py"):
        _still_as_imported(os.path.abspath(target), source, label)


def load_source(source: str, label: str = "--model") -> list[Fixture]:
    """The models a ``--model`` source describes, each remembering its source. ``label`` names
    where the source was given in errors (``--model``, or a matrix file's ``models`` entry); a
    model file edited since this process imported it is a :class:`UsageError`."""
    if source in _loaded_sources:
        unchanged(source, label)
    else:
        specs = _specs(_import_source(source, label), f"{label} {source}")
        if not specs:  # an empty list or mapping: the built-in models would run in their place
            raise UsageError(f"{label} {source}: describes no model (an empty list or mapping); return a "
                             "parity.model.Fixture or a list of them")
        names = [s.name for s in specs]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:  # one would silently replace the other
            raise UsageError(f"{label} {source}: two models are named {twice!r}; give each model its own name")
        _loaded_sources[source] = [replace(s, source=source) for s in specs]
    return _loaded_sources[source]


def distinct(sources: tuple[str, ...], label: str = "--model") -> None:
    """A source given twice is bad input (``label`` as in :func:`load_source`), as ``--paths``
    or ``--ranks`` given twice are."""
    twice = next((s for i, s in enumerate(sources) if s in sources[:i]), None)
    if twice is not None:
        raise UsageError(f"{label} {twice!r} is given twice; give each model source once")


def registry(sources: tuple[str, ...] = (), label: str = "--model") -> dict[str, Fixture]:
    """Registered models plus those of ``sources`` (a source's model replaces a registered
    namesake; a source given twice, or two sources naming a model alike, is bad input: the
    first would silently not run); ``label`` as in :func:`load_source`."""
    distinct(sources, label)
    found, given = dict(registered()), {}
    for source in sources:
        for spec in load_source(source, label):
            if spec.name in given:
                raise UsageError(f"{label} {given[spec.name]!r} and {source!r} both describe a model named "
                                 f"{spec.name!r}; give each model its own Fixture.name")
            found[spec.name] = given[spec.name] = spec
    if not found:
        raise UsageError("no models registered: install parity (pip install -e .) or pass --model pkg.module:factory")
    return found


def get_fixture(name: str, source: str = "") -> Fixture:
    models = registry((source,) if source else ())
    if name not in models:
        raise UsageError(f"unknown fixture {name!r}; valid: {', '.join(models)} (or --model pkg.module:factory)")
    return models[name]
