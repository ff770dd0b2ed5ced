"""One rule for naming a file's contents: the hex SHA-256 of its bytes.

The model registry (a model file edited after its import), the run's identity (``run.json``'s
``sources``) and the reproducer (a model file changed since the run) must agree on it, or a file
unchanged by one would read as changed by another."""

from __future__ import annotations

import hashlib


def data_sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str) -> str:
    """The hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
