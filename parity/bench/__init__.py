"""The benchmark stage: the same model and configuration on every path, measured.

:mod:`~parity.bench.measure` runs on each rank (collectives, packing, memory, step time),
:mod:`~parity.report.environment` says where, :mod:`~parity.bench.tables` writes
``bench.csv`` / ``bench.md`` (and plots with the ``plot`` extra).
"""
