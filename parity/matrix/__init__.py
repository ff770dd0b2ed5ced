"""What to run: cells (axis values of one run) and matrices of them (TOML, ``-k`` filters)."""

from parity.matrix.cell import Cell
from parity.matrix.load import Matrix, available, load, select

__all__ = ["Cell", "Matrix", "available", "load", "select"]
