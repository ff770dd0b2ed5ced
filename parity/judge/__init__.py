"""Stage 5, judge: the independent reference (no FSDP, no torch.distributed), derived
allowances, numeric comparisons and contract checks, turned into records with verdicts."""
