"""One rule for naming a file's (or a value's) contents: the hex SHA-256 of its bytes.

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


def value_sha256(value) -> str:
    """The hex SHA-256 of a value's exact content: a tensor's dtype, shape and bytes (two tensors
    share it only if they are bitwise equal), anything else its ``repr``."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        head = f"{t.dtype}{list(value.shape)}".encode()
        return data_sha256(head + (t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return data_sha256(repr(value).encode())
