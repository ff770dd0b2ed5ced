"""parity: a differential correctness harness for FSDP2 mixed precision.

The pipeline, one module per role:
fixture -> plan (:mod:`parity.plan`) -> path (:mod:`parity.paths`) -> run
(:mod:`parity.cell`, :mod:`parity.pool`) -> compare (:mod:`parity.reference`,
:mod:`parity.compare`, :mod:`parity.tolerance`) -> record (:mod:`parity.record`)
-> report (:mod:`parity.report`).
"""

__version__ = "0.1.0"
