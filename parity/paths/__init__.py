"""Stage 2, the path: how a model is handed to ``fully_shard``. ``legacy`` (dtype-split) and
``native`` (per-parameter) are two registered :class:`ShardingPath` implementations; plugins
add more through the ``parity.paths`` entry-point group.

Plugin authors: implement :class:`ShardingPath`, build :class:`UnitSpec` lists (the helpers
in :mod:`parity.paths.units` resolve roots and apply units), raise :class:`Ineligible` or
:class:`~parity.errors.IsolationError` when a plan cannot be represented.
"""

from parity.paths.apply import apply_sharding, check_rank_consistency, plan_sharding, shard
from parity.paths.base import CONTRACTS, DTYPE_SPLIT, PER_PARAMETER, Ineligible, ShardingPath, ShardReport, UnitSpec
from parity.paths.registry import check_path, get_path, path_names, paths, register

__all__ = [
    "CONTRACTS", "DTYPE_SPLIT", "PER_PARAMETER", "Ineligible", "ShardReport", "ShardingPath", "UnitSpec",
    "apply_sharding", "check_path", "check_rank_consistency", "get_path", "path_names", "paths", "plan_sharding",
    "register", "shard",
]
