"""parity: a differential correctness harness for FSDP2 mixed precision.

The pipeline, one subpackage per stage (data flows one way, top to bottom):

- :mod:`parity.model` -- fixtures and plugin models, the precision plan;
- :mod:`parity.matrix` -- cells and matrices: what to run;
- :mod:`parity.paths` -- sharding paths (legacy, native, plugins) behind one call;
- :mod:`parity.execute` -- rank workers train and observe;
- :mod:`parity.judge` -- the independent reference, comparisons, contracts, verdicts;
- :mod:`parity.report` -- ``cells.csv``, summaries, output directories;

:mod:`parity.runner` drives a run through them; :mod:`parity.cli` is the command line;
:mod:`parity.faults` holds the deliberate faults that prove each check can fail.
"""

__version__ = "0.2.0"
