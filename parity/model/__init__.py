"""Stage 1, the model: what a fixture or plugin model is, where models come from, and the
precision plan (storage / compute / reduce dtype of every tensor).

Public names for plugin authors: :class:`Fixture`, :class:`Batch`, :func:`mark_keep_fp32`,
:func:`set_compute_dtype`, :func:`convert_except_marked`.
"""

from parity.model.markers import convert_except_marked, mark_keep_fp32, set_compute_dtype
from parity.model.spec import Batch, Fixture

__all__ = ["Batch", "Fixture", "convert_except_marked", "mark_keep_fp32", "set_compute_dtype"]
